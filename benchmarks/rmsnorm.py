"""RMSNorm through the public ``to_static`` call, against the composed numpy expression and a copy.

What a user writes, in this fresh process (numpy imported first, as a script usually does)::

    f = jit.to_static(lambda x, w: lf.ops.rms_norm(x, w, eps=1e-6),
                      input_spec=[InputSpec(["N", h], "float32"), InputSpec([h], "float32")])
    f(x, w)

For each shape (fp32) it times ``f(x, w)`` (tracing and compiling happen at the first call, before
timing), the composed numpy ``x * (1 / sqrt(mean(x*x) + eps)) * w``, and ``x.copy()``, which moves
the same bytes (read x, write the output): copy_ms / compiled_ms is the fraction of a numpy copy's
memory bandwidth the call reaches, Python and the executor included. The three are timed in turns,
``--rounds`` times, and each ratio is the median over rounds of the ratio within a round (this VM
drifts). All run under the allocator settings the executor applies at its first call
(``memory.keep_freed_memory``). ``--torch`` adds PyTorch's ``F.rms_norm`` (eager), imported after
the compiled call (torch loads its own OpenMP runtime).

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/rmsnorm.py
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
from _common import emit, emit_paired_ratio, machine, median_time

import llmkit.framework as lf
from llmkit.framework import compiler, jit

EPS = 1e-6
FIGURES = {"numpy": "composed_numpy_ms", "compiled": "to_static_ms", "copy": "numpy_copy_ms"}


def composed(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)) * w


def public(h: int) -> jit.StaticFunction:
    spec = [jit.InputSpec(["N", h], "float32"), jit.InputSpec([h], "float32")]
    return jit.to_static(lambda x, w: lf.ops.rms_norm(x, w, eps=EPS), input_spec=spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2048x4096,8192x1024")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=15, help="calls per figure per round (the median)")
    p.add_argument("--torch", action="store_true", help="also time torch.nn.functional.rms_norm")
    a = p.parse_args()
    emit("rmsnorm", "load_average_1min", os.getloadavg()[0], "", compiler_available=compiler.available(),
         **machine())  # fmt: skip
    for shape in a.shapes.split(","):
        n, h = (int(s) for s in shape.split("x"))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, h), dtype=np.float32)
        w = rng.standard_normal(h, dtype=np.float32)
        xt, wt = lf.tensor(x), lf.tensor(w)
        f = public(h)
        np.testing.assert_allclose(f(xt, wt).numpy(), composed(x, w), rtol=1e-4, atol=1e-5)
        times: dict[str, list[float]] = {k: [] for k in FIGURES}
        for _ in range(a.rounds):
            times["numpy"].append(median_time(lambda: composed(x, w), repeat=a.repeat))
            times["compiled"].append(median_time(lambda: f(xt, wt), repeat=a.repeat))
            times["copy"].append(median_time(lambda: x.copy(), repeat=a.repeat))
        gbs = 2 * x.nbytes / 1e9
        tag = f"{n}x{h}"
        for name, metric in FIGURES.items():
            t = statistics.median(times[name])
            emit("rmsnorm", f"{metric}_{tag}", t * 1e3, "ms", gb_per_s=round(gbs / t, 2))
        ours = times["compiled"]
        emit_paired_ratio("rmsnorm", f"speedup_over_numpy_{tag}", times["numpy"], ours, target=4.0)
        emit_paired_ratio("rmsnorm", f"fraction_of_copy_bandwidth_{tag}", times["copy"], ours, target=0.9)
        if a.torch:
            import torch

            xt_, wt_ = torch.from_numpy(x), torch.from_numpy(w)
            t_t = median_time(lambda: torch.nn.functional.rms_norm(xt_, (h,), wt_, EPS), repeat=a.repeat)
            t_cc = statistics.median(times["compiled"])
            emit("rmsnorm", f"torch_eager_ms_{tag}", t_t * 1e3, "ms", compiled_speedup=round(t_t / t_cc, 2))


if __name__ == "__main__":
    main()
