"""The reference interpreter: numpy in, numpy out, symbolic dims bound and checked."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.framework import ir

ATTENTION_SCORES = """module {
  func @main(%x: f32[B, S, 8], %wq: f32[8, 8], %g: f32[8]) -> (f32[B, 2, S, S], i64[S]) {
    %n = llm.rms_norm(%x, %g) {eps = 1e-05} : f32[B, S, 8]
    %q = llm.linear(%n, %wq) : f32[B, S, 8]
    %h = llm.reshape(%q) {shape = [B, S, 2, 4]} : f32[B, S, 2, 4]
    %t = llm.transpose(%h) {perm = [0, 2, 1, 3]} : f32[B, 2, S, 4]
    %s = llm.matmul(%t, %t) {transpose_y = true} : f32[B, 2, S, S]
    %p = llm.softmax(%s) : f32[B, 2, S, S]
    %pos = llm.arange() {end = S} : i64[S]
    return %p, %pos
  }
}
"""


def test_a_block_matches_a_float64_numpy_formula_at_several_sizes():
    p = ir.parse(ATTENTION_SCORES)
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((8, 8)).astype(np.float32)
    g = rng.standard_normal(8).astype(np.float32)
    for b, s in [(1, 1), (2, 5), (3, 4)]:
        x = rng.standard_normal((b, s, 8)).astype(np.float32)
        probs, pos = ir.interpret(p, x, wq, g)
        xd = x.astype(np.float64)
        n = xd / np.sqrt((xd**2).mean(-1, keepdims=True) + 1e-5) * g
        q = (n @ wq.T).reshape(b, s, 2, 4).transpose(0, 2, 1, 3)
        sc = q @ q.transpose(0, 1, 3, 2)
        ref = np.exp(sc - sc.max(-1, keepdims=True))
        ref /= ref.sum(-1, keepdims=True)
        assert probs.shape == (b, 2, s, s) and probs.dtype == np.float32
        np.testing.assert_allclose(probs, ref, rtol=1e-4, atol=1e-5)
        assert np.array_equal(pos, np.arange(s))


def test_symbols_are_bound_from_inputs_and_checked():
    p = ir.parse("""module {
      func @main(%a: f32[S, 2], %b: f32[S+1], %c: f32[2*S]) -> (f32[S, 2]) {
        return %a
      }
    }""")
    ok = ir.interpret(p, np.zeros((3, 2), np.float32), np.zeros(4, np.float32), np.zeros(6, np.float32))
    assert ok.shape == (3, 2)
    with pytest.raises(
        ir.InterpretError, match=r"input %b of @main: dim 0 is 5 but the type says S\+1 \(S=3\)"
    ):
        ir.interpret(p, np.zeros((3, 2), np.float32), np.zeros(5, np.float32), np.zeros(6, np.float32))
    with pytest.raises(ir.InterpretError, match=r"input %a of @main: dim 1 is 3 but the type says 2"):
        ir.interpret(p, np.zeros((3, 3), np.float32), np.zeros(4, np.float32), np.zeros(6, np.float32))
    with pytest.raises(ir.InterpretError, match="expected dtype float32, got float64"):
        ir.interpret(p, np.zeros((3, 2)), np.zeros(4, np.float32), np.zeros(6, np.float32))
    with pytest.raises(ir.InterpretError, match="@main takes 3 inputs, got 1"):
        ir.interpret(p, np.zeros((3, 2), np.float32))


def test_fusion_bodies_parameters_and_several_functions():
    p = ir.parse("""module {
      func @f(%x: f32[4]) -> (f32[4], f32[4]) {
        %w = builtin.parameter() {name = "w"} : f32[4]
        %y = cinn.fusion() : f32[4] {
          %a = llm.mul(%x, %w) : f32[4]
          %b = llm.exp(%a) : f32[4]
          cinn.yield(%b)
        }
        return %y, %w
      }
      func @g() -> () {
        return
      }
    }""")
    x, w = np.arange(4, dtype=np.float32), np.full(4, 0.5, np.float32)
    y, w_out = ir.interpret(p, x, func="f", params={"w": w})
    np.testing.assert_allclose(y, np.exp(x.astype(np.float64) * 0.5), rtol=1e-6)
    assert w_out is not None and ir.interpret(p, func="g") == ()
    with pytest.raises(ir.InterpretError, match="no value for parameter 'w'"):
        ir.interpret(p, x, func="f")
    with pytest.raises(ir.IRError, match="name one"):
        ir.interpret(p, x)


def test_shells_without_semantics_say_so():
    p = ir.parse("""module {
      func @main(%x: f32[4]) -> (f32[4]) {
        %k = cinn.kernel(%x) {kernel = "k0"} : f32[4]
        return %k
      }
    }""")
    with pytest.raises(ir.InterpretError, match="cinn.kernel has no reference implementation"):
        ir.interpret(p, np.zeros(4, np.float32))


def test_kernel_failures_name_the_op():
    p = ir.parse("""module {
      func @main(%x: f32[3], %i: i64[2]) -> (f32[2]) {
        %g = llm.index_select(%x, %i) : f32[2]
        return %g
      }
    }""")
    with pytest.raises(
        ir.InterpretError, match=r"llm.index_select: kernel failed: IndexError.*\n    %g = llm.index_select"
    ):
        ir.interpret(p, np.zeros(3, np.float32), np.array([0, 7]))
