"""Composite neural-network ops: softmax, normalization, losses, rotary embeddings, attention.

Each has a fast reference kernel and a ``decompose`` into primitives (what the compiler fuses);
their gradients are written with primitives too, so they trace, shard and compile like the rest.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..autograd import run_backward
from ..dispatch import O
from ..opspec import (
    A,
    Kind,
    Meta,
    OpError,
    attr,
    broadcast_shapes,
    defop,
    describe,
    norm_axis,
    optional,
    same_dtype,
)
from ..tape import set_grad_enabled
from . import spmd as P
from .contraction import mm
from .reduce import _logsumexp_kernel


def _floating(name, *xs):
    for x in xs:
        if not B.is_floating(x.dtype):
            raise OpError(f"{name}: expects floating tensors, got {describe(x)}")


# ---- softmax family ----------------------------------------------------------------------------


def _norm_axis_of(ctx):
    x = ctx.metas[0]
    return [x.ndim - 1] if "axis" not in ctx.attrs else [ctx.attrs["axis"] % x.ndim]


# softmax, log_softmax (over axis), rms_norm (over the last axis; its weight follows that axis)
_along_last_or_axis = P.decompose_along(
    _norm_axis_of,
    lambda ctx: [
        ((d,) + (None,) * (len(ctx.metas) - 1), (d,))
        for d in range(ctx.metas[0].ndim)
        if d not in _norm_axis_of(ctx)
    ],
)


def normalizer(name, kernel, decompose, vjp, doc):
    """softmax-like: a floating x normalized along ``axis`` (not empty), same shape and dtype."""

    def infer(x, axis=-1):
        _floating(name, x)
        if x.shape[norm_axis(name, axis, x.ndim)] == 0:
            raise OpError(f"{name}: axis {axis} is empty", x)
        return Meta(x.shape, x.dtype)

    attrs = [attr("axis", A.INT, -1)]
    return defop(name, Kind.OPAQUE, attrs=attrs, infer_meta=infer, kernel=kernel, decompose=decompose,
                 vjp=vjp, spmd=_along_last_or_axis, doc=doc)  # fmt: skip


def _softmax_kernel(xp, x, axis=-1):
    dtype = x.dtype
    if dtype.itemsize < 4:  # 16-bit floats run in float32 (B.accumulation_dtype)
        x = x.astype(np.float32)
    e = x - x.max(axis, keepdims=True)  # array methods and in place: cheap on small arrays too
    xp.exp(e, e)
    e /= e.sum(axis, keepdims=True)
    return e if e.dtype == dtype else e.astype(dtype)


def _softmax_decompose(x, axis=-1):
    e = O.exp(x - O.max(x, axis=axis, keepdim=True))
    return e / O.sum(e, axis=axis, keepdim=True)


def _shifted_lse(xp, x, axis=-1):
    """(x - max, log(sum(exp(x - max)))): log_softmax is their difference."""
    s = x - xp.max(x, axis=axis, keepdims=True)
    return s, xp.log(xp.sum(xp.exp(s), axis=axis, keepdims=True))


def _log_softmax_kernel(xp, x, axis=-1):
    dtype, x = x.dtype, x.astype(B.accumulation_dtype(x.dtype), copy=False)
    s, lse = _shifted_lse(xp, x, axis)
    return (s - lse).astype(dtype, copy=False)


def _log_softmax_decompose(x, axis=-1):
    s = x - O.max(x, axis=axis, keepdim=True)
    return s - O.log(O.sum(O.exp(s), axis=axis, keepdim=True))


normalizer("softmax", _softmax_kernel, _softmax_decompose,
           lambda g, out, x, axis: (out * (g - O.sum(g * out, axis=axis, keepdim=True)),),
           "exp(x - max) / sum(exp(x - max)) along axis.")  # fmt: skip
normalizer("log_softmax", _log_softmax_kernel, _log_softmax_decompose,
           lambda g, out, x, axis: (g - O.exp(out) * O.sum(g, axis=axis, keepdim=True),),
           "x - logsumexp(x) along axis.")  # fmt: skip


# ---- rms_norm ----------------------------------------------------------------------------------


def _rms_norm_meta(x, weight, eps=1e-6):
    _floating("rms_norm", x, weight)
    if weight.ndim != 1 or sym.canonical(weight.shape[0]) != sym.canonical(x.shape[-1]):
        raise OpError("rms_norm: weight must be 1-D with x's last dim", x, weight)
    same_dtype("rms_norm", x, weight)
    return Meta(x.shape, x.dtype)


def _rms_norm_kernel(xp, x, weight, eps=1e-6):
    # Half-precision inputs are normalized in float32, as Hugging Face Llama does.
    xf = x.astype("float32") if x.dtype.itemsize < 4 else x
    r = 1.0 / xp.sqrt(xp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r).astype(x.dtype, copy=False) * weight


def _rms_norm_decompose(x, weight, eps=1e-6):
    return x * O.rsqrt(O.mean(x * x, axis=-1, keepdim=True) + eps) * weight


def _rms_norm_vjp(g, out, x, weight, eps=1e-6):
    r = O.rsqrt(O.mean(x * x, axis=-1, keepdim=True) + eps)
    y = x * r
    gw = g * weight
    return (lambda: r * (gw - y * O.mean(gw * y, axis=-1, keepdim=True)), lambda: g * y)


defop(
    "rms_norm",
    Kind.OPAQUE,
    inputs=("x", "weight"),
    attrs=[attr("eps", A.FLOAT, 1e-6, lambda v: None if v >= 0 else "must be >= 0")],
    infer_meta=_rms_norm_meta,
    kernel=_rms_norm_kernel,
    decompose=_rms_norm_decompose,
    vjp=_rms_norm_vjp,
    spmd=_along_last_or_axis,
    doc="x / sqrt(mean(x^2, last axis) + eps) * weight.",
)


# ---- cross entropy -----------------------------------------------------------------------------

_REDUCTIONS = ("mean", "sum", "none")


def _ce_meta(logits, labels, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    _floating("cross_entropy", logits)
    if not B.is_integer(labels.dtype):
        raise OpError("cross_entropy: labels must be integers", logits, labels)
    if logits.ndim < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise OpError("cross_entropy: expects logits [..., C] and labels [...]", logits, labels)
    return Meta(labels.shape if reduction == "none" else (), logits.dtype)


def _ce_kernel(xp, logits, labels, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    dtype, logits = logits.dtype, logits.astype(B.accumulation_dtype(logits.dtype), copy=False)
    valid = labels != ignore_index
    count = int(xp.count_nonzero(valid))
    every = count == valid.size  # no label ignored: the two where()s below keep everything
    safe = labels if every else xp.where(valid, labels, 0)
    m = logits.max(axis=-1, keepdims=True)
    e = logits - m
    xp.exp(e, out=e)
    lse = e.sum(axis=-1, keepdims=True)
    xp.log(lse, out=lse)
    lse += m
    rows = logits.reshape(-1, logits.shape[-1])  # each row's label's logit
    picked = rows[xp.arange(rows.shape[0]), safe.reshape(-1)].reshape(labels.shape)
    nll = lse[..., 0] - picked
    if label_smoothing:
        smooth = lse[..., 0] - xp.mean(logits, axis=-1)
        nll = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    nll = (nll if every else xp.where(valid, nll, 0)).astype(logits.dtype, copy=False)
    if reduction == "none":
        return nll.astype(dtype, copy=False)
    total = nll.sum(dtype=logits.dtype)
    if reduction == "sum":
        return total.astype(dtype)
    return (total / logits.dtype.type(count)).astype(dtype)


def _ce_parts(logits, labels, ignore_index, label_smoothing):
    valid = O.not_equal(labels, ignore_index)
    safe = O.where(valid, labels, 0)
    c = logits.shape[-1]
    target = O.one_hot(safe, num_classes=c, dtype=logits.dtype)
    if label_smoothing:
        target = target * (1.0 - label_smoothing) + label_smoothing / c
    return O.cast(valid, logits.dtype), target


def _ce_scale(g, validf, reduction):
    if reduction == "none":
        return g * validf
    if reduction == "sum":
        return validf * g
    return validf * (g / O.sum(validf))


def _ce_vjp(g, out, logits, labels, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    validf, target = _ce_parts(logits, labels, ignore_index, label_smoothing)
    scale = O.unsqueeze(_ce_scale(g, validf, reduction), axis=-1)
    return ((O.softmax(logits, axis=-1) - target) * scale, None)


def _ce_decompose(logits, labels, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    validf, target = _ce_parts(logits, labels, ignore_index, label_smoothing)
    nll = -O.sum(O.log_softmax(logits, axis=-1) * target, axis=-1) * validf
    if reduction == "none":
        return nll
    return O.sum(nll) if reduction == "sum" else O.sum(nll) / O.sum(validf)


def _ce_spmd(ctx):
    """Rows shard (reduction none: the output with them; sum: a Partial sum). A sharded class axis,
    or sharded rows under "mean" (the divisor counts every rank's valid labels), decompose."""
    nd = ctx.metas[0].ndim
    red = ctx.attrs["reduction"]
    rows = range(nd - 1)
    here = (ctx.cur(0), ctx.cur(1))
    if here[0] == P.Shard(nd - 1) or (red == "mean" and any(p in (P.Shard(d) for d in rows) for p in here)):
        return P.DECOMPOSE
    groups = [((d, d), (d,)) for d in rows] if red == "none" else []
    parts = [((P.Shard(d), P.Shard(d)), (P.Partial("sum"),)) for d in rows] if red == "sum" else []
    return P.dim_map(ctx, groups, parts)


defop(
    "cross_entropy",
    Kind.OPAQUE,
    inputs=("logits", "labels"),
    nondiff={1},
    attrs=[
        attr("ignore_index", A.INT, -100),
        attr("label_smoothing", A.FLOAT, 0.0, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        attr("reduction", A.STR, "mean", lambda v: None if v in _REDUCTIONS else f"use one of {_REDUCTIONS}"),
    ],
    infer_meta=_ce_meta,
    kernel=_ce_kernel,
    vjp=_ce_vjp,
    spmd=P.Rule(_ce_spmd),
    decompose=_ce_decompose,
    doc="Softmax cross entropy of logits [..., C] against integer labels [...]; labels equal to "
    "ignore_index count for nothing and 'mean' divides by the number of the others. "
    "label_smoothing mixes the target with the uniform distribution.",
)


# ---- token log-probabilities ---------------------------------------------------------------------
# Sampling's precision (float64) and its definition: the log-softmax kernel above on logits / T. The
# inference engine's sampler reports log-probs with that same kernel, and this op is opaque (never
# decomposed, so compiled programs run this kernel too): a trainer that recomputes the log-prob of a
# sampled token from the same logits gets the sampler's bits (RLHF's exact log-probs).


def _tlp_meta(logits, tokens, temperature=1.0):
    _floating("token_logprobs", logits)
    if not B.is_integer(tokens.dtype) or logits.ndim < 1 or tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise OpError("token_logprobs: expects logits [..., V] and integer tokens [...]", logits, tokens)
    return Meta(tokens.shape, np.float64)


def _tlp_kernel(xp, logits, tokens, temperature=1.0):
    # log_softmax's kernel, subtracting only at the tokens: the same operations on the same values
    s, lse = _shifted_lse(xp, logits.astype(np.float64) / temperature)
    return (xp.take_along_axis(s, tokens[..., None], axis=-1) - lse)[..., 0]


def _tlp_vjp(g, out, logits, tokens, temperature=1.0):
    p = O.softmax(O.cast(logits, np.float64) / temperature, axis=-1)
    onehot = O.one_hot(tokens, num_classes=logits.shape[-1], dtype=np.float64)
    return (O.cast((onehot - p) * (O.unsqueeze(g, axis=-1) / temperature), logits.dtype), None)


def _tlp_spmd(ctx):
    """Rows shard, with their tokens and log-probs; a row's vocabulary is read whole (a sharded
    vocab replicates first)."""
    return P.dim_map(ctx, [((d, d), (d,)) for d in range(ctx.metas[1].ndim)])


defop(
    "token_logprobs",
    Kind.OPAQUE,
    inputs=("logits", "tokens"),
    nondiff={1},
    attrs=[attr("temperature", A.FLOAT, 1.0, lambda v: None if v > 0 else "must be > 0")],
    infer_meta=_tlp_meta,
    kernel=_tlp_kernel,
    vjp=_tlp_vjp,
    spmd=P.Rule(_tlp_spmd),
    doc="log_softmax(logits / temperature)[..., token] in float64 over the full vocabulary: the "
    "log-probability of each token [...] under logits [..., V] (the inference sampler's definition).",
)


# ---- rotary embedding --------------------------------------------------------------------------


def _rope_tables(cos, sin, position_ids):
    """cos/sin as they multiply x: gathered by position ids [B, S] -> [B, 1, S, D] when given."""
    if position_ids is None:
        return cos, sin
    return tuple(O.unsqueeze(O.embedding(position_ids, t), axis=1) for t in (cos, sin))


def _rotate_half(x):
    h = x.shape[-1] // 2
    x1 = O.slice(x, axes=[-1], starts=[0], ends=[h])
    x2 = O.slice(x, axes=[-1], starts=[h], ends=[2 * h])
    return O.concat([-x2, x1], axis=-1)


def _rope_meta(x, cos, sin, position_ids=None):
    _floating("rotary_embedding", x, cos, sin)
    d = x.shape[-1]
    if not isinstance(d, int) or d % 2:
        raise OpError("rotary_embedding: the head dim must be a static even size", x)
    if position_ids is None:
        if tuple(broadcast_shapes("rotary_embedding", x, cos, sin)) != tuple(x.shape):
            raise OpError("rotary_embedding: cos/sin must broadcast to x's shape", x, cos, sin)
    else:
        if not B.is_integer(position_ids.dtype) or position_ids.ndim != 2 or x.ndim != 4:
            raise OpError(
                "rotary_embedding: with position_ids [B, S], x must be [B, H, S, D]", x, position_ids
            )
        if cos.ndim != 2 or tuple(cos.shape) != tuple(sin.shape) or cos.shape[-1] != d:
            raise OpError(
                "rotary_embedding: with position_ids, cos/sin must be tables [positions, D]", cos, sin
            )
    same_dtype("rotary_embedding", x, cos, sin)
    return Meta(x.shape, x.dtype)


def _rope_kernel(xp, x, cos, sin, position_ids=None):
    if position_ids is not None:
        cos, sin = cos[position_ids][:, None], sin[position_ids][:, None]
    h = x.shape[-1] // 2
    rot = xp.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def _rope_decompose(x, cos, sin, position_ids=None):
    cos, sin = _rope_tables(cos, sin, position_ids)
    return x * cos + _rotate_half(x) * sin


def _rope_vjp(g, out, x, cos, sin, position_ids=None):
    # out = x*c + R(x)*s with R^T = -R, so dx = g*c - R(g*s).
    cos, sin = _rope_tables(cos, sin, position_ids)
    return (g * cos - _rotate_half(g * sin), None, None, None)


def _rope_spmd(ctx):
    """Every dim but the rotated last one shards, with cos/sin where they have it (broadcast dims
    and tables indexed by position_ids stay replicated); linear in x."""
    x = ctx.metas[0]
    if ctx.metas[3] is None:
        table = P.broadcast_dims(x.shape, ctx.metas[:3])
        groups = [(row + [None], (j,)) for j, row in enumerate(table) if j != x.ndim - 1]
    else:  # x [B, H, S, D], position_ids [B, S]
        groups = [((0, None, None, 0), (0,)), ((1, None, None, None), (1,)), ((2, None, None, 1), (2,))]
    parts = [((P.Partial(op), P.R, P.R, P.R), (P.Partial(op),)) for op in ("sum", "avg")]
    return P.dim_map(ctx, groups, parts)


defop(
    "rotary_embedding",
    Kind.OPAQUE,
    inputs=("x", "cos", "sin", "position_ids?"),
    nondiff={1, 2, 3},
    infer_meta=_rope_meta,
    kernel=_rope_kernel,
    decompose=_rope_decompose,
    vjp=_rope_vjp,
    spmd=P.Rule(_rope_spmd),
    doc="Rotary position embedding, Hugging Face rotate_half convention: x*cos + rotate_half(x)*sin. "
    "With position_ids [B, S], cos/sin are tables [positions, D] and x is [B, H, S, D].",
)


# ---- scaled dot-product attention --------------------------------------------------------------


def _attention_spmd(grad: bool, lse: bool):
    """Attention's rows are independent per batch and head: shard them (heads only where q and kv
    heads both split evenly, so grouped query heads stay with their kv head). Without a causal mask
    query rows shard too; then a backward's dk and dv are Partial sums over the query shards."""
    first = (3 if lse else 2) if grad else 0  # where q sits: after g, out (and lse)
    n_out = 3 if grad else (2 if lse else 1)

    def strategies(ctx):
        metas = ctx.metas
        q, k = first, first + 1
        mask = first + 3 if len(metas) > first + 3 else None
        shape = tuple(metas[q].shape[:3]) + (metas[k].shape[2],)
        mdims = P.broadcast_dims(shape, [metas[mask]])[:] if mask is not None else [[None]] * 4
        n = len(metas)

        def ins(d, kv: bool, m: int | None):
            row = [None] * n
            for i in range(first):  # g, out (and lse) have q's leading dims
                row[i] = d
            row[q] = d
            if kv:
                row[k] = row[k + 1] = d
            if mask is not None:
                row[mask] = mdims[m][0] if m is not None else None
            return row

        groups = [(ins(0, True, 0), (0,) * n_out)]
        if ctx.even(q, 1) and ctx.even(k, 1):
            groups.append((ins(1, True, 1), (1,) * n_out))
        out = P.dim_map(ctx, groups)
        if not ctx.attrs.get("is_causal", False):
            rows = [P.R if p is None else P.Shard(p) for p in ins(2, False, 2)]
            outs = (P.Shard(2), P.Partial("sum"), P.Partial("sum")) if grad else (P.Shard(2),) * n_out
            out.append(P.Strategy(tuple(None if metas[i] is None else p for i, p in enumerate(rows)), outs))
        return out

    return strategies


def _attention_attrs():
    """The attributes every attention op takes (forward, backward, and their log-sum-exp forms)."""
    return [attr("is_causal", A.BOOL, False), attr("scale", optional(A.FLOAT), None)]


def _sdpa_meta(q, k, v, attn_mask=None, is_causal=False, scale=None):
    _floating("scaled_dot_product_attention", q, k, v)
    same_dtype("scaled_dot_product_attention", q, k, v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise OpError("scaled_dot_product_attention: q, k, v must be [batch, heads, seq, head_dim]", q, k, v)
    hq, hk = q.shape[1], k.shape[1]
    if not (isinstance(hq, int) and isinstance(hk, int)) or hq % hk or k.shape[1] != v.shape[1]:
        raise OpError("scaled_dot_product_attention: q heads must be a multiple of k/v heads", q, k, v)
    if q.shape[-1] != k.shape[-1] or k.shape[2] != v.shape[2] or q.shape[0] != k.shape[0]:
        raise OpError("scaled_dot_product_attention: q/k head dims or k/v lengths differ", q, k, v)
    out_shape = (q.shape[0], hq, q.shape[2], v.shape[3])
    if attn_mask is not None:
        scores = Meta((q.shape[0], hq, q.shape[2], k.shape[2]), q.dtype)
        if attn_mask.dtype != B.DTYPES["bool"] and attn_mask.dtype != q.dtype:
            raise OpError("scaled_dot_product_attention: attn_mask must be bool or q's dtype", q, attn_mask)
        if tuple(broadcast_shapes("scaled_dot_product_attention", scores, attn_mask)) != scores.shape:
            raise OpError(
                "scaled_dot_product_attention: attn_mask must broadcast to [B, Hq, S, T]", q, k, attn_mask
            )
    return Meta(out_shape, q.dtype)


def _sdpa_scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _sdpa_scores(xp, q, k, attn_mask, is_causal, scale):
    """(q k^T) * scale + mask as [B, Hq, S, T] (masked scores -inf), and q * scale grouped per kv
    head [B, Hkv, G*S, D]: query heads sharing a kv head are stacked as rows, one GEMM per
    (batch, kv head)."""
    b, hq, s, d = q.shape
    hk, t = k.shape[1], k.shape[2]
    qs = q.reshape(b, hk, hq // hk * s, d) * _sdpa_scale(q, scale)
    scores = xp.matmul(qs, xp.swapaxes(k, -1, -2)).reshape(b, hq, s, t)
    if attn_mask is not None:
        scores = xp.where(attn_mask, scores, -xp.inf) if attn_mask.dtype == bool else scores + attn_mask
    if is_causal:  # aligned to the bottom right: query i sees keys j <= i + (t - s)
        scores = xp.where(xp.tri(s, t, t - s, dtype=bool), scores, -xp.inf)
    return scores, qs


def _sdpa_kernel(xp, q, k, v, attn_mask=None, is_causal=False, scale=None):
    return _sdpa_out(xp, _sdpa_scores(xp, q, k, attn_mask, is_causal, scale)[0], q, v)


def _sdpa_out(xp, scores, q, v):
    b, hq, s, t = scores.shape
    hk = v.shape[1]
    p = _softmax_kernel(xp, scores, -1).astype(q.dtype, copy=False)
    return mm(xp, p.reshape(b, hk, hq // hk * s, t), v).reshape(b, hq, s, v.shape[-1])


def _group(t, hk):
    """[B, Hq, S, X] -> [B, Hkv, G*S, X]: the query heads of a kv head stacked as rows (a free reshape)."""
    return O.reshape(t, [t.shape[0], hk, sym.mul(t.shape[1] // hk, t.shape[2]), t.shape[3]])


def _sdpa_probs(qs, k, attn_mask, is_causal, shape):
    """softmax(qs k^T + mask) as [B, Hq, S, T], for queries already grouped and scaled:
    qs = group(q) * scale. Scaling q ([.., D]) instead of the scores ([.., T]) saves a pass over
    the largest tensor of attention."""
    return O.softmax(_sdpa_masked_scores(qs, k, attn_mask, is_causal, shape), axis=-1)


def _sdpa_masked_scores(qs, k, attn_mask, is_causal, shape):
    """qs k^T + mask as [B, Hq, S, T] (masked scores -inf), for grouped, scaled queries qs."""
    b, hq, s = shape
    scores = O.reshape(O.matmul(qs, k, transpose_y=True), [b, hq, s, k.shape[2]])
    if attn_mask is not None:
        neg = O.full([], float("-inf"), dtype=qs.dtype)
        scores = (
            O.where(attn_mask, scores, neg) if attn_mask.dtype == B.DTYPES["bool"] else scores + attn_mask
        )
    if is_causal:
        t = k.shape[2]
        rows = O.unsqueeze(O.arange(sym.sub(t, s), t), axis=1)  # i + (t - s)
        cols = O.unsqueeze(O.arange(0, t), axis=0)
        scores = O.where(cols <= rows, scores, O.full([], float("-inf"), dtype=qs.dtype))
    return scores


def _scaled_queries(q, k, scale):
    return _group(q, k.shape[1]) * _sdpa_scale(q, scale)  # (B, Hkv, G*S, D)


def _sdpa_decompose(q, k, v, attn_mask=None, is_causal=False, scale=None):
    shape = (q.shape[0], q.shape[1], q.shape[2])
    p = _group(_sdpa_probs(_scaled_queries(q, k, scale), k, attn_mask, is_causal, shape), k.shape[1])
    return O.reshape(O.matmul(p, v), [q.shape[0], q.shape[1], q.shape[2], v.shape[3]])


def _sdpa_vjp(g, out, q, k, v, attn_mask=None, is_causal=False, scale=None):
    dq, dk, dv = O.scaled_dot_product_attention_grad(
        g, out, q, k, v, attn_mask, is_causal=is_causal, scale=scale
    )
    return dq, dk, dv, None


defop(
    "scaled_dot_product_attention",
    Kind.OPAQUE,
    inputs=("q", "k", "v", "attn_mask?"),
    nondiff={3},
    attrs=_attention_attrs(),
    infer_meta=_sdpa_meta,
    kernel=_sdpa_kernel,
    decompose=_sdpa_decompose,
    vjp=_sdpa_vjp,
    spmd=P.Rule(_attention_spmd(grad=False, lse=False)),
    doc="softmax(q k^T * scale + mask) v on [batch, heads, seq, head_dim], with grouped-query attention "
    "(q heads a multiple of k/v heads). attn_mask is additive (q's dtype) or bool (True = attend); "
    "is_causal aligns the causal mask to the bottom right, so a query block after a cache works.",
)


# The backward as one op: the compiler runs it as one kernel (flash-attention style, probabilities
# recomputed tile by tile, never stored); eagerly it is the same math with BLAS products.


def _sdpa_grad_meta(g, out, q, k, v, attn_mask=None, is_causal=False, scale=None):
    _sdpa_meta(q, k, v, attn_mask, is_causal, scale)
    want = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    for t in (g, out):
        if tuple(t.shape) != want or t.dtype != q.dtype:
            raise OpError(
                "scaled_dot_product_attention_grad: g and out must be [B, Hq, S, Dv] like the output", t, q, v
            )
    return Meta(q.shape, q.dtype), Meta(k.shape, k.dtype), Meta(v.shape, v.dtype)


def _sdpa_grad_kernel(xp, g, out, q, k, v, attn_mask=None, is_causal=False, scale=None):
    b, hq, s, _ = q.shape
    hk, t, dv = k.shape[1], k.shape[2], v.shape[3]
    rows = hq // hk * s  # the query heads of a kv head stacked as rows, as in the forward
    sc = _sdpa_scale(q, scale)
    scores, qs = _sdpa_scores(xp, q, k, attn_mask, is_causal, scale)
    p = _softmax_kernel(xp, scores, -1).astype(q.dtype, copy=False).reshape(b, hk, rows, t)
    gg = g.reshape(b, hk, rows, dv)
    dp = xp.matmul(gg, xp.swapaxes(v, -1, -2))
    dp -= xp.sum(g * out, axis=-1, dtype=dp.dtype).reshape(b, hk, rows, 1)
    ds = p * dp  # d(scores), scores = qs k^T
    ds = ds.astype(q.dtype, copy=False)
    dq = mm(xp, ds, k).reshape(q.shape) * q.dtype.type(sc)
    return dq, mm(xp, xp.swapaxes(ds, -1, -2), qs), mm(xp, xp.swapaxes(p, -1, -2), gg)


def _sdpa_grad_decompose(g, out, q, k, v, attn_mask=None, is_causal=False, scale=None):
    hk = k.shape[1]
    qs = _scaled_queries(q, k, scale)  # (B, Hkv, G*S, D)
    p = _group(_sdpa_probs(qs, k, attn_mask, is_causal, (q.shape[0], q.shape[1], q.shape[2])), hk)
    gg = _group(g, hk)  # (B, Hkv, G*S, Dv)
    # sum_j p_j dp_j = g . out: the row term of the softmax backward, from the output
    ds = p * (O.matmul(gg, v, transpose_y=True) - _group(O.sum(g * out, axis=-1, keepdim=True), hk))
    return (
        O.reshape(O.matmul(ds, k) * _sdpa_scale(q, scale), q.shape),  # a group's rows sum per kv head
        O.matmul(ds, qs, transpose_x=True),  # (B, Hkv, T, D)
        O.matmul(p, gg, transpose_x=True),  # (B, Hkv, T, Dv)
    )


def _vjp_of_decomposition(decompose):
    """A vjp rule that differentiates the op's decomposition (for ops whose own rule would only
    restate it: higher-order gradients through a fused backward)."""

    def vjp(gs, outs, *inputs, **attrs):
        fresh = [None if x is None else x.detach().requires_grad_(B.is_floating(x.dtype)) for x in inputs]
        with set_grad_enabled(True):
            ys = decompose(*fresh, **attrs)
        keep = [(y, gy) for y, gy in zip(ys, gs) if gy is not None]
        wrt = [x for x in fresh if x is not None and x.requires_grad]
        got = iter(run_backward([y for y, _ in keep], [gy for _, gy in keep], capture=wrt))
        return tuple(next(got) if x is not None and x.requires_grad else None for x in fresh)

    return vjp


defop(
    "scaled_dot_product_attention_grad",
    Kind.OPAQUE,
    traits={"internal"},
    inputs=("g", "out", "q", "k", "v", "attn_mask?"),
    nondiff={5},
    attrs=_attention_attrs(),
    infer_meta=_sdpa_grad_meta,
    kernel=_sdpa_grad_kernel,
    decompose=_sdpa_grad_decompose,
    vjp=_vjp_of_decomposition(_sdpa_grad_decompose),
    spmd=P.Rule(_attention_spmd(grad=True, lse=False)),
    multi_output=True,
    doc="(dq, dk, dv) of out = scaled_dot_product_attention(q, k, v, ...) for the output gradient g: "
    "with P the probabilities and dS = P * (g v^T - rowsum(g * out)), dq = dS k * scale, dk = dS^T q "
    "* scale, dv = P^T g (grouped-query heads summed per kv head).",
)


# The same pair with each row's log-sum-exp handed from the forward to the backward (as flash
# attention does): the compiler's ``attention-lse`` rewrite puts these in place of a forward and
# backward of the same q, k, v (no mask), so the backward kernel skips the pass over the keys that
# recomputes it. Eagerly they are the ops above plus the log-sum-exp; their gradients differentiate
# their decompositions (nothing on the training path needs them: the rewrite runs after autodiff).


def _lse_meta(q, k, v, is_causal=False, scale=None):
    out = _sdpa_meta(q, k, v, None, is_causal, scale)
    return out, Meta(tuple(q.shape[:3]), q.dtype)


def _lse_kernel(xp, q, k, v, is_causal=False, scale=None):
    scores, _ = _sdpa_scores(xp, q, k, None, is_causal, scale)
    lse = _logsumexp_kernel(xp, scores, axis=-1).astype(q.dtype, copy=False)
    return _sdpa_out(xp, scores, q, v), lse


def _lse_decompose(q, k, v, is_causal=False, scale=None):
    shape = (q.shape[0], q.shape[1], q.shape[2])
    scores = _sdpa_masked_scores(_scaled_queries(q, k, scale), k, None, is_causal, shape)
    return _sdpa_decompose(q, k, v, None, is_causal, scale), O.logsumexp(scores, axis=-1)


defop(
    "scaled_dot_product_attention_lse",
    Kind.OPAQUE,
    traits={"internal"},
    inputs=("q", "k", "v"),
    attrs=_attention_attrs(),
    infer_meta=_lse_meta,
    kernel=_lse_kernel,
    decompose=_lse_decompose,
    vjp=_vjp_of_decomposition(_lse_decompose),
    spmd=P.Rule(_attention_spmd(grad=False, lse=True)),
    multi_output=True,
    doc="(out, lse): scaled_dot_product_attention(q, k, v) without a mask, and each query row's "
    "log-sum-exp of its scaled (and causally masked) scores, [B, Hq, S].",
)


def _lse_grad_meta(g, out, lse, q, k, v, is_causal=False, scale=None):
    metas = _sdpa_grad_meta(g, out, q, k, v, None, is_causal, scale)
    if tuple(lse.shape) != tuple(q.shape[:3]) or lse.dtype != q.dtype:
        raise OpError("scaled_dot_product_attention_lse_grad: lse must be [B, Hq, S] in q's dtype", lse, q)
    return metas


def _lse_grad_decompose(g, out, lse, q, k, v, is_causal=False, scale=None):
    return _sdpa_grad_decompose(g, out, q, k, v, None, is_causal, scale)


defop(
    "scaled_dot_product_attention_lse_grad",
    Kind.OPAQUE,
    traits={"internal"},
    inputs=("g", "out", "lse", "q", "k", "v"),
    nondiff={2},
    attrs=_attention_attrs(),
    infer_meta=_lse_grad_meta,
    kernel=lambda xp, g, out, lse, q, k, v, is_causal=False, scale=None: _sdpa_grad_kernel(
        xp, g, out, q, k, v, None, is_causal, scale
    ),
    decompose=_lse_grad_decompose,
    vjp=_vjp_of_decomposition(_lse_grad_decompose),
    spmd=P.Rule(_attention_spmd(grad=True, lse=True)),
    multi_output=True,
    doc="scaled_dot_product_attention_grad (no mask) given the forward's (out, lse): the same (dq, dk, "
    "dv); lse, the rows' log-sum-exp, lets the compiled kernel skip recomputing it.",
)


# ---- dropout -----------------------------------------------------------------------------------


def _dropout_kernel(xp, x, step=None, p=0.5, seed=0):
    if p == 0.0:
        return x.copy()
    if step is not None:  # one int seed of (seed, step): cupy's generators take an int only
        seed = int(np.random.SeedSequence([seed, int(step)]).generate_state(1, np.uint64)[0] >> 1)
    keep = xp.random.default_rng(seed).random(x.shape) >= p
    return (x * keep / (1.0 - p)).astype(x.dtype, copy=False)


def _dropout_meta(x, step=None, p=0.5, seed=0):
    _floating("dropout", x)
    if step is not None and (step.ndim != 0 or step.dtype != np.int64):
        raise OpError("dropout: step must be an int64 scalar", x, step)
    return Meta(x.shape, x.dtype)


def _dropout_vjp(g, out, x, step=None, p=0.5, seed=0):  # the same mask: dropout is linear in x
    return (O.dropout(g, p=p, seed=seed) if step is None else O.dropout(g, step, p=p, seed=seed), None)


defop(
    "dropout",
    Kind.OPAQUE,
    inputs=("x", "step?"),
    attrs=[
        attr("p", A.FLOAT, 0.5, lambda v: None if 0 <= v < 1 else "must be in [0, 1)"),
        attr("seed", A.INT, 0, lambda v: None if v >= 0 else "must be >= 0"),
    ],
    infer_meta=_dropout_meta,
    kernel=_dropout_kernel,
    vjp=_dropout_vjp,
    nondiff={1},
    spmd=P.replicate_only("its mask is drawn from the seed over the whole shape: a shard would draw another"),
    doc="Zero each element with probability p and scale the rest by 1/(1-p); the mask is a "
    "function of (seed, step, shape), so the gradient reuses it exactly. step (a static program's "
    "input, drawn afresh for every run) makes a traced dropout draw a new mask at each call.",
)
