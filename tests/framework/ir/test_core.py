"""Core IR: values and uses, blocks as linked lists, the builder, types, attributes, dialects."""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.framework import ir
from llmkit.framework.opspec import OpError, table
from llmkit.framework.placement import ProcessMesh, Replicate, Shard

F32 = "float32"


def fresh(*types):
    p = ir.Program()
    f = p.add_function("main", [(f"x{i}", t) for i, t in enumerate(types)])
    return p, f, ir.Builder.at_end(f.body)


# ---- values and the builder -------------------------------------------------------------------


def test_value_carries_shape_dtype_ndim_for_the_tracer():
    _, f, b = fresh(ir.TensorType(["B", 64], F32), ir.TensorType([128, 64], F32))
    x, w = f.args
    y = b.llm.matmul(x, w, transpose_y=True)
    assert y.shape == ("B", 128) and y.dtype == np.float32 and y.ndim == 2
    assert repr(x) == "%x0: f32[B, 64]"
    assert y.owner.name == "llm.matmul" and x.owner is f.body


def test_builder_infers_types_from_the_op_table_and_validates():
    _, f, b = fresh(ir.TensorType([2, 3], F32))
    (x,) = f.args
    op = b.create("llm.sum", [x], {"axis": [1], "keepdim": True})
    assert op.results[0].type == ir.TensorType([2, 1], F32)
    assert op.plain_attrs == {"axis": (1,), "keepdim": True}
    assert list(op.attributes) == [a.name for a in table()["sum"].attrs]  # op-table order, defaults filled
    with pytest.raises(OpError, match="axis 5 is out of range"):
        b.create("llm.sum", [x], {"axis": [5]})
    with pytest.raises(OpError, match="unknown attribute 'axes'"):
        b.create("llm.sum", [x], {"axes": [1]})
    with pytest.raises(OpError, match="expects 2 tensor inputs"):
        b.create("llm.add", [x])
    with pytest.raises(ir.IRError, match="did you mean 'llm.matmul'"):
        b.create("llm.matmull", [x, x])


def test_builder_handles_multi_output_variadic_and_optional_inputs():
    _, f, b = fresh(ir.TensorType([4, 6], F32), ir.TensorType([5, 6], F32))
    x, w = f.args
    lo, hi = b.llm.split(x, sections=2, axis=1)
    assert lo.type == hi.type == ir.TensorType([4, 3], F32)
    cat = b.llm.concat([lo, hi, lo], axis=1)
    assert cat.shape == (4, 9)
    no_bias = b.create("llm.linear", [x, w])  # the optional bias is simply left out
    assert no_bias.num_operands == 2 and no_bias.results[0].shape == (4, 5)
    assert b.llm.linear(x, w, bias=None).shape == (4, 5)


def test_uses_and_replace_all_uses_with():
    _, f, b = fresh(ir.TensorType([3], F32), ir.TensorType([3], F32))
    x, y = f.args
    a = b.llm.add(x, x)
    m = b.llm.mul(a, x)
    assert [(op.name, i) for op, i in x.uses] == [("llm.add", 0), ("llm.add", 1), ("llm.mul", 1)]
    assert [op.name for op in x.users] == ["llm.add", "llm.mul"]
    x.replace_all_uses_with(y)
    assert not x.has_uses and len(y.uses) == 3
    assert a.owner.operands == (y, y) and m.owner.operand(1) is y
    m.owner.set_operand(0, x)
    assert x.uses == [(m.owner, 0)] and not any(op is m.owner and i == 0 for op, i in a.uses)


def test_block_is_a_linked_list_with_o1_insert_erase_move():
    _, f, b = fresh(ir.TensorType([3], F32))
    (x,) = f.args
    ops = [b.create("llm.exp", [x]) for _ in range(5)]
    body = f.body
    assert len(body) == 5 and body.first is ops[0] and body.last is ops[4]
    ops[2].erase()
    assert body.ops == [ops[0], ops[1], ops[3], ops[4]] and ops[2].parent is None
    ops[4].detach()
    body.insert_before(ops[4], ops[0])  # move to the front
    assert body.ops == [ops[4], ops[0], ops[1], ops[3]]
    body.insert_after(ops[4].detach(), ops[3])
    assert [o for o in body.reversed()] == [ops[4], ops[3], ops[1], ops[0]]
    ops[0].move_after(ops[4])
    ops[3].move_before(ops[1])
    assert body.ops == [ops[3], ops[1], ops[4], ops[0]] and len(body) == 4
    for op in body:  # erasing the op just yielded is allowed
        op.erase()
    assert len(body) == 0 and body.first is None and body.last is None


