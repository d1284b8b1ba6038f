"""DRR: declarative rewrite rules, written in Python and compiled to a RewritePattern.

A rule is a *source pattern* (ops over named values, with attributes that are constants or
captures), *constraints* on a match, and a *result pattern* (ops over the source's inputs, with
attributes that are constants, captures or computed)::

    linear_bias = drr.Rule(
        "matmul_add_to_linear",
        source=[drr.op("llm.matmul", ["x", "w"], ["mm"], transpose_x=False, transpose_y=True),
                drr.op("llm.add", ["mm", "b"], ["out"])],
        constraints=[lambda m: m["b"].ndim == 1],
        result=[drr.op("llm.linear", ["x", "w", "b"], ["out"])],
    )
    apply_patterns(program, [linear_bias])

The last source op is the root. Both patterns are checked when the rule is built to be closed
subgraphs: every source op feeds the root, the result reads only source inputs (never the
intermediates it replaces) and defines every root output. At match time, an intermediate used
outside the match blocks the rewrite; commutative ops match either operand order; a result whose
types differ from the values it replaces (or that infer_meta rejects) leaves the IR untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..opspec import OpError, Trait
from .attributes import Attribute, from_optable, to_attr
from .builder import Builder, resolve
from .core import Operation, OpResult, Value
from .errors import IRError
from .opdef import OpDef
from .rewriter import PatternRewriter, RewritePattern


@dataclass(frozen=True)
class Attr:
    """In a source pattern: capture the attribute under ``name``; in a result: use the capture."""

    name: str


@dataclass(frozen=True)
class Compute:
    """A result attribute computed from the match: ``fn(m) -> plain value``."""

    fn: Callable[[Match], Any]


@dataclass(frozen=True)
class OpPattern:
    """One op of a pattern: ``name(inputs) -> outputs`` with attribute constraints/values."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)


def op(name: str, inputs: Sequence[str], outputs: Sequence[str], **attrs: Any) -> OpPattern:
    """``drr.op("llm.add", ["a", "b"], ["out"], **attrs)``; bare op-table names work too."""
    return OpPattern(resolve(name).name, tuple(inputs), tuple(outputs), dict(attrs))


class Match:
    """A successful match: ``m["x"]`` is the Value bound to ``x``, ``m.attrs`` the captures,
    ``m.ops`` the matched operations in source-pattern order."""

    __slots__ = ("attrs", "ops", "values")

    def __init__(self, values: dict[str, Value], attrs: dict[str, Any], ops: list[Operation]) -> None:
        self.values, self.attrs, self.ops = values, attrs, ops

    def __getitem__(self, name: str) -> Value:
        return self.values[name]

    def attr(self, name: str) -> Any:
        return self.attrs[name]


def _normalize(d: OpDef, key: str, value: Any) -> Attribute:
    """A pattern's constant attribute as the op would store it."""
    if d.spec is not None:
        decl = {a.name: a for a in d.spec.attrs}.get(key)
        if decl is None:
            raise IRError(f"{d.name} has no attribute {key!r}")
        return from_optable(decl.type.name, None if value is None else decl.type.normalize(value))
    return to_attr(value)


