"""``lower``: a ``cinn.fusion`` group as expressions over its loop domain.

The group's domain D gets one loop variable per axis (``i0, i1, ...``); the axes its reductions
fold are *reduced*, the others *kept*. Every value is computed by :meth:`Lowering.value` at an
index (a tuple of index expressions, one per dim of the value):

- a group input is a ``Load`` at the linearized index (strides from the shape, or per-call stride
  arguments for inputs that are not contiguous);
- an elementwise op applies its op-table C template to its operands at the broadcast index;
- a view (movement op with an ``index_map``) maps the index to its input's index (a ``Select``
  over inputs for concat/stack, whose loads are clamped so the unchosen side stays in bounds);
- a reduction is its accumulator, valid only at the current row (the kept indices), which is
  checked: anything else cannot be one loop nest and the group runs unfused.

The result (:class:`Lowered`) lists the reductions (each: reducer, accumulated expression, the
accumulators it reads) and the output stores; :func:`coalesce` then merges adjacent axes that
every access walks contiguously (so ``[B, S, H]`` elementwise is one loop), and ``loop_schedule`` turns
it into loops. Symbolic dims become size arguments bound from the inputs' shapes at call time.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

import numpy as np

from .. import symbolic as sym
from ..ir import Operation, Value
from ..ir.core import BlockArgument
from . import loop_ir as L
from .fuse import outer_shapes, reduced_axes, role

_INDEX_CHARS = set("{}0123456789+-*() ")  # templates that are index arithmetic (arange)


def stride_symbol(k: int, axis: int) -> str:
    """The kernel argument holding input k's stride (in elements) along an axis."""
    return f"__st{k}_{axis}"


class LowerError(Exception):
    """The group cannot be one loop nest (its ops then run one by one with reference kernels)."""


@dataclass
class Axis:
    var: str
    extent: sym.Dim
    reduced: bool


@dataclass
class Reduction:
    acc: str
    reducer: str  # sum | max | min (mean is a sum divided at its use)
    dtype: np.dtype
    body: L.Expr
    deps: frozenset[str] = frozenset()


@dataclass
class Output:
    buf: str
    index: L.Expr
    value: L.Expr
    full: bool  # stored per element (True) or once per row


@dataclass
class Input:
    buf: str
    dtype: np.dtype
    shape: tuple  # kernel dims
    strided: bool  # strides are per-call arguments (st<k>_<axis>)
    used: bool = False


@dataclass
class Lowered:
    """A group as expressions over its domain; ``schedule.build`` makes loops of it."""

    label: str
    axes: list[Axis]
    inputs: list[Input]
    outputs: list[tuple[str, np.dtype, tuple]]  # (buf, dtype, kernel dims)
    sizes: list[str]  # size symbols then stride symbols, in argument order
    size_sources: list[tuple[int, int]]  # (input, axis) whose length is each size symbol
    num_sizes: int = 0  # how many of ``sizes`` are sizes (the rest are strides of strided inputs)
    reductions: list[Reduction] = field(default_factory=list)
    stores: list[Output] = field(default_factory=list)
    head: Operation | None = None  # a matmul run first (its product is the last input)
    inplace: int | None = None  # output that may reuse the head's product buffer


def _shape(v: Value) -> tuple:
    return tuple(sym.canonical(d) for d in v.type.shape)


def group_parts(fusion: Operation) -> tuple[list[Operation], list[Value], Operation | None]:
    body = fusion.regions[0].blocks[0]
    ops = [op for op in body if op.name != "cinn.yield"]
    head = ops[0] if ops and role(ops[0]) == "contraction" else None
    return ops, list(body.last.operands), head


