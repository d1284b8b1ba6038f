"""Inference ops: the paged KV cache as program state, and batch-invariant contractions.

The inference engine (``llmkit.infer``) keeps keys and values of every running sequence in one
*pool* per model: ``pool[layer, 0 | 1, block, offset, kv_head, head_dim]`` (0 = keys, 1 = values).
A sequence owns a list of fixed-size blocks (its *block table*); token position ``p`` lives in
slot ``block_table[p // BS] * BS + p % BS``. Three ops make that a program:

- ``paged_kv_write(pool, k, v, slots)`` stores this step's keys/values into their slots. With
  ``inplace=True`` the kernel writes into ``pool`` itself and returns it (trait
  ``inplace_input0``): the program must treat the pool it passes in as *donated*, i.e. never read
  that value again after the op (the engine threads one pool value from layer to layer and returns
  the last). Copying the pool every step would cost more than the step.
- ``paged_attention(q, pool, block_tables, kv_len, q_start, q_len)`` attends each *segment* (a run
  of query tokens of one sequence) to that sequence's first ``kv_len`` keys, causally, computing
  every segment on its own so that its result never depends on the other segments of the batch.
- ``tiled_linear(x, w, b, rows)`` is ``linear`` computed in BLAS calls of exactly ``rows`` rows:
  a row's result then never depends on how many rows the batch has (BLAS picks different kernels,
  with different summation orders, for different matrix sizes). The engine rewrites its programs'
  ``linear`` ops into it; see docs/serve.md ("Batch invariance"). ``transposed=True`` takes the
  weight as ``[in, out]``, the layout BLAS reads fastest (the engine stores weights that way).

They and ``tiled_linear_swiglu`` are the engine's ops (``engine_op``: traits ``inference`` and
``internal``): none has a decomposition (the compiler must keep their kernels, which carry the
guarantees above), and each has a hand-written C kernel that the engine's compiled programs run
(``compiler/native/paged.py``, ``linear.py``). ``tiled_linear`` and ``paged_attention`` have
gradient rules (``paged_attention_grad``: each segment's attention backward, the keys' and values'
gradients added into a pool-shaped gradient): RLHF's trainer differentiates a forward that runs
these kernels, so that its log-probs are the engine's bit for bit (``llmkit.rlhf.policy``).

int8 pools (the engine's ``kv_dtype="int8"``): the keys and values are stored as int8 codes with one
float32 scale per (token, kv head) row, the row's last 4 bytes (``pool[..., D + 4]`` int8):
``paged_kv_write`` quantizes each row on its own (:func:`quantize_kv`), ``paged_attention`` reads
the dequantized rows (:func:`dequantize_kv`); a token's stored bits depend on its own row only, so
batch invariance holds. Queries, keys and values given to the ops stay float32.

SPMD (tensor-parallel serving): the kv heads shard with the query heads that share them (when
both split evenly), and the tiled products shard like ``linear`` (batch rows, output features, or
the inner dim into a Partial sum; the swiglu pair only by output features). The rest is
replicated.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..dispatch import O
from ..opspec import A, Kind, Meta, OpError, attr, defop, describe, get, optional, same_dtype
from . import spmd as P
from .contraction import _flat, _linear_meta, _linear_vjp, mm
from .indexed import _add_at


def _known_differ(a: sym.Dim, b: sym.Dim) -> bool:
    """Two dims provably different (symbolic dims are checked when the program runs)."""
    return isinstance(a, int) and isinstance(b, int) and a != b


def _check_int(name: str, what: str, x, ndim: int) -> None:
    if not B.is_integer(x.dtype) or x.ndim != ndim:
        raise OpError(f"{name}: {what} must be a {ndim}-D integer tensor, got {describe(x)}")


KV_SCALE_BYTES = 4  # an int8 pool's row: head_dim int8 codes, then the row's float32 scale


def is_int8_pool(pool) -> bool:
    return B.dtype(pool.dtype) == np.int8


def kv_head_dim(pool) -> sym.Dim:
    """The head dim of a pool's rows (an int8 pool's rows end with their scale's bytes)."""
    return sym.add(pool.shape[5], -KV_SCALE_BYTES) if is_int8_pool(pool) else pool.shape[5]


