"""Golden tests: each ``golden/*.pir`` holds a pipeline, an input program and the exact output.

File format (xDSL filecheck style, without the pattern language)::

    // RUN: canonicalize,cse          (a PassManager pipeline, or "none" for a round trip)
    // comments saying what is tested
    <input program>
    // CHECK:
    <expected output, exactly>

Besides the text, the input and output programs must compute the same values through the
interpreter on random inputs (symbols bound to 3), so a golden file cannot bless a wrong rewrite.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmkit.framework import ir

from .helpers import assert_same_outputs, inputs_for, symbol_sizes

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(GOLDEN.glob("*.pir"))


def load(path: Path) -> tuple[str, str, str]:
    text = path.read_text()
    first, _, _ = text.partition("\n")
    assert first.startswith("// RUN:"), f"{path.name}: the first line must be '// RUN: <pipeline>'"
    source, sep, expected = text.partition("// CHECK:\n")
    assert sep, f"{path.name}: no '// CHECK:' line"
    return first.removeprefix("// RUN:").strip(), source, expected


def test_there_are_goldens_for_every_standard_pass():
    runs = " ".join(load(p)[0] for p in CASES)
    for name in (
        "dce",
        "cse",
        "fold-constants",
        "canonicalize",
        "simplify-shapes",
        "fuse-patterns",
        "quantize-linear",
    ):
        assert name in runs, f"no golden test runs {name}"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_golden(path: Path):
    run, source, expected = load(path)
    program = ir.parse(source)
    before = program.clone()
    if run != "none":
        ir.PassManager([run]).run(program)
    got = str(program)
    assert got == expected, f"{path.name}: output differs\n--- got\n{got}--- expected\n{expected}"
    assert str(ir.parse(got)) == got  # the output round-trips too

    for name, f in program.functions.items():
        if any(
            op.name in ("builtin.parameter", "cinn.kernel") or op.name.startswith("dist.") for op in f.walk()
        ):
            continue  # no reference semantics for these shells
        env = symbol_sizes(f)
        args = inputs_for(f, np.random.default_rng(0), env)
        with np.errstate(all="ignore"):
            want = ir.interpret(before, *args, func=name, symbols=env)
            got_values = ir.interpret(program, *args, func=name, symbols=env)
        assert_same_outputs(want, got_values, rtol=1e-5, atol=1e-5)
