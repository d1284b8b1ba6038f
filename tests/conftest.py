"""Shared test setup: every run writes its caches (tokenizers, packed tokens, compiled kernels)
under a temporary directory removed at exit, never into the user's ~/.cache; the built-in
tokenizer is trained once per session. In CI (``CI`` set), a test skipped because torch,
transformers, gguf, lm-eval, accelerate or ``mpiexec`` is missing fails instead: CI installs the
``test``, ``parity`` and ``dist`` extras, so the independent references (Hugging Face logits,
torch's optimizers, the gguf reader, lm-evaluation-harness) and the multi-process runs run on every
submission.

GPU twins: a test taking the ``device`` fixture runs once on "cpu" (numpy) and once on "gpu"
(cupy, marked ``gpu``: skipped where cupy finds no CUDA device; ``pytest -m gpu`` on a GPU machine,
as ``benchmarks/gpu_check.sh`` does). ``assert_on_device`` fails a GPU run whose result came back
as a host array: a kernel that silently fell back to numpy."""

from __future__ import annotations

import atexit
import copy
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

_root = tempfile.mkdtemp(prefix="llmkit-tests-")
atexit.register(shutil.rmtree, _root, ignore_errors=True)
os.environ.setdefault("LLMKIT_CACHE_DIR", os.path.join(_root, "cache"))
os.environ.setdefault("LLMKIT_KERNEL_CACHE", os.path.join(_root, "kernels"))


# references CI must have (a test skipped for want of one fails there): the parity extra, the gguf
# package whose reader checks `llmkit export --format gguf`, lm-evaluation-harness (the test extra)
PARITY = ("torch", "transformers", "gguf", "lm_eval", "accelerate")
MPIEXEC = "needs mpiexec"  # how every MPI test's skip reason starts (skipif no mpiexec on PATH)


def _missing_reference(report: pytest.CollectReport | pytest.TestReport) -> bool:
    text = str(report.longrepr) if report.skipped else ""
    return MPIEXEC in text or any(f"could not import '{m}'" in text for m in PARITY)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if os.environ.get("CI") and _missing_reference(report):
        report.outcome, report.longrepr = "failed", f"CI runs the parity and MPI tests: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if os.environ.get("CI") and _missing_reference(report):
        report.outcome, report.longrepr = "failed", f"CI runs the parity and MPI tests: {report.longrepr}"


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request) -> Iterator[str]:
    """The device a twin test runs on: "cpu" (numpy) and "gpu" (cupy, where a CUDA device exists),
    also the current device while it runs (tensors made without a device land there)."""
    from llmkit.framework import backend

    if request.param == "gpu" and not backend.gpu_available():
        pytest.skip("gpu twin: cupy found no CUDA device")
    before = backend.get_device()
    backend.set_device(request.param)
    yield request.param
    backend.set_device(before)


def _check_on_device(device: str, *arrays: Any) -> None:
    for i, a in enumerate(arrays):
        a = getattr(a, "_data", a)  # a Tensor's payload
        host = isinstance(a, (np.ndarray, np.generic))
        on_gpu = type(a).__module__.split(".")[0] == "cupy"
        assert host if device == "cpu" else on_gpu, (
            f"result {i} is a {type(a).__module__}.{type(a).__name__} on a {device} run"
            + (": a kernel fell back to the host" if device == "gpu" else "")
        )


@pytest.fixture
def assert_on_device(device: str):
    """``assert_on_device(*arrays_or_tensors)``: each lives on the test's device (on "gpu" a cupy
    array, never a host one: a kernel that fell back to numpy fails the test)."""
    return lambda *arrays: _check_on_device(device, *arrays)


@pytest.fixture(scope="session")
def session_cache_dir() -> Path:
    """The cache directory of this test session ($LLMKIT_CACHE_DIR)."""
    return Path(os.environ["LLMKIT_CACHE_DIR"])


@pytest.fixture(scope="session")
def builtin_tok(session_cache_dir: Path):
    """The 4096-piece built-in tokenizer (trained once per session, about half a second)."""
    from llmkit.train.corpus import builtin_tokenizer

    return builtin_tokenizer(4096, cache_dir=session_cache_dir)


@pytest.fixture(scope="session")
def tok(builtin_tok):
    return builtin_tok


# ---- fuzzing JSON files (manifests, configs) --------------------------------------------------------

_JSON_VALUES: list[Any] = [None, True, False, 0, -1, 1, 2**70, 1.5, "", "x", "..", "../x", "/etc/passwd"]
_JSON_VALUES += ["a/b", "\x00", "\udcff", "\ud800", "forward.pir", "weights.safetensors", "notes.txt"]
_JSON_VALUES += [
    "manifest.json",
    "main",
    "float32",
    "N",
    [],
    {},
    [1],
    ["x"],
    {"a": 1},
    {"shape": [], "dtype": "x"},
]
_JSON_KEYS = [v for v in _JSON_VALUES if isinstance(v, str)] + ["extra", "files", "file", "weights"]


def _json_positions(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every position below the root of a JSON tree, as a key path."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out += [(*path, k), *_json_positions(v, (*path, k))]
    return out


def _mutate_json(tree: dict | list, rng: random.Random) -> None:
    """One random change in place: a value replaced, a key or element deleted, a key renamed or added."""
    positions = _json_positions(tree)
    if not positions:
        tree.append(1) if isinstance(tree, list) else tree.update(x=1)
        return
    *parents, key = rng.choice(positions)
    parent = tree
    for k in parents:
        parent = parent[k]
    value = copy.deepcopy(rng.choice(_JSON_VALUES))
    kind = rng.randrange(4)
    if kind == 0:
        parent[key] = value
    elif kind == 1:
        del parent[key]
    elif isinstance(parent, list):
        parent.insert(rng.randrange(len(parent) + 1), value)
    elif kind == 2:
        parent[rng.choice(_JSON_KEYS)] = parent.pop(key)
    else:
        parent[rng.choice(_JSON_KEYS)] = value


@pytest.fixture(scope="session")
def mutate_json():
    """``mutate_json(tree, rng)``: one random change of a parsed JSON object (types, keys, values, names)."""
    return _mutate_json
