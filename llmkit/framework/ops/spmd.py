"""SPMD rules: how an op runs on distributed tensors, declared on its spec (``defop(..., spmd=...)``).

A rule looks at one mesh dim at a time. Given the op's global metas, its attributes and the
inputs' current placements (a :class:`Ctx`), it lists :class:`Strategy` s: the placement each input
must have on that mesh dim and the placements the outputs then have. :func:`decide` picks, per mesh
dim, the strategy whose reshards move the fewest bytes (ties: the fewest changed inputs, then list
order), so the eager distributed world and the static propagation pass make the same choice. A
rule may instead answer :data:`DECOMPOSE` (run the op's decomposition, whose ops have rules of their
own: a softmax over a sharded axis becomes a sharded max, sum and all-reduces) or fail loudly.

Families supply the rules (the math behind each):

- :func:`elementwise`: out[i] = f(in[i]) commutes with slicing, so any output dim may be sharded
  with the inputs' matching dims (broadcast size-1 dims stay replicated). ``partial="linear"``:
  f(sum x_r, sum y_r) = sum f(x_r, y_r) (add, sub, neg, where's branches); ``"bilinear"``:
  a * sum b_r = sum a b_r with one Partial factor (mul; div in its numerator); ``"max"``/``"min"``:
  max(max_r x_r, max_r y_r) = max_r max(x_r, y_r).
- :func:`reduction`: reducing a sharded axis leaves the ranks' partial reductions, ``Partial(op)``;
  a linear reduction also passes a Partial input through.
- :class:`Einsum`: a contraction declared by its einsum string; a letter in both operands and
  the output shards all three, one in an operand and the output shards those two, and a
  contracted letter sharded in both operands gives ``Partial("sum")``.
- :func:`dim_map`: movement ops and composites that keep some dims' elements independent.
- :func:`replicate_only`: an op that cannot run sharded, with the reason.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import symbolic as sym
from ..opspec import Meta, OpError, broadcast_shapes, describe, norm_axes, same_dtype
from ..placement import Partial, Placement, Replicate, Shard, local_shape

ANY = "any"  # an input requirement: whatever the input's placement is (the op reads only its shape)
DECOMPOSE = "decompose"  # a rule's answer: run the op's decomposition instead
R = Replicate()


@dataclass(frozen=True)
class Strategy:
    """Required placement per input (a Placement, ANY, or None for an absent input) and the
    resulting placement per output, on one mesh dim. ``local`` (optional) computes the op on one
    rank's shards with ops: ``local(regions, *tensors, **attrs)``, ``regions[i]`` being the slice of
    the global value input i's shard covers (vocab-parallel embedding shifts its ids by it)."""

    inputs: tuple
    outputs: tuple
    local: Callable[..., Any] | None = None


@dataclass
class Ctx:
    """What a rule sees for mesh dim ``dim``: global ``metas`` (None for absent inputs), the inputs'
    current ``placements`` (one tuple per input, over all mesh dims) and the op's attributes."""

    mesh_shape: tuple
    dim: int
    metas: list
    placements: list
    attrs: dict

    @property
    def n(self) -> int:
        return self.mesh_shape[self.dim]

    def cur(self, i: int) -> Placement | None:
        p = self.placements[i]
        return None if p is None else p[self.dim]

    def outer(self, i: int, d: int) -> int:
        """How many chunks the mesh dims before this one cut input i's dim d into."""
        return math.prod(self.mesh_shape[m] for m in range(self.dim) if self.placements[i][m] == Shard(d))

    def nonempty(self, i: int, d: int) -> bool:
        """Every rank's chunk of input i's dim d is non-empty here."""
        size = self.metas[i].shape[d]
        return not isinstance(size, int) or size // self.outer(i, d) >= self.n

    def even(self, i: int, d: int) -> bool:
        """Input i's dim d splits evenly here, nested under the mesh dims before this one."""
        size = self.metas[i].shape[d]
        return isinstance(size, int) and size % (self.n * self.outer(i, d)) == 0


