"""RMSNorm: the compiled kernel against the composed numpy expression and a numpy copy.

For each shape (fp32): the composed numpy ``x * (1 / sqrt(mean(x*x) + eps)) * w``, the compiled
RMSNorm as a static program runs it (executor included), and ``np.copy`` of x — which moves the
same bytes (read x, write the output), so copy_ms / compiled_ms is the fraction of the copy's
memory bandwidth the kernel reaches. Every ratio is measured in this run; ``--torch`` adds
PyTorch's ``F.rms_norm`` (eager) for reference.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/rmsnorm.py
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from _common import emit, machine, median_time

import llmkit.framework as lf
from llmkit.framework import compiler, jit
from llmkit.framework.executor import Executor
from llmkit.framework.memory import keep_freed_memory

EPS = 1e-6


def composed(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)) * w


def compiled(h: int) -> Executor:
    spec = [jit.InputSpec(["N", h], "float32"), jit.InputSpec([h], "float32")]
    f = jit.to_static(lambda x, w: lf.ops.rms_norm(x, w, eps=EPS), input_spec=spec, compiler="none")
    program = f.get_concrete_program(lf.zeros(2, h), lf.ones(h)).program
    return Executor(compiler.compile_program(program))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2048x4096,8192x1024")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--torch", action="store_true", help="also time torch.nn.functional.rms_norm")
    a = p.parse_args()
    keep_freed_memory()  # as the executor does: freed buffers stay in the heap for the next call
    emit(
        "rmsnorm",
        "load_average_1min",
        os.getloadavg()[0],
        "",
        compiler_available=compiler.available(),
        **machine(),
    )
    for shape in a.shapes.split(","):
        n, h = (int(s) for s in shape.split("x"))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, h), dtype=np.float32)
        w = rng.standard_normal(h, dtype=np.float32)
        ex = compiled(h)
        got = ex.run([x, w])[0]
        np.testing.assert_allclose(got, composed(x, w), rtol=1e-4, atol=1e-5)
        t_np = median_time(lambda: composed(x, w), repeat=a.repeat)
        t_cc = median_time(lambda: ex.run([x, w]), repeat=a.repeat)
        t_copy = median_time(lambda: x.copy(), repeat=a.repeat)
        gbs = 2 * x.nbytes / 1e9
        tag = f"{n}x{h}"
        emit("rmsnorm", f"composed_numpy_ms_{tag}", t_np * 1e3, "ms")
        emit("rmsnorm", f"compiled_ms_{tag}", t_cc * 1e3, "ms", gb_per_s=round(gbs / t_cc, 2))
        emit("rmsnorm", f"numpy_copy_ms_{tag}", t_copy * 1e3, "ms", gb_per_s=round(gbs / t_copy, 2))
        emit("rmsnorm", f"speedup_over_numpy_{tag}", t_np / t_cc, "x", target=4.0)
        emit("rmsnorm", f"fraction_of_copy_bandwidth_{tag}", t_copy / t_cc, "", target=0.7)
        if a.torch:
            import torch

            xt, wt = torch.from_numpy(x), torch.from_numpy(w)
            t_t = median_time(lambda: torch.nn.functional.rms_norm(xt, (h,), wt, EPS), repeat=a.repeat)
            emit("rmsnorm", f"torch_eager_ms_{tag}", t_t * 1e3, "ms", compiled_speedup=round(t_t / t_cc, 2))


if __name__ == "__main__":
    main()
