"""``benchmarks/gpu_check.sh``, the GPU check of a lent machine, as far as this CPU machine can run
it: without a GPU (or with ``--dry-run``) it reports what it could not find, writes its log and
JSON lines and exits 0; its test report reads a junit file; its PyTorch baseline
(``benchmarks/torch_llama.py``) is the same function as Hugging Face's Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import llmkit.framework as lf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
PARTS = ["tests_ops", "tests_paths", "kernels", "train_bench", "train_134m", "decode"]


def _run(tmp_path, *args):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    rows = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    return r, rows, (out / "gpu_check.log").read_text()


def _check_no_gpu_report(r, rows, log, reason):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    by = {row["metric"]: row for row in rows if row["metric"] not in ("part_skipped",)}
    assert all(row["benchmark"] == "gpu_check" for row in rows)
    assert by["gpu_found"]["value"] == 0
    assert by["cupy"]["value"] == 0 and by["cupy"]["missing"]  # says what it could not find
    assert by["nccl"]["value"] == 0
    for tool in ("torch", "nvcc", "mpi4py", "c_compiler", "llmkit_requirements_missing"):
        assert tool in by
    assert "quant_linear" in by["hand_written_kernels_without_cuda"]["ops"]
    skipped = [row for row in rows if row["metric"] == "part_skipped"]
    assert [s["part"] for s in skipped] == PARTS and {s["reason"] for s in skipped} == {reason}
    assert sum(s["limit_s"] for s in skipped) + 30 < 8 * 60  # the parts' limits fit the 8 minutes
    assert by["parts_failed"]["value"] == 0
    assert "NO GPU: cupy found no CUDA device" in log and "NO GPU" in r.stdout
    for part in PARTS:
        assert f"part {part} (limit" in log


@pytest.mark.skipif(lf.backend.gpu_available(), reason="a GPU is present: the script would run the GPU parts")
def test_dry_run_without_a_gpu_says_so_and_exits_0(tmp_path):
    r, rows, log = _run(tmp_path, "--dry-run")
    _check_no_gpu_report(r, rows, log, "dry run")


@pytest.mark.slow
@pytest.mark.skipif(lf.backend.gpu_available(), reason="a GPU is present: the script would run the GPU parts")
def test_plain_run_without_a_gpu_skips_the_gpu_parts(tmp_path):
    r, rows, log = _run(tmp_path)
    _check_no_gpu_report(r, rows, log, "no CUDA device found")


@pytest.mark.slow
@pytest.mark.skipif(lf.backend.gpu_available(), reason="a GPU is present: the script would run the GPU parts")
def test_named_parts_only_and_an_unknown_part_fails(tmp_path):
    r, rows, _ = _run(tmp_path, "--dry-run", "kernels", "decode")
    assert r.returncode == 0
    assert [row["part"] for row in rows if row["metric"] == "part_skipped"] == ["kernels", "decode"]
    r, rows, log = _run(tmp_path, "--dry-run", "kernel")
    assert r.returncode == 1 and "unknown part kernel; the parts are: tests_ops tests_paths kernels" in log
    assert rows[-1] == {"benchmark": "gpu_check", "metric": "parts_failed", "value": 1, "unit": ""}


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.a" name="test_ok" time="0.1"/>
<testcase classname="tests.a" name="test_ok2" time="0.1"/>
<testcase classname="tests.b" name="test_bad[gpu]">
  <failure message="AssertionError: on the host">x</failure></testcase>
<testcase classname="tests.c" name="test_nccl"><skipped message="nccl: no MPI"/></testcase>
</testsuite></testsuites>
"""


def test_the_test_report_counts_and_names_failures_and_skips(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(JUNIT)
    script = os.path.join(ROOT, "benchmarks", "gpu_check.py")
    r = subprocess.run(
        [sys.executable, script, "tests", str(xml)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    rows = {(row["metric"], row.get("test")): row for row in map(json.loads, r.stdout.splitlines())}
    assert rows[("gpu_tests_passed", None)]["value"] == 2
    assert rows[("gpu_tests_failed", None)]["value"] == 1
    assert rows[("gpu_tests_skipped", None)]["value"] == 1
    assert rows[("gpu_test_failed", "tests.b::test_bad[gpu]")]["message"] == "AssertionError: on the host"
    assert rows[("gpu_test_skipped", "tests.c::test_nccl")]["message"] == "nccl: no MPI"
    r = subprocess.run(
        [sys.executable, script, "tests", str(tmp_path / "none.xml")], capture_output=True, text=True
    )
    assert json.loads(r.stdout)["missing"].endswith("not written (pytest did not finish)")


def test_the_torch_baseline_is_hugging_face_llama(monkeypatch):
    """The small PyTorch Llama the GPU benchmarks time: Hugging Face's logits on the same weights,
    and llmkit's parameter count."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    from torch_llama import TorchLlama

    from llmkit.models.llama import LlamaConfig

    cfg = LlamaConfig.from_preset("tiny", vocab_size=96, num_hidden_layers=2, rope_theta=5000.0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_dict())).eval()
    ours = TorchLlama(cfg).eval()
    names = {
        k.replace("model.", "", 1).replace(".self_attn", "").replace(".mlp", ""): v
        for k, v in hf.state_dict().items()
    }
    ours.load_state_dict(names)  # strict: the same parameters, name for name
    assert sum(p.numel() for p in ours.parameters()) == cfg.num_parameters()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 96, (2, 11)))
    with torch.no_grad():
        np.testing.assert_allclose(ours(ids).numpy(), hf(ids).logits.numpy(), rtol=1e-4, atol=1e-5)