@dataclass(frozen=True)
class Rule:
    """An op's SPMD rule: ``strategies(ctx)`` lists strategies (or returns DECOMPOSE); ``shape_attr``
    names an attribute holding the output's shape (made local per rank); ``shape_only`` lists inputs
    read only for their (global) shape; ``reason`` says why an op is replicate only; ``globalize``
    spells out attributes whose meaning depends on the input shapes (squeeze's axis=None), since a
    rank sees only its shard's."""

    strategies: Callable[[Ctx], Any]
    shape_attr: str | None = None
    shape_only: tuple[int, ...] = ()
    reason: str | None = None
    globalize: Callable[..., dict] | None = None  # (metas, attrs) -> attrs no longer implied by shapes
    doc: str = ""


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose: the placements the inputs must take (None: absent input, or any),
    the outputs' placements, an optional local implementation, or ``decompose``."""

    inputs: tuple = ()
    outputs: tuple = ()
    local: Callable[..., Any] | None = None
    decompose: bool = False


def local_attrs(
    spec: Any, attrs: dict, metas: Sequence[Any], out_meta: Any, out_placements: Any, mesh_shape, coord
) -> dict:
    """The attributes the op runs with on the rank at mesh coordinate ``coord``."""
    rule = spec.spmd
    if rule.globalize is not None:
        attrs = rule.globalize(metas, attrs)
    if rule.shape_attr is not None:
        attrs = {**attrs, rule.shape_attr: local_shape(out_meta.shape, mesh_shape, out_placements, coord)}
    return attrs


# ---- choosing ----------------------------------------------------------------------------------


def _nbytes(meta: Any, placements: Sequence[Placement], mesh_shape: Sequence[int], skip: int) -> float:
    size = float(np.prod([d if isinstance(d, int) else 1 for d in meta.shape]))
    for m, p in enumerate(placements):
        if m != skip and isinstance(p, Shard):
            size /= mesh_shape[m]
    return size * meta.dtype.itemsize


def move_cost(src: Placement, dst: Placement, nbytes: float, n: int) -> float:
    """Bytes a rank sends to move a value of ``nbytes`` from ``src`` to ``dst`` over ``n`` ranks."""
    if src == dst or n == 1:
        return 0.0
    gather = nbytes * (n - 1) / n
    if isinstance(src, Replicate):
        return 0.0  # slicing, or keeping the value on one rank (R -> P)
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return nbytes * (n - 1) / n**2
        return gather  # (S -> P goes through R; keeping it is free)
    if isinstance(dst, Shard):
        return gather  # reduce-scatter
    return 2 * gather  # all-reduce (P -> R, or P -> P' through R)


_DECISIONS: dict[tuple, Decision] = {}
DECISIONS_KEPT = 1 << 14  # a bound for programs whose shapes keep changing (decoding)


def decide(
    spec: Any,
    metas: Sequence[Any],
    placements: Sequence[Any],
    attrs: dict,
    mesh_shape: tuple,
    want: Any = None,
    fixed: Sequence[int] = (),
) -> Decision:
    """The strategy per mesh dim for ``spec`` on inputs with ``placements`` (None: absent input).
    ``want``: placements wished for the first output; on a mesh dim where a strategy gives it for
    free (no input moves but slices), that one is taken. ``fixed``: the inputs that are parameters
    (large and persistent, where the plan put them): a strategy moving fewer of their bytes wins
    over any that moves fewer activation bytes, so activations follow the weights' layout.

    A decision is a function of the op's rule, attributes, the inputs' global shapes, dtypes and
    placements, the mesh's shape, ``want`` and ``fixed``: it is computed once per such key
    (:func:`choose`) and remembered, so a training step pays for each of its ops' decisions once.
    """
    rule = spec.spmd
    if rule is None:
        raise OpError(
            f"{spec.name}: no SPMD rule, so it cannot run on distributed tensors; give its defop an "
            "spmd= rule (ops/spmd.py has the families), or replicate_only('why') if it cannot be sharded"
        )
    try:
        key = (
            spec.name,
            id(rule),
            tuple(attrs.items()),
            tuple(None if m is None else (tuple(m.shape), m.dtype) for m in metas),
            tuple(None if p is None else tuple(p) for p in placements),
            tuple(mesh_shape),
            None if want is None else tuple(want),
            tuple(fixed),
        )
        hit = _DECISIONS.get(key)
    except TypeError:  # an attribute that cannot be a key (a list): decided afresh
        return choose(spec, metas, placements, attrs, mesh_shape, want, fixed)
    if hit is None:
        if len(_DECISIONS) >= DECISIONS_KEPT:
            _DECISIONS.clear()
        hit = _DECISIONS[key] = choose(spec, metas, placements, attrs, mesh_shape, want, fixed)
    return hit


