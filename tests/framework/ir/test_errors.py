"""Bad input gets a clear error naming the op and its position (parser) or the op's text (verifier)."""

from __future__ import annotations

import pytest

from llmkit.framework import ir

F32 = "float32"


def wrap(body: str, sig: str = "%x: f32[2, 3]", results: str = "f32[2, 3]") -> str:
    return f"module {{\n  func @main({sig}) -> ({results}) {{\n{body}\n  }}\n}}\n"


# (what, text, line:column, message fragment)
PARSE_ERRORS = [
    (
        "unknown op",
        wrap("    %0 = llm.ad(%x, %x) : f32[2, 3]\n    return %0"),
        (3, 10),
        "unknown op 'llm.ad' (did you mean 'llm.add'?)",
    ),
    (
        "unknown dialect",
        wrap("    %0 = foo.bar(%x) : f32[2, 3]\n    return %0"),
        (3, 10),
        "unknown op 'foo.bar'",
    ),
    (
        "wrong attribute type",
        wrap('    %0 = llm.transpose(%x) {perm = "a"} : f32[3, 2]\n    return %0', results="f32[3, 2]"),
        (3, 36),
        "llm.transpose: attribute 'perm' expects a list of integers, got \"a\"",
    ),
    (
        "attribute value rejected",
        wrap('    %0 = llm.gelu(%x) {approximate = "fast"} : f32[2, 3]\n    return %0'),
        (3, 38),
        "'approximate' = \"fast\" is invalid: use 'none' or 'tanh'",
    ),
    (
        "unknown attribute",
        wrap("    %0 = llm.sum(%x) {axes = [1]} : f32[2]\n    return %0", results="f32[2]"),
        (3, 23),
        "llm.sum has no attribute 'axes' (did you mean 'axis'?)",
    ),
    (
        "missing attribute",
        wrap("    %0 = llm.transpose(%x) : f32[3, 2]\n    return %0", results="f32[3, 2]"),
        (3, 10),
        "transpose: missing required attribute(s) perm",
    ),
    (
        "use before definition",
        wrap("    %0 = llm.add(%x, %1) : f32[2, 3]\n    %1 = llm.exp(%x) : f32[2, 3]\n    return %0"),
        (3, 22),
        "use of undefined value %1",
    ),
    (
        "redefinition",
        wrap("    %x = llm.exp(%x) : f32[2, 3]\n    return %x"),
        (3, 5),
        "%x is defined twice (first at 2:14)",
    ),
    (
        "missing terminator",
        wrap("    %0 = llm.exp(%x) : f32[2, 3]"),
        (4, 3),
        "does not end with a terminator: expected return",
    ),
    (
        "terminator not last",
        wrap("    return %x\n    %0 = llm.exp(%x) : f32[2, 3]"),
        (4, 5),
        "nothing may follow return: it ends the block (expected '}', got '%0')",
    ),
    (
        "wrong result type",
        wrap("    %0 = llm.exp(%x) : f32[3, 2]\n    return %0", results="f32[3, 2]"),
        (3, 5),
        "llm.exp: result #0 has type f32[3, 2] but infer_meta gives f32[2, 3]",
    ),
    (
        "operands rejected",
        wrap("    %0 = llm.matmul(%x, %x) : f32[2, 3]\n    return %0"),
        (3, 5),
        "llm.matmul: operands rejected: matmul: inner dims differ",
    ),
    (
        "wrong operand count",
        wrap("    %0 = llm.exp(%x, %x) : f32[2, 3]\n    return %0"),
        (3, 5),
        "expects 1 operands, got 2",
    ),
    (
        "signature mismatch",
        wrap("    return %x", results="f32[2]"),
        (2, 29),
        "@main declares results (f32[2]) but returns",
    ),
    ("unknown dtype", wrap("    return %x", sig="%x: f33[2]"), (2, 18), "unknown dtype 'f33'"),
    (
        "bad dim",
        wrap("    return %x", sig="%x: f32[S+]"),
        (2, 22),
        "bad dim 'S+': bad symbolic dim 'S+': unexpected end",
    ),
    (
        "negative dim",
        wrap("    return %x", sig="%x: f32[-2]"),
        (2, 22),
        "bad dim: a dim must be non-negative",
    ),
    ("reserved symbol", wrap("    return %x", sig="%x: f32[nan]"), (2, 22), "symbol name 'nan' is reserved"),
    (
        "missing result types",
        wrap("    %0 = llm.exp(%x)\n    return %0"),
        (3, 10),
        "names 1 results but gives 0 types",
    ),
    (
        "unclosed function",
        "module {\n  func @main(%x: f32[2]) -> (f32[2]) {\n    return %x\n",
        (4, 1),
        "expected '}'",
    ),
    ("trailing garbage", wrap("    return %x") + "junk", (6, 1), "expected the end of the program"),
    ("no module", "func @main() -> () {\n  return\n}\n", (1, 1), "expected 'module'"),
    ("bad character", wrap("    return %x ~"), (3, 15), "unexpected character '~'"),
    (
        "undefined resource",
        wrap("    %c = builtin.constant() {value = dense_resource<r9>} : f32[2, 3]\n    return %c"),
        (3, 53),
        "undefined resource 'r9'",
    ),
    (
        "wrong element count",
        wrap("    %c = builtin.constant() {value = dense<f32[2, 3] [1.0]>} : f32[2, 3]\n    return %c"),
        (3, 54),
        "f32[2, 3] needs 6 elements, got 1",
    ),
    (
        "int out of range",
        wrap(
            "    %c = builtin.constant() {value = dense<i8[1] [300]>} : i8[1]\n    return %c", results="i8[1]"
        ),
        (3, 51),
        "300 does not fit int8",
    ),
    (
        "duplicate function",
        "module {\n  func @f() -> () {\n    return\n  }\n  func @f() -> () {\n    return\n  }\n}\n",
        (5, 3),
        "function @f is defined twice",
    ),
    (
        "deep nesting",
        wrap(
            '    %0 = cinn.kernel(%x) {kernel = "k", a = '
            + "[" * 100
            + "]" * 100
            + "} : f32[2, 3]\n    return %0"
        ),
        (3, 108),
        "nesting deeper than 64 levels",
    ),
    ("yield outside fusion", wrap("    cinn.yield(%x)"), (3, 5), "cinn.yield must end a cinn.fusion body"),
]


