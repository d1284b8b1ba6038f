"""Every generated kernel equals the reference kernels: random shapes (odd sizes, size 1,
broadcasting, strided inputs), float32 and float64, NaN and inf inputs.

Each case is traced once with symbolic dims, so one compiled kernel serves every size below.
"""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import compiler, ir, optim

from .conftest import needs_cc
from .harness import Case, assert_same, build_all, count_kernels, count_native, run

O = lf.ops
pytestmark = needs_cc


def r(rng, shape, dt):
    return rng.standard_normal(shape).astype(dt)


def _adamw(p, g, m, v, lr, step):
    opt = optim.AdamW.__new__(optim.AdamW)
    group = {"lr": lr, "step": step, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    new_p, state = optim.AdamW.update(opt, p, g, {"exp_avg": m, "exp_avg_sq": v}, group)
    return new_p, state["exp_avg"], state["exp_avg_sq"]


def _ce(logits, labels):
    loss = O.cross_entropy(logits, labels)
    return loss, lf.grad(loss, [logits])[0]


def _ce_smooth_none(logits, labels):
    loss = O.cross_entropy(logits, labels, label_smoothing=0.1, reduction="none")
    return loss, lf.grad((loss * loss).sum(), [logits])[0]


def _swiglu(a, b):
    y = O.swiglu(a, b)
    return (y, *lf.grad((y * y).sum(), [a, b]))


def _rope(x, cos, sin, pos):
    y = O.rotary_embedding(x, cos, sin, pos)
    return y, lf.grad((y * y).sum(), [x])[0]


def _sdpa(q, k, v):
    y = O.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (y, *lf.grad((y * y).sum(), [q, k, v]))


def _labels(rng, n, v):
    lab = rng.integers(0, v, n)
    lab[rng.random(n) < 0.2] = -100
    return lab.astype(np.int64)


ROWS = [{"N": 1, "H": 1}, {"N": 5, "H": 33}, {"N": 3, "H": 128}]
BSH = [{"B": 1, "S": 1, "H": 4}, {"B": 2, "S": 7, "H": 33}, {"B": 3, "S": 5, "H": 64}]
MAT = [{"N": 1, "M": 1}, {"N": 9, "M": 13}, {"N": 4, "M": 100}]
ABC = [{"A": 1, "B": 1, "C": 1}, {"A": 3, "B": 5, "C": 7}, {"A": 2, "B": 1, "C": 40}]
F = "f"  # the float dtype under test


def floats(*shapes, scale=1.0):
    """A maker of standard-normal inputs, each shape a tuple of ints and symbol names."""
    return lambda g, dt, s: [r(g, tuple(s.get(d, d) for d in shape), dt) * scale for shape in shapes]


def with_labels(classes):
    return lambda g, dt, s: [r(g, (s["N"], classes), dt), _labels(g, s["N"], classes)]


def rope_inputs(g, dt, s):
    pos = g.integers(0, 16, (s["B"], s["S"])).astype(np.int64)
    return [r(g, (s["B"], 3, s["S"], 8), dt), r(g, (16, 8), dt), r(g, (16, 8), dt), pos]


def adamw_inputs(g, dt, s):
    n, m = s["N"], s["M"]
    p, grad, mom = r(g, (n, m), dt), r(g, (n, m), dt), r(g, (n, m), dt) * 0.1
    return [p, grad, mom, np.abs(r(g, (n, m), dt)) * 0.01, np.array(1e-3), np.array(7, np.int64)]


def ints_inputs(g, dt, s):
    return [r(g, (s["N"], s["M"]), dt), g.integers(-5, 5, (s["N"], s["M"])).astype(np.int64)]


def reductions(x):
    return x.sum(axis=0), O.mean(x, axis=[0, 2], keepdim=True), O.max(x, axis=1), O.min(x), x.sum()


def broadcast(a, b, c):
    return O.where(a > b, a * c, b - c) + O.maximum(a, b) / (1.0 + O.abs(c))


def views(x, y):
    return O.concat([x, y], axis=-1) * 2.0, O.transpose(x, [1, 0]) + 1.0, x[:, 1:] - x[:, :-1]


def joins(x, y):  # views of several arrays no group takes in: each a group (a kernel) of its own
    return O.concat([O.transpose(x, [1, 0]), y], axis=-1), O.stack([x, O.transpose(y, [1, 0])])


def activations(x):
    return O.gelu(x, approximate="tanh"), O.erf(x), O.silu(x) * x, O.tanh(x) - O.sigmoid(x)


def ints_and_bools(x, i):
    return (x > 0).astype(x.dtype) * x, (i * 3 - 1).astype(x.dtype), O.logical_not(i > 2)


NM = [(["N", "M"], F)]
CASES = [
    Case("rms_norm", lambda x, w: O.rms_norm(x, w, eps=1e-5), [(["N", "H"], F), (["H"], F)],
         floats(("N", "H"), ("H",)), ROWS),
    Case("residual_rms_norm", lambda x, y, w: (x + y, O.rms_norm(x + y, w)),
         [(["B", "S", "H"], F)] * 2 + [(["H"], F)], floats(("B", "S", "H"), ("B", "S", "H"), ("H",)), BSH),
    Case("softmax", lambda x: O.softmax(x, axis=-1), NM, floats(("N", "M"), scale=3.0), MAT),
    Case("softmax_axis0", lambda x: O.softmax(x, axis=0), NM, floats(("N", "M")), MAT),
    Case("log_softmax", lambda x: O.log_softmax(x, axis=-1), NM, floats(("N", "M")), MAT),
    # the one-hot of the gradient needs a static class count
    Case("cross_entropy", _ce, [(["N", 37], F), (["N"], "int64")], with_labels(37), [{"N": 1}, {"N": 19}],
         grad=(0,)),
    Case("cross_entropy_smooth", _ce_smooth_none, [(["N", 5], F), (["N"], "int64")], with_labels(5),
         [{"N": 1}, {"N": 6}], grad=(0,)),
    Case("swiglu", _swiglu, NM * 2, floats(("N", "M"), ("N", "M")), MAT, grad=(0, 1)),
    Case("rotary", _rope, [(["B", 3, "S", 8], F), ([16, 8], F), ([16, 8], F), (["B", "S"], "int64")],
         rope_inputs, [{"B": 1, "S": 1}, {"B": 2, "S": 9}], grad=(0,)),
    Case("sdpa", _sdpa, [(["B", 4, "S", 8], F), (["B", 2, "S", 8], F), (["B", 2, "S", 8], F)],
         floats(("B", 4, "S", 8), ("B", 2, "S", 8), ("B", 2, "S", 8)), [{"B": 1, "S": 1}, {"B": 2, "S": 11}],
         grad=(0, 1, 2)),
    Case("adamw", _adamw, NM * 4 + [([], "float64"), ([], "int64")], adamw_inputs, MAT),
    Case("reductions", reductions, [(["A", "B", "C"], F)], floats(("A", "B", "C")), ABC),
    Case("broadcast", broadcast, [(["N", 1], F), ([1, "M"], F), (["M"], F)],
         floats(("N", 1), (1, "M"), ("M",)), MAT),
    Case("views", views, [(["N", "M"], F), (["N", 3], F)], floats(("N", "M"), ("N", 3)), MAT),
    Case("joins", joins, [(["N", "M"], F), (["M", "N"], F)], floats(("N", "M"), ("M", "N")), MAT),
    Case("activations", activations, NM, floats(("N", "M"), scale=3.0), MAT),
    Case("ints_and_bools", ints_and_bools, [(["N", "M"], F), (["N", "M"], "int64")], ints_inputs, MAT),
]  # fmt: skip

DTYPES = ["float32", "float64"]


@pytest.fixture(scope="module")
def built():
    return {(b.case.name, b.dtype.name): b for b in build_all(CASES, DTYPES)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_compiled_equals_reference(built, name, dtype):
    b = built[(name, dtype)]
    groups, compiled = count_kernels(b.fused)
    assert groups >= 1 and compiled == groups, f"{name}: {compiled} of {groups} groups compiled"
    applies, ran = count_native(b.fused)
    assert ran == applies, f"{name}: {ran} of {applies} hand-written kernels run"
    rng = np.random.default_rng(1)
    for sizes in b.case.sizes:
        arrays = b.case.make(rng, np.dtype(dtype), sizes)
        with np.errstate(all="ignore"):  # a row whose labels are all ignored: 0/0 in both
            want = run(b.reference, arrays)
        assert_same(run(b.fused, arrays, native=True), want, np.dtype(dtype), f"{name} {sizes}")


NAN_CASES = ["rms_norm", "softmax", "softmax_axis0", "cross_entropy", "swiglu", "reductions", "broadcast",
             "activations", "adamw", "rotary"]  # fmt: skip


@pytest.mark.parametrize("name", NAN_CASES)
def test_nan_and_inf_propagate_as_in_the_reference(built, name):
    for dtype in DTYPES:
        b = built[(name, dtype)]
        rng = np.random.default_rng(2)
        sizes = b.case.sizes[-1]
        arrays = b.case.make(rng, np.dtype(dtype), sizes)
        for a in arrays:
            if a.dtype.kind == "f" and a.ndim:
                flat = a.reshape(-1)
                pick = rng.choice(flat.size, size=min(3, flat.size), replace=False)
                flat[pick] = [np.nan, np.inf, -np.inf][: len(pick)]
        with np.errstate(all="ignore"):
            want = run(b.reference, arrays)
            got = run(b.fused, arrays, native=True)
        assert_same(got, want, np.dtype(dtype), f"{name} with NaN/inf")


def test_strided_inputs_get_their_own_variant(built):
    b = built[("rms_norm", "float32")]
    rng = np.random.default_rng(3)
    big = r(rng, (6, 80), np.float32)
    x = big[1::2, ::2]  # rows and columns strided
    w = r(rng, (40,), np.float32)
    assert not x.flags.c_contiguous
    assert_same(
        run(b.fused, [x, w], native=True), run(b.reference, [np.ascontiguousarray(x), w]), np.dtype("float32")
    )
    xt = r(rng, (40, 5), np.float32).T  # a transposed view
    assert_same(
        run(b.fused, [xt, w], native=True),
        run(b.reference, [np.ascontiguousarray(xt), w]),
        np.dtype("float32"),
    )


def test_one_kernel_serves_every_size(built):
    from llmkit.framework.compiler import STATS

    b = built[("softmax", "float32")]
    rng = np.random.default_rng(4)
    for i, (n, m) in enumerate([(1, 1), (2, 3), (17, 31), (64, 500), (3, 4097)]):
        x = r(rng, (n, m), np.float32)
        assert_same(run(b.fused, [x], native=True), run(b.reference, [x]), np.dtype("float32"))
        if i == 0:  # the first run builds the kernel (when no earlier test has)
            before = STATS.compiled
    assert STATS.compiled == before  # no new kernel for new sizes


_PAIR = """module {
  func @main(%q: f32[B, 2, S, 4], %k: f32[B, 2, S, 4], %v: f32[B, 2, S, 4], %g: f32[B, 2, S, 4],
             %m: f32[B, 2, S, S]) -> (f32[B, 2, S, 4], f32[B, 2, S, 4]) {
    %0 = llm.scaled_dot_product_attention(%q, %k, %v FWD) {is_causal = true} : f32[B, 2, S, 4]
    %1, %2, %3 = llm.scaled_dot_product_attention_grad(%g, OUT, %q, KEYS, %v GRAD) {is_causal = true} : f32[B, 2, S, 4], f32[B, 2, S, 4], f32[B, 2, S, 4]
    return %0, %1
  }
}"""  # noqa: E501


@pytest.mark.parametrize(
    "fwd, out, keys, grad, pairs",
    [
        ("", "%0", "%k", "", 1),  # a backward of its forward: paired
        ("", "%g", "%k", "", 0),  # the output is not the forward's
        ("", "%0", "%q", "", 0),  # other keys
        (", %m", "%0", "%k", ", %m", 0),  # a mask: no kernel template, decomposed instead
    ],
)
def test_attention_backward_takes_the_forwards_log_sum_exp(fwd, out, keys, grad, pairs):
    from llmkit.framework.compiler.attention_lse import keep_attention_lse

    text = _PAIR.replace("FWD", fwd).replace("OUT", out).replace("KEYS", keys).replace("GRAD", grad)
    p = ir.parse(text)
    assert keep_attention_lse(p) == pairs
    p.verify()
    names = [op.name for op in p.walk()]
    assert ("llm.scaled_dot_product_attention_lse_grad" in names) == bool(pairs)
    assert ("llm.scaled_dot_product_attention_grad" in names) == (not pairs)


def test_paired_attention_runs_the_lse_kernels_and_its_lse_equals_the_reference(built):
    """The sdpa case above (forward and gradients) ran as the _lse pair; the log-sum-exp the
    forward kernel writes equals the reference kernel's."""
    b = built[("sdpa", "float32")]
    inner = [op.name for op in b.fused.walk()]
    assert "llm.scaled_dot_product_attention_lse" in inner
    assert "llm.scaled_dot_product_attention_lse_grad" in inner
    assert "llm.scaled_dot_product_attention_grad" not in inner
    assert count_native(b.fused) == (2, 2)  # the flash kernels run them
    rng = np.random.default_rng(4)
    q, k, v = (r(rng, (2, h, 11, 8), np.float32) for h in (4, 2, 2))
    p = ir.parse(
        """module {
  func @main(%q: f32[2, 4, 11, 8], %k: f32[2, 2, 11, 8], %v: f32[2, 2, 11, 8]) -> (f32[2, 4, 11, 8], f32[2, 4, 11]) {
    %0, %1 = llm.scaled_dot_product_attention_lse(%q, %k, %v) {is_causal = true} : f32[2, 4, 11, 8], f32[2, 4, 11]
    return %0, %1
  }
}"""  # noqa: E501
    )
    fused = compiler.compile_program(p)
    out, lse = run(fused, [q, k, v], native=True)
    want_out, want_lse = run(p, [q, k, v])
    assert_same([out, lse], [want_out, want_lse], np.dtype("float32"), "attention with lse")