def choose(
    spec: Any,
    metas: Sequence[Any],
    placements: Sequence[Any],
    attrs: dict,
    mesh_shape: tuple,
    want: Any = None,
    fixed: Sequence[int] = (),
) -> Decision:
    """:func:`decide`'s decision, computed: per mesh dim, the cheapest strategy of the rule."""
    rule = spec.spmd
    pad = 0 if spec.variadic else len(spec.inputs) - len(metas)  # omitted trailing optional inputs
    metas = list(metas) + [None] * pad
    cur = [None if p is None else list(p) for p in placements] + [None] * pad
    out: list[list[Placement]] | None = None
    local = None
    for m in range(len(mesh_shape)):
        ctx = Ctx(tuple(mesh_shape), m, metas, [None if c is None else tuple(c) for c in cur], attrs)
        options = rule.strategies(ctx)
        if isinstance(options, str) and options == DECOMPOSE:
            if spec.decompose is None:
                raise OpError(f"{spec.name}: its SPMD rule asks for its decomposition, but it has none")
            return Decision(decompose=True)
        if not options:
            raise OpError(f"{spec.name}: its SPMD rule offers no strategy on mesh dim {m}")

        def cost(s: Strategy) -> tuple:
            weights, total, changed = 0.0, 0.0, 0
            for i, req in enumerate(s.inputs):
                if req is None or req == ANY or cur[i] is None:
                    continue
                have = cur[i][m]
                if have != req:
                    changed += 1
                    sent = move_cost(have, req, _nbytes(metas[i], cur[i], mesh_shape, m), mesh_shape[m])
                    total += sent
                    weights += sent if i in fixed else 0.0
            return (weights, total, changed)

        free = [s for s in options if want is not None and s.outputs[0] == want[m] and cost(s)[1] == 0]
        best = min(free or options, key=cost)
        for i, req in enumerate(best.inputs):
            if req is not None and req != ANY and cur[i] is not None:
                cur[i][m] = req
        if out is None:
            out = [[] for _ in best.outputs]
        for o, p in zip(out, best.outputs):
            o.append(p)
        if best.local is not None:
            local = best.local
    return Decision(
        inputs=tuple(None if c is None else tuple(c) for c in cur),
        outputs=tuple(tuple(o) for o in (out or [])),
        local=local,
    )


# ---- building strategies -------------------------------------------------------------------------


def _place(d: int | None) -> Placement:
    return R if d is None else Shard(d)


def dim_map(
    ctx: Ctx,
    groups: Sequence[tuple[Sequence[int | None], Sequence[int | None]]],
    partial: Sequence[Any] = (),
) -> list[Strategy]:
    """All-replicated, then one strategy per group of co-sharded dims ``(input dims, output dims)``
    (None: that input or output replicated), then the given partial strategies. Absent inputs get
    None; inputs read only for their shape (ANY in a partial strategy) keep their placement."""
    n_in = len(ctx.metas)

    def fix(ins):
        return tuple(None if ctx.metas[i] is None else p for i, p in enumerate(ins))

    if groups:
        n_out = len(groups[0][1])
    elif partial:
        first = partial[0]
        n_out = len(first.outputs if isinstance(first, Strategy) else first[1])
    else:
        n_out = 1
    out = [Strategy(fix((R,) * n_in), (R,) * n_out)]
    for ins, outs in groups:
        out.append(Strategy(fix(tuple(_place(d) for d in ins)), tuple(_place(d) for d in outs)))
    for p in partial:
        s = p if isinstance(p, Strategy) else Strategy(tuple(p[0]), tuple(p[1]))
        out.append(Strategy(fix(s.inputs), s.outputs, s.local))
    return out


