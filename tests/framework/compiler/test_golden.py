"""Fusion and loop-IR decisions checked on printed IR (golden files in ``golden/``).

``*.pir``: ``// RUN: <pipeline>``, the input program, ``// CHECK:``, the exact output program
(the pipeline is usually ``cinn-fuse``). Both programs must also compute the same values in the
reference interpreter, so a golden file cannot bless a wrong grouping.

``*.loop``: an input program, ``// CHECK:``, then the printed loop IR of each group's kernel
(``rows`` schedule, then the other candidate schedules for column reductions), kernel names
replaced by ``k`` (they hash the C source and the compiler's identity).

To regenerate after an intended change: ``python -m tests.framework.compiler.test_golden``
(from the repository root), then review the diff.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from llmkit.framework import compiler, ir, symbolic
from llmkit.framework.compiler.lower import lower
from llmkit.framework.compiler.runtime import kernel_sources

GOLDEN = Path(__file__).parent / "golden"


def _split(path: Path) -> tuple[str, str, str]:
    text = path.read_text()
    first = text.splitlines()[0]
    source, sep, expected = text.partition("// CHECK:\n")
    assert sep, f"{path.name}: no '// CHECK:' line"
    return first, source, expected


def fused_text(source: str, run: str) -> str:
    p = ir.parse(source)
    ir.PassManager([run]).run(p)
    return str(p)


def loops_text(source: str) -> str:
    fp = compiler.fuse_program(ir.parse(source))
    out = []
    for op in fp.walk():
        if op.name == "cinn.fusion":
            for _, _, _, k in kernel_sources(lower(op)):
                out.append(re.sub(r"\bk_[0-9a-f]+\b", "k", str(k)))
    return "\n".join(out)


def _inputs(f: ir.FuncOp, rng: np.random.Generator) -> tuple[list, dict]:
    env = {s: 3 for a in f.args for d in a.type.shape for s in symbolic.symbols(d)}
    arrays = []
    for a in f.args:
        shape = tuple(symbolic.evaluate(d, env) for d in a.type.shape)
        dt = a.type.dtype
        if dt.kind in "iu":
            arrays.append(rng.integers(0, 3, shape).astype(dt))
        else:
            arrays.append(rng.standard_normal(shape).astype(dt))
    return arrays, env


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.pir")), ids=lambda p: p.stem)
def test_fusion_golden(path: Path):
    first, source, expected = _split(path)
    run = first.removeprefix("// RUN:").strip()
    got = fused_text(source, run)
    assert got == expected, f"{path.name}: output differs\n--- got\n{got}--- expected\n{expected}"
    before, after = ir.parse(source), ir.parse(got)
    for name, f in before.functions.items():
        arrays, env = _inputs(f, np.random.default_rng(0))
        with np.errstate(all="ignore"):  # random inputs: sqrt of a negative moment is NaN in both
            want = ir.interpret(before, *arrays, func=name, symbols=env)
            have = ir.interpret(after, *arrays, func=name, symbols=env)
        for w, h in zip(
            want if isinstance(want, tuple) else (want,), have if isinstance(have, tuple) else (have,)
        ):
            np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.loop")), ids=lambda p: p.stem)
def test_loop_ir_golden(path: Path):
    _, source, expected = _split(path)
    got = loops_text(source)
    assert got == expected, f"{path.name}: loop IR differs\n--- got\n{got}--- expected\n{expected}"


def test_llama_block_groups():
    """The Llama block's RMSNorm is one group, and no group crosses a matmul."""
    _, source, _ = _split(GOLDEN / "llama_block.pir")
    fp = compiler.fuse_program(ir.parse(source))
    groups = [op for op in fp.walk() if op.name == "cinn.fusion"]
    norms = [g for g in groups if "rms_norm" in str(g.attributes["name"].value)]
    assert len(norms) == 2
    for g in norms:
        names = [op.name for op in g.regions[0].blocks[0]]
        for part in ("llm.mean", "llm.rsqrt", "llm.mul"):
            assert part in names, (part, names)
    for g in groups:
        body = [op for op in g.regions[0].blocks[0] if op.name != "cinn.yield"]
        for i, op in enumerate(body):
            if op.name == "llm.matmul":  # only as the head of an elementwise epilogue
                assert i == 0, "a matmul inside a group must run first"
                assert not any(o.name in ("llm.sum", "llm.max", "llm.mean") for o in body), (
                    "epilogues are elementwise"
                )


def _regenerate() -> None:
    for path in sorted(GOLDEN.glob("*.pir")):
        first, source, _ = _split(path)
        path.write_text(f"{source}// CHECK:\n{fused_text(source, first.removeprefix('// RUN:').strip())}")
    for path in sorted(GOLDEN.glob("*.loop")):
        _, source, _ = _split(path)
        path.write_text(f"{source}// CHECK:\n{loops_text(source)}")


if __name__ == "__main__":
    _regenerate()
