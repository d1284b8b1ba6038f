"""Passes and the PassManager.

A pass is a small named dataclass whose fields are its options; ``apply(program)`` transforms the
program in place. ``@register_pass`` files it under its name, so pipelines are readable lists::

    ir.PassManager(["canonicalize", "cse", "dce"]).run(program)
    ir.PassManager.parse("simplify-shapes{bind = {B = 2}},fold-constants{max_elements = 64}")

The manager verifies the program after each pass (naming the pass that broke it), times each
pass (``pm.timings``), and dumps the IR after each pass when asked: ``dump=True`` (stderr), a
directory path (one ``NN-name.pir`` file per pass), or the environment variable
``LLMKIT_IR_DUMP`` (``1`` or a directory). ``timing=True`` or ``LLMKIT_IR_TIMING=1`` prints a
timing report to stderr.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, ClassVar, TextIO

from .core import paused_gc
from .errors import IRError, VerifyError
from .program import Program
from .text_parser import TextParser

DUMP_ENV = "LLMKIT_IR_DUMP"
TIMING_ENV = "LLMKIT_IR_TIMING"


class Pass:
    """Base class: subclasses are dataclasses with a ``name`` and an ``apply``."""

    name: ClassVar[str] = ""

    def apply(self, program: Program) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """``name{opt = value, ...}`` (the options that differ from the defaults)."""
        if not dataclasses.is_dataclass(self):
            return self.name
        fields = dataclasses.fields(self)
        opts = [
            f"{f.name} = {getattr(self, f.name)!r}" for f in fields if getattr(self, f.name) != _default(f)
        ]
        return self.name + ("{" + ", ".join(opts) + "}" if opts else "")


def _default(f: dataclasses.Field) -> Any:
    """A pass option's default (MISSING when it has none)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


_PASSES: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available by its ``name`` in pipelines."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _PASSES and _PASSES[cls.name] is not cls:
        raise ValueError(f"pass {cls.name!r} is registered twice")
    _PASSES[cls.name] = cls
    return cls


def registered_passes() -> dict[str, type[Pass]]:
    """Every registered pass, by name (``ir/__init__`` imports ``passes``, which registers the
    standard ones)."""
    return dict(_PASSES)


def make_pass(name: str, **options: Any) -> Pass:
    """The pass ``name`` with ``options``; unknown names or options raise IRError with hints."""
    registry = registered_passes()
    cls = registry.get(name)
    if cls is None:
        hint = difflib.get_close_matches(name, registry, 1)
        raise IRError(
            f"unknown pass {name!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + f"; passes: {', '.join(sorted(registry))}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    for k, v in options.items():
        f = fields.get(k)
        if f is None:
            raise IRError(
                f"pass {name!r} has no option {k!r} (options: {', '.join(sorted(fields)) or 'none'})"
            )
        default = _default(f)
        if default not in (None, dataclasses.MISSING) and not _same_kind(v, default):
            raise IRError(f"pass {name!r}: option {k!r} must be of type {type(default).__name__}, got {v!r}")
    return cls(**options)


def _same_kind(value: Any, default: Any) -> bool:
    """An option value fits when it has its default's type (a bool is not an int here)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


class PassManager:
    """Runs a pipeline of passes over a program (see the module docstring)."""

    def __init__(
        self,
        pipeline: Sequence[str | Pass | tuple[str, dict]] = (),
        *,
        verify: bool = True,
        dump: bool | str | TextIO | None = None,
        timing: bool | None = None,
    ) -> None:
        self.passes: list[Pass] = []
        for p in pipeline:
            if isinstance(p, Pass):
                self.passes.append(p)
            elif isinstance(p, tuple):
                self.passes.append(make_pass(p[0], **p[1]))
            elif isinstance(p, str):
                self.passes.extend(PassManager.parse(p).passes)
            else:
                raise IRError(f"a pipeline holds pass names or Pass objects, got {p!r}")
        self.verify = verify
        env_dump = os.environ.get(DUMP_ENV)
        self.dump = dump if dump is not None else (env_dump if env_dump not in (None, "", "0") else None)
        self.timing = timing if timing is not None else os.environ.get(TIMING_ENV, "") not in ("", "0")
        self.timings: list[tuple[str, float]] = []  # (pass, seconds) of the last run

    @staticmethod
    def parse(text: str) -> PassManager:
        """``"canonicalize,cse,fold-constants{max_elements = 64}"``: option values use the PIR
        attribute syntax (numbers, true/false, strings, lists, ``{k = v}`` dicts)."""
        pm = PassManager()
        tp = TextParser(text)
        while tp.kind() != "eof":
            if pm.passes:
                tp.expect(",", "between passes")
            name: list[str] = []
            end = tp.offsets[tp.i]
            # a name is adjacent tokens ("fold", "-", "constants"); whitespace ends it
            while tp.offsets[tp.i] == end and (tp.kind() in ("ident", "int") or tp.peek() == "-"):
                name.append(tp.texts[tp.i])
                end += len(name[-1])
                tp.i += 1
            if not name:
                tp.fail(f"expected a pass name, got {tp.got()}")
            options: dict[str, Any] = {}
            if tp.peek() == "{":
                options = {k: a.value for k, a in tp.attr_dict().items()}
            pm.passes.append(make_pass("".join(name), **options))
        return pm

    def run(self, program: Program) -> Program:
        """Run every pass in order on ``program`` (in place); returns it."""
        self.timings = []
        self._verify(program, "before the pipeline")
        for i, p in enumerate(self.passes):
            start = time.perf_counter()
            with paused_gc():
                p.apply(program)
            seconds = time.perf_counter() - start
            self.timings.append((p.describe(), seconds))
            if self.dump:
                self._dump(i, p, program, seconds)
            self._verify(program, f"after pass {p.describe()!r}")
        if self.timing:
            print(self.report(), file=sys.stderr)
        return program

    def _verify(self, program: Program, when: str) -> None:
        if self.verify:
            try:
                program.verify()
            except VerifyError as e:
                raise VerifyError(f"{when}: {e}", e.op, e.location) from None

    def report(self) -> str:
        """The per-pass times of the last run, as a small table."""
        total = sum(s for _, s in self.timings) or 1e-12
        lines = ["pass timing:"]
        for name, s in self.timings:
            lines.append(f"  {s * 1e3:9.3f} ms  {100 * s / total:5.1f}%  {name}")
        lines.append(f"  {total * 1e3:9.3f} ms  total")
        return "\n".join(lines)

    def _dump(self, i: int, p: Pass, program: Program, seconds: float) -> None:
        text = f"// ----- after {p.describe()} ({seconds * 1e3:.3f} ms)\n{program}"
        d = self.dump
        if d is True or d in ("1", "stderr"):
            sys.stderr.write(text)
        elif isinstance(d, str):
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{i:02d}-{p.name}.pir"), "w") as f:
                f.write(text)
        else:
            d.write(text)  # type: ignore[union-attr]
