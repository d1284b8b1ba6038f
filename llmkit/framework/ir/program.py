"""``Program``: a module of named functions (``forward``, ``backward``, ``train_step``...).

``str(program)`` is the text form, ``ir.parse(text)`` reads it back, ``program.verify()`` checks
every IR rule. ``program["main"]`` is a :class:`~.dialects.builtin.FuncOp` view.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..types import Type
from .attributes import StrAttr
from .core import Block, Operation, Region, paused_gc
from .dialects.builtin import FUNC, MODULE, FuncOp
from .errors import IRError
from .printer import print_program
from .verifier import verify


class Program:
    """A ``builtin.module`` op and conveniences around it."""

    __slots__ = ("module",)

    def __init__(self, module: Operation | None = None) -> None:
        if module is None:
            module = Operation("builtin.module", regions=[Region([Block()])], opdef=MODULE)
        elif module.name != "builtin.module":
            raise IRError(f"a Program wraps a builtin.module, not {module.name}")
        self.module = module  # the builtin.module operation

    @property
    def body(self) -> Block:
        """The module's block (its ops are the functions)."""
        return self.module.regions[0].blocks[0]

    @property
    def functions(self) -> dict[str, FuncOp]:
        """Function name -> function, in program order."""
        out = {}
        for op in self.body:
            if op.name == "builtin.func":
                name = op.attributes.get("sym_name")
                if isinstance(name, StrAttr):
                    out[name.value] = FuncOp(op)
        return out

    def __getitem__(self, name: str) -> FuncOp:
        fns = self.functions
        if name not in fns:
            raise KeyError(
                f"no function @{name} in the program (it has: {', '.join('@' + n for n in fns) or 'none'})"
            )
        return fns[name]

    def __contains__(self, name: str) -> bool:
        return name in self.functions

    def function(self, name: str | None = None) -> FuncOp:
        """Function ``name``; by default ``main``, or the only function there is."""
        if name is not None:
            return self[name]
        fns = self.functions
        if "main" in fns:
            return fns["main"]
        if len(fns) == 1:
            return next(iter(fns.values()))
        raise IRError(f"the program has functions {', '.join('@' + n for n in fns) or '(none)'}: name one")

    def add_function(
        self,
        name: str,
        inputs: Sequence[tuple[str | None, Type]] | Sequence[Type] = (),
        attributes: dict[str, Any] | None = None,
    ) -> FuncOp:
        """Append an empty function (no return yet) whose inputs are ``(name, type)`` pairs or
        bare types; fill its body with ``Builder.at_end(f.body)``."""
        if name in self.functions:
            raise IRError(f"function @{name} already exists")
        pairs = [x if isinstance(x, tuple) else (None, x) for x in inputs]  # (name, type)
        block = Block([t for _, t in pairs], [n for n, _ in pairs])
        attrs = {"sym_name": StrAttr(name), **(attributes or {})}
        op = Operation("builtin.func", attributes=attrs, regions=[Region([block])], opdef=FUNC)
        self.body.append(op)
        return FuncOp(op)

    def walk(self) -> Iterator[Operation]:
        """Every op of every function (module excluded), in program order."""
        for f in self.body:
            yield from f.walk()

    def num_ops(self) -> int:
        return sum(1 for _ in self.walk())

    def verify(self) -> Program:
        """Check every IR rule; raise :class:`~.errors.VerifyError` naming the offending op."""
        verify(self.module)
        return self

    def clone(self) -> Program:
        """A deep copy (values keep their names)."""
        with paused_gc():
            return Program(self.module.clone())

    def __str__(self) -> str:
        return print_program(self)

    def __repr__(self) -> str:
        fns = ", ".join(f"@{n}" for n in self.functions)
        return f"<Program {fns or '(empty)'}: {self.num_ops()} ops>"
