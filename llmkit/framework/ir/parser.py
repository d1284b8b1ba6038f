"""Reads the PIR text form (see :mod:`.printer` for the syntax) back into a Program.

``parse(text)`` raises :class:`~.errors.ParseError` — and only that — for any bad input: syntax,
unknown ops (with a "did you mean"), attributes an op rejects, values used before they are
defined, missing terminators, and every verifier rule (reported at the offending op's line:column).
"""

from __future__ import annotations

import difflib
from typing import Any

from ..opspec import OpError, Trait
from ..types import Type
from .attributes import Attribute, StrAttr, from_optable
from .core import Block, Operation, Region, Value, paused_gc
from .errors import IRError, ParseError, VerifyError
from .lexer import EOF_KIND
from .opdef import OpDef, known_names, lookup
from .program import Program
from .text_parser import TextParser
from .verifier import verify as run_verifier


def parse(text: str, *, verify: bool = True) -> Program:
    """The Program a text describes; verified unless ``verify=False``."""
    if not isinstance(text, str):
        raise ParseError(f"expected PIR text (a str), got {type(text).__name__}")
    with paused_gc():
        return _Parser(text).program(verify)


class _Parser(TextParser):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.scope: dict[str, Value] = {}  # value name -> value, per function
        self.def_at: dict[str, int] = {}  # value name -> token index of its definition
        self.locations: dict[Operation, tuple[int, int]] = {}
        self.signatures: list[tuple[Operation, list[Type], int]] = []

    def program(self, verify: bool) -> Program:
        res = self._find_resources()
        if res is not None:
            self.window(res, len(self.toks.kinds) - 1)
            self.resource_section()
            self.window(0, res)
        module = self.module()
        if self.kind() != EOF_KIND:
            self.fail(f"expected the end of the program, got {self.got()}")
        if verify:
            try:
                run_verifier(module, self.locations)
            except VerifyError as e:
                line, col = e.location or self.toks.position(0)
                raise ParseError(e.reason.split("\n")[0], line, col, self.toks.source_line(line)) from None
        self.check_signatures()
        return Program(module)

    def _find_resources(self) -> int | None:
        """Where a trailing ``resources { ... }`` section starts (it is parsed first, so the
        module can refer to it); only candidates are scanned, never the whole module."""
        kinds, texts = self.kinds, self.texts
        for c in reversed([i for i, t in enumerate(texts) if t == "resources"]):
            if c == 0 or kinds[c] != "ident" or texts[c + 1] != "{":
                continue
            depth, j = 0, c + 1
            while kinds[j] != EOF_KIND:
                if kinds[j] == "punct":
                    t = texts[j]
                    if t in ("{", "[", "(", "<"):
                        depth += 1
                    elif t in ("}", "]", ")", ">"):
                        depth -= 1
                        if depth == 0:
                            break
                j += 1
            if depth == 0 and kinds[j + 1] == EOF_KIND:
                return c
        return None

    def resource_section(self) -> None:
        self.expect("resources")
        self.expect("{", "after 'resources'")
        while not self.accept("}"):
            at = self.i
            name = self.take("ident", "a resource name")
            if name in self.resources:
                self.fail(f"resource {name!r} is defined twice", at)
            self.expect("=", f"after resource name {name!r}")
            if self.peek() != "dense":
                self.fail(f"expected a dense<...> value for resource {name!r}, got {self.got()}")
            self.resources[name] = self.dense()
        if self.kind() != EOF_KIND:
            self.fail(f"expected the end of the program after the resources, got {self.got()}")

    def module(self) -> Operation:
        self.expect("module", "(a program starts with 'module {')")
        attrs = self.attr_dict() if self.accept("attributes") else {}
        self.expect("{", "to open the module body")
        block = Block()
        module = Operation("builtin.module", attributes=attrs, regions=[Region([block])])
        names: dict[str, int] = {}
        while not self.accept("}"):
            if self.kind() == EOF_KIND:
                self.fail("expected '}' to close the module, got end of input")
            at = self.i
            op = self.func() if self.peek() == "func" else self.op()
            if op.name == "builtin.func":
                fname = op.attributes["sym_name"].value
                if fname in names:
                    self.fail(f"function @{fname} is defined twice", at)
                names[fname] = at
            block.append(op)
        return module

    def func(self) -> Operation:
        start = self.expect("func")
        tok = self.take("symbol", "a function name like @main")
        name = self._unquote(tok[1:]) if tok.startswith('@"') else tok[1:]
        self.scope, self.def_at = {}, {}
        self.expect("(", f"after @{name}")
        block = Block()
        self.items(")", lambda: self.block_arg(block), "between function arguments")
        arrow = self.expect("->", "after the function's arguments")
        self.expect("(", "to open the result types")
        results = self.items(")", self.type, "between result types")
        attrs = self.attr_dict() if self.accept("attributes") else {}
        if "sym_name" in attrs:
            self.fail("a function's name is given by @name, not a sym_name attribute", start)
        op = Operation(
            "builtin.func", attributes={"sym_name": StrAttr(name), **attrs}, regions=[Region([block])]
        )
        self.locations[op] = self.toks.position(self.offsets[start])
        self.expect("{", f"to open the body of @{name}")
        close = self.ops_until_close(block)
        self.check_terminator(op, block, close)
        self.signatures.append((op, results, arrow))
        return op

    def check_signatures(self) -> None:
        """Declared function result types against the returned values (after verification, so
        a wrong op type is reported at the op rather than here)."""
        for op, results, arrow in self.signatures:
            last = op.regions[0].blocks[0].last
            got = [v.type for v in last.operands] if last is not None else []
            if got != results:
                name = op.attributes["sym_name"].value
                self.fail(
                    f"@{name} declares results ({', '.join(map(str, results))}) but returns "
                    f"({', '.join(map(str, got))})",
                    arrow,
                )

    def block_arg(self, block: Block) -> None:
        at = self.i
        name = self.take("value", "an argument like %x: f32[2]")[1:]
        self.expect(":", f"after %{name}")
        arg = block.add_argument(self.type(), None if name.isdigit() else name)
        self.define(name, arg, at)

    def define(self, name: str, v: Value, at: int) -> None:
        prev = self.def_at.get(name)
        if prev is not None:
            line, col = self.toks.position(self.offsets[prev])
            self.fail(f"%{name} is defined twice (first at {line}:{col})", at)
        self.scope[name] = v
        self.def_at[name] = at

    def ops_until_close(self, block: Block) -> int:
        """Parse ops into ``block`` up to the closing '}'; return that token's index."""
        while self.peek() != "}" or self.kind() != "punct":
            if self.kind() == EOF_KIND:
                self.fail("expected '}' to close the block, got end of input")
            if self.kind() == "label":
                self.fail("a function body is a single block: it takes no block labels")
            self.append_op(block)
        self.i += 1
        return self.i - 1

    def append_op(self, block: Block) -> None:
        op = self.op()
        block.append(op)
        if Trait.TERMINATOR in op.opdef.traits and not (
            (self.peek() == "}" and self.kind() == "punct") or self.kind() == "label"
        ):
            short = "return" if op.name == "builtin.return" else op.name
            self.fail(f"nothing may follow {short}: it ends the block (expected '}}', got {self.got()})")

    def check_terminator(self, op: Operation, block: Block, close: int) -> None:
        if Trait.NO_TERMINATOR in op.opdef.traits:
            return
        last = block.last
        if last is None or Trait.TERMINATOR not in last.opdef.traits:
            want = {"builtin.func": "return", "cinn.fusion": "cinn.yield"}.get(op.name, "a terminator")
            what = f"@{op.attributes['sym_name'].value}" if op.name == "builtin.func" else op.name
            self.fail(
                f"the body of {what} does not end with a terminator: expected {want} before '}}'", close
            )

    # ---- ops ----------------------------------------------------------------------------------
    def op(self) -> Operation:
        start = self.i
        if self.peek() == "return" and self.kind() == "ident":
            return self.return_op()
        names: list[tuple[str, int]] = []
        if self.kind() == "value":
            names = self.comma_list(lambda: (self.take("value", "a result name")[1:], self.i - 1))
            self.expect("=", "after the result names")
        name_at = self.i
        opname = self.take("ident", "an op name like llm.add")
        opdef = lookup(opname)
        if opdef is None:
            hint = difflib.get_close_matches(opname, known_names(), 1)
            self.fail(f"unknown op {opname!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""), name_at)
        self.expect("(", f"after {opname}")
        operands = self.items(")", self.use, "or ')' after an operand")
        raw: dict[str, Attribute] = {}
        where: dict[str, tuple[int, int]] = {}
        if self.peek() == "{" and self.kind() == "punct":
            if not (self.peek(1) == "}" or (self.kind(1) in ("ident", "string") and self.peek(2) == "=")):
                self.fail(
                    f"expected attributes of {opname}; before a region write ': ()' or the result types"
                )
            raw, where = self.attr_dict_with_positions()
        attrs = self.op_attrs(opdef, raw, where, name_at) if opdef.spec is not None else raw
        types: list[Type] = []
        if self.accept(":"):
            if self.accept("("):
                self.expect(")", "(': ()' means no results)")
            else:
                types = self.comma_list(self.type)
        if len(types) != len(names):
            self.fail(f"{opname} names {len(names)} results but gives {len(types)} types", name_at)
        regions: list[tuple[Region, int]] = []
        if self.peek() == "{" and self.kind() == "punct":
            regions = self.comma_list(self.region)
        try:
            op = Operation(
                opname,
                operands,
                types,
                attrs,
                [r for r, _ in regions],
                opdef=opdef,
                result_names=[None if n.isdigit() else n for n, _ in names],
            )
        except IRError as e:
            self.fail(str(e), name_at)
        for r, close in regions:
            for b in r.blocks:
                self.check_terminator(op, b, close)
        for (n, at), r in zip(names, op.results, strict=False):
            self.define(n, r, at)
        self.locations[op] = self.toks.position(self.offsets[start])
        return op

    def return_op(self) -> Operation:
        start = self.i
        line = self.toks.position(self.offsets[start])[0]
        self.i += 1
        values: list[Value] = []
        if self.kind() == "value" and self.toks.position(self.offsets[self.i])[0] == line:
            values = self.comma_list(self.use)
        op = Operation("builtin.return", values)
        self.locations[op] = self.toks.position(self.offsets[start])
        return op

    def use(self) -> Value:
        at = self.i
        name = self.take("value", "a value like %x")[1:]
        v = self.scope.get(name)
        if v is None:
            self.fail(f"use of undefined value %{name} (values must be defined before they are used)", at)
        return v

    def op_attrs(
        self, opdef: OpDef, raw: dict[str, Attribute], where: dict[str, tuple[int, int]], at: int
    ) -> dict:
        """An llm op's attributes: checked and normalized by the op table, defaults filled in."""
        spec = opdef.spec
        plain: dict[str, Any] = {}
        index = {a.name: a for a in spec.attrs}
        extra = {}
        for k, a in raw.items():
            if k in opdef.optional_attrs:  # auto-parallel's placements annotation: checked by verify
                extra[k] = a
                continue
            decl = index.get(k)
            if decl is None:
                hint = difflib.get_close_matches(k, index, 1)
                self.fail(
                    f"{opdef.name} has no attribute {k!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + f"; its attributes are: {', '.join(index) or 'none'}",
                    where[k][0],
                )
            try:
                v = decl.type.normalize(a.value)
            except (TypeError, ValueError) as e:
                self.fail(f"{opdef.name}: attribute {k!r} expects {e}, got {a}", where[k][1])
            problem = decl.check(v) if decl.check is not None and v is not None else None
            if problem:
                self.fail(f"{opdef.name}: attribute {k!r} = {a} is invalid: {problem}", where[k][1])
            plain[k] = v
        try:
            bound = spec.bind(plain)
        except (OpError, TypeError, ValueError) as e:
            self.fail(str(e), at)
        return {**{a.name: from_optable(a.type.name, bound[a.name]) for a in spec.attrs}, **extra}

    # ---- regions ------------------------------------------------------------------------------
    def region(self) -> tuple[Region, int]:
        self.nest()
        self.expect("{", "to open a region")
        region = Region()
        block = region.add_block(Block())
        if self.kind() == "label":
            self.block_header(block)
        while True:
            while not (self.peek() == "}" and self.kind() == "punct") and self.kind() != "label":
                if self.kind() == EOF_KIND:
                    self.fail("expected '}' to close the region, got end of input")
                self.append_op(block)
            if self.kind() != "label":
                break
            block = region.add_block(Block())
            self.block_header(block)
        close = self.expect("}", "to close the region")
        self.depth -= 1
        return region, close

    def block_header(self, block: Block) -> None:
        self.take("label", "a block label like ^bb0")
        if self.accept("("):
            self.items(")", lambda: self.block_arg(block), "between block arguments")
        self.expect(":", "after the block label")
