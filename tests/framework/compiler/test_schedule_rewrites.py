"""Two rewrites of ``loop_schedule``: the equal pieces of a split concat merged into one loop (values
they share computed once), and a sum of ``x * (t == i)`` read as a pick of ``x`` at ``t``.
Numbers against float64 formulas written here."""

from __future__ import annotations

import numpy as np

import llmkit.framework as lf
from llmkit.framework import compiler, jit
from llmkit.framework.compiler import loop_ir as L
from llmkit.framework.compiler.lower import lower
from llmkit.framework.compiler.runtime import kernel_sources

from .conftest import needs_cc
from .harness import run

O = lf.ops
pytestmark = needs_cc


def _swiglu_grad(a, b, g):  # SwiGLU's backward as a merged gate/up projection sees it: one concat
    y = O.swiglu(a, b)
    return O.concat(lf.grad((y * g).sum(), [a, b]), axis=-1)


def _compiled(fn, specs, grad: tuple[int, ...]):
    """(the fused, compiled program of ``fn``, the rows-schedule loop IR of each of its groups)."""
    ts = [lf.tensor(np.zeros([3 if isinstance(d, str) else d for d in s], dt), requires_grad=i in grad)
          for i, (s, dt) in enumerate(specs)]  # fmt: skip
    sf = jit.to_static(fn, input_spec=[jit.InputSpec(s, d) for s, d in specs], compiler="none")
    fused = compiler.fuse_program(sf.get_concrete_program(*ts).program)
    compiler.compile_fusions(fused)
    return fused, [kernel_sources(lower(op))[0][3] for op in fused.walk() if op.name == "cinn.fusion"]


def _loops(k: L.Kernel) -> list[L.Loop]:
    return [s for s in L.walk_stmts(k.body) if isinstance(s, L.Loop) and s.kind == "vector"]


def test_the_pieces_of_a_concat_become_one_loop_computing_the_sigmoid_once():
    specs = [(["N", 64], "float32")] * 3  # pieces of 64: merged (shorter ones stay apart)
    prog, ks = _compiled(_swiglu_grad, specs, (0, 1))
    (k,) = [k for k in ks if "concat" in k.label]
    assert len(_loops(k)) == 1
    assert str(k).count("exp(") == 1
    rng = np.random.default_rng(0)
    a, b, g = (rng.standard_normal((5, 64)).astype(np.float32) for _ in range(3))
    (got,) = run(prog, [a, b, g], native=True)
    a64, b64, g64 = (x.astype(np.float64) for x in (a, b, g))
    s = 1.0 / (1.0 + np.exp(-a64))
    want = np.concatenate([g64 * b64 * s * (1.0 + a64 * (1.0 - s)), g64 * a64 * s], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _ce(logits, labels):
    loss = O.cross_entropy(logits, labels)
    return loss, lf.grad(loss, [logits])[0]


def test_the_one_hot_pick_of_cross_entropy_is_a_load_not_a_pass():
    specs = [(["N", 37], "float32"), (["N"], "int64")]
    prog, ks = _compiled(_ce, specs, (0,))
    (k,) = [k for k in ks if "softmax" in k.label]
    assert len(_loops(k)) == 3  # max, sum of exp, the gradient: no pass for the picked logit
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 37)).astype(np.float32)
    lab = rng.integers(0, 37, 6)
    lab[2] = -100  # ignored
    x[0, (lab[0] + 1) % 37] = -np.inf  # another class at -inf: its probability is 0, the loss finite
    loss, grad = run(prog, [x, lab], native=True)
    x64, ok = x.astype(np.float64), lab != -100
    lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
    nll = lse[ok] - x64[ok, lab[ok]]
    assert np.isfinite(loss) and abs(loss - nll.mean()) < 1e-5
    p = np.exp(x64 - lse[:, None])
    p[np.arange(6), np.where(ok, lab, 0)] -= 1.0
    np.testing.assert_allclose(grad, p * ok[:, None] / ok.sum(), rtol=1e-5, atol=1e-7)
