"""The registry walk's "compiled equals eager" column: every fusible op of the table (an
elementwise op with a C template, a reduction with a reducer, a view with an index map, or a
composite with a decomposition), on the samples of ``test_op_table.CASES``, in float64 and float32.

Views compute nothing on their own, so each is followed by ``+ zeros_like`` to be fused into it.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.framework import compiler, ir
from llmkit.framework.compiler.fuse import role
from llmkit.framework.opspec import Kind, table

from .conftest import needs_cc
from .harness import assert_same, count_kernels, count_native, run

pytestmark = needs_cc


def _cases():
    import test_op_table  # tests/framework is on sys.path (the rootdir of this test package)

    return test_op_table


def fusible(name: str) -> bool:
    """What the fuser reads from the spec: a C template, a reducer, an index map, a decomposition."""
    spec = table()[name]
    return (
        spec.decompose is not None
        or (spec.c is not None and spec.kind != Kind.REDUCE)
        or (spec.kind == Kind.REDUCE and spec.reducer is not None)
        or (spec.kind == Kind.MOVEMENT and spec.index_map is not None and not spec.multi_output)
    )


FUSIBLE = sorted(n for n in table() if fusible(n))


def one_op_program(name: str, inputs: list, attrs: dict) -> tuple[ir.Program, list]:
    spec = table()[name]
    arrays = [a for a in inputs if a is not None]
    p = ir.Program()
    f = p.add_function("main", [(f"x{i}", ir.TensorType(a.shape, a.dtype)) for i, a in enumerate(arrays)])
    b = ir.Builder.at_end(f.body)
    op = b.create(spec, list(f.args), attrs)
    outs = list(op.results)
    if role(op) == "view":
        outs = [b.create("add", [y, b.create("zeros_like", [y]).result]).result for y in outs]
    b.ret(*outs)
    return p, arrays


@pytest.fixture(scope="module")
def programs():
    """Every (op, sample, dtype) as a fused program; all kernels built in one compiler run."""
    mod = _cases()
    out = {}
    for name in FUSIBLE:
        for k, s in enumerate(mod._samples(name)):
            for dt in ("float64", "float32"):
                ins = [a.astype(dt) if a is not None and a.dtype == np.float64 else a for a in s.inputs]
                attrs = dict(s.attrs)
                if dt == "float32" and attrs.get("dtype") == "float64":
                    attrs["dtype"] = "float32"
                p, arrays = one_op_program(name, ins, attrs)
                out[(name, k, dt)] = (p, compiler.fuse_program(p), arrays)
    compiler.compile_fusions(*[fp for _, fp, _ in out.values()])
    return out


@pytest.mark.parametrize("name", FUSIBLE)
def test_compiled_equals_eager(programs, name):
    keys = [k for k in programs if k[0] == name]
    assert keys, f"no samples for {name}"
    for key in keys:
        ref, fused, arrays = programs[key]
        groups, compiled = count_kernels(fused)
        assert compiled == groups, f"{key}: {compiled} of {groups} groups compiled"
        applies, ran = count_native(fused)
        assert ran == applies, f"{key}: {ran} of {applies} hand-written kernels run"
        with np.errstate(all="ignore"):
            want = run(ref, arrays)
            got = run(fused, arrays, native=True)
        assert_same(got, want, np.dtype(key[2]), str(key))


def test_every_elementwise_and_reduce_primitive_is_fusible():
    """Fusibility comes from the op table alone: nothing elementwise or reducing is left out."""
    for name, spec in table().items():
        if spec.kind == "elementwise" and spec.decompose is None:
            assert spec.c is not None, (
                f"{name}: an elementwise primitive without a C template cannot be fused"
            )
        if spec.kind == "reduce" and spec.decompose is None and name != "argmax":
            assert spec.reducer is not None, f"{name}: a reduction without a reducer cannot be fused"
