"""The Python side of ``benchmarks/gpu_check.sh`` (issue 29): what the machine has, the GPU test
results as figures, and the fused-kernel benchmark. One JSON line per figure (``_common.emit``).

  missing       llmkit's requirements not installed (the script installs carried wheels if any)
  probe         python, cupy and its CUDA devices, PyTorch (and whether it sees CUDA), nvcc, the C
                compiler the kernels need, NCCL through cupy, mpi4py's MPI, llmkit's dependencies
                (pyproject.toml's, installed or missing), which hand-written kernels have no CUDA
                version; last the line ``gpu_found`` (1 or 0) that the shell script branches on
  tests XML     the counts and every failure/skip of a ``pytest --junitxml`` run
  kernels       fused RMSNorm, softmax, SwiGLU, rotary and cross entropy (forward and backward)
                through ``to_static(f, compiler="cinn")(x)`` on the GPU against the same ops composed
                in cupy, PyTorch eager and ``torch.compile`` on the same GPU; each checked against
                the composed ops first, timed (device synchronized, median), and given as a
                fraction of the GPU's measured device-to-device copy bandwidth

Run through the shell script (``bash benchmarks/gpu_check.sh``); alone: ``python
benchmarks/gpu_check.py probe``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata

import numpy as np
from _common import emit

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
B = "gpu_check"


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {_first_line(str(e))}"


def _requirements() -> list[str]:
    """llmkit's runtime and test requirements, as pyproject.toml names them (one source)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return []
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return [re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0] for r in reqs]


def missing_requirements() -> list[str]:
    """The requirements (distribution names) not installed in this Python."""
    missing = []
    for dist in _requirements():
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


# ---- probe --------------------------------------------------------------------------------------