@pytest.mark.parametrize(
    ("text", "position", "fragment"), [c[1:] for c in PARSE_ERRORS], ids=[c[0] for c in PARSE_ERRORS]
)
def test_parse_errors_name_the_problem_and_position(text, position, fragment):
    with pytest.raises(ir.ParseError) as info:
        ir.parse(text)
    e = info.value
    assert fragment in e.reason, e
    assert (e.line, e.column) == position, e
    assert str(e).startswith(f"{position[0]}:{position[1]}: ")
    assert "^" in str(e)  # the source line with a caret


def test_verifier_errors_show_the_op_in_text_form():
    p = ir.Program()
    f = p.add_function("main", [("x", ir.TensorType([2, 3], F32))])
    b = ir.Builder.at_end(f.body)
    (x,) = f.args
    e = b.create("llm.exp", [x])
    n = b.create("llm.neg", [e.result])
    r = b.ret(n.result)
    p.verify()

    n.detach()  # now %1 is used by return before... nothing defines it in scope
    f.body.insert_before(n, e)
    with pytest.raises(
        ir.VerifyError,
        match=r"in @main: llm.neg: operand #0 is used before its definition\n"
        r"    %0 = llm.neg\(%1\) : f32\[2, 3\]",
    ):
        p.verify()
    n.detach()
    f.body.insert_before(n, r)

    e.set_attr("bogus", 1)
    with pytest.raises(ir.VerifyError, match="unknown attribute 'bogus'") as info:
        p.verify()
    assert info.value.op is e
    e.del_attr("bogus")

    n.set_attr("dtype", "float32")
    with pytest.raises(ir.VerifyError, match="llm.neg: unknown attribute 'dtype'"):
        p.verify()
    n.del_attr("dtype")

    t = b.create("llm.transpose", [x], {"perm": [1, 0]}, insert=False)
    f.body.insert_before(t, r)
    t.set_attr("perm", "oops")
    with pytest.raises(ir.VerifyError, match="transpose: attribute 'perm' expects a list of integers"):
        p.verify()
    t.erase()

    r.erase()
    with pytest.raises(
        ir.VerifyError, match=r"builtin.func: a block of its region does not end with a terminator"
    ):
        p.verify()
    b.ret(n.result)
    p.verify()

    n.results[0].type = ir.TensorType([3, 2], F32)
    with pytest.raises(
        ir.VerifyError, match=r"result #0 has type f32\[3, 2\] but infer_meta gives f32\[2, 3\]"
    ):
        p.verify()


def test_verifier_catches_values_from_another_function_and_unknown_ops():
    p = ir.Program()
    f = p.add_function("f", [("x", ir.TensorType([2], F32))])
    g = p.add_function("g", [])
    ir.Builder.at_end(f.body).ret(f.args[0])
    ir.Builder.at_end(g.body).ret(f.args[0])
    with pytest.raises(
        ir.VerifyError, match="in @g: builtin.return: operand #0 is not defined in an enclosing scope"
    ):
        p.verify()
    with pytest.raises(ir.IRError, match="unknown op 'llm.nope'"):
        ir.Operation("llm.nope")
    rogue = ir.Operation("llm.exp", [f.args[0]], [f.args[0].type], opdef=ir.OpDef("llm.exp"))
    f.body.insert_before(rogue, f.body.first)
    with pytest.raises(ir.VerifyError, match="unknown op 'llm.exp': no dialect defines it"):
        p.verify()
