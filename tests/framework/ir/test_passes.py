"""Standard passes, the PassManager and the pattern driver (golden files cover the texts)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.framework import ir, opspec
from llmkit.framework.ir import opdef
from llmkit.framework.ir.pass_manager import Pass, register_pass

from .gen import REWRITABLE, input_arrays, random_program
from .helpers import assert_same_outputs

F32 = "float32"
PIPELINE = ["canonicalize", "cse", "fold-constants", "fuse-patterns", "dce", "simplify-shapes"]


def prog(text_body: str, sig: str, results: str) -> ir.Program:
    return ir.parse(f"module {{\n  func @main({sig}) -> ({results}) {{\n{text_body}\n  }}\n}}\n")


# ---- semantics on random programs -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 20), st.integers(1, 3), st.booleans(), st.booleans())
def test_the_standard_pipeline_keeps_the_values_of_random_programs(seed, n_ops, keep, rewritable, constants):
    rng = random.Random(seed)
    p = random_program(rng, n_ops, ops=REWRITABLE if rewritable else None, constants=constants)
    ret = p["main"].return_op
    outs = ret.operands[-keep:]  # return only a few values so DCE has work to do
    ret.set_operands(outs)
    p.verify()
    q = p.clone()
    ir.PassManager(PIPELINE).run(q)
    args = input_arrays(np.random.default_rng(seed))
    with np.errstate(all="ignore"):
        try:
            want = ir.interpret(p, *args)
        except ir.InterpretError:
            return  # the random data is out of some kernel's domain
        got = ir.interpret(q, *args)
    assert_same_outputs(want, got, rtol=1e-5, atol=1e-6)
    assert q.num_ops() <= p.num_ops() + 2  # (a fused transpose may add one op per rule)


# ---- individual passes ------------------------------------------------------------------------


def test_dce_erases_chains_in_one_sweep_and_keeps_impure_ops():
    p = ir.Program()
    f = p.add_function("main", [("x", ir.TensorType([4], F32))])
    b = ir.Builder.at_end(f.body)
    (x,) = f.args
    v = x
    for _ in range(50):
        v = b.llm.exp(v)
    b.create("dist.send", [x], {"peer": 1})
    b.ret(x)
    assert ir.passes.dce.dce_block(f.body) == 50
    assert [op.name for op in f.body] == ["dist.send", "builtin.return"]


def test_cse_does_not_merge_across_functions_or_into_regions_it_does_not_dominate():
    text = """module {
      func @f(%x: f32[2]) -> (f32[2]) {
        %a = llm.exp(%x) : f32[2]
        return %a
      }
      func @g(%x: f32[2]) -> (f32[2], f32[2]) {
        %a = llm.exp(%x) : f32[2]
        %b = llm.exp(%x) : f32[2]
        return %a, %b
      }
    }"""
    p = ir.parse(text)
    ir.PassManager(["cse"]).run(p)
    assert len(p["f"].body) == 2 and str(p["g"].outputs[0]) == str(p["g"].outputs[1])
    assert p["g"].outputs[0] is p["g"].outputs[1]


def test_fold_respects_max_elements_and_leaves_failing_kernels():
    text = """    %c = builtin.constant() {value = dense<f32[4] [1.0, 2.0, 3.0, 4.0]>} : f32[4]
    %e = llm.exp(%c) : f32[4]
    %i = builtin.constant() {value = dense<i64[1] [5]>} : i64[1]
    %g = llm.index_select(%c, %i) : f32[1]
    return %e, %g"""
    p = prog(text, "", "f32[4], f32[1]")
    ir.PassManager([("fold-constants", {"max_elements": 2})]).run(p)
    assert [op.name for op in p["main"].body] == [
        "builtin.constant",
        "llm.exp",
        "builtin.constant",
        "llm.index_select",
        "builtin.return",
    ]
    ir.PassManager(["fold-constants{max_elements = 8}"]).run(p)
    names = [op.name for op in p["main"].body]
    assert names == [
        "builtin.constant",
        "builtin.constant",
        "builtin.constant",
        "llm.index_select",
        "builtin.return",
    ]  # index 5 is out of range: that op stays, unevaluated
    folded = ir.ConstantOp(p["main"].body.ops[1]).value
    assert folded.dtype == np.float32 and np.array_equal(folded, np.exp(np.float32([1, 2, 3, 4])))


def test_canonicalize_leaves_growing_broadcasts_and_ints():
    text = """    %one = builtin.constant() {value = dense<i64[2, 2] [1, 1, 1, 1]>} : i64[2, 2]
    %a = llm.mul(%x, %one) : i64[2, 2]
    %zero = builtin.constant() {value = dense<i64[] [0]>} : i64[]
    %b = llm.add(%x, %zero) : i64[2, 2]
    %c = llm.mul(%v, %one) : i64[2, 2]
    return %a, %b, %c"""
    p = prog(text, "%x: i64[2, 2], %v: i64[2]", "i64[2, 2], i64[2, 2], i64[2, 2]")
    ir.PassManager(["canonicalize"]).run(p)
    f = p["main"]
    assert f.outputs[0] is f.args[0] and f.outputs[1] is f.args[0]
    assert f.outputs[2].owner.name == "llm.mul"  # [2] * [2, 2] grows: the op stays


def test_simplify_shapes_folds_numel_once_its_dims_are_known():
    text = """    %n = llm.numel(%x) : f32[]
    %m = llm.numel(%x) {axis = [1]} : f32[]
    return %n, %m"""
    p = prog(text, "%x: f32[S, 2]", "f32[], f32[]")
    ir.PassManager(["simplify-shapes"]).run(p)  # S is unknown: numel over it stays an op
    assert [op.name for op in p["main"].body] == ["llm.numel", "builtin.constant", "builtin.return"]
    ir.PassManager(["simplify-shapes{bind = {S = 4}}"]).run(p)
    assert [ir.ConstantOp(v.owner).value.item() for v in p["main"].outputs] == [8.0, 2.0]


def test_a_new_op_gets_the_rewrites_its_spec_declares(monkeypatch):
    """Passes read traits and valued facts from the op table, never op names: ops declared here
    with the rules of neg (involution), add (identity 0, commutative) and reshape (same_type_noop)
    are rewritten as those are."""
    monkeypatch.setattr(opdef, "_CACHE", dict(opdef._CACHE))  # forget the ops' OpDefs afterwards
    for new, like in [("flip", "neg"), ("plus", "add"), ("view_as", "reshape")]:
        monkeypatch.setitem(opspec._TABLE, new, dataclasses.replace(opspec.get(like), name=new))
    text = """    %zero = llm.zeros_like(%x) : f32[2, 3]
    %a = llm.flip(%x) : f32[2, 3]
    %b = llm.flip(%a) : f32[2, 3]
    %c = llm.plus(%zero, %x) : f32[2, 3]
    %d = llm.view_as(%x) {shape = [2, 3]} : f32[2, 3]
    %e = llm.plus(%x, %x) : f32[2, 3]
    return %b, %c, %d, %e"""
    p = prog(text, "%x: f32[2, 3]", "f32[2, 3], f32[2, 3], f32[2, 3], f32[2, 3]")
    ir.PassManager(["canonicalize"]).run(p)
    f = p["main"]
    assert [v is f.args[0] for v in f.outputs] == [True, True, True, False]
    assert [op.name for op in f.body] == ["llm.plus", "builtin.return"]


def test_simplify_shapes_rejects_bad_bindings_and_reports_broken_ops():
    text = """    %r = llm.slice_scatter(%x, %s) {axes = [0], starts = [0], ends = [2]} : f32[4]
    return %r"""
    p = prog(text, "%x: f32[4], %s: f32[S]", "f32[4]")
    with pytest.raises(ir.IRError, match="is not a dim"):
        ir.PassManager([("simplify-shapes", {"bind": {"S": "x+"}})]).run(p)
    with pytest.raises(ir.IRError, match="llm.slice_scatter no longer type-checks"):
        ir.PassManager([("simplify-shapes", {"bind": {"S": 3}})]).run(p)


# ---- the pass manager -------------------------------------------------------------------------


def test_pipelines_by_name_with_options_and_helpful_errors():
    pm = ir.PassManager.parse(
        "canonicalize, fold-constants{max_elements = 64}, simplify-shapes{bind = {B = 2}}"
    )
    assert [p.describe() for p in pm.passes] == [
        "canonicalize",
        "fold-constants{max_elements = 64}",
        "simplify-shapes{bind = {'B': 2}}",
    ]
    assert {"canonicalize", "cse", "dce", "fold-constants", "fuse-patterns", "simplify-shapes"} <= set(
        ir.registered_passes()
    )
    with pytest.raises(ir.IRError, match="unknown pass 'canonicalise' \\(did you mean 'canonicalize'\\?\\)"):
        ir.PassManager(["canonicalise"])
    with pytest.raises(
        ir.IRError, match="pass 'fold-constants' has no option 'max' \\(options: max_elements\\)"
    ):
        ir.PassManager(["fold-constants{max = 3}"])
    with pytest.raises(ir.ParseError, match="expected ',' between passes"):
        ir.PassManager.parse("cse dce")
    with pytest.raises(ir.IRError, match="option 'max_elements' must be of type int, got 'many'"):
        ir.PassManager(['fold-constants{max_elements = "many"}'])
    with pytest.raises(ir.IRError, match="option 'rules' must be of type list"):
        ir.PassManager([("fuse-patterns", {"rules": "silu_mul_to_swiglu"})])


@register_pass
@dataclass
class _Corrupt(Pass):
    """Breaks the IR on purpose: the manager must name it."""

    name = "test-corrupt"

    def apply(self, program: ir.Program) -> None:
        ret = program.function().return_op
        ret.operands[0].type = ir.TensorType([99], F32)


def test_verify_between_passes_names_the_guilty_pass():
    p = prog("    %e = llm.exp(%x) : f32[2]\n    return %e", "%x: f32[2]", "f32[2]")
    with pytest.raises(
        ir.VerifyError, match="after pass 'test-corrupt': in @main: llm.exp: result #0 has type f32"
    ):
        ir.PassManager(["cse", "test-corrupt"]).run(p)
    with pytest.raises(ir.VerifyError, match="before the pipeline: in @main: llm.exp: result #0 has type"):
        ir.PassManager(["cse"]).run(p)  # a broken input is reported as such, not blamed on a pass
    p2 = prog("    %e = llm.exp(%x) : f32[2]\n    return %e", "%x: f32[2]", "f32[2]")
    ir.PassManager(["test-corrupt"], verify=False).run(p2)  # verification can be turned off


def test_dump_and_timing(tmp_path, monkeypatch, capsys):
    p = prog(
        "    %e = llm.exp(%x) : f32[2]\n    %d = llm.neg(%x) : f32[2]\n    return %e", "%x: f32[2]", "f32[2]"
    )
    pm = ir.PassManager(["cse", "dce"], dump=str(tmp_path), timing=True)
    pm.run(p)
    files = sorted(x.name for x in tmp_path.iterdir())
    assert files == ["00-cse.pir", "01-dce.pir"]
    dumped = (tmp_path / "01-dce.pir").read_text()
    assert dumped.startswith("// ----- after dce (") and "llm.neg" not in dumped
    assert str(ir.parse(dumped)) == str(p)  # a dump is a valid program
    err = capsys.readouterr().err
    assert "pass timing:" in err and "cse" in err and "total" in err
    assert [name for name, _ in pm.timings] == ["cse", "dce"] and all(s >= 0 for _, s in pm.timings)

    monkeypatch.setenv("LLMKIT_IR_DUMP", "1")
    monkeypatch.setenv("LLMKIT_IR_TIMING", "1")
    ir.PassManager(["dce"]).run(p)
    err = capsys.readouterr().err
    assert "// ----- after dce" in err and "module {" in err and "pass timing:" in err


# ---- the pattern driver -----------------------------------------------------------------------


class _Counting(ir.RewritePattern):
    roots = ("llm.neg",)

    def __init__(self) -> None:
        self.calls = 0

    def match_and_rewrite(self, op, rewriter):
        self.calls += 1
        inner = op.operands[0].owner
        if isinstance(inner, ir.Operation) and inner.name == "llm.neg":
            rewriter.replace_op(op, [inner.operands[0]])


def test_driver_reaches_a_fixpoint_without_rescanning():
    n = 2000
    p = ir.Program()
    f = p.add_function("main", [("x", ir.TensorType([3], F32))])
    b = ir.Builder.at_end(f.body)
    v = f.args[0]
    for _ in range(n):
        v = b.llm.neg(v)
    b.ret(v)
    pat = _Counting()
    rewrites = ir.apply_patterns(p, [pat])
    assert len(f.body) == 1 and f.outputs[0] is f.args[0]  # 2000 negations cancel
    assert pat.calls <= 3 * n and rewrites <= 2 * n  # linear, not quadratic


def test_driver_detects_patterns_that_undo_each_other():
    @ir.pattern("llm.add")
    def swap(op, rewriter):
        a, b = op.operands
        rewriter.set_operand(op, 0, b)
        rewriter.set_operand(op, 1, a)

    p = prog("    %a = llm.add(%x, %y) : f32[2]\n    return %a", "%x: f32[2], %y: f32[2]", "f32[2]")
    with pytest.raises(ir.IRError, match="did not converge .* swap on llm.add"):
        ir.apply_patterns(p, [swap], max_rewrites=100)


def test_rewriter_refuses_type_changing_replacements():
    @ir.pattern("llm.exp")
    def bad(op, rewriter):
        rewriter.replace_op(op, [rewriter.create("llm.sum", [op.operands[0]]).result])

    p = prog("    %a = llm.exp(%x) : f32[2]\n    return %a", "%x: f32[2]", "f32[2]")
    with pytest.raises(ir.IRError, match="replace a f32\\[2\\] value with a f32\\[\\] one"):
        ir.apply_patterns(p, [bad])
