"""The flash attention kernels (``compiler/native/attention.py``) against PyTorch's CPU
``scaled_dot_product_attention``, forward and backward, in the same process (both on the same
threads, causal, float32, q/k/v as the model's transposed views; torch's backward is its
forward + backward less its forward). Shapes: ``bench`` (configs/bench.yaml: 8 x 256 tokens, 8 query
heads, 4 K/V heads, head dim 32) and ``134M`` (4 x 512, 12 heads, head dim 64). FLOPs count the
visible half of the scores (forward 2 products, backward 5); ``pct_peak`` is against the machine's
float32 peak at ``--ghz`` (2 FMA units x 8 lanes x 2 per cycle per core). Threads: the kernels'
(``LLMKIT_CINN_THREADS``, default every core), torch's the same; at 1 thread the figures are the
calling thread's CPU time (steadier on a shared machine), else wall time.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/attention.py
"""

from __future__ import annotations

# _common first (puts the repository on sys.path), then llmkit before numpy (see llmkit/__init__.py)
# isort: off
import _common  # noqa: F401
import llmkit  # noqa: F401

# isort: on
import argparse
import time

import numpy as np
from _common import emit, load_average

from llmkit.framework.compiler import build
from llmkit.framework.compiler.native import NativeOp, build_c
from llmkit.framework.opspec import Meta, table

SHAPES = {"bench": (8, 8, 4, 256, 32), "134M": (4, 12, 12, 512, 64)}  # B, Hq, Hk, S, D


def kernel(name, *arrays):
    spec = table()[name]
    return NativeOp(
        spec, build_c(spec.native.source(*[Meta(a.shape, a.dtype) for a in arrays], is_causal=True))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ghz", type=float, default=3.15, help="clock for the peak (an FMA loop ran 101 GFLOP/s a core here)"
    )
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    import torch

    threads = build.CPUS
    torch.set_num_threads(threads)
    clock = time.thread_time if threads == 1 else time.perf_counter
    peak = threads * 32 * args.ghz * 1e9
    rng = np.random.default_rng(0)
    for shape, (b, hq, hk, s, d) in SHAPES.items():
        q, k, v, g = (
            rng.standard_normal((b, s, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
            for h in (hq, hk, hk, hq)
        )
        fwd = kernel("scaled_dot_product_attention_lse", q, k, v)
        out, lse = fwd(np, q, k, v, is_causal=True)
        bwd = kernel("scaled_dot_product_attention_lse_grad", g, out, lse, q, k, v)
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        tg = torch.from_numpy(g)

        def torch_fwd():
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

        def torch_both():
            y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
            torch.autograd.grad(y, (tq, tk, tv), tg)

        def best(fn):  # the fastest of --repeat calls: the least disturbed by other load
            fn()
            times = []
            for _ in range(args.repeat):
                t = clock()
                fn()
                times.append(clock() - t)
            return min(times)

        runs = {
            "forward": lambda: fwd(np, q, k, v, is_causal=True),
            "backward": lambda: bwd(np, g, out, lse, q, k, v, is_causal=True),
            "torch_forward": torch_fwd,
            "torch_both": torch_both,
        }
        times = {name: best(fn) for name, fn in runs.items()}
        times["torch_backward"] = times["torch_both"] - times["torch_forward"]
        flops = b * hq * s * s * d  # one product over the visible half of the scores
        for part, n in (("forward", 2), ("backward", 5)):
            ours, theirs = times[part], times["torch_" + part]
            tags = dict(shape=shape, load=load_average(), torch_us=round(theirs * 1e6, 1))
            tags.update(
                pct_peak=round(100 * n * flops / ours / peak, 1), torch_over_ours=round(theirs / ours, 3)
            )
            emit("attention", part, ours * 1e6, "us", **tags)


if __name__ == "__main__":
    main()
