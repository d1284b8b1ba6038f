"""Every kernel test and benchmark on a GPU machine, in one go.

1. the compiler's tests, GPU tests included (``pytest tests/framework/compiler``);
2. each fused op (RMSNorm, softmax, swiglu, rotary, cross entropy; forward and backward) as a
   CUDA kernel against the same composed ops in cupy, timed with the device synchronized;
3. the CPU benchmarks (``rmsnorm.py``, ``fused_ops.py``), so one run reports everything.

One JSON line per figure. Without cupy or a CUDA device it says so and exits 0 after the CPU
parts (``--skip-cpu`` leaves those out).

Run: python benchmarks/gpu_smoke.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np
from _common import emit, machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def gpu_timed(cp, fn, repeat: int = 20) -> float:
    fn()
    cp.cuda.Device().synchronize()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def run_tests() -> int:
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/framework/compiler", "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]
    emit("gpu_smoke", "compiler_tests_exit_code", r.returncode, "", summary=tail)
    if r.returncode:
        print(r.stdout[-6000:], file=sys.stderr)
    return r.returncode


def gpu_benchmarks(cp) -> None:
    import fused_ops

    import llmkit.framework as lf
    from llmkit.framework import compiler, jit
    from llmkit.framework.executor import Executor

    def rms(x, w, xp):
        return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + 1e-6)) * w

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 4096), dtype=np.float32)
    xd = cp.asarray(x)
    t_copy = gpu_timed(cp, lambda: xd.copy())
    copy_gbps = 2 * xd.nbytes / t_copy / 1e9
    emit("gpu_smoke", "copy_bandwidth", copy_gbps, "GB/s", note="cupy copy of [2048, 4096] fp32, read+write")
    w = rng.standard_normal(4096, dtype=np.float32)
    items = [("rmsnorm", rms, lambda a, b: lf.ops.rms_norm(a, b, eps=1e-6), [x, w], ())]
    items += [
        (n, lambda *xs, f=f, **k: f(*xs, **k), g, arrays, grad)
        for n, f, g, arrays, grad in fused_ops.cases(rng)
    ]
    for name, ref, fn, arrays, grad in items:
        specs = [jit.InputSpec(a.shape, a.dtype) for a in arrays]
        ts = [lf.tensor(a, dtype=a.dtype, requires_grad=i in grad) for i, a in enumerate(arrays)]
        program = jit.to_static(fn, input_spec=specs, compiler="none").get_concrete_program(*ts).program
        ex = Executor(compiler.compile_program(program))
        dev = [cp.asarray(a) for a in arrays]
        got = ex.run(dev)
        want = ref(*dev, xp=cp)
        for g, w_ in zip(got, want if isinstance(want, tuple) else (want,)):
            np.testing.assert_allclose(cp.asnumpy(g), cp.asnumpy(w_), rtol=2e-4, atol=2e-5, err_msg=name)
        t_ref = gpu_timed(cp, lambda: ref(*dev, xp=cp))
        t_cc = gpu_timed(cp, lambda: ex.run(dev))
        moved = sum(a.nbytes for a in dev) + sum(o.nbytes for o in got)  # each byte once, at least
        gbps = moved / t_cc / 1e9
        emit(
            "gpu_smoke",
            f"{name}_speedup_over_cupy",
            t_ref / t_cc,
            "x",
            cupy_ms=round(t_ref * 1e3, 3),
            compiled_ms=round(t_cc * 1e3, 3),
            compiled_gbps=round(gbps, 1),
            of_copy_bandwidth=round(gbps / copy_gbps, 3),
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-cpu", action="store_true", help="only the GPU parts")
    a = p.parse_args()
    try:
        import cupy as cp

        n = cp.cuda.runtime.getDeviceCount()
        name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode() if n else ""
    except Exception as e:  # no cupy, no driver, no device
        cp, n, name = None, 0, f"unavailable: {type(e).__name__}: {e}"
    emit("gpu_smoke", "cuda_devices", n, "", device=name, **machine())
    status = run_tests()
    if cp is not None and n:
        gpu_benchmarks(cp)
    if not a.skip_cpu:
        for script in ("rmsnorm.py", "fused_ops.py"):
            subprocess.run([sys.executable, os.path.join(HERE, script)], check=False)
    sys.exit(status)


if __name__ == "__main__":
    main()