class Rule(RewritePattern):
    """A declarative rewrite rule (see the module docstring)."""

    def __init__(
        self,
        name: str,
        source: Sequence[OpPattern],
        result: Sequence[OpPattern],
        constraints: Sequence[Callable[[Match], bool]] = (),
        aliases: Mapping[str, str] | None = None,
        benefit: int = 1,
    ) -> None:
        self.rule_name = name
        self.source = tuple(source)
        self.result = tuple(result)
        self.constraints = tuple(constraints)
        self.aliases = dict(aliases or {})  # source output -> source input it becomes
        self.benefit = benefit  # type: ignore[misc]
        self._check()
        self.roots = (self.source[-1].name,)  # type: ignore[misc]

    @property
    def name(self) -> str:
        return self.rule_name

    def __repr__(self) -> str:
        return f"<drr.Rule {self.rule_name}>"

    # ---- compile-time checks ------------------------------------------------------------------
    def _fail(self, msg: str) -> IRError:
        return IRError(f"DRR rule {self.rule_name!r}: {msg}")

    def _check(self) -> None:
        if not self.source:
            raise self._fail("the source pattern is empty")
        self._defs = {d.name: resolve(d.name) for d in (*self.source, *self.result)}
        producer: dict[str, tuple[int, int]] = {}  # value name -> (source op index, output index)
        for i, p in enumerate(self.source):
            d = self._defs[p.name]
            if d.num_results is not None and len(p.outputs) != d.num_results:
                raise self._fail(
                    f"source op #{i} ({p.name}) has {d.num_results} results, "
                    f"the pattern names {len(p.outputs)}"
                )
            for k, out in enumerate(p.outputs):
                if out in producer or out in p.inputs:
                    raise self._fail(f"value {out!r} is defined twice in the source pattern")
                producer[out] = (i, k)
            for key, v in p.attrs.items():
                if isinstance(v, Compute):
                    raise self._fail("Compute belongs in the result pattern")
                if not isinstance(v, Attr):
                    self._const(d, key, v)
        for i, p in enumerate(self.source):
            for name in p.inputs:
                if name in producer and producer[name][0] >= i:
                    raise self._fail(f"source op #{i} reads {name!r} before it is produced")
        # every source op must feed the root (the pattern is one connected, rooted subgraph)
        reached = {len(self.source) - 1}
        stack = [len(self.source) - 1]
        while stack:
            for name in self.source[stack.pop()].inputs:
                j = producer.get(name, (None,))[0]
                if j is not None and j not in reached:
                    reached.add(j)
                    stack.append(j)
        for i, p in enumerate(self.source):
            if i not in reached:
                raise self._fail(f"source op #{i} ({p.name}) does not feed the root")
        self._producer = producer
        self._inputs = [n for p in self.source for n in p.inputs if n not in producer]
        captures = [v.name for p in self.source for v in p.attrs.values() if isinstance(v, Attr)]
        if len(set(captures)) != len(captures):
            raise self._fail("an attribute capture name is used twice")
        available = set(self._inputs)
        replaced: set[str] = set()
        for i, p in enumerate(self.result):
            d = self._defs[p.name]
            for name in p.inputs:
                if name not in available:
                    why = "an intermediate of the source" if name in producer else "undefined"
                    raise self._fail(f"result op #{i} ({p.name}) reads {name!r}, which is {why}")
            for key, v in p.attrs.items():
                if isinstance(v, Attr) and v.name not in captures:
                    raise self._fail(
                        f"result op #{i} uses capture {v.name!r}, which the source does not make"
                    )
                if not isinstance(v, (Attr, Compute)):
                    self._const(d, key, v)
            for out in p.outputs:
                if out in available:
                    raise self._fail(f"result op #{i} redefines {out!r}")
                available.add(out)
                if out in producer:
                    replaced.add(out)
        for out, src in self.aliases.items():
            if out not in producer or src not in self._inputs:
                raise self._fail(f"alias {out!r} -> {src!r} must map a source output to a source input")
            replaced.add(out)
        for out in self.source[-1].outputs:
            if out not in replaced:
                raise self._fail(f"the result does not define the root's output {out!r}")
        self._replaced = replaced

    def _const(self, d: OpDef, key: str, v: Any) -> None:
        try:
            _normalize(d, key, v)
        except (TypeError, ValueError) as e:
            raise self._fail(f"{d.name} attribute {key!r} = {v!r}: {e}") from None

    # ---- matching -----------------------------------------------------------------------------
    def match(self, root: Operation) -> Match | None:
        """The first match rooted at ``root`` that satisfies the constraints, or None."""
        last = len(self.source) - 1
        for values, attrs, ops in self._match_op(last, root, {}, {}, {}):
            matched = set(ops.values())
            if len(matched) != len(self.source):
                continue
            if not self._closed(ops, matched):
                continue
            m = Match(values, attrs, [ops[i] for i in range(len(self.source))])
            if all(c(m) for c in self.constraints):
                return m
        return None

    def _closed(self, ops: dict[int, Operation], matched: set[Operation]) -> bool:
        """Intermediates that will disappear must not be used outside the match."""
        for i, p in enumerate(self.source[:-1]):
            for name, r in zip(p.outputs, ops[i].results, strict=False):
                if name in self._replaced:
                    continue
                for user, _ in r._uses:
                    if user not in matched:
                        return False
        return True

    def _match_op(self, i: int, o: Operation, values: dict, attrs: dict, ops: dict) -> Iterator[tuple]:
        p = self.source[i]
        if o.name != p.name or len(o.results) != len(p.outputs) or len(o._operands) != len(p.inputs):
            return
        if i in ops:
            if ops[i] is o:
                yield values, attrs, ops
            return
        if o in ops.values():
            return
        d = self._defs[p.name]
        attrs = dict(attrs)
        for key, want in p.attrs.items():
            have = o.attributes.get(key)
            if have is None:
                return
            if isinstance(want, Attr):
                if want.name in attrs and attrs[want.name] != have.value:
                    return
                attrs[want.name] = have.value
            elif have != _normalize(d, key, want):
                return
        values = dict(values)
        for name, r in zip(p.outputs, o.results, strict=False):
            if values.setdefault(name, r) is not r:
                return
        ops = {**ops, i: o}
        operands = o.operands
        orders = [operands]
        if len(operands) == 2 and Trait.COMMUTATIVE in o.opdef.traits:
            orders.append(operands[::-1])
        for order in orders:
            yield from self._match_operands(p.inputs, order, 0, values, attrs, ops)

    def _match_operands(self, names, vals, k, values, attrs, ops) -> Iterator[tuple]:
        if k == len(names):
            yield values, attrs, ops
            return
        name, v = names[k], vals[k]
        prod = self._producer.get(name)
        if prod is None:
            bound = values.get(name)
            if bound is None:
                yield from self._match_operands(names, vals, k + 1, {**values, name: v}, attrs, ops)
            elif bound is v:
                yield from self._match_operands(names, vals, k + 1, values, attrs, ops)
            return
        j, out_index = prod
        if not isinstance(v, OpResult) or v.index != out_index:
            return
        for values2, attrs2, ops2 in self._match_op(j, v.op, values, attrs, ops):
            yield from self._match_operands(names, vals, k + 1, values2, attrs2, ops2)

    # ---- rewriting ----------------------------------------------------------------------------
    def match_and_rewrite(self, root: Operation, rewriter: PatternRewriter) -> None:
        m = self.match(root)
        if m is None:
            return
        built = self._build(m)
        if built is None:
            return
        created, env = built
        for new in created:
            rewriter.insert(new, root)
        for out in self._replaced:
            rewriter.replace_all_uses_with(m.values[out], env[self.aliases.get(out, out)])
        for o in reversed(m.ops):
            if o.parent is not None and all(not r._uses for r in o.results):
                rewriter.erase_op(o)

    def _build(self, m: Match) -> tuple[list[Operation], dict[str, Value]] | None:
        """The result ops (not inserted yet) and the value environment, or None when the result
        does not apply (infer_meta rejects it, or types differ from the values it replaces)."""
        env = dict(m.values)
        created: list[Operation] = []
        ok = False
        try:
            for p in self.result:
                attrs = {k: self._attr_value(v, m) for k, v in p.attrs.items()}
                new = Builder().create(p.name, [env[n] for n in p.inputs], attrs, insert=False)
                created.append(new)
                if len(new.results) != len(p.outputs):
                    return None
                env.update(zip(p.outputs, new.results, strict=False))
            ok = all(env[self.aliases.get(out, out)].type == m.values[out].type for out in self._replaced)
        except (OpError, IRError, TypeError, ValueError):
            return None
        finally:
            if not ok:
                for new in reversed(created):
                    new.erase(drop_uses=True)
        return (created, env) if ok else None

    @staticmethod
    def _attr_value(v: Any, m: Match) -> Any:
        if isinstance(v, Attr):
            return m.attrs[v.name]
        if isinstance(v, Compute):
            return v.fn(m)
        return v