def replicate_only(reason: str) -> Rule:
    """The op runs only on replicated inputs (every rank computes the whole op), for ``reason``."""

    def strategies(ctx: Ctx) -> list[Strategy]:
        return dim_map(ctx, [])

    return Rule(strategies, reason=reason, doc=f"replicate only: {reason}")


def not_distributed(reason: str) -> Rule:
    """The op acts on per-rank arrays and never on a distributed tensor."""

    def strategies(ctx: Ctx) -> list[Strategy]:
        raise OpError(reason)

    return Rule(strategies, reason=reason, doc=f"not on distributed tensors: {reason}")


# ---- elementwise -------------------------------------------------------------------------------

_LINEAR_OPS = ("sum", "avg")


def broadcast_dims(out_shape: Sequence[Any], metas: Sequence[Any]) -> list[list[int | None]]:
    """For each output dim, each input's matching dim (None where the input is absent, shorter or
    broadcasts a size-1 dim there)."""
    nd = len(out_shape)
    table = []
    for j, size in enumerate(out_shape):
        row = []
        for m in metas:
            if m is None:
                row.append(None)
                continue
            d = j - (nd - m.ndim)
            row.append(d if d >= 0 and (m.shape[d] == size or m.shape[d] != 1) else None)
        table.append(row)
    return table


def partials(fixed: Sequence[Any], together: Sequence[int], ops: Sequence[str] = _LINEAR_OPS, n_out: int = 1):
    """Partial strategies of an op linear in its inputs ``together`` jointly (max/min: monotone):
    per op, those inputs ``Partial(op)``, the others as ``fixed``, the outputs ``Partial(op)``."""
    ins = lambda op: [Partial(op) if i in together else p for i, p in enumerate(fixed)]
    return [(ins(op), (Partial(op),) * n_out) for op in ops]


def one_partial(fixed: Sequence[Any], positions: Sequence[int]) -> list:
    """Partial strategies of an op linear in each input of ``positions`` alone (a product's factors)."""
    return [s for op in _LINEAR_OPS for i in positions for s in partials(fixed, (i,), (op,))]


def elementwise(partial: str | None = None, inputs: Sequence[int] | None = None) -> Rule:
    """Rule of an elementwise op (numpy broadcasting). ``partial``: None, "linear", "bilinear",
    "first" (linear in the first input only, like div), "max" or "min"; ``inputs``: the positions
    that may be Partial (all by default; where's condition never is)."""

    def strategies(ctx: Ctx) -> list[Strategy]:
        metas = ctx.metas
        present = [m for m in metas if m is not None]
        shape = broadcast_shapes("spmd", *present) if present else ()
        groups = [(row, (j,)) for j, row in enumerate(broadcast_dims(shape, metas))]
        idx = [i for i, m in enumerate(metas) if m is not None and (inputs is None or i in inputs)]
        fixed = [R if m is not None else None for m in metas]
        parts = []
        if partial in ("linear", "max", "min"):
            parts = partials(fixed, idx, _LINEAR_OPS if partial == "linear" else (partial,))
        elif partial in ("bilinear", "first"):
            parts = one_partial(fixed, idx if partial == "bilinear" else idx[:1])
        return dim_map(ctx, groups, parts)

    return Rule(strategies, doc=f"elementwise (partial: {partial})")


def like_input(ctx: Ctx) -> list[Strategy]:
    """zeros_like / ones_like: the output takes the input's layout (a Partial input's value is
    irrelevant: the output is replicated); the input is never moved."""
    p = ctx.cur(0)
    return [Strategy((ANY,), (R if isinstance(p, Partial) else p,))]