def test_erase_refuses_used_results_and_drops_operand_uses():
    _, f, b = fresh(ir.TensorType([3], F32))
    (x,) = f.args
    e = b.create("llm.exp", [x])
    b.create("llm.neg", [e.result])
    with pytest.raises(ir.IRError, match="still used by llm.neg"):
        e.erase()
    e.erase(drop_uses=True)
    assert len(x.uses) == 0


def test_clone_is_deep_and_remaps_values():
    p, f, b = fresh(ir.TensorType([3], F32))
    (x,) = f.args
    b.ret(b.llm.exp(b.llm.neg(x)))
    q = p.clone()
    assert str(q) == str(p)
    g = q["main"]
    assert all(v.owner is not f.body for op in g.walk() for v in op.operands)
    q.verify()


def test_typed_views():
    p, f, b = fresh(ir.TensorType([2, 3], F32), ir.TensorType([4, 3], F32))
    x, w = f.args
    y = b.llm.linear(x, w)
    c = b.constant(np.arange(3, dtype=np.float32), name="c")
    b.ret(y, c)
    func = p["main"]
    assert func.name == "main" and func.args == [x, w] and func.outputs == (y, c)
    assert func.input_types == [x.type, w.type] and func.output_types == [y.type, c.type]
    lin = ir.LlmOp(y.owner)
    assert lin.spec.name == "linear" and lin.x is x and lin.weight is w and lin.input("bias") is None
    matmul_cls = ir.op_class("matmul")
    assert matmul_cls.match(y.owner) is None and ir.op_class("linear").match(y.owner) is not None
    assert np.array_equal(ir.ConstantOp(c.owner).value, np.arange(3))
    with pytest.raises(TypeError):
        ir.FuncOp(y.owner)
    with pytest.raises(KeyError, match="no function @nope.*@main"):
        p["nope"]


# ---- types and attributes ---------------------------------------------------------------------


def test_tensor_types_are_interned_canonical_and_validated():
    assert ir.TensorType(["S*B", 4], "float32") is ir.TensorType(("B*S", np.int64(4)), np.float32)
    assert str(ir.TensorType(["S+1", "2*B"], "bfloat16")) == "bf16[S+1, 2*B]"
    assert ir.TensorType(["2+1"], F32).shape == (3,)
    assert str(ir.ScalarType("int64")) == "i64"
    for bad in ([-1], ["f32"], ["S+"], [1.5]):
        with pytest.raises(TypeError):
            ir.TensorType(bad, F32)
    with pytest.raises(TypeError):
        ir.TensorType([2], "complex64")


def test_attributes_are_immutable_hashable_and_round_trip_plain_values():
    values = [
        3,
        -1,
        0.5,
        float("inf"),
        True,
        "mean",
        np.dtype("float16"),
        None,
        (1, 2),
        (),
        {"a": 1, "b": [1.5, "x"]},
        np.arange(4, dtype=np.int32),
    ]
    for v in values:
        a = ir.to_attr(v)
        assert ir.to_attr(v) == a and hash(ir.to_attr(v)) == hash(a)
        got = a.value
        if isinstance(v, np.ndarray):
            assert np.array_equal(got, v) and got.dtype == v.dtype
        elif isinstance(v, dict):
            assert got == {"a": 1, "b": (1.5, "x")}
        else:
            assert got == v
        with pytest.raises(AttributeError):
            a._v = 1
    assert ir.FloatAttr(float("nan")) == ir.FloatAttr(float("nan"))
    assert ir.FloatAttr(0.0) != ir.FloatAttr(-0.0) and ir.IntAttr(1) != ir.FloatAttr(1.0)
    assert ir.ShapeAttr(["B", 64]).symbolic and ir.ShapeAttr(["B", 64]).evaluate({"B": 2}) == (2, 64)
    assert ir.DimAttr("S+1").evaluate({"S": 4}) == 5
    with pytest.raises(TypeError, match="ShapeAttr"):
        ir.ArrayAttr([ir.IntAttr(1)])
    with pytest.raises(TypeError):
        ir.DenseAttr(np.zeros(2, np.complex64))
    dense = ir.DenseAttr(np.ones((2, 2), np.float32))
    assert dense.splat() == 1.0 and not dense.value.flags.writeable


# ---- dialects ---------------------------------------------------------------------------------


