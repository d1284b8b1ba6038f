"""Eager-mode overhead.

1. Dispatch overhead per op on tiny tensors (µs): ``x + y`` (also with grad), softmax, ``x * 2.0``
   and a 4x4 matmul through ``apply`` vs numpy's own add, and against PyTorch's eager dispatch of
   the same ops in the same run where torch is installed (each side's time less numpy's add).
2. Forward + backward of a 4-layer MLP (d=1024, batch 256) against the same math hand-written in
   numpy in the same run; the issue's target is a ratio <= 1.2.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/eager_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _common import emit, machine, median_time

import llmkit.framework as lf


def dispatch_overhead() -> None:
    a, b = np.ones(2, np.float32), np.ones(2, np.float32)
    x, y = lf.tensor(a), lf.tensor(b)
    xg = lf.tensor(a, requires_grad=True)
    n = 2000
    t_np = median_time(lambda: a + b, number=n)
    t_lf = median_time(lambda: x + y, number=n)
    t_grad = median_time(lambda: xg + y, number=n)
    t_soft = median_time(lambda: lf.ops.softmax(x, axis=-1), number=n)
    t_scalar = median_time(lambda: x * 2.0, number=n)
    m = lf.tensor(np.ones((4, 4), np.float32))
    t_mm = median_time(lambda: m @ m, number=n)
    emit("eager_overhead", "numpy_add_us", t_np * 1e6, "us")
    emit("eager_overhead", "dispatch_add_us", t_lf * 1e6, "us", overhead_us=round((t_lf - t_np) * 1e6, 2))
    emit("eager_overhead", "dispatch_add_with_grad_us", t_grad * 1e6, "us")
    emit("eager_overhead", "dispatch_softmax_us", t_soft * 1e6, "us")
    emit("eager_overhead", "dispatch_mul_scalar_us", t_scalar * 1e6, "us")
    emit("eager_overhead", "dispatch_matmul_4x4_us", t_mm * 1e6, "us")
    try:
        import torch
    except ImportError:
        return
    ta, tb = torch.ones(2), torch.ones(2)
    tg = torch.ones(2, requires_grad=True)
    tm = torch.ones(4, 4)
    ours = {"add": t_lf, "add_with_grad": t_grad, "softmax": t_soft}
    ours.update(mul_scalar=t_scalar, matmul_4x4=t_mm)
    theirs = {
        "add": median_time(lambda: ta + tb, number=n),
        "add_with_grad": median_time(lambda: tg + tb, number=n),
        "softmax": median_time(lambda: torch.softmax(ta, -1), number=n),
        "mul_scalar": median_time(lambda: ta * 2.0, number=n),
        "matmul_4x4": median_time(lambda: tm @ tm, number=n),
    }
    for op, t in theirs.items():  # the per-op cost over numpy's own add, ours against torch's
        emit("eager_overhead", f"torch_{op}_us", t * 1e6, "us")
        emit(
            "eager_overhead",
            f"{op}_overhead_over_torch",
            (ours[op] - t_np) / max(t - t_np, 1e-9),
            "x",
            ours_us=round((ours[op] - t_np) * 1e6, 2),
            torch_us=round((t - t_np) * 1e6, 2),
            target="<= 2",
        )


def mlp(d: int, batch: int, layers: int) -> None:
    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(layers)]
    bs = [np.zeros(d, np.float32) for _ in range(layers)]
    x = rng.standard_normal((batch, d)).astype(np.float32)

    def numpy_step():
        hs = [x]
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = hs[-1] @ w.T + b
            hs.append(np.maximum(h, 0) if i < layers - 1 else h)
        out = hs[-1]
        g = out * (2.0 / out.size)  # d mean(out^2)
        grads = []
        for i in range(layers - 1, -1, -1):
            if i < layers - 1:
                g = g * (hs[i + 1] > 0)
            grads.append((g.T @ hs[i], g.sum(0)))
            if i > 0:
                g = g @ ws[i]
        return float(np.mean(out * out)), grads

    params = [(lf.Parameter(w), lf.Parameter(b)) for w, b in zip(ws, bs)]
    xt = lf.tensor(x)

    def lf_step():
        h = xt
        for i, (w, b) in enumerate(params):
            h = lf.ops.linear(h, w, b)
            if i < layers - 1:
                h = lf.ops.relu(h)
        loss = lf.ops.mean(h * h)
        for w, b in params:
            w.grad = b.grad = None
        loss.backward()
        return loss

    # Same numbers first: the comparison is only meaningful if both compute the same thing.
    ref_loss, ref_grads = numpy_step()
    loss = lf_step()
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-4)
    np.testing.assert_allclose(params[0][0].grad.numpy(), ref_grads[-1][0], rtol=2e-3, atol=1e-6)

    # Interleaved, so both sides see the same machine (a shared 2-core VM drifts between runs).
    samples: dict[str, list[float]] = {"np": [], "lf": []}
    for _ in range(2):
        numpy_step(), lf_step()
    for _ in range(11):
        for key, fn in (("np", numpy_step), ("lf", lf_step)):
            t0 = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t0)
    t_np, t_lf = statistics.median(samples["np"]), statistics.median(samples["lf"])
    flops = 3 * 2 * batch * d * d * layers
    emit(
        "eager_overhead",
        "mlp_numpy_ms",
        t_np * 1e3,
        "ms",
        d=d,
        batch=batch,
        layers=layers,
        gflops=round(flops / t_np / 1e9, 1),
    )
    emit(
        "eager_overhead",
        "mlp_llmkit_ms",
        t_lf * 1e3,
        "ms",
        d=d,
        batch=batch,
        layers=layers,
        gflops=round(flops / t_lf / 1e9, 1),
    )
    emit("eager_overhead", "mlp_ratio_llmkit_over_numpy", t_lf / t_np, "x", target="<= 1.2", **machine())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    dispatch_overhead()
    mlp(a.d, a.batch, a.layers)
