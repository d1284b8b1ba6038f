"""DRR: the two fusion rules (matmul + bias -> linear, silu(a) * b -> swiglu) and the rule
machinery (captures, computed attributes, constraints, aliases, closed-subgraph checks)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from llmkit.framework import ir
from llmkit.framework.ir import drr
from llmkit.framework.ir.passes.fuse_patterns import (
    MATMUL_ADD_TO_LINEAR,
    MATMUL_T_ADD_TO_LINEAR,
    SILU_MUL_TO_SWIGLU,
)

from .helpers import assert_same_outputs, inputs_for

RULES = [MATMUL_T_ADD_TO_LINEAR, MATMUL_ADD_TO_LINEAR, SILU_MUL_TO_SWIGLU]


def prog(body: str, sig: str, results: str) -> ir.Program:
    return ir.parse(f"module {{\n  func @main({sig}) -> ({results}) {{\n{body}\n  }}\n}}\n")


def fuse(p: ir.Program) -> ir.Program:
    q = p.clone()
    ir.apply_patterns(q, RULES)
    q.verify()
    return q


def op_names(p: ir.Program) -> list[str]:
    return [op.name for op in p.function().walk()]


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# ---- matmul + bias -> linear ------------------------------------------------------------------


@pytest.mark.parametrize("order", ["mm + b", "b + mm"])
@pytest.mark.parametrize("transposed", [True, False])
def test_linear_rule_computes_the_same_values(order, transposed):
    w_type, attrs = ("f32[16, 8]", "{transpose_y = true} ") if transposed else ("f32[8, 16]", "")
    add = "llm.add(%mm, %b)" if order == "mm + b" else "llm.add(%b, %mm)"
    p = prog(
        f"    %mm = llm.matmul(%x, %w) {attrs}: f32[B, S, 16]\n    %y = {add} : f32[B, S, 16]\n    return %y",
        f"%x: f32[B, S, 8], %w: {w_type}, %b: f32[16]",
        "f32[B, S, 16]",
    )
    q = fuse(p)
    assert "llm.linear" in op_names(q) and "llm.matmul" not in op_names(q)
    rng = np.random.default_rng(0)
    for sizes in ({"B": 2, "S": 3}, {"B": 1, "S": 5}):  # one program serves every size
        args = inputs_for(q.function(), rng, sizes)
        x, w, b = (a.astype(np.float64) for a in args)
        ref = x @ (w.T if transposed else w) + b  # float64 formula
        np.testing.assert_allclose(ir.interpret(q, *args, symbols=sizes), ref, rtol=1e-5, atol=1e-5)
        assert_same_outputs(ir.interpret(p, *args), ir.interpret(q, *args), rtol=1e-6, atol=1e-6)


LINEAR_BLOCKED = {
    "bias is 2-D": ("%w: f32[16, 8], %b: f32[4, 16]", "{transpose_y = true}", "f32[4, 8]"),
    "bias broadcasts from one element": ("%w: f32[16, 8], %b: f32[1]", "{transpose_y = true}", "f32[4, 8]"),
    "x is transposed": (
        "%w: f32[16, 8], %b: f32[16]",
        "{transpose_x = true, transpose_y = true}",
        "f32[8, 4]",
    ),
}


@pytest.mark.parametrize("case", sorted(LINEAR_BLOCKED))
def test_linear_rule_does_not_fire_when_its_constraints_fail(case):
    sig, attrs, x_type = LINEAR_BLOCKED[case]
    p = prog(
        f"    %mm = llm.matmul(%x, %w) {attrs} : f32[4, 16]\n"
        "    %y = llm.add(%mm, %b) : f32[4, 16]\n    return %y",
        f"%x: {x_type}, {sig}",
        "f32[4, 16]",
    )
    assert str(fuse(p)) == str(p)


def test_linear_rule_does_not_fire_when_the_product_has_another_user():
    p = prog(
        "    %mm = llm.matmul(%x, %w) {transpose_y = true} : f32[4, 16]\n"
        "    %y = llm.add(%mm, %b) : f32[4, 16]\n    %z = llm.exp(%mm) : f32[4, 16]\n    return %y, %z",
        "%x: f32[4, 8], %w: f32[16, 8], %b: f32[16]",
        "f32[4, 16], f32[4, 16]",
    )
    assert str(fuse(p)) == str(p)


# ---- silu(a) * b -> swiglu --------------------------------------------------------------------


@pytest.mark.parametrize("order", ["s * u", "u * s"])
def test_swiglu_rule_computes_the_same_values(order):
    mul = "llm.mul(%s, %u)" if order == "s * u" else "llm.mul(%u, %s)"
    p = prog(
        f"    %s = llm.silu(%g) : f64[T, 32]\n    %h = {mul} : f64[T, 32]\n    return %h",
        "%g: f64[T, 32], %u: f64[T, 32]",
        "f64[T, 32]",
    )
    q = fuse(p)
    assert op_names(q) == ["llm.swiglu", "builtin.return"]
    args = inputs_for(q.function(), np.random.default_rng(1), {"T": 7})
    g, u = args
    np.testing.assert_allclose(ir.interpret(q, *args), g * sigmoid(g) * u, rtol=1e-12)
    assert_same_outputs(ir.interpret(p, *args), ir.interpret(q, *args), rtol=1e-12, atol=0)


def test_swiglu_rule_does_not_fire_when_its_constraints_fail():
    broadcast = prog(
        "    %s = llm.silu(%g) : f32[4, 8]\n    %h = llm.mul(%s, %u) : f32[4, 8]\n    return %h",
        "%g: f32[4, 8], %u: f32[8]",
        "f32[4, 8]",
    )
    assert str(fuse(broadcast)) == str(broadcast)
    shared = prog(
        "    %s = llm.silu(%g) : f32[4, 8]\n    %h = llm.mul(%s, %u) : f32[4, 8]\n    return %h, %s",
        "%g: f32[4, 8], %u: f32[4, 8]",
        "f32[4, 8], f32[4, 8]",
    )
    assert str(fuse(shared)) == str(shared)


# ---- the rule machinery -----------------------------------------------------------------------


def test_match_exposes_values_captures_and_ops():
    p = prog(
        "    %t = llm.transpose(%x) {perm = [1, 0]} : f32[3, 2]\n"
        "    %u = llm.transpose(%t) {perm = [1, 0]} : f32[2, 3]\n    return %u",
        "%x: f32[2, 3]",
        "f32[2, 3]",
    )
    rule = drr.Rule(
        "tt",
        source=[
            drr.op("transpose", ["x"], ["t"], perm=drr.Attr("p")),
            drr.op("transpose", ["t"], ["out"], perm=drr.Attr("q")),
        ],
        result=[drr.op("transpose", ["x"], ["out"], perm=drr.Compute(lambda m: (0, 1)))],
    )
    f = p.function()
    m = rule.match(f.outputs[0].owner)
    assert (
        m is not None
        and m["x"] is f.args[0]
        and m.attr("p") == (1, 0)
        and m.attrs == {"p": (1, 0), "q": (1, 0)}
    )
    assert [op.name for op in m.ops] == ["llm.transpose", "llm.transpose"]
    assert rule.match(f.body.first) is None  # rooted at the last source op only
    ir.apply_patterns(p, [rule])
    assert "perm = [0, 1]" in str(p)


def test_aliases_shared_producers_and_a_result_that_does_not_apply():
    p = prog(
        "    %o = llm.ones_like(%y) : f32[2, 3]\n    %m = llm.mul(%x, %o) : f32[2, 3]\n"
        "    %e = llm.exp(%m) : f32[2, 3]\n    %d = llm.add(%e, %e) : f32[2, 3]\n    return %d",
        "%x: f32[2, 3], %y: f32[2, 3]",
        "f32[2, 3]",
    )
    times_one = drr.Rule(
        "times_ones_like",
        source=[drr.op("ones_like", ["y"], ["o"]), drr.op("mul", ["x", "o"], ["out"])],
        result=[],
        aliases={"out": "x"},
    )
    doubled = drr.Rule(
        "double",
        source=[drr.op("exp", ["a"], ["e"]), drr.op("add", ["e", "e"], ["out"])],
        result=[drr.op("exp", ["a"], ["e2"]), drr.op("mul", ["e2", "e2"], ["out"])],
    )
    # a rule whose result infer_meta rejects (matmul of [2, 3] by [2, 3]) leaves the IR untouched
    never = drr.Rule(
        "never", source=[drr.op("add", ["a", "b"], ["out"])], result=[drr.op("matmul", ["a", "b"], ["out"])]
    )
    x_uses_before = len(p.function().args[0].uses)
    ir.apply_patterns(p, [never])
    assert len(p.function().args[0].uses) == x_uses_before
    ir.apply_patterns(p, [times_one, doubled])
    assert op_names(p) == ["llm.exp", "llm.mul", "builtin.return"]
    assert p.function().body.first.operands[0] is p.function().args[0]


BAD_RULES = {
    "disconnected": (
        dict(
            source=[drr.op("exp", ["x"], ["e"]), drr.op("neg", ["y"], ["out"])],
            result=[drr.op("neg", ["y"], ["out"])],
        ),
        "source op #0 (llm.exp) does not feed the root",
    ),
    "result reads an intermediate": (
        dict(
            source=[drr.op("exp", ["x"], ["e"]), drr.op("neg", ["e"], ["out"])],
            result=[drr.op("neg", ["e"], ["out"])],
        ),
        "reads 'e', which is an intermediate of the source",
    ),
    "root output not defined": (
        dict(source=[drr.op("neg", ["x"], ["out"])], result=[drr.op("exp", ["x"], ["y"])]),
        "the result does not define the root's output 'out'",
    ),
    "defined twice": (
        dict(source=[drr.op("exp", ["x"], ["e"]), drr.op("exp", ["x"], ["e"])], result=[]),
        "value 'e' is defined twice",
    ),
    "read before produced": (
        dict(source=[drr.op("neg", ["e"], ["out0"]), drr.op("exp", ["x"], ["e"])], result=[]),
        "reads 'e' before it is produced",
    ),
    "unknown attribute": (
        dict(source=[drr.op("sum", ["x"], ["out"], axes=[1])], result=[]),
        "llm.sum attribute 'axes'",
    ),
    "bad attribute value": (
        dict(source=[drr.op("transpose", ["x"], ["out"], perm="a")], result=[]),
        "attribute 'perm' = 'a'",
    ),
    "missing capture": (
        dict(
            source=[drr.op("neg", ["x"], ["out"])],
            result=[drr.op("transpose", ["x"], ["out"], perm=drr.Attr("p"))],
        ),
        "uses capture 'p', which the source does not make",
    ),
    "wrong result count": (dict(source=[drr.op("split", ["x"], ["a"])], result=[]), None),
    "empty": (dict(source=[], result=[]), "the source pattern is empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_RULES))
def test_rules_are_checked_when_built(case):
    kwargs, fragment = BAD_RULES[case]
    if fragment is None:  # split has a variable number of results: any count is accepted
        drr.Rule(case, aliases={"a": "x"}, **kwargs)
        return
    with pytest.raises(ir.IRError, match=f"DRR rule '{case}': .*{re.escape(fragment)}"):
        drr.Rule(case, **kwargs)


def test_unknown_op_names_are_rejected_with_a_hint():
    with pytest.raises(ir.IRError, match="did you mean 'llm.matmul'"):
        drr.op("llm.matmull", ["x", "y"], ["z"])