class Lowering:
    """Lowers one fusion op; ``layout[k]`` is False where input k is passed with explicit strides."""

    def __init__(self, fusion: Operation, layout: tuple[bool, ...] | None = None) -> None:
        self.fusion = fusion
        self.ops, self.yields, self.head = group_parts(fusion)
        self.members = set(self.ops)
        if self.head is not None:
            self.members.discard(self.head)
        in_values = list(fusion.operands) + ([self.head.results[0]] if self.head is not None else [])
        self.in_values = in_values
        self.in_index = {v: k for k, v in enumerate(in_values)}
        layout = layout or (True,) * len(in_values)
        self._sizes(in_values)
        self.inputs = [
            Input(f"in{k}", v.type.dtype, tuple(self.kdim(d) for d in v.type.shape), not layout[k])
            for k, v in enumerate(in_values)
        ]
        self.reductions: dict[Operation, Reduction] = {}
        self.order: list[Operation] = []
        self.memo: dict[tuple, L.Expr] = {}
        self.delin: dict[L.Expr, tuple[L.Expr, tuple, int]] = {}
        self.ix = _IndexAlgebra(self)

    # ---- sizes -------------------------------------------------------------------------------------
    def _sizes(self, in_values: list[Value]) -> None:
        """Size symbols: plain symbols of the inputs' dims; a compound dim whose symbols no input
        gives alone (``B*S`` from a flattened input) becomes a symbol of its own."""
        self.sizes: list[str] = []
        self.size_sources: list[tuple[int, int]] = []
        self.compound: dict[str, str] = {}
        for k, v in enumerate(in_values):
            for a, d in enumerate(v.type.shape):
                if (
                    isinstance(d, str)
                    and d not in self.sizes
                    and len(sym.symbols(d)) == 1
                    and sym.poly(d) == {(d,): 1}
                ):
                    self.sizes.append(d)
                    self.size_sources.append((k, a))
        for k, v in enumerate(in_values):
            for a, d in enumerate(v.type.shape):
                if isinstance(d, str) and not sym.symbols(d) <= set(self.sizes) and d not in self.compound:
                    name = f"__c{len(self.compound)}"  # "__" never starts a user's symbol
                    self.compound[d] = name
                    self.sizes.append(name)
                    self.size_sources.append((k, a))

    def kdim(self, d: sym.Dim) -> sym.Dim:
        """A program dim in kernel symbols."""
        d = sym.canonical(d)
        if isinstance(d, int):
            return d
        if d in self.compound:
            return self.compound[d]
        if sym.symbols(d) <= set(self.sizes):
            return d
        raise LowerError(f"dim {d} is not known from the group's inputs")

    # ---- the domain ----------------------------------------------------------------------------------
    def domain(self) -> tuple[tuple, tuple[int, ...]]:
        reds = [op for op in self.ops if role(op) == "reduce"]
        if reds:
            shape, axes = _shape(reds[0].operands[0]), reduced_axes(reds[0])
            for r in reds[1:]:
                if _shape(r.operands[0]) != shape or reduced_axes(r) != axes:
                    raise LowerError("reductions of different domains or axes")
            return shape, axes
        shape = _shape(self.yields[0])
        if any(_shape(y) != shape for y in self.yields):
            raise LowerError("outputs of different shapes in an elementwise group")
        return shape, ()

    # ---- values at an index -------------------------------------------------------------------------
    def value(self, v: Value, idx: tuple) -> L.Expr:
        key = (v, idx)
        hit = self.memo.get(key)
        if hit is None:
            hit = self.memo[key] = self._value(v, idx)
        return hit

    def _value(self, v: Value, idx: tuple) -> L.Expr:
        op = None if isinstance(v, BlockArgument) else v.op
        if op is None or op not in self.members:
            return self.load(v, idx)
        if op.name == "builtin.constant":
            arr = np.asarray(op.attributes["value"].value)
            if arr.size != 1:
                raise LowerError("a constant with more than one element inside a group")
            return L.Const(arr.reshape(()).item(), arr.dtype)
        r = role(op)
        spec = op.opdef.spec
        attrs = op.plain_attrs
        if r == "ew":
            return self.template(op, idx)
        if r == "view":
            metas = [a.type for a in op.operands]
            entries = spec.index_map(self.ix, idx, v.type, *metas, **attrs)
            *conds, (last_idx, _) = entries
            out = self.value(op.operands[-1], self._clamped(last_idx, op.operands[-1]) if conds else last_idx)
            for (i_idx, cond), x in reversed(list(zip(entries[:-1], op.operands[:-1]))):
                out = L.Select(cond, self.value(x, self._clamped(i_idx, x)), out)
            return out
        if r == "reduce":
            return self.accumulator(op, idx)
        raise LowerError(f"{op.name} cannot be lowered inside a group")

    def template(self, op: Operation, idx: tuple) -> L.Expr:
        """An op's C template applied at ``idx``: operands at the broadcast index, attributes as
        constants (dims as sizes), ``{i<k>}`` as the output index."""
        spec, attrs, dt = op.opdef.spec, op.plain_attrs, op.results[0].type.dtype
        args = [self.value(a, self.ix.broadcast(idx, _shape(a))) for a in op.operands]
        text = spec.c
        dims = {a.name for a in spec.attrs if a.type.name == "dim"}
        for _, name, _, _ in string.Formatter().parse(spec.c):
            if not name or name.isdigit() or name == "ctype" or "{" + name + "}" not in text:
                continue
            if name[0] == "i" and name[1:].isdigit():
                e: L.Expr = idx[int(name[1:])]
            elif name in dims:
                e = L.Affine((), self.kdim(attrs[name]))
            else:
                e = L.Const(attrs[name], dt)
            text = text.replace("{" + name + "}", "{" + str(len(args)) + "}")
            args.append(e)
        if not args:  # a constant: zeros_like, ones_like
            return L.Const(float(text), dt)
        if text == "{0}" and args[0].dtype == dt:  # full
            return args[0]
        ints = [L.Affine((), a.value) if isinstance(a, L.Const) and a.dtype.kind in "iu" else a for a in args]
        if dt == L.I64 and all(isinstance(a, L.Affine) for a in ints) and set(text) <= _INDEX_CHARS:
            return eval(text.format(*[f"a[{k}]" for k in range(len(ints))]), {"a": ints})  # arange
        return L.Call(text, tuple(args), dt)

    def _clamped(self, idx: tuple, x: Value) -> tuple:
        return tuple(L.clamp(i, self.kdim(d)) for i, d in zip(idx, x.type.shape))

    def load(self, v: Value, idx: tuple) -> L.Expr:
        k = self.in_index.get(v)
        if k is None:
            raise LowerError("a value from outside the group that is not an operand")
        inp = self.inputs[k]
        inp.used = True
        if inp.strided:
            strides = [stride_symbol(k, a) for a in range(len(inp.shape))]
        else:
            strides, acc = [], 1
            for d in reversed(inp.shape):
                strides.insert(0, acc)
                acc = sym.mul(acc, d)
        return L.Load(inp.buf, self.linearize(idx, inp.shape, strides), inp.dtype)

    def linearize(self, idx: tuple, shape: tuple, strides: list) -> L.Expr:
        """sum(idx[a] * stride[a]); runs of a delinearized index (from a reshape) fold back."""
        total: L.Expr = L.Affine((), 0)
        a = 0
        while a < len(idx):
            part = self.delin.get(idx[a])
            if part is not None and part[2] == 0:
                src, dims, _ = part
                n = len(dims)
                run = all(
                    self.delin.get(idx[a + t]) == (src, dims, t) for t in range(n) if a + t < len(idx)
                ) and a + n <= len(idx)
                contiguous = run and all(
                    sym.canonical(strides[a + t])
                    == sym.canonical(sym.mul(strides[a + n - 1], sym.product(dims[t + 1 :])))
                    for t in range(n)
                )
                if contiguous:
                    total = L.add(total, L.mul(src, strides[a + n - 1]))
                    a += n
                    continue
            if not (isinstance(shape[a], int) and shape[a] == 1):
                total = L.add(total, L.mul(idx[a], strides[a]))
            a += 1
        return total

    def accumulator(self, op: Operation, idx: tuple) -> L.Expr:
        """The reduction's value at ``idx``: its accumulator, if idx is the current row."""
        red = self.reductions.get(op)
        if red is None:
            spec = op.opdef.spec
            red = Reduction(
                f"acc{len(self.reductions)}",
                "sum" if spec.reducer == "mean" else spec.reducer,
                op.results[0].type.dtype,
                L.Const(0, op.results[0].type.dtype),
            )
            self.reductions[op] = red
            self.order.append(op)
        keepdim = op.plain_attrs.get("keepdim", False)
        kept = [a for a in range(len(self.shape)) if a not in self.axes]
        want = (
            [L.var(f"i{a}") if a in kept else L.Affine((), 0) for a in range(len(self.shape))]
            if keepdim
            else [L.var(f"i{a}") for a in kept]
        )
        dims = op.results[0].type.shape
        for got, w, d in zip(idx, want, dims):
            if got != w and d != 1:  # a size-1 dim has only index 0, however it is written
                raise LowerError(f"{op.name} is read at another row than the one it reduces")
        ref: L.Expr = L.Ref(red.acc, red.dtype)
        if op.opdef.spec.reducer == "mean":
            count = sym.product(self.kdim(self.shape[a]) for a in self.axes)
            ref = L.Call("({0}/{1})", (ref, L.Cast(L.Affine((), count), red.dtype)), red.dtype)
        return ref

    # ---- the whole group ---------------------------------------------------------------------------
    def run(self) -> Lowered:
        shape, axes = self.domain()
        self.shape, self.axes = shape, axes
        n = len(shape)
        full_idx = tuple(L.var(f"i{a}") for a in range(n))
        keep, squeezed = outer_shapes(shape, axes)
        stores = []
        for j, y in enumerate(self.yields):
            ys = _shape(y)
            if ys == shape:
                idx, full = full_idx, True
            elif axes and ys in (keep, squeezed):
                kept = [L.var(f"i{a}") for a in range(n) if a not in axes]
                if ys == keep and keep != squeezed:
                    it = iter(kept)
                    idx = tuple(L.Affine((), 0) if a in axes else next(it) for a in range(n))
                else:
                    idx = tuple(kept)
                full = False
            else:
                raise LowerError(f"output {j} has shape {list(ys)}, neither the domain nor a row shape")
            if full and axes and all(d == 1 for a, d in enumerate(shape) if a in axes):
                pass
            out_shape = tuple(self.kdim(d) for d in ys)
            strides, acc = [], 1
            for d in reversed(out_shape):
                strides.insert(0, acc)
                acc = sym.mul(acc, d)
            stores.append(
                Output(f"out{j}", self.linearize(idx, out_shape, strides), self.value(y, idx), full)
            )
        done = 0
        while done < len(self.order):  # bodies may reach further reductions
            op = self.order[done]
            self.reductions[op].body = self.value(op.operands[0], full_idx)
            done += 1
        accs = {r.acc for r in self.reductions.values()}
        reds = []
        for op in self.order:
            r = self.reductions[op]
            r.deps = frozenset(L.free_vars(r.body) & accs)
            reds.append(r)
        lowered = Lowered(
            label=str(self.fusion.attributes.get("name").value) if "name" in self.fusion.attributes else "",
            axes=[Axis(f"i{a}", self.kdim(d), a in axes) for a, d in enumerate(shape)],
            inputs=self.inputs,
            outputs=[
                (f"out{j}", y.type.dtype, tuple(self.kdim(d) for d in y.type.shape))
                for j, y in enumerate(self.yields)
            ],
            sizes=list(self.sizes)
            + [
                stride_symbol(k, a)
                for k, i in enumerate(self.inputs)
                if i.strided
                for a in range(len(i.shape))
            ],
            num_sizes=len(self.sizes),
            size_sources=list(self.size_sources),
            reductions=_ordered(reds),
            stores=stores,
            head=self.head,
        )
        lowered.inplace = self._inplace(lowered)
        return lowered

    def _inplace(self, low: Lowered) -> int | None:
        """The output that may overwrite the matmul product: it has the product's type and every
        read of the product is at the element being stored (an elementwise epilogue)."""
        if self.head is None or self.axes:
            return None
        k = len(self.in_values) - 1
        prod = self.head.results[0]
        for j, (s, y) in enumerate(zip(low.stores, self.yields)):
            if y.type != prod.type or not s.full:
                continue
            loads = [e for e in _nodes(s.value) if isinstance(e, L.Load) and e.buf == f"in{k}"]
            if (
                loads
                and all(e.index == s.index for e in loads)
                and all(
                    e.index == s.index
                    for st in low.stores
                    for e in _nodes(st.value)
                    if isinstance(e, L.Load) and e.buf == f"in{k}"
                )
            ):
                return j
        return None