def quantize_kv(xp, x):
    """Float32 rows [..., D] as an int8 pool's rows [..., D + 4]: codes q = rint(x / s) (ties to
    even) with s = max|x| / 127 in float32 (q = 0 where s is 0 or not finite), then s's bytes."""
    s = (xp.abs(x).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    ok = (s > 0) & (s < np.inf)
    q = xp.clip(xp.where(ok, xp.rint(x / xp.where(ok, s, 1)), 0), -127, 127).astype(np.int8)
    return xp.concatenate([q, s.view(np.int8)], axis=-1)


def dequantize_kv(xp, rows):
    """An int8 pool's rows [..., D + 4] as float32 [..., D]: code * scale."""
    return rows[..., :-KV_SCALE_BYTES].astype(np.float32) * xp.ascontiguousarray(
        rows[..., -KV_SCALE_BYTES:]
    ).view(np.float32)


def _check_kv(name: str, pool, *xs) -> None:
    """The float tensors an op stores in or reads with ``pool``: its dtype, or float32 for an int8 pool."""
    if not is_int8_pool(pool):
        same_dtype(name, pool, *xs)
    elif any(B.dtype(x.dtype) != np.float32 for x in xs):
        raise OpError(f"{name}: an int8 pool stores and attends float32 tensors", pool, *xs)


def _check_pool(name: str, pool, layer: int) -> None:
    if not (B.is_floating(pool.dtype) or is_int8_pool(pool)) or pool.ndim != 6:
        raise OpError(
            f"{name}: pool must be a floating (or int8) [layers, 2, blocks, block_size, kv_heads, "
            f"head_dim] tensor, got {describe(pool)}"
        )
    if _known_differ(pool.shape[1], 2):
        raise OpError(f"{name}: pool axis 1 holds keys and values and must have size 2, got {describe(pool)}")
    if isinstance(pool.shape[0], int) and not 0 <= layer < pool.shape[0]:
        raise OpError(f"{name}: layer {layer} is out of range for a pool of {pool.shape[0]} layers")


def _host(x) -> np.ndarray:
    return x if type(x) is np.ndarray else B.to_numpy(x)


def engine_op(name, inputs, attrs, infer_meta, kernel, doc, *, traits=(), **kw):
    """An op of the inference engine's programs: opaque, ``inference`` (a hand-written kernel keeps
    its contract) and ``internal`` (programs use it, users do not)."""
    traits = {"inference", "internal", *traits}
    return defop(name, Kind.OPAQUE, inputs=inputs, attrs=attrs, infer_meta=infer_meta, kernel=kernel,
                 traits=traits, doc=doc, **kw)  # fmt: skip


def _kv_heads_spmd(pool: int, heads: tuple, out: int | tuple[int, ...]):
    """Shard the pool's kv heads (dim 4) with the heads dim of the tensors at ``heads`` ((input,
    dim) pairs), the output's dim ``out`` (one per output); everything else replicated."""
    outs = out if isinstance(out, tuple) else (out,)

    def strategies(ctx):
        groups = []
        if ctx.even(pool, 4) and all(ctx.even(i, d) for i, d in heads):
            ins = [None] * len(ctx.metas)
            ins[pool] = 4
            for i, d in heads:
                ins[i] = d
            groups.append((ins, outs))
        if not groups:  # all replicated (dim_map counts the outputs from a group's)
            groups.append(([None] * len(ctx.metas), (None,) * len(outs)))
        return P.dim_map(ctx, groups)

    return strategies


_LAYER = attr("layer", A.INT, 0, lambda v: None if v >= 0 else "must be >= 0")


# ---- paged_kv_write -----------------------------------------------------------------------------


def _write_meta(pool, k, v, slots, layer=0, inplace=False):
    _check_pool("paged_kv_write", pool, layer)
    _check_kv("paged_kv_write", pool, k, v)
    if k.ndim != 4 or tuple(k.shape) != tuple(v.shape):
        raise OpError("paged_kv_write: k and v must both be [batch, kv_heads, seq, head_dim]", k, v)
    if _known_differ(k.shape[1], pool.shape[4]) or _known_differ(k.shape[3], kv_head_dim(pool)):
        raise OpError("paged_kv_write: k/v heads and head dim must match the pool's", pool, k)
    _check_int("paged_kv_write", "slots", slots, 1)
    n = sym.mul(k.shape[0], k.shape[2])
    if _known_differ(n, slots.shape[0]):
        raise OpError("paged_kv_write: slots needs one entry per token (batch * seq)", k, slots)
    return Meta(pool.shape, pool.dtype)


def _write_kernel(xp, pool, k, v, slots, layer=0, inplace=False):
    out = pool if inplace and pool.flags.c_contiguous else xp.ascontiguousarray(pool).copy()
    nb, bs, h, d = pool.shape[2:]
    q8 = is_int8_pool(pool)
    idx = _host(slots)
    lo, hi = (int(idx.min()), int(idx.max())) if idx.size else (0, 0)
    if hi >= nb * bs:
        raise OpError(f"paged_kv_write: slot {hi} is out of range for a pool of {nb * bs} slots")
    keep = None if lo >= 0 else idx >= 0  # -1 marks a token not to store
    if keep is not None:
        idx = idx[keep]
    flat = out[layer].reshape(2, nb * bs, h, d)  # a view of the pool (it is C-contiguous)
    for j, x in ((0, k), (1, v)):
        rows = x.transpose(0, 2, 1, 3).reshape(-1, h, x.shape[3])  # (B*S, H, D), token-major
        rows = rows if keep is None else rows[keep]
        flat[j, idx] = quantize_kv(xp, rows) if q8 else rows
    return out


engine_op(
    "paged_kv_write",
    ("pool", "k", "v", "slots"),
    [_LAYER, attr("inplace", A.BOOL, False)],
    _write_meta,
    _write_kernel,
    traits={"inplace_input0"},
    spmd=P.Rule(_kv_heads_spmd(pool=0, heads=((1, 1), (2, 1)), out=4)),
    doc="The pool with this step's keys/values stored: k, v [B, Hkv, S, D] go to pool[layer, 0/1] at "
    "flat slots [B*S] (block * block_size + offset; -1 = do not store). With inplace=True the kernel "
    "writes into the pool it is given and returns it: the caller donates that value.",
)


# ---- paged_attention ----------------------------------------------------------------------------


def _attn_meta(q, pool, block_tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    _check_pool("paged_attention", pool, layer)
    _check_kv("paged_attention", pool, q)
    if q.ndim != 4:
        raise OpError("paged_attention: q must be [batch, heads, seq, head_dim]", q)
    hq, hk = q.shape[1], pool.shape[4]
    if isinstance(hq, int) and isinstance(hk, int) and hq % hk:
        raise OpError("paged_attention: q heads must be a multiple of the pool's kv heads", q, pool)
    if _known_differ(q.shape[3], kv_head_dim(pool)):
        raise OpError("paged_attention: q head dim must match the pool's", q, pool)
    _check_int("paged_attention", "block_tables", block_tables, 2)
    _check_int("paged_attention", "kv_len", kv_len, 1)
    segs = [block_tables.shape[0], kv_len.shape[0]]
    if (q_start is None) != (q_len is None):
        raise OpError("paged_attention: give both q_start and q_len, or neither (one token per segment)")
    if q_start is not None:
        _check_int("paged_attention", "q_start", q_start, 1)
        _check_int("paged_attention", "q_len", q_len, 1)
        segs += [q_start.shape[0], q_len.shape[0]]
    else:
        segs.append(sym.mul(q.shape[0], q.shape[2]))
    if any(_known_differ(s, segs[0]) for s in segs):
        raise OpError(
            "paged_attention: block_tables, kv_len (and q_start, q_len) need one row per segment "
            "(without q_start/q_len every token is a segment)",
            q,
            block_tables,
            kv_len,
        )
    return Meta(q.shape, q.dtype)


def _attn_groups(q, pool, block_tables, kv_len, q_start, q_len):
    """Segments checked and grouped by (q_len, kv_len): ``(tables, starts, groups)``, groups mapping
    sizes to member segments. Segments of equal sizes are computed together: each still gets its
    own BLAS calls and reductions of its own sizes (stacked matmul slices, last-axis reductions), so
    its result is the same as alone (batch invariance)."""
    b, _, s, _ = q.shape
    n = b * s
    tables = _host(block_tables)
    lens = _host(kv_len).tolist()
    starts = list(range(n)) if q_start is None else _host(q_start).tolist()
    counts = [1] * n if q_len is None else _host(q_len).tolist()
    if not len(lens) == len(counts) == len(starts) == tables.shape[0]:
        raise OpError(
            f"paged_attention: {tables.shape[0]} block tables and {len(lens)} kv lengths for "
            f"{len(counts)} segments (without q_start/q_len, one per query token)"
        )
    bs = pool.shape[3]
    groups: dict[tuple[int, int], list[int]] = {}
    covered = np.zeros(n, bool)
    for i, (m, t, st) in enumerate(zip(counts, lens, starts)):
        if m == 0:
            continue
        fits = 0 < m <= t and -(-t // bs) <= tables.shape[1]
        if not (fits and st >= 0 and st + m <= n and st // s == (st + m - 1) // s):
            raise OpError(
                f"paged_attention: segment {i} (q_start={st}, q_len={m}, kv_len={t}) must have "
                f"q_len <= kv_len, lie within one row of the {b}x{s} query tokens, and fit its "
                f"{tables.shape[1]}-block table"
            )
        if covered[st : st + m].any():
            raise OpError(f"paged_attention: segment {i} (q_start={st}, q_len={m}) overlaps an earlier one")
        covered[st : st + m] = True
        groups.setdefault((m, t), []).append(i)
    return tables, starts, groups


def _attn_group(xp, qt, pool, tables, starts, m, t, members, layer, scale):
    """One group of C segments of m queries over t keys: (rows of qt, blocks, keys, values
    [C, T, Hkv, D], stacked queries [C, Hkv, G*M, D], probabilities [C, Hkv, G*M, T])."""
    bs, hk, d = pool.shape[3], pool.shape[4], qt.shape[2]
    c, nblk, g = len(members), -(-t // bs), qt.shape[1] // hk
    if c == 1:  # (the common case in serving: a slice instead of an index array)
        i = members[0]
        blocks = tables[i : i + 1, :nblk]
        rows = slice(starts[i], starts[i] + m)
    else:
        idx = np.asarray(members)
        blocks = tables[idx, :nblk]
        rows = (np.asarray(starts)[idx][:, None] + np.arange(m)).reshape(-1)  # (C*M,)
    kv = pool[layer]  # (2, NB, BS, Hkv, D)
    # Gathering along the pool's first axis gives contiguous copies: (C, T, Hkv, D) each.
    keys, values = (kv[j][blocks].reshape(c, -1, hk, kv.shape[-1])[:, :t] for j in (0, 1))
    if is_int8_pool(pool):  # (the blocks read only)
        keys, values = dequantize_kv(xp, keys), dequantize_kv(xp, values)
    # Query heads sharing a kv head are stacked as rows: (C, Hkv, G*M, D), row = (group, token).
    qs = qt[rows].reshape(c, m, hk, g, d).transpose(0, 2, 3, 1, 4).reshape(c, hk, g * m, d)
    scores = xp.matmul(qs, keys.transpose(0, 2, 3, 1))  # (C, Hkv, G*M, T)
    scores *= scale
    if m > 1:  # causal, bottom-right aligned: query i sits at position t - m + i
        scores = scores.reshape(c, hk, g, m, t)
        scores = xp.where(xp.tri(m, t, t - m, dtype=bool), scores, -xp.inf).reshape(c, hk, g * m, t)
    scores -= scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores, out=scores)
    p /= p.sum(axis=-1, keepdims=True)
    return rows, blocks, keys, values, qs, p


def _token_major(q):
    b, hq, s, d = q.shape
    return q.transpose(0, 2, 1, 3).reshape(b * s, hq, d)  # (N, Hq, D)


def _head_major(x, like):
    b, hq, s, d = like.shape
    return x.reshape(b, s, hq, d).transpose(0, 2, 1, 3)  # (B, Hq, S, D)


def _attn_kernel(xp, q, pool, block_tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    tables, starts, groups = _attn_groups(q, pool, block_tables, kv_len, q_start, q_len)
    qt = _token_major(q)
    out = xp.zeros_like(qt)
    hk, g, d = pool.shape[4], q.shape[1] // pool.shape[4], q.shape[3]
    for (m, t), members in groups.items():
        rows, _, _, values, _, p = _attn_group(xp, qt, pool, tables, starts, m, t, members, layer, scale)
        o = xp.matmul(p, values.transpose(0, 2, 1, 3))  # (C, Hkv, G*M, D)
        out[rows] = o.reshape(-1, hk, g, m, d).transpose(0, 3, 1, 2, 4).reshape(-1, hk * g, d)
    return _head_major(out, q)


def _attn_vjp(g, out, q, pool, block_tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    dq, dpool = O.paged_attention_grad(
        g, q, pool, block_tables, kv_len, q_start, q_len, layer=layer, scale=scale
    )
    return dq, dpool, None, None, None, None


def _attn_grad_meta(g, q, pool, block_tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    _attn_meta(q, pool, block_tables, kv_len, q_start, q_len, layer, scale)
    if is_int8_pool(pool):
        raise OpError("paged_attention_grad: no gradient through an int8 pool", pool)
    if tuple(g.shape) != tuple(q.shape) or g.dtype != q.dtype:
        raise OpError("paged_attention_grad: g must be [B, Hq, S, D] like q", g, q)
    return Meta(q.shape, q.dtype), Meta(pool.shape, pool.dtype)


def _attn_grad_kernel(xp, g, q, pool, block_tables, kv_len, q_start=None, q_len=None, layer=0, scale=None):
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    tables, starts, groups = _attn_groups(q, pool, block_tables, kv_len, q_start, q_len)
    qt, gt = _token_major(q), _token_major(g)
    dq = xp.zeros_like(qt)
    # C-contiguous whatever the pool's strides (zeros_like keeps a transposed pool's): the reshape
    # below must be a view for add.at to write into dpool (the trainer's pool is a transposed k, v)
    dpool = xp.zeros(pool.shape, pool.dtype)
    bs, hk, d = pool.shape[3], pool.shape[4], pool.shape[5]
    grp = q.shape[1] // hk
    flat = dpool[layer].reshape(2, -1, hk, d)  # a view: (2, NB*BS, Hkv, D)
    for (m, t), members in groups.items():
        rows, blocks, keys, values, qs, p = _attn_group(
            xp, qt, pool, tables, starts, m, t, members, layer, scale
        )
        c = len(members)
        gs = gt[rows].reshape(c, m, hk, grp, d).transpose(0, 2, 3, 1, 4).reshape(c, hk, grp * m, d)
        dp = xp.matmul(gs, values.transpose(0, 2, 3, 1))  # (C, Hkv, G*M, T)
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))  # d(scores before scaling) * 1
        dqs = xp.matmul(ds, keys.transpose(0, 2, 1, 3)) * scale  # (C, Hkv, G*M, D)
        dq[rows] = dqs.reshape(c, hk, grp, m, d).transpose(0, 3, 1, 2, 4).reshape(-1, hk * grp, d)
        dk = xp.matmul(ds.transpose(0, 1, 3, 2), qs) * scale  # (C, Hkv, T, D)
        dv = xp.matmul(p.transpose(0, 1, 3, 2), gs)
        pos = np.arange(t)
        slots = (blocks[:, pos // bs] * bs + pos % bs).reshape(-1)  # (C*T,) where each key lives
        for j, dx in ((0, dk), (1, dv)):  # (numpy's add.at, cupyx's scatter_add on the GPU)
            _add_at(xp, flat[j], xp.asarray(slots), dx.transpose(0, 2, 1, 3).reshape(-1, hk, d))
    return _head_major(dq, q), dpool


engine_op(
    "paged_attention",
    ("q", "pool", "block_tables", "kv_len", "q_start?", "q_len?"),
    [_LAYER, attr("scale", optional(A.FLOAT), None)],
    _attn_meta,
    _attn_kernel,
    nondiff={2, 3, 4, 5},
    vjp=_attn_vjp,
    spmd=P.Rule(_kv_heads_spmd(pool=1, heads=((0, 1),), out=1)),
    doc="Causal attention of q [B, Hq, S, D] against a paged KV pool, segment by segment. Segment i is the "
    "query tokens [q_start[i], q_start[i] + q_len[i]) of the flattened B*S tokens (one row of B); its "
    "keys are positions 0 .. kv_len[i]-1 of the sequence whose blocks are block_tables[i], and its "
    "queries are the last q_len[i] of those positions. Without q_start/q_len every token is a "
    "segment (decode). Tokens in no segment get zeros. Grouped-query heads as in "
    "scaled_dot_product_attention; scale defaults to 1/sqrt(D).",
)


defop(  # the training side's backward (internal, not an engine op: no hand-written kernel)
    "paged_attention_grad",
    Kind.OPAQUE,
    inputs=("g", "q", "pool", "block_tables", "kv_len", "q_start?", "q_len?"),
    attrs=[_LAYER, attr("scale", optional(A.FLOAT), None)],
    infer_meta=_attn_grad_meta,
    kernel=_attn_grad_kernel,
    multi_output=True,
    traits={"internal"},
    spmd=P.Rule(_kv_heads_spmd(pool=2, heads=((0, 1), (1, 1)), out=(1, 4))),
    doc="(dq, dpool) of out = paged_attention(q, pool, ...) for the output gradient g: per segment, "
    "with P its probabilities and dS = P * (g V^T - rowsum(P * g V^T)), dq = dS K * scale, and the "
    "keys' dS^T q * scale and values' P^T g added into dpool at their slots (zero elsewhere).",
)


# ---- tiled_linear -------------------------------------------------------------------------------


PANEL = 16  # output columns per panel of a packed tiled_linear weight (the C kernel's register tile)


def pack_panels(w: np.ndarray) -> np.ndarray:
    """An ``[in, out]`` weight as ``tiled_linear``'s panels (``panel=16``): ``[out / 16, in, 16]``,
    ``p[j, k, c] = w[k, 16 j + c]``. A panel is what the C kernel's register tile reads, contiguous."""
    k, n = w.shape
    if n % PANEL:
        raise ValueError(f"pack_panels: out_features {n} is not a multiple of {PANEL}")
    return B.xp_of(w).ascontiguousarray(w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2))


def _unpanel(weight):
    """The ``[in, out]`` matrix a packed weight stands for (a view where the backend allows)."""
    return weight.transpose(1, 0, 2).reshape(weight.shape[1], weight.shape[0] * weight.shape[2])


def _tiled_meta(x, weight, bias=None, rows=8, transposed=False, panel=0, op="tiled_linear"):
    if panel:
        if weight.ndim != 3 or weight.shape[2] != panel:
            msg = f"{op}: a panel={panel} weight must be [out/{panel}, in, {panel}]"
            raise OpError(msg, x, weight)
        weight = Meta((sym.mul(weight.shape[0], panel), weight.shape[1]), weight.dtype)
    elif transposed and weight.ndim == 2:  # given as [in, out]: check it as the [out, in] it stands for
        weight = Meta((weight.shape[1], weight.shape[0]), weight.dtype)
    return _linear_meta(x, weight, bias)


def _tiled_kernel(xp, x, weight, bias=None, rows=8, transposed=False, panel=0):
    # (in, out); a contiguous one is BLAS's fast layout (panels are copied back to it: slow, but only
    # programs whose executor runs the C kernel get packed weights)
    wt = xp.ascontiguousarray(_unpanel(weight)) if panel else weight if transposed else weight.T
    k, n_out = x.shape[-1], wt.shape[1]
    m = math.prod(x.shape[:-1])
    x2 = x.reshape(m, k)
    pad = -m % rows
    if pad:
        x2 = xp.concatenate([x2, xp.zeros((pad, k), x2.dtype)])
    # numpy runs a stacked matmul as one BLAS call per [rows, K] matrix: the tiles never merge.
    out = mm(xp, x2.reshape((m + pad) // rows, rows, k), wt).reshape(m + pad, n_out)[:m]
    if bias is not None:
        out = out + bias
    return out.reshape(x.shape[:-1] + (n_out,))


def _tiled_vjp(g, out, x, weight, bias=None, rows=8, transposed=False, panel=0):
    if not (transposed or panel):
        return _linear_vjp(g, out, x, weight, bias)
    if panel:  # the weight's gradient comes back in the weight's own (packed) layout
        n, k = weight.shape[0] * panel, weight.shape[1]
        wt = O.reshape(O.transpose(weight, [1, 0, 2]), [k, n])
        dw = lambda: O.matmul(_flat(x), _flat(g), transpose_x=True)
        return (
            lambda: O.matmul(g, wt, transpose_y=True),
            lambda: O.transpose(O.reshape(dw(), [k, n // panel, panel]), [1, 0, 2]),
            None if bias is None else g,
        )
    return (
        lambda: O.matmul(g, weight, transpose_y=True),  # weight is [in, out]
        lambda: O.matmul(_flat(x), _flat(g), transpose_x=True),  # (in, out)
        None if bias is None else g,
    )


def _tiled_strategies(ctx, swiglu):
    """tiled_linear(x, w, b) / tiled_linear_swiglu(x, w_gate, w_up) as ``...k,nk->...n``: batch rows,
    output features (the weight's out dim: 0, or 1 when transposed, 0 of the panels: a whole number
    of panels per rank) or, for tiled_linear, the inner dim (a Partial sum, the bias on one rank)."""
    x = ctx.metas[0]
    transposed, panel = ctx.attrs["transposed"], ctx.attrs["panel"]
    out_dim, in_dim = (0, 1) if panel else ((1, 0) if transposed else (0, 1))
    nd = x.ndim
    weights = (1, 2) if swiglu else (1,)
    groups = [((d,) + (None,) * (len(ctx.metas) - 1), (d,)) for d in range(nd - 1)]
    feat = [None] * len(ctx.metas)
    for w in weights:
        feat[w] = out_dim
    if not swiglu and ctx.metas[2] is not None:
        feat[2] = 0
    if not panel or ctx.even(1, 0):
        groups.append((feat, (nd - 1,)))
    parts = []
    if not swiglu:
        bias = [] if ctx.metas[2] is None else [P.Partial("sum")]
        parts.append(((P.Shard(nd - 1), P.Shard(in_dim), *bias), (P.Partial("sum"),)))
    return P.dim_map(ctx, groups, parts)


_TILED_ATTRS = [  # the weight layout attributes of tiled_linear and tiled_linear_swiglu
    attr("rows", A.INT, 8, lambda v: None if v >= 1 else "must be >= 1"),
    attr("transposed", A.BOOL, False),
    attr("panel", A.INT, 0, lambda v: None if v in (0, PANEL) else f"must be 0 or {PANEL}"),
]


engine_op(
    "tiled_linear",
    ("x", "weight", "bias?"),
    _TILED_ATTRS,
    _tiled_meta,
    _tiled_kernel,
    vjp=_tiled_vjp,
    spmd=P.Rule(lambda ctx: _tiled_strategies(ctx, swiglu=False)),
    doc="x @ weight.T + bias (as linear), computed in matrix products of exactly `rows` rows (the last "
    "zero-padded), so each row's result is independent of the number of rows: batch invariance (the "
    "C kernel computes each row alone, whatever `rows`). "
    "transposed=True takes the weight as [in_features, out_features] (BLAS's fast layout); "
    "panel=16 as [out_features / 16, in_features, 16] (pack_panels: the C kernel's layout).",
)


# ---- tiled_linear_swiglu --------------------------------------------------------------------------


def _tls_meta(x, w_gate, w_up, rows=8, transposed=False, panel=0):
    if tuple(w_gate.shape) != tuple(w_up.shape) or w_gate.dtype != w_up.dtype:
        raise OpError(
            "tiled_linear_swiglu: the gate and up weights must have one shape and dtype", w_gate, w_up
        )
    return _tiled_meta(x, w_gate, None, rows, transposed, panel, op="tiled_linear_swiglu")


def _tls_kernel(xp, x, w_gate, w_up, rows=8, transposed=False, panel=0):
    a = _tiled_kernel(xp, x, w_gate, None, rows, transposed, panel)
    b = _tiled_kernel(xp, x, w_up, None, rows, transposed, panel)
    return get("swiglu").kernel(xp, a, b)


def _tls_vjp(g, out, x, w_gate, w_up, rows=8, transposed=False, panel=0):
    kw = dict(rows=rows, transposed=transposed, panel=panel)
    a, b = O.tiled_linear(x, w_gate, **kw), O.tiled_linear(x, w_up, **kw)
    da, db = get("swiglu").vjp(g, None, a, b)
    ga, gb = _tiled_vjp(da, a, x, w_gate, None, **kw), _tiled_vjp(db, b, x, w_up, None, **kw)
    return (lambda: ga[0]() + gb[0](), ga[1], gb[1])


engine_op(
    "tiled_linear_swiglu",
    ("x", "w_gate", "w_up"),
    _TILED_ATTRS,
    _tls_meta,
    _tls_kernel,
    vjp=_tls_vjp,
    spmd=P.Rule(lambda ctx: _tiled_strategies(ctx, swiglu=True)),
    doc="swiglu(tiled_linear(x, w_gate), tiled_linear(x, w_up)) as one op (the engine's MLP with "
    "both weights in panels: each thread finishes its own columns; the products are never stored). "
    "Weights and attributes as tiled_linear's, no bias.",
)


# ---- tiled_linear_logprobs ------------------------------------------------------------------------


def _tll_meta(x, weight, targets, logit_rows, k=5, rows=8, transposed=False, panel=0):
    if x.ndim != 2:
        raise OpError(f"tiled_linear_logprobs: x must be [N, in_features], got {describe(x)}", x)
    _check_int("tiled_linear_logprobs", "targets", targets, 1)
    _check_int("tiled_linear_logprobs", "logit_rows", logit_rows, 1)
    z = _tiled_meta(x, weight, None, rows, transposed, panel, op="tiled_linear_logprobs")
    n, v = z.shape
    if _known_differ(targets.shape[0], n):
        raise OpError("tiled_linear_logprobs: targets must have one id per row of x", x, targets)
    if isinstance(v, int) and not 0 < k <= v:
        raise OpError(f"tiled_linear_logprobs: k={k} is out of range for {v} output features")
    f64 = B.DTYPES["float64"]
    return (
        Meta((logit_rows.shape[0], v), z.dtype),
        Meta((n,), f64),
        Meta((n, k), f64),
        Meta((n, k), B.DTYPES["int64"]),
    )


def _tll_kernel(xp, x, weight, targets, logit_rows, k=5, rows=8, transposed=False, panel=0):
    z = _tiled_kernel(xp, x, weight, None, rows, transposed, panel)  # (N, V)
    lse = get("logsumexp").kernel(xp, z.astype("float64"), axis=-1, keepdim=True)
    top, ids = get("topk").kernel(xp, z, k)
    picked = get("gather").kernel(xp, z, targets.reshape(-1, 1), axis=-1)
    f64 = lambda a: a.astype("float64")
    logits = get("index_select").kernel(xp, z, logit_rows)
    return logits, (f64(picked) - lse).reshape(-1), f64(top) - lse, ids


engine_op(
    "tiled_linear_logprobs",
    ("x", "weight", "targets", "logit_rows"),
    [attr("k", A.INT, 5, lambda v: None if v >= 1 else "must be >= 1"), *_TILED_ATTRS],
    _tll_meta,
    _tll_kernel,
    multi_output=True,
    spmd=P.Rule(
        lambda ctx: P.dim_map(ctx, [([None] * 4, (None,) * 4)]), reason="whole rows of the vocabulary"
    ),
    doc="The score program's LM head: z = tiled_linear(x, weight) [N, V] (same attributes), and with "
    "lse = logsumexp(z) in float64 per row: (z[logit_rows] [R, V], z[i, targets[i]] - lse [N], the "
    "k largest z of each row (first index wins ties) - lse [N, k] in float64, their ids [N, k]). "
    "The C kernel never forms z whole: a block of columns at a time, reduced while in cache.",
)
