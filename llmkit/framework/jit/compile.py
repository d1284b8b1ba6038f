"""What happens to a traced program before it runs: the standard passes, then the compiler."""

from __future__ import annotations

from ..ir import Program

COMPILERS = ("cinn", "none")


def default_compiler() -> str:
    """The compiler static programs get when none is named: "cinn" where a C compiler works."""
    from ..compiler import available

    return "cinn" if available() else "none"


def prepare(program: Program, compiler: str | None, key: str | None = None) -> Program:
    """The program the executor runs: cleaned up (and, with compiler="cinn", fused and compiled).

    ``compiler``: "cinn" fuses and compiles (where no C compiler exists it warns once and the
    reference kernels run); "none" runs the traced ops as they are; None picks the default
    (:func:`default_compiler`), so traced and loaded programs, training steps and inference
    programs alike, are compiled wherever a C compiler exists. ``key``: the program's text, under
    which the compiled program is cached across processes (``compiler/program_cache.py``).
    """
    compiler = default_compiler() if compiler is None else compiler
    if compiler == "none":
        return program
    if compiler == "cinn":
        from ..compiler import compile_program

        return compile_program(program, key)
    raise ValueError(f"unknown compiler {compiler!r}; use one of {', '.join(COMPILERS)}")


def executor_for(program: Program, compiler: str | None, func: str | None = None, key: str | None = None):
    """The executor of ``program`` (function ``func``) as :func:`prepare` leaves it. With the CINN
    compiler it also runs the ops' hand-written C kernels and replays all-C functions in one call
    (``Executor(native=True)``, see ``compiler/native/``)."""
    from ..executor import Executor

    compiler = default_compiler() if compiler is None else compiler
    return Executor(prepare(program, compiler, key), func, native=compiler == "cinn")
