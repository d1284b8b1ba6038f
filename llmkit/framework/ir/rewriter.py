"""Imperative rewrites: ``RewritePattern.match_and_rewrite(op, rewriter)`` and a worklist driver.

A pattern looks at one op and, when it matches, changes the IR only through the
:class:`PatternRewriter` it is given (create/insert, replace, erase, modify). The rewriter tells
the driver what changed, so :func:`apply_patterns` revisits exactly the ops a change can affect
(new ops, users of replaced values, producers of erased ops' operands) and never rescans the
program: the work is proportional to the program plus the rewrites, not their product.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from ..opspec import Trait
from ..types import Type
from .builder import Builder
from .core import Operation, Region, Value
from .errors import IRError


def is_pure(op: Operation) -> bool:
    """No side effects: Pure, or RecursivelyPure with only pure ops inside."""
    traits = op.opdef.traits
    inner = (o for r in op.regions for b in r.blocks for o in b if Trait.TERMINATOR not in o.opdef.traits)
    return Trait.PURE in traits or (Trait.RECURSIVELY_PURE in traits and all(map(is_pure, inner)))


def is_trivially_dead(op: Operation) -> bool:
    """A pure, non-terminator op none of whose results is used."""
    return Trait.TERMINATOR not in op.opdef.traits and not any(r._uses for r in op.results) and is_pure(op)


class RewritePattern:
    """A rewrite rooted at one op. Subclasses set ``roots`` (op names they can match; empty
    means any op) and implement :meth:`match_and_rewrite`, returning nothing: the rewriter
    records whether anything changed."""

    roots: ClassVar[tuple[str, ...]] = ()
    benefit: ClassVar[int] = 1  # higher runs first among patterns for the same op

    @property
    def name(self) -> str:
        return type(self).__name__

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        raise NotImplementedError


class FunctionPattern(RewritePattern):
    """A pattern made from a plain function (see :func:`pattern`)."""

    def __init__(
        self, fn: Callable[[Operation, PatternRewriter], None], roots: Sequence[str], benefit: int
    ) -> None:
        self.fn = fn
        self.roots = tuple(roots)  # type: ignore[misc]
        self.benefit = benefit  # type: ignore[misc]

    @property
    def name(self) -> str:
        return self.fn.__name__

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        self.fn(op, rewriter)


def pattern(*roots: str, benefit: int = 1) -> Callable[[Callable[..., None]], RewritePattern]:
    """Decorator: ``@pattern("llm.neg")`` turns ``fn(op, rewriter)`` into a RewritePattern."""
    return lambda fn: FunctionPattern(fn, roots, benefit)


class Listener:
    """Receives the rewriter's change notifications (the driver implements it)."""

    def inserted(self, op: Operation) -> None: ...
    def erased(self, op: Operation) -> None: ...
    def modified(self, op: Operation) -> None: ...
    def replaced(self, old: Value, users: list[Operation]) -> None: ...


class PatternRewriter:
    """The only way patterns change the IR. New ops go before the matched op by default."""

    def __init__(self, listener: Listener | None = None) -> None:
        self.listener = listener or Listener()
        self.changed = False  # set by every mutation
        self.current: Operation | None = None  # the op being matched

    # ---- creating ops -------------------------------------------------------------------------
    def create(
        self,
        op: Any,
        operands: Sequence[Value] = (),
        attrs: Mapping[str, Any] | None = None,
        *,
        result_types: Sequence[Type] | None = None,
        regions: Sequence[Region] = (),
        before: Operation | None = None,
    ) -> Operation:
        """Create an op (types inferred as in Builder.create) and insert it before ``before``
        (default: the matched op)."""
        new = Builder().create(op, operands, attrs, result_types=result_types, regions=regions, insert=False)
        return self.insert(new, before)

    def insert(self, op: Operation, before: Operation | None = None) -> Operation:
        anchor = before or self.current
        if anchor is None or anchor.parent is None:
            raise IRError("PatternRewriter.insert: no op to insert before")
        anchor.parent.insert_before(op, anchor)
        self.changed = True
        self.listener.inserted(op)
        return op

    # ---- replacing and erasing -----------------------------------------------------------------
    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        if old is new:
            return
        if old.type != new.type:
            raise IRError(f"rewrite would replace a {old.type} value with a {new.type} one")
        users = old.users
        old.replace_all_uses_with(new)
        if new.name is None:  # the replacement inherits the name readers know the value by
            new.name = old.name
        self.changed = True
        self.listener.replaced(old, users)

    def replace_op(self, op: Operation, new: Operation | Sequence[Value]) -> None:
        """Replace every result of ``op`` (with ``new``'s results, or the given values), then erase it."""
        values = new.results if isinstance(new, Operation) else tuple(new)
        if len(values) != len(op.results):
            raise IRError(
                f"replace_op: {op.name} has {len(op.results)} results, got {len(values)} replacements"
            )
        for old, v in zip(op.results, values, strict=False):
            self.replace_all_uses_with(old, v)
        self.erase_op(op)

    def erase_op(self, op: Operation) -> None:
        """Erase an op whose results are unused (and everything nested in it)."""
        nested = list(op.walk())
        op.erase()
        self.changed = True
        for o in nested:
            self.listener.erased(o)

    # ---- in-place changes ---------------------------------------------------------------------
    def set_operand(self, op: Operation, i: int, v: Value) -> None:
        op.set_operand(i, v)
        self.changed = True
        self.listener.modified(op)

    def set_attr(self, op: Operation, key: str, value: Any) -> None:
        op.set_attr(key, value)
        self.changed = True
        self.listener.modified(op)