def probe() -> None:
    emit(B, "python", 1, "", version=platform.python_version(), executable=sys.executable)
    devices = 0
    try:
        import cupy as cp

        devices = cp.cuda.runtime.getDeviceCount()
        props = [cp.cuda.runtime.getDeviceProperties(i) for i in range(devices)]
        emit(B, "cupy", 1, "", version=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion())
        for i, p in enumerate(props):
            emit(
                B,
                f"cuda_device_{i}",
                1,
                "",
                name=p["name"].decode(),
                compute_capability=f"{p['major']}.{p['minor']}",
                memory_gib=round(p["totalGlobalMem"] / 2**30, 1),
                multiprocessors=p["multiProcessorCount"],
                l2_mib=round(p["l2CacheSize"] / 2**20, 1),
            )
    except Exception as e:  # not installed, no driver, no device
        emit(B, "cupy", 0, "", missing=_error(e))
    try:
        import torch

        cuda = torch.cuda.is_available()
        emit(
            B,
            "torch",
            1,
            "",
            version=torch.__version__,
            cuda=cuda,
            device=torch.cuda.get_device_name(0) if cuda else None,
        )
    except Exception as e:
        emit(B, "torch", 0, "", missing=_error(e))
    nvcc = shutil.which("nvcc")
    if nvcc:
        r = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        emit(B, "nvcc", 1, "", path=nvcc, version=(r.stdout.strip().splitlines() or [""])[-1])
    else:
        emit(B, "nvcc", 0, "", missing="nvcc not on PATH (the kernels need only NVRTC, through cupy)")
    from llmkit.framework import compiler
    from llmkit.framework.opspec import table

    emit(
        B,
        "c_compiler",
        int(compiler.available()),
        "",
        note="compiled programs need it on the GPU too: a group's CUDA kernel comes with its C one",
    )
    try:
        from cupy.cuda import nccl

        emit(B, "nccl", 1, "", version=nccl.get_version())
    except Exception as e:
        emit(B, "nccl", 0, "", missing=_error(e))
    # in a process of its own: an MPI that hangs at start must not stop the probe
    code = "from mpi4py import MPI; print(MPI.Get_library_version().strip())"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
        ok = r.returncode == 0
        text = r.stdout if ok else (r.stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired:
        ok, text = False, "importing mpi4py.MPI took over 20 s"
    if ok:
        emit(B, "mpi4py", 1, "", library=_first_line(text), note="the nccl backend bootstraps over MPI")
    else:
        emit(B, "mpi4py", 0, "", missing=text[:300], note="without MPI the nccl backend cannot start")
    missing = missing_requirements()
    emit(
        B,
        "llmkit_requirements_missing",
        len(missing),
        "",
        missing=missing,
        note="bring them as wheels: gpu_check.sh --fetch-wheels, then carry .whl" if missing else "",
    )
    native = sorted(n for n, s in table().items() if s.native is not None)
    emit(
        B,
        "hand_written_kernels_without_cuda",
        len(native),
        "",
        ops=native,
        note="C only (compiler/native/): on the GPU these ops run their reference kernels in cupy, so "
        "int8/int4 decode (quant_linear) has no CUDA kernel and is not measured",
    )
    emit(B, "gpu_found", int(devices > 0), "", devices=devices)


# ---- the test run as figures -------------------------------------------------------------------


def tests(xml_path: str) -> None:
    if not os.path.exists(xml_path):
        emit(B, "gpu_tests_report", 0, "", missing=f"{xml_path} not written (pytest did not finish)")
        return
    root = ET.parse(xml_path).getroot()
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        kind = kinds[0] if kinds else "passed"
        counts["failed" if kind == "failure" else kind] += 1
        if kinds:
            detail = case.find(kind)
            text = detail.get("message") or detail.text or ""
            metric = f"gpu_test_{'failed' if kind == 'failure' else kind}"
            emit(B, metric, 1, "", test=name, message=_first_line(text))
    for k, v in counts.items():
        emit(B, f"gpu_tests_{k}", v, "tests")


# ---- kernels ------------------------------------------------------------------------------------


def _timed(sync, fn, repeat: int) -> float:
    """Median seconds of ``fn`` with the device synchronized around each call (after 2 warm-ups)."""
    for _ in range(2):
        fn()
    sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _copy_bandwidth(cp, sync, repeat: int) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (far past the L2), counting read + written."""
    src = cp.empty(1 << 28, cp.float32)
    dst = cp.empty_like(src)
    return 2 * src.nbytes / _timed(sync, lambda: cp.copyto(dst, src), repeat)


def _torch_cases(torch):
    F = torch.nn.functional

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)

    def swiglu_bwd(a, b, g):
        s = torch.sigmoid(a)
        return g * b * s * (1.0 + a * (1.0 - s)), g * a * s

    return {
        "rmsnorm": lambda x, w: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w,
        "softmax_fwd": lambda x: torch.softmax(x, -1),
        "softmax_bwd": lambda y, g: y * (g - (g * y).sum(-1, keepdim=True)),
        "swiglu_fwd": lambda a, b: F.silu(a) * b,
        "swiglu_bwd": swiglu_bwd,
        "rotary_fwd": lambda x, c, s: x * c + rot(x) * s,
        "rotary_bwd": lambda g, c, s: g * c - rot(g * s),
        "cross_entropy_fwd": lambda x, y: F.cross_entropy(x, y),
        "cross_entropy_bwd": lambda x, y: (
            (torch.softmax(x, -1) - F.one_hot(y, x.shape[-1]).to(x.dtype)) / x.shape[0]
        ),
    }


def _tuple(x) -> tuple:
    return x if isinstance(x, (tuple, list)) else (x,)


def kernels(scale: int, repeat: int, use_torch_compile: bool) -> int:
    import cupy as cp
    import fused_ops

    import llmkit.framework as lf
    from llmkit.framework import jit
    from llmkit.framework.compiler.runtime import FusedKernel

    sync = cp.cuda.Device().synchronize
    copy = _copy_bandwidth(cp, sync, repeat)
    emit(B, "copy_bandwidth", copy / 1e9, "GB/s", note="cupy device-to-device copy of 1 GiB, read + written")
    try:
        import torch

        torch_ok = torch.cuda.is_available()
    except ImportError:
        torch_ok = False
    if not torch_ok:
        emit(B, "torch_baselines", 0, "", missing="PyTorch with CUDA not found: no eager/compiled baselines")
    tcases = _torch_cases(torch) if torch_ok else {}

    def rms(x, w, xp):
        return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * w

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048 * scale, 4096), dtype=np.float32)
    w = rng.standard_normal(4096, dtype=np.float32)
    items = [("rmsnorm", rms, lambda a, b: lf.ops.rms_norm(a, b, eps=1e-6), [x, w], ())]
    for n, f, g, arrays, grad in fused_ops.cases(rng, scale):
        items.append((n, lambda *xs, f=f, **k: f(*xs, **k), g, arrays, grad))
    failures = 0
    for name, ref, fn, arrays, grad in items:
        try:
            dev = [cp.asarray(a) for a in arrays]
            ts = [
                lf.tensor(d, dtype=a.dtype, device="gpu", requires_grad=i in grad)
                for i, (a, d) in enumerate(zip(arrays, dev))
            ]
            specs = [jit.InputSpec(a.shape, a.dtype) for a in arrays]
            run = jit.to_static(fn, input_spec=specs, compiler="cinn")
            got = [o._data for o in _tuple(run(*ts))]  # traces, fuses, builds the C and CUDA kernels
            steps = run._last.executor.steps
            groups = [st.fn for st in steps if isinstance(st.fn, FusedKernel)]
            on_cuda = sum(g.cuda is not None for g in groups)
            want = _tuple(ref(*dev, xp=cp))
            for g, w_ in zip(got, want):
                np.testing.assert_allclose(cp.asnumpy(g), cp.asnumpy(w_), rtol=2e-4, atol=2e-5, err_msg=name)
            t_ours = _timed(sync, lambda: run(*ts), repeat)
            t_cupy = _timed(sync, lambda: ref(*dev, xp=cp), repeat)
            moved = sum(a.nbytes for a in dev) + sum(o.nbytes for o in got)  # each byte once, at least
            row = dict(
                ours_ms=round(t_ours * 1e3, 4),
                cupy_ms=round(t_cupy * 1e3, 4),
                bytes=moved,
                of_copy_bandwidth=round(moved / t_ours / copy, 3),
                fused_groups=len(groups),
                groups_on_cuda=on_cuda,
                other_steps=[st.name for st in steps if not isinstance(st.fn, FusedKernel)],
            )
            if torch_ok:
                tin = [torch.as_tensor(d, device="cuda") for d in dev]
                variants = {"torch_eager": tcases[name]}
                if use_torch_compile:
                    variants["torch_compile"] = torch.compile(tcases[name])
                for label, tf in variants.items():
                    for g, w_ in zip(_tuple(tf(*tin)), want):
                        got_t, want_c = g.cpu().numpy(), cp.asnumpy(w_)
                        np.testing.assert_allclose(
                            got_t, want_c, rtol=2e-4, atol=2e-5, err_msg=f"{name} {label}"
                        )
                    tt = _timed(sync, lambda tf=tf: tf(*tin), repeat)
                    row[f"{label}_ms"] = round(tt * 1e3, 4)
                    row[f"{label}_of_copy_bandwidth"] = round(moved / tt / copy, 3)
                    row[f"over_{label}"] = round(tt / t_ours, 3)
            emit(B, f"{name}_over_cupy_composed", t_cupy / t_ours, "x", **row)
        except Exception as e:  # one op's failure is a figure, not the end of the part
            failures += 1
            emit(B, f"{name}_failed", 1, "", error=_error(e))
        finally:
            cp.get_default_memory_pool().free_all_blocks()
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    sub.add_parser("probe")
    sub.add_parser("missing", help="print the missing requirements, one a line (the script's wheel step)")
    t = sub.add_parser("tests")
    t.add_argument("xml")
    k = sub.add_parser("kernels")
    k.add_argument("--scale", type=int, default=8, help="rows x this (8: each input tens to hundreds of MB)")
    k.add_argument("--repeat", type=int, default=20)
    k.add_argument("--no-torch-compile", action="store_true")
    a = p.parse_args()
    if a.part == "probe":
        probe()
    elif a.part == "missing":
        print("\n".join(missing_requirements()))
    elif a.part == "tests":
        tests(a.xml)
    else:
        sys.exit(1 if kernels(a.scale, a.repeat, not a.no_torch_compile) else 0)


if __name__ == "__main__":
    main()