def _nodes(e: L.Expr):
    yield e
    for c in L.children(e):
        yield from _nodes(c)


def _ordered(reds: list[Reduction]) -> list[Reduction]:
    """Reductions so each follows those it reads."""
    out: list[Reduction] = []
    left = list(reds)
    while left:
        ready = [r for r in left if r.deps <= {o.acc for o in out}]
        if not ready:
            raise LowerError("reductions depend on each other in a cycle")
        out.extend(ready)
        left = [r for r in left if r not in ready]
    return out


class _IndexAlgebra:
    """The ``ix`` the op table's index maps receive: dims, broadcasting and reshapes as index math."""

    def __init__(self, low: Lowering) -> None:
        self.low = low

    def dim(self, d: sym.Dim) -> L.Expr:
        return L.Affine((), self.low.kdim(d))

    def broadcast(self, out: tuple, in_shape: tuple) -> tuple:
        lead = len(out) - len(in_shape)
        return tuple(L.Affine((), 0) if d == 1 else out[lead + j] for j, d in enumerate(in_shape))

    def reshape(self, out: tuple, out_shape: tuple, in_shape: tuple) -> tuple:
        """The input index of a row-major reshape, matching groups of dims with equal products."""
        kd = self.low.kdim
        o = [(j, kd(d)) for j, d in enumerate(out_shape) if d != 1]
        i = [(j, kd(d)) for j, d in enumerate(in_shape) if d != 1]
        res: list[L.Expr] = [L.Affine((), 0)] * len(in_shape)
        try:
            groups = _factor_groups(i, o)
        except LowerError:  # no common factoring ([3, 4] -> [2, 6]): through the flat index
            groups = [(i, o)]
        for gi, go in groups:
            lin: L.Expr = L.Affine((), 0)
            for j, d in go:
                lin = L.add(L.mul(lin, d), out[j])
            dims = tuple(d for _, d in gi)
            for t, (j, _) in enumerate(gi):
                rest = sym.product(dims[t + 1 :])
                c = L.floordiv(lin, L.as_index(rest)) if t < len(gi) - 1 else lin
                c = L.mod(c, L.as_index(dims[t])) if t > 0 else c
                if len(gi) > 1:
                    self.low.delin[c] = (lin, dims, t)
                res[j] = c
        return tuple(res)