# ---- reductions --------------------------------------------------------------------------------


def reduction(kind: str | None, *, local: Callable[..., Any] | None = None, decompose: bool = False) -> Rule:
    """Rule of a reduction over ``axis``: a sharded reduced axis gives ``Partial(kind)`` (computed by
    ``local(regions, x, **attrs, count=<elements reduced globally>)`` when given: mean is a Partial sum
    of local sums over the global count); ``kind`` None: that axis must be replicated, or with
    ``decompose`` the op runs as its decomposition; kept axes stay sharded; a linear reduction
    passes a Partial input through."""

    def strategies(ctx: Ctx) -> Any:
        x = ctx.metas[0]
        axis = ctx.attrs.get("axis")
        keep = ctx.attrs.get("keepdim", False)
        axes = norm_axes("spmd", axis if axis is None or isinstance(axis, tuple) else (axis,), x.ndim)
        fn = None
        if local is not None:
            count = int(np.prod([x.shape[a] for a in axes]))
            fn = lambda regions, *xs, **attrs: local(regions, *xs, **attrs, count=count)
        groups = []
        parts: list[Any] = []
        j = 0
        for d in range(x.ndim):
            if d in axes:
                if kind in ("max", "min") and not ctx.nonempty(0, d):
                    pass  # an empty chunk has no max: that axis is gathered
                elif kind is not None:
                    parts.append(Strategy((Shard(d),), (Partial(kind),), fn))
                elif decompose and ctx.cur(0) == Shard(d):
                    return DECOMPOSE
                j += keep
            else:
                groups.append(((d,), (j,)))
                j += 1
        if kind == "sum":
            parts += [Strategy((Partial(op),), (Partial(op),), fn) for op in _LINEAR_OPS]
        elif kind in ("max", "min"):
            parts.append(((Partial(kind),), (Partial(kind),)))
        return dim_map(ctx, groups, parts)

    return Rule(strategies, doc=f"reduction ({kind})")


def along_axis(axis_attr: str = "axis", *, linear: bool = False, outputs: int = 1) -> Rule:
    """An op computed along one axis (cumsum, topk): that axis replicated, the others sharded
    freely (same dims in and out)."""

    def strategies(ctx: Ctx) -> list[Strategy]:
        x = ctx.metas[0]
        ax = ctx.attrs[axis_attr] % x.ndim
        groups = [((d,), (d,) * outputs) for d in range(x.ndim) if d != ax]
        parts = [((Partial(op),), (Partial(op),) * outputs) for op in _LINEAR_OPS] if linear else []
        return dim_map(ctx, groups, parts)

    return Rule(strategies, doc=f"along {axis_attr}")


def decompose_along(axis_of: Callable[[Ctx], Sequence[int]], groups_of: Callable[[Ctx], list]) -> Rule:
    """A composite computed along some axes: when one of them is sharded, run its decomposition
    (its reductions become Partial and all-reduces); otherwise shard the other dims."""

    def strategies(ctx: Ctx) -> Any:
        p = ctx.cur(0)
        if isinstance(p, Shard) and p.dim in set(axis_of(ctx)):
            return DECOMPOSE
        return dim_map(ctx, groups_of(ctx))

    return Rule(strategies, doc="decomposed when its axis is sharded")


# ---- contractions: one einsum string ---------------------------------------------------------------


