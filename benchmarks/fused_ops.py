"""Fused kernels against the composed numpy ops: softmax, swiglu, rotary, cross entropy.

Each op forward and backward, at the bench model's shapes scaled up to be memory-bound: the
composed numpy expression (what the reference kernels do, op by op) against the same math
written with llmkit ops and compiled (one kernel each, run by the executor). Ratios are of this
run; the target is 3x.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/fused_ops.py
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

O = lf.ops
N, V, H, I = 2048, 4096, 8, 2752  # rows (batch x seq), vocab, heads, MLP width
S, D = 256, 64  # attention length, head dim


# ---- the composed ops (numpy, or cupy on a GPU), op by op --------------------------------------
def np_softmax(x, xp=np):
    e = xp.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_softmax_bwd(y, g, xp=np):
    return y * (g - (g * y).sum(-1, keepdims=True))


def np_sigmoid(x, xp=np):
    return 1.0 / (1.0 + xp.exp(-x))


def np_swiglu(a, b, xp=np):
    return a * np_sigmoid(a, xp) * b


def np_swiglu_bwd(a, b, g, xp=np):
    s = np_sigmoid(a, xp)
    return g * b * s * (1.0 + a * (1.0 - s)), g * a * s


def np_rotate_half(x, xp=np):
    h = x.shape[-1] // 2
    return xp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def np_rope(x, cos, sin, xp=np):
    return x * cos + np_rotate_half(x, xp) * sin


def np_rope_bwd(g, cos, sin, xp=np):
    return g * cos - np_rotate_half(g * sin, xp)


def np_ce(x, labels, xp=np):
    m = x.max(-1, keepdims=True)
    lse = xp.log(xp.exp(x - m).sum(-1, keepdims=True)) + m
    return (lse[:, 0] - xp.take_along_axis(x, labels[:, None], -1)[:, 0]).mean(dtype=xp.float32)


def np_ce_bwd(x, labels, xp=np):
    p = np_softmax(x, xp)
    p[xp.arange(len(labels)), labels] -= 1.0
    return p / xp.float32(len(labels))


# ---- the same math, compiled --------------------------------------------------------------------
def lk_softmax_bwd(y, g):
    return y * (g - (g * y).sum(axis=-1, keepdim=True))


def lk_swiglu_bwd(a, b, g):
    s = O.sigmoid(a)
    return g * b * s * (1.0 + a * (1.0 - s)), g * a * s


def lk_rotate_half(x):
    h = x.shape[-1] // 2
    return O.concat([-x[..., h:], x[..., :h]], axis=-1)


def lk_rope(x, cos, sin):
    return x * cos + lk_rotate_half(x) * sin


def lk_rope_bwd(g, cos, sin):
    return g * cos - lk_rotate_half(g * sin)


def lk_ce_bwd(x, labels):
    return lf.grad(O.cross_entropy(x, labels), [x])[0]


def compile_fn(fn, arrays, grad=()):
    specs = [jit.InputSpec(a.shape, a.dtype) for a in arrays]
    ts = [lf.tensor(a, dtype=a.dtype, requires_grad=i in grad) for i, a in enumerate(arrays)]
    program = jit.to_static(fn, input_spec=specs, compiler="none").get_concrete_program(*ts).program
    ex = Executor(compiler.compile_program(program))
    return lambda *xs: ex.run(list(xs))


def cases(rng: np.random.Generator, scale: int = 1) -> list:
    """(name, composed ops, the same with llmkit ops, inputs, inputs differentiated); ``scale``
    multiplies the rows and sequences (a GPU needs data several times its L2)."""
    f32 = np.float32
    n = N * scale
    scores = rng.standard_normal((H * 8 * scale, S, S), dtype=f32)  # attention scores of 8 sequences
    gs = rng.standard_normal(scores.shape, dtype=f32)
    ys = np_softmax(scores)
    ga, gb, gg = (rng.standard_normal((n, I), dtype=f32) for _ in range(3))
    q = rng.standard_normal((8 * scale, H, S, D), dtype=f32)
    ang = np.arange(S)[:, None] * rng.uniform(0.01, 1, D // 2)[None]
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang).astype(f32), np.sin(ang).astype(f32)
    logits = rng.standard_normal((n, V), dtype=f32)
    labels = rng.integers(0, V, n)
    return [
        ("softmax_fwd", np_softmax, lambda x: O.softmax(x, axis=-1), [scores], ()),
        ("softmax_bwd", np_softmax_bwd, lk_softmax_bwd, [ys, gs], ()),
        ("swiglu_fwd", np_swiglu, O.swiglu, [ga, gb], ()),
        ("swiglu_bwd", np_swiglu_bwd, lk_swiglu_bwd, [ga, gb, gg], ()),
        ("rotary_fwd", np_rope, lk_rope, [q, cos, sin], ()),
        ("rotary_bwd", np_rope_bwd, lk_rope_bwd, [q, cos, sin], ()),
        ("cross_entropy_fwd", np_ce, lambda x, y: O.cross_entropy(x, y), [logits, labels], ()),
        ("cross_entropy_bwd", np_ce_bwd, lk_ce_bwd, [logits, labels], (0,)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=11)
    a = p.parse_args()
    keep_freed_memory()
    emit(
        "fused_ops",
        "load_average_1min",
        os.getloadavg()[0],
        "",
        compiler_available=compiler.available(),
        **machine(),
    )
    for name, ref, fn, arrays, grad in cases(np.random.default_rng(0)):
        run = compile_fn(fn, arrays, grad)
        want, got = ref(*arrays), run(*arrays)
        for w, g in zip(want if isinstance(want, tuple) else (want,), got):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5, err_msg=name)
        t_np = median_time(lambda: ref(*arrays), repeat=a.repeat)
        t_cc = median_time(lambda: run(*arrays), repeat=a.repeat)
        emit(
            "fused_ops",
            f"{name}_speedup",
            t_np / t_cc,
            "x",
            numpy_ms=round(t_np * 1e3, 3),
            compiled_ms=round(t_cc * 1e3, 3),
            target=3.0,
        )


if __name__ == "__main__":
    main()