class _Worklist(Listener):
    """Ops still to visit: a stack plus a membership set, so each op is queued at most once."""

    def __init__(self) -> None:
        self.stack: list[Operation] = []
        self.queued: set[Operation] = set()
        self.dead: set[Operation] = set()

    def push(self, op: Operation) -> None:
        if op not in self.queued and op not in self.dead:
            self.queued.add(op)
            self.stack.append(op)

    def pop(self) -> Operation | None:
        while self.stack:
            op = self.stack.pop()
            self.queued.discard(op)
            if op not in self.dead and op.parent is not None:
                return op
        return None

    def inserted(self, op: Operation) -> None:
        for o in op.walk():
            self.push(o)

    def erased(self, op: Operation) -> None:
        self.dead.add(op)
        for v in op._operands:  # producers may be dead now
            owner = getattr(v, "op", None)
            if owner is not None:
                self.push(owner)

    def modified(self, op: Operation) -> None:
        self.push(op)
        for r in op.results:
            for user, _ in r._uses:
                self.push(user)

    def replaced(self, old: Value, users: list[Operation]) -> None:
        for u in users:
            self.push(u)


def apply_patterns(
    root: Any, patterns: Iterable[RewritePattern], *, erase_dead: bool = True, max_rewrites: int | None = None
) -> int:
    """Apply ``patterns`` to every op under ``root`` (a Program, op or FuncOp) to a fixpoint.

    With ``erase_dead`` the driver also erases pure ops whose results are unused. Returns the
    number of rewrites; raises IRError when more than ``max_rewrites`` (default: ten per op
    plus 1000) are made, which means two patterns undo each other.
    """
    top: Operation = getattr(root, "module", None) or getattr(root, "op", None) or root
    by_root: dict[str, list[RewritePattern]] = {}
    generic: list[RewritePattern] = []
    for p in sorted(patterns, key=lambda p: -p.benefit):
        if p.roots:
            for r in p.roots:
                by_root.setdefault(r, []).append(p)
        else:
            generic.append(p)
    wl = _Worklist()
    ops = [o for o in top.walk() if o is not top]
    for o in reversed(ops):  # popped in program order
        wl.queued.add(o)
        wl.stack.append(o)
    limit = max_rewrites if max_rewrites is not None else 10 * len(ops) + 1000
    rw = PatternRewriter(wl)
    count = 0
    while True:
        op = wl.pop()
        if op is None:
            return count
        if erase_dead and is_trivially_dead(op):
            rw.erase_op(op)
            count += 1
            continue
        candidates = by_root.get(op.name, ())
        for p in (*candidates, *generic) if generic else candidates:
            rw.changed = False
            rw.current = op
            p.match_and_rewrite(op, rw)
            if rw.changed:
                count += 1
                if count > limit:
                    raise IRError(
                        f"patterns did not converge after {limit} rewrites "
                        f"(last: {p.name} on {op.name}); do two patterns undo each other?"
                    )
                if op not in wl.dead and op.parent is not None:
                    wl.push(op)  # it may match again in its new form
                break
        rw.current = None