class Einsum:
    """A contraction given as an einsum string (``"...mk,...kn->...mn"``, ``...`` = broadcast batch
    dims): its shape rule and its SPMD rule (batch/free letters shard with the output, contracted
    letters sharded in every operand give Partial("sum"))."""

    def __init__(self, spec: str) -> None:
        lhs, out = spec.replace(" ", "").split("->")
        self.text = spec
        self.operands = tuple(lhs.split(","))
        self.out = out
        for term in (*self.operands, out):
            core = term.replace("...", "")
            if len(set(core)) != len(core) or not set(core) <= set(string.ascii_letters):
                raise ValueError(
                    f"einsum {spec!r}: each term is distinct letters with an optional leading ..."
                )
        self.contracted = sorted(set("".join(self.operands).replace(".", "")) - set(out))

    def swapped(self, i: int) -> Einsum:
        """The same contraction with operand ``i``'s last two letters swapped (a transpose flag)."""
        terms = list(self.operands)
        t = terms[i]
        terms[i] = t[:-2] + t[-1] + t[-2]
        return Einsum(",".join(terms) + "->" + self.out)

    def _letters(self, metas: Sequence[Any]) -> tuple[int, list[list[str]]]:
        """Batch rank and, per operand, one label per dim ("0", "1"... for the broadcast dims)."""
        extras = []
        for t, m in zip(self.operands, metas):
            extra = m.ndim - len(t.replace("...", ""))
            if extra < 0 or (extra and not t.startswith("...")):
                raise OpError(f"einsum {self.text}: operand {describe(m)} has too few dims")
            extras.append(extra)
        nb = max(extras, default=0)
        cores = [t.replace("...", "") for t in self.operands]
        return nb, [[str(nb - e + k) for k in range(e)] + list(c) for c, e in zip(cores, extras)]

    def meta(self, name: str, *metas: Any, flags: str = "") -> Meta:
        """The output Meta: operands of one dtype, each letter one size ("inner dims differ (3 vs
        4{flags})" otherwise), the batch dims broadcast."""
        same_dtype(name, *metas)
        _, labels = self._letters(metas)
        sizes: dict[str, Any] = {}
        for lab, m in zip(labels, metas):
            for letter, d in zip(lab, m.shape):
                if letter.isdigit():
                    continue
                have = sizes.get(letter)
                if have is not None and sym.canonical(have) != sym.canonical(d):
                    raise OpError(f"{name}: inner dims differ ({have} vs {d}{flags})", *metas)
                sizes[letter] = d
        batch = broadcast_shapes(
            name,
            *[
                Meta([d for letter, d in zip(lab, m.shape) if letter.isdigit()], m.dtype)
                for lab, m in zip(labels, metas)
            ],
        )
        return Meta(tuple(batch) + tuple(sizes[c] for c in self.out.replace("...", "")), metas[0].dtype)

    def strategies(self, ctx: Ctx, metas: Sequence[Any] | None = None) -> list[Strategy]:
        metas = list(ctx.metas if metas is None else metas)
        nb, labels = self._letters(metas)
        out_labels = [str(k) for k in range(nb)] + list(self.out.replace("...", ""))
        groups = []
        for j, letter in enumerate(out_labels):
            ins = []
            for lab, m in zip(labels, metas):
                d = lab.index(letter) if letter in lab else None
                if (
                    d is not None
                    and letter.isdigit()
                    and m.shape[d] == 1
                    and _batch_size(metas, labels, letter) != 1
                ):
                    d = None  # a broadcast batch dim stays replicated
                ins.append(d)
            groups.append((ins, (j,)))
        parts = [([Shard(lab.index(c)) for lab in labels], (Partial("sum"),)) for c in self.contracted]
        parts += one_partial([R] * len(metas), range(len(metas)))  # one Partial factor, the others R
        return dim_map(Ctx(ctx.mesh_shape, ctx.dim, metas, ctx.placements, ctx.attrs), groups, parts)


def _batch_size(metas, labels, letter):
    sizes = [m.shape[lab.index(letter)] for lab, m in zip(labels, metas) if letter in lab]
    return max((s for s in sizes if isinstance(s, int)), default=None)


def with_bias(strategies: list[Strategy], present: bool, out_ndim: int) -> list[Strategy]:
    """Strategies of ``contraction + bias`` (bias ``[n]`` on the output's last dim): the bias is
    sharded with that dim, replicated otherwise, and Partial with a Partial output (R -> P keeps it on
    one rank, so it is added once)."""
    out = []
    for s in strategies:
        o = s.outputs[0]
        if not present:
            b: Placement | None = None
        elif isinstance(o, Partial):
            b = o
        else:
            b = Shard(0) if o == Shard(out_ndim - 1) else R
        out.append(Strategy(s.inputs + (b,), s.outputs, s.local))
    return out


