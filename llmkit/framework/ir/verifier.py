"""The verifier: every IR rule, checked in one linear walk.

- SSA and dominance: an operand must be defined before its use, in the same block or in an
  enclosing one (block arguments included); functions are isolated from above.
- Structure: op names known to a dialect; operand, result and region counts; use lists intact;
  blocks of regions that need one end with a terminator and nothing follows a terminator.
- Attributes: the required ones present and of the right kind (llm ops: ``spec.bind`` accepts
  them and they are in normal form); no undeclared ones.
- Types: result types equal what the op's ``infer`` gives (``infer_meta`` for llm ops, symbolic
  dims included), plus the op's own checks.

The first problem raises :class:`VerifyError`, whose message names the function and the op and
shows the op in text form (and its line:column when the program came from text).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..opspec import Trait
from ..types import Type
from .core import Block, Operation, OpResult, Value
from .errors import VerifyError
from .opdef import lookup
from .printer import _enclosing_func, format_op


def verify(op: Operation, locations: Mapping[Operation, tuple[int, int]] | None = None) -> None:
    """Verify ``op`` (usually a module) and everything nested in it."""
    _Verifier(locations or {}).top(op)


class _Verifier:
    def __init__(self, locations: Mapping[Operation, tuple[int, int]]) -> None:
        self.locations = locations

    def fail(self, op: Operation, msg: str) -> VerifyError:
        func = _enclosing_func(op)
        where = ""
        if func is not None and func is not op:
            name = func.attributes.get("sym_name")
            where = f"in @{name.value if name is not None else '?'}: "
        try:
            text = format_op(op)
        except Exception:  # a broken op may not print; the message still names it
            text = op.name
        return VerifyError(f"{where}{op.name}: {msg}\n    {text}", op, self.locations.get(op))

    def top(self, op: Operation) -> None:
        self.op(op, set())

    def op(self, op: Operation, visible: set[Value]) -> None:
        d = op.opdef
        if d is None or d.name != op.name or lookup(op.name) is not d:
            raise self.fail(op, f"unknown op {op.name!r}: no dialect defines it")
        # ---- operands: SSA dominance and use lists
        for i, v in enumerate(op._operands):
            if v not in visible:
                if isinstance(v, OpResult) and v.op.parent is op.parent and v.op.parent is not None:
                    raise self.fail(op, f"operand #{i} is used before its definition")
                raise self.fail(op, f"operand #{i} is not defined in an enclosing scope")
            if (op, i) not in v._uses:
                raise self.fail(op, f"operand #{i}: the value's use list does not record this use")
        # ---- counts
        problem = d.operand_problem(len(op._operands))
        if problem:
            raise self.fail(op, problem)
        if d.num_results is not None and len(op.results) != d.num_results:
            raise self.fail(op, f"expects {d.num_results} results, got {len(op.results)}")
        if len(op.regions) != d.num_regions:
            raise self.fail(op, f"expects {d.num_regions} regions, got {len(op.regions)}")
        for r in op.results:
            if not isinstance(r.type, Type):
                raise self.fail(op, f"result #{r.index} has no PIR type ({r.type!r})")
        # ---- attributes
        attrs = op.attributes
        for k in d.attrs:
            if k not in attrs:
                raise self.fail(op, f"missing attribute {k!r}")
        opt = d.optional_attrs
        for k, a in attrs.items():
            check = d.attrs.get(k) or opt.get(k) or opt.get("*")
            if check is None:
                known = ", ".join(list(d.attrs) + [o for o in opt if o != "*"]) or "none"
                raise self.fail(op, f"unknown attribute {k!r} (its attributes are: {known})")
            problem = check(a)
            if problem:
                raise self.fail(op, f"attribute {k!r} must be {problem}, got {a}")
        if d.verify is not None:
            problem = d.verify(op)
            if problem:
                raise self.fail(op, problem)
        # ---- result types
        if d.infer is not None:
            try:
                types = d.infer(op._operands, op.plain_attrs)
            except Exception as e:  # infer_meta rejects the operands: say so, whatever it raised
                raise self.fail(op, f"operands rejected: {e}") from None
            if len(types) != len(op.results):
                raise self.fail(op, f"infer gives {len(types)} results, the op has {len(op.results)}")
            for r, t in zip(op.results, types, strict=False):
                if r.type != t:
                    raise self.fail(op, f"result #{r.index} has type {r.type} but infer_meta gives {t}")
        # ---- regions
        if op.regions:
            isolated = Trait.ISOLATED in d.traits
            needs_term = Trait.NO_TERMINATOR not in d.traits
            for region in op.regions:
                for block in region.blocks:
                    self.block(block, set() if isolated else visible, needs_term, op)

    def block(self, block: Block, visible: set[Value], needs_term: bool, owner: Operation) -> None:
        added: list[Value] = list(block.args)
        visible.update(added)
        last = block.last
        for o in block:
            if o.parent is not block:
                raise self.fail(o, "the op's parent link does not point at its block")
            self.op(o, visible)
            if o is not last and Trait.TERMINATOR in o.opdef.traits:
                raise self.fail(o, "a terminator must be the last op of its block")
            visible.update(o.results)
            added.extend(o.results)
        if needs_term and (last is None or Trait.TERMINATOR not in last.opdef.traits):
            what = _terminator_name(owner)
            raise self.fail(owner, f"a block of its region does not end with a terminator ({what})")
        visible.difference_update(added)


def _terminator_name(op: Operation) -> Any:
    return {"builtin.func": "builtin.return", "cinn.fusion": "cinn.yield"}.get(op.name, "a terminator op")