def test_llm_and_dist_dialects_are_generated_from_the_whole_op_table():
    for name, spec in table().items():
        dialect = "dist" if spec.kind == "collective" else "llm"
        d = ir.lookup(f"{dialect}.{name}")
        assert d is not None and d.spec is spec
        assert ir.Interface.INFER_META in d.interfaces and ir.Interface.KERNEL in d.interfaces
        assert (ir.Interface.VJP in d.interfaces) == (spec.vjp is not None)
        assert (ir.Trait.PURE in d.traits) == (spec.kind != "collective")
    names = set(ir.dialects()["llm"].names()) | set(ir.dialects()["dist"].names())
    assert names == {("dist." if s.kind == "collective" else "llm.") + n for n, s in table().items()}
    add, exp, sub = ir.lookup("llm.add"), ir.lookup("llm.exp"), ir.lookup("llm.sub")
    _, f, b = fresh(ir.TensorType([2], F32))
    op = b.create("llm.exp", [f.args[0]])
    assert op.interface(ir.Interface.VJP) is table()["exp"].vjp and op.interface("Nope") is None
    assert op.has_trait(ir.Trait.PURE) and not op.has_trait(ir.Trait.COMMUTATIVE)
    assert {ir.Trait.COMMUTATIVE, ir.Trait.ASSOCIATIVE, ir.Trait.ELEMENTWISE} <= add.traits
    assert ir.Trait.COMMUTATIVE not in sub.traits and ir.Trait.SAME_SHAPE in exp.traits
    assert ir.Trait.IDEMPOTENT in ir.lookup("llm.maximum").traits


def test_builtin_cinn_and_the_dist_dialect_generated_from_the_collectives():
    for name in ["builtin.module", "builtin.func", "builtin.return", "builtin.parameter", "builtin.constant"]:
        assert ir.lookup(name) is not None, name
    for name in ["cinn.fusion", "cinn.yield", "cinn.kernel"]:
        assert ir.lookup(name) is not None, name
    collectives = sorted(n for n, s in table().items() if s.kind == "collective")
    assert {"reshard", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"} <= set(
        collectives
    )
    assert sorted(ir.dialects()["dist"].names()) == sorted("dist." + n for n in collectives)
    assert ir.lookup("llm.all_reduce") is None and ir.lookup("dist.add") is None
    assert ir.lookup("llm.nope") is None and ir.lookup("nodialect.op") is None
    assert ir.Trait.PURE not in ir.lookup("dist.all_reduce").traits  # never merged nor dropped

    p, f, b = fresh(ir.TensorType([4, 6], F32))
    (x,) = f.args
    mesh = ProcessMesh((2, 2), ["dp", "tp"])
    r = b.create("dist.reshard", [x], {"mesh": mesh, "placements": [Shard(0), "R"]})
    assert r.attributes["mesh"] == ir.MeshAttr(mesh)
    assert r.plain_attrs["placements"] == (Shard(0), Replicate())
    g = b.create("all_gather", [r.result], {"group": [0, 1], "axis": 1, "sizes": [6, 5]})
    assert g.result.type == ir.TensorType([4, 11], F32)
    s = b.create("dist.reduce_scatter", [g.result], {"group": [2, 3], "axis": 0, "sizes": [3, 1], "rank": 3})
    assert s.result.type == ir.TensorType([1, 11], F32)  # rank 3 keeps the second piece
    b.ret(s.result)
    p.verify()
    assert str(ir.parse(str(p))) == str(p)
    for attrs, msg in [
        ({"mesh": mesh, "placements": [Shard(0)]}, "1 placements .* for a 2-d mesh"),
        ({"mesh": mesh, "placements": [Shard(2), "R"]}, "out of range for a rank-2 tensor"),
        ({"mesh": mesh, "placements": ["P(sum)", "P(max)"]}, "mix Partial reductions"),
        ({"mesh": [2, 2], "placements": ["R", "R"]}, "expects a ProcessMesh"),
    ]:
        with pytest.raises(OpError, match=msg):
            b.create("dist.reshard", [x], attrs, insert=False)
    with pytest.raises(OpError, match="'reduce'.*use one of"):
        b.create("dist.all_reduce", [x], {"group": [0, 1], "reduce": "mul"}, insert=False)
    # text that breaks the rules is rejected by the verifier or the parser
    with pytest.raises(ir.ParseError, match="out of range for a rank-2 tensor"):
        ir.parse(str(p).replace("#shard<0>", "#shard<5>"))
    with pytest.raises(ir.ParseError, match="bad #partial attribute"):
        ir.parse(str(p).replace("#shard<0>", '#partial<"prod">'))
