"""CI runs the references and the multi-process tests instead of skipping them: tests/conftest.py
turns a skip for a missing torch, transformers or mpiexec into a failure when ``CI`` is set. Checked
on a throwaway test directory holding this suite's conftest and tests that skip for those reasons."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

SKIPS = {
    "mpiexec": """
import shutil
import pytest

@pytest.mark.skipif(shutil.which("no-such-mpiexec") is None, reason="needs mpiexec (dist extra)")
def test_over_mpi():
    pass
""",
    "torch": """
import pytest

def test_parity():
    pytest.importorskip("no_such_module_torch", reason="could not import 'torch': none here")
""",
    "other": """
import pytest

@pytest.mark.skip(reason="needs a GPU")
def test_gpu():
    pass
""",
}


def run(tmp_path: Path, kind: str, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text())
    (tmp_path / f"test_{kind}.py").write_text(SKIPS[kind])
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("kind", ["mpiexec", "torch"])
def test_under_ci_a_missing_reference_or_mpiexec_fails_the_run(tmp_path, kind):
    out = run(tmp_path, kind, ci=True)
    # a skip at setup (skipif) turns into an error, one inside the test into a failure: either fails
    assert out.returncode == 1 and ("1 failed" in out.stdout or "1 error" in out.stdout), out.stdout
    assert "CI runs the parity and MPI tests" in out.stdout and "skipped" not in out.stdout
    local = run(tmp_path, kind, ci=False)  # outside CI: a plain skip, with its reason
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout


def test_under_ci_other_skips_stay_skips(tmp_path):
    out = run(tmp_path, "other", ci=True)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout


def test_every_mpiexec_skip_gives_the_reason_ci_looks_for():
    """A skip for a missing mpiexec whose reason lacks "needs mpiexec" would pass CI silently."""
    from conftest import MPIEXEC

    tests = Path(__file__).parent
    marker = "pytest.mark.skipif(shutil.which(" + '"mpiexec")'  # (split: not a match of this line)
    lines = [
        (path, n, line)
        for path in tests.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if marker in line
    ]
    assert len(lines) >= 5
    for path, n, line in lines:
        assert f'reason="{MPIEXEC}' in line, f"{path.relative_to(tests)}:{n}: {line.strip()}"
