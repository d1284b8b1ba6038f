"""The text form: exact printing, exact round trips, kept names, large constants."""

from __future__ import annotations

import numpy as np

from llmkit.framework import ir

F32 = "float32"


def mlp_program() -> ir.Program:
    p = ir.Program()
    f = p.add_function(
        "main",
        [
            ("x", ir.TensorType(["B", 8], F32)),
            ("w", ir.TensorType([16, 8], F32)),
            ("b", ir.TensorType([16], F32)),
        ],
    )
    b = ir.Builder.at_end(f.body)
    x, w, bias = f.args
    h = b.llm.linear(x, w, bias, name="h")
    a = b.llm.gelu(h, approximate="tanh")
    s = b.llm.sum(a, axis=[1], keepdim=True)
    eps = b.constant(np.float32(1e-6))
    b.ret(b.llm.div(a, b.llm.add(s, eps)), s)
    return p


EXPECTED = """\
module {
  func @main(%x: f32[B, 8], %w: f32[16, 8], %b: f32[16]) -> (f32[B, 16], f32[B, 1]) {
    %h = llm.linear(%x, %w, %b) : f32[B, 16]
    %0 = llm.gelu(%h) {approximate = "tanh"} : f32[B, 16]
    %1 = llm.sum(%0) {axis = [1], keepdim = true} : f32[B, 1]
    %2 = builtin.constant() {value = dense<f32[] [1e-06]>} : f32[]
    %3 = llm.add(%1, %2) : f32[B, 1]
    %4 = llm.div(%0, %3) : f32[B, 16]
    return %4, %1
  }
}
"""


def test_printer_output_is_exactly_the_documented_form():
    assert str(mlp_program()) == EXPECTED


def test_round_trip_is_exact_and_keeps_semantics():
    p = mlp_program()
    q = ir.parse(str(p))
    assert str(q) == EXPECTED
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((3, 8)), rng.standard_normal((16, 8)), rng.standard_normal(16)
    x, w, b = (a.astype(np.float32) for a in (x, w, b))
    got, s = ir.interpret(q, x, w, b)
    # float64 reference written out: gelu(tanh) of x w^T + b, normalized by its row sums
    h = x.astype(np.float64) @ w.T.astype(np.float64) + b
    a = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    np.testing.assert_allclose(s, a.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, a / (a.sum(1, keepdims=True) + 1e-6), rtol=1e-3, atol=1e-4)


def test_value_names_are_kept_made_unique_and_numbers_renumbered():
    p = ir.Program()
    f = p.add_function("f", [("x", ir.TensorType([2], F32)), ("x", ir.TensorType([2], F32))])
    b = ir.Builder.at_end(f.body)
    x0, x1 = f.args
    y = b.llm.add(x0, x1, name="x")  # a third "x"
    z = b.llm.exp(y, name="7")  # a numeric name is just a number
    w = b.llm.exp(z, name="weird name!")
    b.ret(w)
    text = str(p)
    assert "func @f(%x: f32[2], %x_1: f32[2])" in text
    assert "%x_2 = llm.add(%x, %x_1)" in text and "%0 = llm.exp(%x_2)" in text
    assert "%weird_name_ = llm.exp(%0)" in text
    q = ir.parse(text)
    assert str(q) == text
    assert [a.name for a in q["f"].args] == ["x", "x_1"]


def test_large_constants_live_in_the_resources_section():
    p = ir.Program()
    f = p.add_function("main")
    b = ir.Builder.at_end(f.body)
    big = np.arange(100, dtype=np.float32).reshape(10, 10)
    c1 = b.constant(big)
    c2 = b.constant(big)  # the same data is stored once
    c3 = b.constant(np.ones(17, np.int8))
    b.ret(c1, c2, c3)
    text = str(p)
    assert text.count("dense_resource<r0>") == 2 and "dense_resource<r1>" in text
    assert "\nresources {\n  r0 = dense<f32[10, 10] 0x" in text
    q = ir.parse(text)
    assert str(q) == text
    out = ir.interpret(q)
    assert np.array_equal(out[0], big) and out[2].dtype == np.int8


def test_every_dtype_and_special_value_survives_a_round_trip():
    p = ir.Program()
    f = p.add_function("main")
    b = ir.Builder.at_end(f.body)
    rng = np.random.default_rng(1)
    arrays = []
    for dt in ["float64", "float32", "float16", "bfloat16"]:
        v = np.concatenate(
            [rng.standard_normal(8) * 10.0 ** rng.integers(-8, 8, 8), [np.inf, -np.inf, np.nan, -0.0, 0.0]]
        )
        with np.errstate(over="ignore"):  # huge values become inf in small dtypes
            arrays += [v.astype(ir.TensorType([], dt).dtype)]
    arrays += [np.array([-128, 127, 0], np.int8), np.array([0, 255], np.uint8), np.array([True, False])]
    arrays += [np.array([-(2**63), 2**63 - 1], np.int64), np.arange(40, dtype=np.int16)]
    for a in arrays:
        b.constant(a)
    b.ret(*[op.result for op in f.body])
    q = ir.parse(str(p))
    assert str(q) == str(p)
    for a, got in zip(arrays, ir.interpret(q), strict=True):
        assert got.dtype == a.dtype and got.tobytes() == a.tobytes()


def test_comments_and_whitespace_do_not_matter():
    text = EXPECTED.replace("\n", " // a comment\n").replace("  ", " ").replace(", ", ",")
    assert str(ir.parse(text)) == EXPECTED


def test_generic_op_syntax_reads_builtin_ops_too():
    text = """module {
      builtin.func() {sym_name = "g"} : () {
      ^bb0(%a: f32[2]):
        %e = llm.exp(%a) : f32[2]
        builtin.return(%e)
      }
    }"""
    q = ir.parse(text)
    assert (
        str(q) == "module {\n  func @g(%a: f32[2]) -> (f32[2]) {\n    %e = llm.exp(%a) : f32[2]\n"
        "    return %e\n  }\n}\n"
    )
