"""The PIR text form (printing). :mod:`.parser` reads it back exactly.

::

    module {
      func @main(%x: f32[B, 64], %w: f32[128, 64], %b: f32[128]) -> (f32[B, 128]) {
        %0 = llm.matmul(%x, %w) {transpose_y = true} : f32[B, 128]
        %y = llm.add(%0, %b) : f32[B, 128]
        return %y
      }
    }

Generic op form: ``%r0, %r1 = dialect.op(%a, %b) {key = attr, ...} : type0, type1`` followed by
its regions (``{ ... }``; ``: ()`` stands for "no results" before a region). Attributes equal to
an llm op's default are left out. Values keep their names; unnamed values are numbered per
function in program order. Constants with more than ``INLINE_LIMIT`` elements print as
``dense_resource<rN>`` with their bytes in a ``resources { ... }`` section after the module.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .attributes import IDENT, DenseAttr, StrAttr, format_attr_dict, format_dense, quote

if TYPE_CHECKING:
    from .core import Block, Operation, Region, Value
    from .program import Program

_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.]")

# ---- values -----------------------------------------------------------------------------------


class Namer:
    """Names values for one function: kept names stay (made unique with ``_1``, ``_2``...),
    unnamed values get numbers in order of definition."""

    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self.taken: set[str] = set()
        self.next_suffix: dict[str, int] = {}
        self.counter = 0

    def __call__(self, v: Value) -> str:
        if v not in self.names:
            self.names[v] = self._fresh(v.name)
        return self.names[v]

    def _fresh(self, name: str | None) -> str:
        if name is None or name.isdigit() or not name:
            n = str(self.counter)
            self.counter += 1
            return n
        if not IDENT.match(name):
            name = _BAD_CHARS.sub("_", name)
            if not IDENT.match(name):
                name = "_" + name
        if name not in self.taken:
            self.taken.add(name)
            return name
        k = self.next_suffix.get(name, 1)
        while f"{name}_{k}" in self.taken:
            k += 1
        self.next_suffix[name] = k + 1
        out = f"{name}_{k}"
        self.taken.add(out)
        return out


# ---- ops --------------------------------------------------------------------------------------


class Printer:
    """Prints ops, blocks and whole programs; ``resources`` collects large constants."""

    def __init__(self, indent: str = "  ") -> None:
        self.indent = indent
        self.lines: list[str] = []
        self.resources: dict[DenseAttr, str] = {}
        self.namer = Namer()

    def program(self, program: Program) -> str:
        self.module(program.module)
        if self.resources:
            self.lines.append("resources {")
            for a, name in self.resources.items():
                self.lines.append(f"{self.indent}{name} = {format_dense(a)}")
            self.lines.append("}")
        return "\n".join(self.lines) + "\n"

    def module(self, op: Operation) -> None:
        attrs = f" attributes {format_attr_dict(op.attributes, self.resources)}" if op.attributes else ""
        self.lines.append(f"module{attrs} {{")
        for block in op.regions[0].blocks:
            for f in block:
                self.op(f, 1)  # a function too: op() hands it to func()
        self.lines.append("}")

    def func(self, op: Operation, depth: int) -> None:
        self.namer = Namer()
        pad = self.indent * depth
        body = op.regions[0].blocks[0] if op.regions and op.regions[0].blocks else None
        args = ", ".join(f"%{self.namer(a)}: {a.type}" for a in body.args) if body else ""
        last = body.last if body is not None else None
        outs = last.operands if last is not None and last.name == "builtin.return" else ()
        extra = {k: v for k, v in op.attributes.items() if k != "sym_name"}
        attrs = f" attributes {format_attr_dict(extra, self.resources)}" if extra else ""
        name = op.attributes.get("sym_name")
        fname = name.value if isinstance(name, StrAttr) else "?"
        fname = fname if IDENT.match(fname) else quote(fname)
        self.lines.append(f"{pad}func @{fname}({args}) -> ({', '.join(str(v.type) for v in outs)}){attrs} {{")
        if body is not None:
            for o in body:
                self.op(o, depth + 1)
        self.lines.append(f"{pad}}}")

    def op_head(self, op: Operation) -> str:
        """The op's first line, without its regions' contents."""
        namer = self.namer
        if op.name == "builtin.return" and not op.attributes:
            vals = ", ".join(f"%{namer(v)}" for v in op._operands)
            return f"return {vals}" if vals else "return"
        parts = []
        if op.results:
            parts.append(", ".join(f"%{namer(r)}" for r in op.results) + " = ")
        parts.append(f"{op.name}({', '.join(f'%{namer(v)}' for v in op._operands)})")
        attrs = op.attributes
        if attrs:
            defaults = op.opdef.defaults
            shown = {k: a for k, a in attrs.items() if defaults.get(k) != a} if defaults else attrs
            if shown:
                parts.append(" " + format_attr_dict(shown, self.resources))
        if op.results:
            parts.append(" : " + ", ".join(str(r.type) for r in op.results))
        elif op.regions:
            parts.append(" : ()")
        return "".join(parts)

    def op(self, op: Operation, depth: int) -> None:
        if op.name == "builtin.func":
            self.func(op, depth)
            return
        pad = self.indent * depth
        head = pad + self.op_head(op)
        if not op.regions:
            self.lines.append(head)
            return
        self.lines.append(head + " {")
        for i, region in enumerate(op.regions):
            if i:
                self.lines.append(f"{pad}}}, {{")
            self.region_body(region, depth + 1)
        self.lines.append(f"{pad}}}")

    def region_body(self, region: Region, depth: int) -> None:
        labelled = len(region.blocks) > 1 or any(b.args for b in region.blocks)
        for i, b in enumerate(region.blocks):
            if labelled:
                args = ", ".join(f"%{self.namer(a)}: {a.type}" for a in b.args)
                self.lines.append(f"{self.indent * (depth - 1)}^bb{i}" + (f"({args})" if args else "") + ":")
            for o in b:
                self.op(o, depth)


def print_program(program: Program) -> str:
    return Printer().program(program)


def _enclosing_func(op: Operation) -> Operation | None:
    p: Operation | None = op
    while p is not None and p.name != "builtin.func":
        p = p.parent_op
    return p


def format_op(op: Operation) -> str:
    """One op's head line, with value names as the full function printout would show them."""
    pr = Printer()
    func = _enclosing_func(op)
    if func is not None and func is not op and func.regions and func.regions[0].blocks:
        _name_until(pr.namer, func.regions[0].blocks[0], op)
    text = pr.op_head(op)
    return text + " {...}" if op.regions else text


def _name_until(namer: Namer, block: Block, stop: Operation) -> bool:
    """Name values in printing order up to ``stop``; True once it is reached."""
    for a in block.args:
        namer(a)
    for o in block:
        if o is stop:
            return True
        for r in o.results:
            namer(r)
        for region in o.regions:
            for b in region.blocks:
                if _name_until(namer, b, stop):
                    return True
    return False