def _factor_groups(i: list, o: list) -> list[tuple[list, list]]:
    """Pair consecutive runs of input and output dims with equal products (row-major reshape)."""
    groups = []
    a = b = 0
    while a < len(i) or b < len(o):
        gi, go = [i[a]] if a < len(i) else [], [o[b]] if b < len(o) else []
        a, b = a + len(gi), b + len(go)
        pi, po = _prod(gi), _prod(go)
        while sym.canonical(pi) != sym.canonical(po):
            if _divides(po, pi) and b < len(o):  # out side is the smaller: extend it
                go.append(o[b])
                b += 1
            elif _divides(pi, po) and a < len(i):
                gi.append(i[a])
                a += 1
            else:
                raise LowerError("reshape with no common factoring")
            pi, po = _prod(gi), _prod(go)
        groups.append((gi, go))
    return groups


def _prod(g: list) -> sym.Dim:
    return sym.product(d for _, d in g)


def _divides(small: sym.Dim, big: sym.Dim) -> bool:
    """``small`` strictly divides ``big`` (so the side with ``small`` must grow)."""
    if isinstance(small, int) and isinstance(big, int):
        return small < big and big % small == 0
    try:
        q = sym.div(big, small)
    except (sym.DimError, ZeroDivisionError):
        return False
    return q != 1


def lower(fusion: Operation, layout: tuple[bool, ...] | None = None) -> Lowered:
    """A fusion op as a :class:`Lowered` (raises :class:`LowerError` when it is not one loop nest)."""
    return Lowering(fusion, layout).run()