def contraction(einsum_of: Callable[[dict], Einsum], bias: int | None = None) -> Rule:
    """Rule of a contraction given by an einsum (a function of the attributes: transpose flags
    swap letters), optionally plus a bias on the output's last dim (input ``bias``)."""

    def strategies(ctx: Ctx) -> list[Strategy]:
        e = einsum_of(ctx.attrs)
        if bias is None:
            return e.strategies(ctx)
        metas = ctx.metas[:bias]
        out_ndim = e.meta("spmd", *metas).ndim
        return with_bias(e.strategies(ctx, metas), ctx.metas[bias] is not None, out_ndim)

    return Rule(strategies, doc="contraction (einsum)")


# ---- reshape -------------------------------------------------------------------------------------


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Consecutive dims of shapes ``a`` and ``b`` grouped so each group holds the same elements:
    ``(4, 6) -> (2, 2, 6)`` gives ``[([0], [0, 1]), ([1], [2])]``."""
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        while True:
            if pa <= pb and i < len(a) and (not gi or pa != pb or a[i] == 1):
                pa *= a[i]
                gi.append(i)
                i += 1
            elif j < len(b) and (pb < pa or not gj or b[j] == 1):
                pb *= b[j]
                gj.append(j)
                j += 1
            else:
                break
            if pa == pb and (i == len(a) or a[i] != 1) and (j == len(b) or b[j] != 1):
                break
        groups.append((gi, gj))
    return groups


def _reshape(ctx: Ctx) -> list[Strategy]:
    x = ctx.metas[0]
    src = [d for d in x.shape]
    dst = list(reshape_out(x, ctx.attrs["shape"]))
    groups = []
    if all(isinstance(d, int) for d in src + dst):
        for gi, gj in reshape_groups(src, dst):
            i0 = next((i for i in gi if src[i] != 1), None)
            j0 = next((j for j in gj if dst[j] != 1), None)
            if i0 is None or j0 is None or not ctx.even(0, i0):
                continue
            # the first output dim of the group splits as the first input dim does
            if dst[j0] % (ctx.n * ctx.outer(0, i0)) == 0:
                groups.append(((i0,), (j0,)))
    parts = [((Partial(op),), (Partial(op),)) for op in _LINEAR_OPS]
    return dim_map(ctx, groups, parts)


def reshape_out(x: Any, shape: Sequence[Any]) -> tuple:
    """``shape`` with its -1 resolved against ``x``."""
    if -1 not in shape:
        return tuple(shape)
    known = 1
    for d in shape:
        if d != -1:
            known = sym.mul(known, d)
    rest = sym.div(sym.product(x.shape), known)
    return tuple(rest if d == -1 else d for d in shape)


RESHAPE = Rule(
    _reshape, shape_attr="shape", doc="reshape: the first dim of each group of dims keeps its sharding"
)


def _reshard(ctx: Ctx) -> list[Strategy]:
    return [Strategy((ANY,), (ctx.attrs["placements"][ctx.dim],))]


# reshard only moves data: the distributed world and the propagation pass recognise this rule and
# move the value themselves.
RESHARD = Rule(_reshard, doc="changes the layout: the caller moves the data")


def dense(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with Partial ones made Replicate: where a gradient of a value so laid out goes
    (the gradient of a sum of the ranks' values is the same on every rank)."""
    return tuple(R if isinstance(p, Partial) else p for p in placements)


def _reshard_like(ctx: Ctx) -> list[Strategy]:
    (want,) = dense((ctx.cur(1),))
    return [Strategy((want, ANY), (want,))]


# reshard_like(x, like): x takes like's layout (reshard's gradient); an op like any other on one mesh
RESHARD_LIKE = Rule(_reshard_like, shape_only=(1,), doc="x laid out as like is (Partial as Replicate)")
