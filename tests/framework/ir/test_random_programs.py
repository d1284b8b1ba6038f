"""Random programs drawn from the op table: verify, round-trip exactly, run the same after a
round trip; corrupting them is caught by the verifier; every op in the table takes part."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.framework import ir
from llmkit.framework.opspec import OpError, table

from .gen import INPUTS, input_arrays, instantiate, random_program
from .helpers import assert_same_outputs

SEEDS = st.integers(0, 2**32 - 1)


def run(p: ir.Program, seed: int):
    """Outputs, or the error text when a kernel rejects the (random) data."""
    with np.errstate(all="ignore"):
        try:
            return ir.interpret(p, *input_arrays(np.random.default_rng(seed)))
        except ir.InterpretError as e:
            return str(e)


@settings(max_examples=60, deadline=None)
@given(SEEDS, st.integers(1, 16))
def test_random_programs_round_trip_exactly(seed, n_ops):
    p = random_program(random.Random(seed), n_ops)
    p.verify()
    text = str(p)
    q = ir.parse(text)
    assert str(q) == text
    assert str(p.clone()) == text
    a, b = run(p, seed), run(q, seed)
    if isinstance(a, str):
        assert a == b
    else:
        assert_same_outputs(a, b, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(SEEDS, st.sampled_from(["type", "order", "terminator", "operand"]))
def test_corrupted_random_programs_fail_verification(seed, how):
    rng = random.Random(seed)
    p = random_program(rng, 6)
    f = p["main"]
    ops = [op for op in f.body if op.name != "builtin.return"]
    if not ops:
        return
    victim = rng.choice(ops)
    if how == "type":  # a result type infer_meta disagrees with
        r = victim.results[0]
        r.type = ir.TensorType([*r.type.shape, 7], r.type.dtype)
        match = "has type .* but infer_meta gives"
    elif how == "order":  # the op's result is returned before... the op moves after the return
        victim.detach()
        f.body.append(victim)
        match = "used before its definition|terminator must be the last op"
    elif how == "terminator":
        f.return_op.erase()
        match = "does not end with a terminator"
    else:  # a value of this function returned by another one
        other = p.add_function("other", [("z", ir.TensorType([9], "float32"))])
        ir.Builder.at_end(other.body).ret(victim.results[0])
        match = "not defined in an enclosing scope"
    with pytest.raises(ir.VerifyError, match=match):
        p.verify()


def _op_table_sample(name: str):
    """The first sample of ``name`` in test_op_table.py's CASES (inputs and attributes), or None."""
    cases = sys.modules.get("_op_table_cases")
    if cases is None:
        path = Path(__file__).resolve().parent.parent / "test_op_table.py"
        spec = importlib.util.spec_from_file_location("_op_table_cases", path)
        cases = sys.modules["_op_table_cases"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cases)
    case = cases.CASES.get(name)
    return None if case is None else case.samples(np.random.default_rng(0))[0]


@pytest.mark.parametrize("name", sorted(table()))
def test_every_op_builds_prints_parses_and_runs(name):
    spec = table()[name]
    p = ir.Program()
    f = p.add_function("main", INPUTS)
    b = ir.Builder.at_end(f.body)
    arrays = input_arrays(np.random.default_rng(0))
    op = instantiate(b, spec, random.Random(0), list(f.args), tries=3000)
    sample = _op_table_sample(name) if op is None else None
    if sample is not None:
        # Operands no random draw from the shared pool fits (several tensors of unrelated ranks,
        # like the paged KV-cache ops): build the op over inputs shaped like its op-table sample.
        arrays = [a for a in sample.inputs if a is not None]
        p = ir.Program()
        f = p.add_function(
            "main", [(f"x{i}", ir.TensorType(list(a.shape), a.dtype)) for i, a in enumerate(arrays)]
        )
        b = ir.Builder.at_end(f.body)
        op = b.create(spec, list(f.args), sample.attrs)
    assert op is not None, (
        f"the random generator cannot instantiate {name}: give its attribute types candidates"
    )
    b.ret(*op.results)
    p.verify()
    q = ir.parse(str(p))
    assert str(q) == str(p)
    # the interpreter calls the op's kernel with the op's operands and (plain) attributes
    by_arg = dict(zip(f.args, arrays, strict=True))
    with np.errstate(all="ignore"):
        try:
            want = spec.kernel(np, *[by_arg[v].copy() for v in op.operands], **op.plain_attrs)
        except Exception:
            return  # the data makes the kernel fail (an out-of-range index...): nothing to compare
        got = ir.interpret(q, *arrays)
    want = tuple(np.asarray(w) for w in want) if spec.multi_output else np.asarray(want)
    assert_same_outputs(got, want, rtol=0, atol=0)


# Inputs infer_meta once accepted but the kernels could not run (found by the random programs
# above); the op table now rejects each when the op is built.
REJECTED = {
    "relu of bool": ("llm.relu", "%m", {}),
    "neg of bool": ("llm.neg", "%m", {}),
    "sum over axis 0 of a 0-d tensor": ("llm.sum", "%s", {"axis": [0]}),
    "gather with index narrower than x": ("llm.gather", "%t, %p", {"axis": 1}),
    "dropout with a negative seed": ("llm.dropout", "%a", {"seed": -1}),
    "arange of bools": ("llm.arange", "", {"end": 4, "dtype": "bool"}),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_op_table_rejects_what_its_kernels_cannot_run(case):
    name, operands, attrs = REJECTED[case]
    p = ir.Program()
    f = p.add_function("main", INPUTS)
    b = ir.Builder.at_end(f.body)
    by_name = {a.name: a for a in f.args}
    values = [by_name[v.strip()[1:]] for v in operands.split(",") if v.strip()]
    with pytest.raises(OpError, match=name.removeprefix("llm.")):
        b.create(name, values, attrs)
