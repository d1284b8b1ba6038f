"""``fuse``: group primitives into ``cinn.fusion`` ops, deciding by each op's ``kind`` alone.

What an op can do in a group comes from its op-table spec, never from a list of names:

- ``elementwise`` with a C template (``spec.c``): computed inline at any index (so is a
  generator such as ``arange``, whose template reads the output index);
- ``reduce`` with a ``reducer``: one accumulator per row of the group's domain;
- ``movement`` with an ``index_map`` (a view): index arithmetic, free to duplicate; a view of
  several arrays (concat, stack) writes a new one, so one no group takes in heads its own;
- ``contraction`` (matmul): stays with BLAS, but may head a group whose elementwise epilogue
  consumes its result once (the epilogue then runs in place on the product).

A group has a *domain* D (the shape its loops cover) and, once it holds a reduction, the reduced
axes R. Every member is either FULL (shape D, computed per element) or OUTER (the reduced shape,
keepdim or not: computed once per row). Grouping runs in three steps:

1. forward: each op joins the group of an operand's producer when its shape fits that group's
   levels and no path through outside ops would make a cycle; groups an op bridges are merged;
2. pull-in: views, and elementwise ops that are cheap or whose users all sit in one group, are
   moved (or cloned) into the groups that consume them, so they are never materialized;
3. recompute: a value other groups read that is cheap to recompute from its group's inputs is
   recomputed by its readers rather than written and read back;
4. materialize: each group with some computation becomes a ``cinn.fusion`` whose operands are
   the values it reads from outside and whose results (yielded) are the values read after it.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from .. import symbolic as sym
from ..ir import Block, Operation, Program, Region, Value
from ..ir.core import BlockArgument
from ..ir.pass_manager import Pass, register_pass
from ..opspec import Kind, norm_axes
from .decompose import supported

_EXPENSIVE = ("exp(", "log(", "pow(", "tanh(", "erf(", "sin(", "cos(")
SMALL = 64  # static element count below which recomputing a value anywhere is free


def role(op: Operation) -> str | None:
    """What ``op`` can be in a fusion group: "ew", "reduce", "view", "contraction" or None."""
    spec = op.opdef.spec
    if spec is None or not supported(op) or len(op.results) != 1:
        return None
    if spec.c is not None and spec.kind != Kind.REDUCE:  # computable per element (arange too)
        return "ew"
    if spec.kind == Kind.REDUCE and spec.reducer is not None:
        return "reduce"
    if spec.kind == Kind.MOVEMENT and spec.index_map is not None:
        return "view"
    if spec.kind == Kind.CONTRACTION and not spec.decompose:
        return "contraction"
    return None


def _joins(op: Operation) -> bool:
    """A view of several arrays (concat, stack): it writes a new array wherever it runs, so it heads
    a group of its own (its operands' views read in place) rather than running as a numpy copy."""
    return len(op.operands) > 1 and role(op) == "view"


def reduced_axes(op: Operation) -> tuple[int, ...]:
    x = op.operands[0]
    return norm_axes(op.opdef.spec.name, op.plain_attrs.get("axis"), x.ndim)


def outer_shapes(shape: tuple, axes: tuple[int, ...]) -> tuple[tuple, tuple]:
    """The keepdim and squeezed shapes of reducing ``axes`` of ``shape``."""
    keep = tuple(1 if i in axes else d for i, d in enumerate(shape))
    return keep, tuple(d for i, d in enumerate(shape) if i not in axes)


def static_numel(shape: tuple) -> int | None:
    n = sym.product(shape)
    return n if isinstance(n, int) else None


class Group:
    __slots__ = ("axes", "head", "ops", "shape")

    def __init__(self, shape: tuple, axes: tuple[int, ...] | None = None) -> None:
        self.shape = tuple(sym.canonical(d) for d in shape)  # the domain D
        self.axes = axes  # reduced axes of D, None for an elementwise group
        self.ops: list[Operation] = []
        self.head: Operation | None = None  # a contraction whose epilogue this group is

    def levels(self) -> tuple[tuple, ...]:
        """Shapes a member may have: D, and for reductions the keepdim and squeezed shapes."""
        if self.axes is None:
            return (self.shape,)
        return (self.shape, *outer_shapes(self.shape, self.axes))


def _shape(v: Value) -> tuple:
    return tuple(sym.canonical(d) for d in v.type.shape)


@dataclass
class Fuse(Pass):
    """Group fusible ops of every function into ``cinn.fusion`` ops (see the module docstring)."""

    name = "fuse"
    epilogues: bool = True  # let a matmul head the elementwise group consuming it once

    def __post_init__(self) -> None:
        self.origins: dict[Operation, str] = {}  # from the decompose pass, to name groups

    def apply(self, program: Program) -> None:
        for f in program.functions.values():
            _Fuser(f.body, self.origins, self.epilogues).run()


register_pass(Fuse)


class _Fuser:
    def __init__(self, block: Block, origins: dict[Operation, str], epilogues: bool) -> None:
        self.block = block
        self.origins = origins
        self.epilogues = epilogues
        self.pos = {op: i for i, op in enumerate(block)}
        self.group: dict[Operation, Group] = {}

    # ---- queries ---------------------------------------------------------------------------------
    def producer(self, v: Value) -> Operation | None:
        return None if isinstance(v, BlockArgument) else v.op

    def depends_on(self, v: Value, g: Group, inside: set[Operation]) -> bool:
        """Does ``v`` (a value outside the group) reach a member of ``g`` through outside ops?"""
        first = min(self.pos[o] for o in g.ops if o in self.pos)
        seen: set[Operation] = set()
        stack = [self.producer(v)]
        while stack:
            op = stack.pop()
            if op is None or op in seen or self.pos.get(op, -1) < first:
                continue
            seen.add(op)
            if op in inside:
                return True
            stack.extend(self.producer(u) for u in op.operands)
        return False

    def fits(self, op: Operation, g: Group, r: str) -> bool:
        levels = g.levels()
        if r == "reduce":
            x = op.operands[0]
            axes = reduced_axes(op)
            if _shape(x) != g.shape or not axes:
                return False
            return g.axes is None or g.axes == axes
        return _shape(op.results[0]) in levels

    def acyclic_with(self, ops: list[Operation], g: Group) -> bool:
        """Adding ``ops`` to ``g`` keeps the graph acyclic: no operand from outside reaches ``g``."""
        inside = set(g.ops) | set(ops)
        for op in ops:
            for v in op.operands:
                p = self.producer(v)
                if p is not None and p not in inside and self.depends_on(v, g, inside):
                    return False
        return True

    # ---- step 1: forward grouping ----------------------------------------------------------------
    def forward(self) -> None:
        for op in list(self.block):
            r = role(op)
            if r not in ("ew", "reduce", "view"):
                continue
            cands = []
            for v in op.operands:
                p = self.producer(v)
                g = self.group.get(p) if p is not None else None
                if g is not None and g not in cands:
                    cands.append(g)
            home = None
            for g in cands:
                if home is None:
                    if self.fits(op, g, r) and self.acyclic_with([op], g):
                        home = g
                        self.join(op, g, r)
                elif (
                    self.mergeable(home, g)
                    and self.acyclic_with(g.ops, home)
                    and self.acyclic_with(home.ops, g)
                ):
                    self.merge(home, g)
            if home is None and (r != "view" or _joins(op)):
                x = op.operands[0] if r == "reduce" else op.results[0]
                g = Group(_shape(x))
                self.join(op, g, r)

    def join(self, op: Operation, g: Group, r: str) -> None:
        if r == "reduce" and g.axes is None:
            g.axes = reduced_axes(op)
        g.ops.append(op)
        self.group[op] = g

    def mergeable(self, a: Group, b: Group) -> bool:
        if a.head is not None or b.head is not None:
            return False
        if a.axes is not None and b.axes is not None:
            return a.shape == b.shape and a.axes == b.axes
        red, ew = (a, b) if a.axes is not None else (b, a)
        return ew.shape in red.levels()

    def merge(self, into: Group, g: Group) -> None:
        if into.axes is None and g.axes is not None:
            into.shape, into.axes = g.shape, g.axes
        for op in g.ops:
            self.group[op] = into
        into.ops.extend(g.ops)

    # ---- matmul epilogues --------------------------------------------------------------------------
    def attach_epilogues(self) -> None:
        for op in list(self.block):
            if role(op) != "contraction":
                continue
            uses = op.results[0].uses
            if len(uses) != 1:
                continue
            user = uses[0][0]
            g = self.group.get(user)
            if (
                g is None
                or g.axes is not None
                or g.head is not None
                or role(user) != "ew"
                or g.shape != _shape(op.results[0])
                or _shape(user.results[0]) != g.shape
            ):
                continue
            inside = set(g.ops)
            if any(self.depends_on(v, g, inside) for v in op.operands):
                continue  # the group would cross the matmul
            g.head = op
            g.ops.insert(0, op)
            self.group[op] = g

    # ---- step 2: pull producers into their consumers ----------------------------------------------
    def pull_in(self) -> None:
        for op in reversed(list(self.block)):
            r = role(op)
            own = self.group.get(op)
            if own is not None and (len(own.ops) > 1 or r != "ew"):
                continue
            if r not in ("ew", "view") and not (op.name == "builtin.constant" and _small(op)):
                continue
            users: list[Operation] = []
            outside = False
            for v in op.results:
                for u, _ in v.uses:
                    if u in self.group and self.group[u] is not own and role(u) != "contraction":
                        users.append(u)
                    else:
                        outside = True
            groups = list(dict.fromkeys(self.group[u] for u in users))
            if not groups:
                continue
            # views, constants, generators (arange) and tiny values are recomputed wherever used
            free = r == "view" or not op.operands or _small(op)
            if outside and not free:
                continue
            if len(groups) > 1 and not (free or _cheap(op)):
                continue
            if own is not None:
                del self.group[op]
            for g in groups:
                target = op if (len(groups) == 1 and not outside) else None
                self.add_copy(op, g, target)
            if not outside and len(groups) > 1:  # every user has its own copy now
                op.erase()

    def add_copy(self, op: Operation, g: Group, reuse: Operation | None) -> None:
        """Put ``op`` (or a clone used by ``g``'s members only) into ``g``."""
        if reuse is not None:
            g.ops.append(reuse)
            self.group[reuse] = g
            return
        clone = op.clone({})
        self.pos[clone] = self.pos[op]
        members = set(g.ops)
        for old, new in zip(op.results, clone.results):
            for u, i in old.uses:
                if u in members:
                    u.set_operand(i, new)
        self.block.insert_before(clone, op)
        g.ops.append(clone)
        self.group[clone] = g

    # ---- step 3: recompute instead of materializing -----------------------------------------------
    def recompute(self) -> None:
        """A member read only by other groups, computed from the group's inputs by elementwise ops
        alone (the backward's ``1 + a*(1 - sigmoid(a))``), is recomputed where it is read instead of
        being written and read back, when that reads at most two arrays the readers do not."""
        for g in list(dict.fromkeys(self.group.values())):
            members = set(g.ops)
            for y in list(g.ops):
                if role(y) not in ("ew", "view") or y not in members:
                    continue
                users = [u for u, _ in y.results[0].uses if u not in members]
                if not users or any(u not in self.group or role(u) == "contraction" for u in users):
                    continue
                part = _slice(y, members)
                if part is None:
                    continue
                readers = list(dict.fromkeys(self.group[u] for u in users))
                if any(len(_new_inputs(part, h)) > 2 for h in readers):
                    continue
                for h in readers:
                    self.clone_into(part, h, y)
                if not y.results[0].has_uses:
                    self.drop_dead(y, g)
                    members = set(g.ops)

    def clone_into(self, part: list[Operation], h: Group, y: Operation) -> None:
        mapping: dict[Value, Value] = {}
        inside = set(h.ops)
        clones = []
        for op in part:
            c = op.clone(mapping)
            self.block.insert_before(c, op)
            self.pos[c] = self.pos[op]
            clones.append(c)
        for u, i in y.results[0].uses:
            if u in inside:
                u.set_operand(i, mapping[y.results[0]])
        for c in clones:
            h.ops.append(c)
            self.group[c] = h

    def drop_dead(self, y: Operation, g: Group) -> None:
        """Erase ``y`` and the members of ``g`` that only it read."""
        work = [y]
        while work:
            op = work.pop()
            if op not in self.group or any(r.has_uses for r in op.results):
                continue
            producers = [v.op for v in op.operands if not isinstance(v, BlockArgument)]
            g.ops.remove(op)
            del self.group[op]
            op.erase()
            work.extend(p for p in producers if self.group.get(p) is g)

    # ---- step 4: materialize -----------------------------------------------------------------------
    def run(self) -> None:
        self.forward()
        if self.epilogues:
            self.attach_epilogues()
        self.pull_in()
        self.recompute()
        prio: dict[Operation, int] = dict(self.pos)
        for g in dict.fromkeys(self.group.values()):
            if any(role(o) in ("ew", "reduce") or _joins(o) for o in g.ops):
                prio[self.materialize(g)] = max(self.pos[o] for o in g.ops)
        _toposort(self.block, prio)

    def label(self, g: Group) -> str:
        names = Counter(self.origins[o] for o in g.ops if o in self.origins)
        if names:
            return "+".join(n for n, _ in names.most_common(2))
        prims = [o.opdef.spec.name for o in g.ops if role(o) in ("ew", "reduce", "contraction") or _joins(o)]
        return "_".join(list(dict.fromkeys(prims))[:3]) or "fusion"

    def witnesses(self, ops: list[Operation], inputs: list[Value]) -> list[Value]:
        """Function arguments whose shapes give the sizes the inputs do not (a ``[B*S, H]`` input
        reshaped to ``[B, S, H]`` needs B and S): extra operands the kernel only reads sizes from."""
        known = {d for v in inputs for d in v.type.shape if _plain(d)}
        wanted = {s for op in ops for r in op.results for d in r.type.shape for s in sym.symbols(d)}
        out = []
        for s in sorted(wanted - known):
            for a in self.block.args:
                if s in a.type.shape:
                    out.append(a)
                    known.update(d for d in a.type.shape if _plain(d))
                    break
        return [a for a in dict.fromkeys(out) if a not in inputs]

    def materialize(self, g: Group) -> Operation:
        ops = sorted(g.ops, key=lambda o: (self.pos.get(o, 0), o.name == "builtin.constant"))
        ops = _topo(ops)
        if g.head is not None:  # the matmul runs first; its epilogue follows
            ops.remove(g.head)
            ops.insert(0, g.head)
        members = set(ops)
        inputs: list[Value] = []
        outputs: list[Value] = []
        for op in ops:
            for v in op.operands:
                p = self.producer(v)
                if (p is None or p not in members) and v not in inputs:
                    inputs.append(v)
            for r in op.results:
                if any(u not in members for u, _ in r.uses):
                    outputs.append(r)
        inputs += self.witnesses(ops, inputs)
        body = Block()
        for op in ops:
            op.detach()
            body.append(op)
        yield_op = body.append(Operation("cinn.yield", outputs))
        attrs = {"name": self.label(g)}
        fusion = Operation("cinn.fusion", inputs, [v.type for v in outputs], attrs, [Region([body])])
        self.block.insert_before(fusion, self.block.last)  # _toposort moves it where it belongs
        for old, new in zip(outputs, fusion.results):
            for u, i in old.uses:
                if u not in members and u is not yield_op:
                    u.set_operand(i, new)
        return fusion


def _plain(d: sym.Dim) -> bool:
    return isinstance(d, str) and sym.poly(d) == {(d,): 1}


def _slice(y: Operation, members: set[Operation]) -> list[Operation] | None:
    """The members ``y`` is computed from (in order), if all are elementwise ops, views or constants."""
    seen: dict[Operation, None] = {}

    def visit(op: Operation) -> bool:
        if op in seen:
            return True
        if role(op) not in ("ew", "view") and op.name != "builtin.constant":
            return False
        for v in op.operands:
            if not isinstance(v, BlockArgument) and v.op in members and not visit(v.op):
                return False
        seen[op] = None
        return len(seen) <= 32

    return list(seen) if visit(y) else None


def _new_inputs(part: list[Operation], h: Group) -> set[Value]:
    """Values the ops of ``part`` read from outside it that group ``h`` does not read already."""
    inside = {r for op in part for r in op.results}
    have = {v for op in h.ops for v in op.operands} | {r for op in h.ops for r in op.results}
    return {v for op in part for v in op.operands if v not in inside and v not in have}


def _small(op: Operation) -> bool:
    n = static_numel(op.results[0].type.shape)
    return n is not None and n <= SMALL


def _cheap(op: Operation) -> bool:
    c = op.opdef.spec.c if op.opdef.spec is not None else None
    return c is not None and not any(f in c for f in _EXPENSIVE)


def _topo(ops: list[Operation]) -> list[Operation]:
    """Order ops so each comes after the members it reads (clones sit next to their originals)."""
    members = set(ops)
    done: set[Operation] = set()
    out: list[Operation] = []

    def visit(op: Operation) -> None:
        if op in done:
            return
        done.add(op)
        for v in op.operands:
            if not isinstance(v, BlockArgument) and v.op in members:
                visit(v.op)
        out.append(op)

    for op in ops:
        visit(op)
    return out


def _toposort(block: Block, prio: dict[Operation, int]) -> None:
    """Reorder ``block`` so every op follows the ops it reads, in ``prio`` order where possible."""
    ops = [op for op in block]
    index = {op: (prio.get(op, len(ops)), i) for i, op in enumerate(ops)}
    deps: dict[Operation, set[Operation]] = {op: set() for op in ops}
    users: dict[Operation, list[Operation]] = {op: [] for op in ops}
    for op in ops:
        for inner in op.walk():
            for v in inner.operands:
                if isinstance(v, BlockArgument):
                    continue
                d = v.op
                while d is not None and d.parent is not block:
                    d = d.parent_op
                if d is not None and d is not op and d not in deps[op]:
                    deps[op].add(d)
                    users[d].append(op)
    missing = {op: len(deps[op]) for op in ops}
    ready = [(index[op], op) for op in ops if not missing[op]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, op = heapq.heappop(ready)
        order.append(op)
        for u in users[op]:
            missing[u] -= 1
            if not missing[u]:
                heapq.heappush(ready, (index[u], u))
    if len(order) != len(ops):
        raise RuntimeError("fuse: the grouped program has a cycle (a fusion bug)")
    terminator = ops[-1]
    for op in order:
        if op is not terminator:
            op.detach()
            block.insert_before(op, terminator)
