"""Quantized linears: ``dequantize`` and ``quant_linear`` (docs/quantize.md has the format).

A weight ``W [out, in]`` is stored as integer codes and float scales, in groups of ``group_size``
consecutive input columns (column c is in group ``c // group_size``, the last group may be shorter;
``group_size=-1``: one group of the whole row, per output channel)::

    bits=8   qweight int8  [out, in]       values in [-127, 127]           W[n, c] = q * scale
    bits=4   qweight uint8 [out, in / 2]   column 2j in the low nibble,     W[n, c] = (q - zero) * scale
                                           2j + 1 in the high; q in [0, 15]

    scales  float [out, ceil(in / group_size)];  zeros  uint8, the same shape (4-bit asymmetric only;
    without it the zero point is 8)

``dequantize`` gives ``W`` (in the scales' dtype); ``quant_linear(x, qweight, scales, zeros)`` is
``linear(x, W)`` without storing ``W``: the program form of a linear whose weight is quantized
(the ``quantize-linear`` pass makes it from ``linear(x, dequantize(...))``). With ``rows`` it keeps
``tiled_linear``'s contract: products of exactly ``rows`` rows, so a row's result does not depend
on the other rows (the engine's batch invariance). With ``act_bits=8`` x is quantized too, to int8
per row and weight group (:func:`quantize_activations`), and the product is the integer one scaled
(``compiler/native/quant_int.py`` runs it with integer dot products). ``quant_linears`` is several
``quant_linear`` of one x in one op (the engine's q/k/v and gate/up): one kernel call, each output's
bits those of its own ``quant_linear``.

Neither differentiates the codes or scales (codes are integers, and nothing trains scales);
``quant_linear`` with float activations differentiates ``x``: dx = g @ dequantize(qweight, scales,
zeros), the transposed product through the same dequantized weight, so a frozen quantized base
passes gradients on to the adapters and layers below it (QLoRA); with ``act_bits=8`` (x rounded)
nothing reaches x. Both are ``internal``
(no Tensor methods); ``quant_linear`` is an engine op (``engine_op``) whose compiled programs run
its hand-written kernel (``compiler/native/quant.py``). SPMD: rows of x and output features (a
weight's rows, with their scales and zeros) shard; the inner dim stays whole, since a group must
not straddle two shards.
"""

from __future__ import annotations

import numpy as np

from .. import backend as B
from .. import symbolic as sym
from ..dispatch import O
from ..opspec import A, Kind, Meta, OpError, attr, defop, describe
from . import spmd as P
from .contraction import _linear_kernel, _linear_meta
from .paged import _known_differ, _tiled_kernel, engine_op

BITS = (4, 8)
CODE_DTYPE = {8: np.dtype(np.int8), 4: np.dtype(np.uint8)}  # qweight dtype per width
PACK = {8: 1, 4: 2}  # input columns per qweight element
SYM_ZERO = {8: 0, 4: 8}  # the zero point without a zeros tensor
_U8 = np.dtype(np.uint8)
_F16 = np.dtype(np.float16)


def num_groups(in_features: sym.Dim, group_size: int) -> sym.Dim | None:
    """Groups per row: ceil(in / group_size), one for ``group_size=-1`` (None: a symbolic ``in``)."""
    if group_size == -1:
        return 1
    return -(-in_features // group_size) if isinstance(in_features, int) else None


def _weight_meta(op, qweight, scales, zeros=None, bits=4, group_size=128):
    """The Meta of the float weight [out, in] the tensors stand for; every input checked."""
    want = CODE_DTYPE[bits]
    if qweight.ndim != 2 or qweight.dtype != want:
        raise OpError(f"{op}: a {bits}-bit qweight must be a 2-D {want.name} tensor, got {describe(qweight)}")
    out, cols = qweight.shape
    in_features = sym.mul(cols, PACK[bits])
    if scales.ndim != 2 or not B.is_floating(scales.dtype):
        raise OpError(f"{op}: scales must be a 2-D floating tensor [out, groups], got {describe(scales)}")
    groups = num_groups(in_features, group_size)
    if _known_differ(scales.shape[0], out) or (groups is not None and _known_differ(scales.shape[1], groups)):
        raise OpError(
            f"{op}: scales must be [out, ceil(in / group_size)] = [{out}, {groups}] "
            f"(in = {in_features}, group_size = {group_size})",
            qweight,
            scales,
        )
    if zeros is not None:
        if bits != 4:
            raise OpError(f"{op}: zeros belong to 4-bit weights only (8-bit codes are symmetric)", zeros)
        if zeros.dtype != _U8 or zeros.ndim != 2 or any(map(_known_differ, zeros.shape, scales.shape)):
            raise OpError(f"{op}: zeros must be uint8 with the shape of scales", scales, zeros)
    return Meta((out, in_features), scales.dtype)


def codes(xp, qweight, bits: int):
    """The integer codes [out, in] (int16) of a qweight: 4-bit nibbles unpacked, low nibble first."""
    if bits == 8:
        return qweight.astype(xp.int16)
    q = qweight.astype(xp.int16)
    return xp.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], 2 * q.shape[1])


def _dequantize_kernel(xp, qweight, scales, zeros=None, bits=4, group_size=128):
    q = codes(xp, qweight, bits)  # (out, in)
    n_in = q.shape[1]
    g = n_in if group_size == -1 else group_size

    def per_column(t):  # (out, groups) -> (out, in)
        return xp.repeat(t, g, axis=1)[:, :n_in]

    z = SYM_ZERO[bits] if zeros is None else per_column(zeros.astype(xp.int16))
    return (q - z).astype(scales.dtype) * per_column(scales)  # q - z is exact; one rounding


def _quant_attrs() -> list:
    return [
        attr("bits", A.INT, 4, lambda v: None if v in BITS else "must be 4 or 8"),
        attr("group_size", A.INT, 128, lambda v: None if v == -1 or v >= 1 else "must be >= 1, or -1"),
    ]


def _weight_spmd(x: int, group: bool = False):
    """Output features (dim 0 of qweight, scales, zeros at inputs x.., the output's last dim) and,
    with an ``x`` input (quant_linear), its rows; with ``group`` (quant_linears), every output's."""

    def strategies(ctx):
        n = len(ctx.metas)
        out_nd = 2 if x == 0 else ctx.metas[0].ndim
        outs = (n - 1) // (3 if ctx.attrs["zeros"] else 2) if group else 1
        rows = [((d,) + (None,) * (n - 1), (d,) * outs) for d in range(out_nd - 1)] if x else []
        feat = ((None,) * x + (0,) * (n - x), (out_nd - 1 if x else 0,) * outs)
        return P.dim_map(ctx, [*rows, feat])

    return P.Rule(strategies)


defop(
    "dequantize",
    Kind.OPAQUE,
    inputs=("qweight", "scales", "zeros?"),
    attrs=_quant_attrs(),
    infer_meta=lambda *a, **k: _weight_meta("dequantize", *a, **k),
    kernel=_dequantize_kernel,
    traits={"internal"},
    spmd=_weight_spmd(0),
    doc="The float weight [out, in] that quantized codes stand for: (q - zero) * scale per group of "
    "group_size input columns (-1: per output channel). bits=8: qweight int8 [out, in], zero 0; "
    "bits=4: qweight uint8 [out, in/2] (column 2j low nibble, 2j+1 high), zero 8 or zeros [out, "
    "groups] uint8. No gradient.",
)


ACT_BITS = (0, 8)  # quant_linear's activations: float (weight-only), or int8 per weight group


def quantize_activations(xp, x, group_size: int):
    """int8 activation codes and scales of x [M, K] (float32), per column, as ``quant_linear`` with
    ``act_bits=8`` makes them: per row and weight group (the whole row with ``group_size=-1``),
    ``d = max|x| / 127`` and codes ``rint(x / d)`` (0 where ``d = 0``), float32 arithmetic.
    Returns (codes, d), both [M, K] float32."""
    m, k = x.shape
    g = k if group_size == -1 else group_size
    groups = -(-k // g) if k else 0
    padded = xp.zeros((m, groups * g), xp.float32)
    padded[:, :k] = x
    blocks = padded.reshape(m, groups, g)
    d = xp.abs(blocks).max(axis=-1, keepdims=True) / xp.float32(127)
    q = xp.where(d > 0, xp.clip(xp.rint(blocks / xp.where(d > 0, d, xp.float32(1))), -127, 127), 0)
    return q.reshape(m, -1)[:, :k], xp.broadcast_to(d, blocks.shape).reshape(m, -1)[:, :k]


PANEL = 16  # output features per panel of a packed qweight (the C kernel's vector of outputs)


def _panel_bytes(k: int, bits: int, group_size: int) -> np.ndarray:
    """The byte of a row of codes at each byte of one output's part of a panel (-1: padding): per
    group, its bytes padded to a whole number of 4-byte words, the same padding for every group."""
    g = k if group_size == -1 else group_size
    gb, rb = g // PACK[bits], k // PACK[bits]
    gw = -(-gb // 4) * 4
    idx = np.arange(-(-k // g))[:, None] * gb + np.arange(gw)[None, :]
    return np.where((np.arange(gw)[None, :] < gb) & (idx < rb), idx, -1).reshape(-1)


def pack_qweight(qweight: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """A qweight [out, in / PACK] as ``quant_linear``'s panels (``packed=1``, what its int8-activation
    C kernel reads; the engine makes them once): [ceil(out / 16), W * 64] uint8, where W is the
    4-byte words of a row's groups, each padded alike (docs/quantize.md); panel p, word t, lane l
    holds those 4 bytes of output 16 p + l (0 past the last output or the group)."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK[bits]
    at = _panel_bytes(k, bits, group_size)
    rows = np.zeros((-(-n // PANEL) * PANEL, at.size), np.uint8)
    rows[:n] = np.where(at >= 0, qweight.view(np.uint8)[:, np.maximum(at, 0)], 0)
    p = rows.reshape(-1, PANEL, at.size // 4, 4).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(p).reshape(p.shape[0], -1)


def half_scales(scales: np.ndarray) -> np.ndarray:
    """float32 scales [out, groups] as ``packed=2`` takes them (2 bytes a group where float32 takes
    4): float16, in panels of 16 outputs, each panel's [groups, 16] (the last, of the n % 16 outputs
    left, [groups, n % 16]), so the C kernel reads a panel's scales in its lanes' order. Only scales
    that are float16 numbers already (``QuantConfig(scale_dtype="float16")``): the same products."""
    half = np.asarray(scales).astype(np.float16)
    if not np.array_equal(half.astype(np.float32), scales):
        raise OpError(
            "quant_linear: packed=2 needs scales that are float16 numbers; quantize with "
            "--scale-dtype float16 (QuantConfig(scale_dtype='float16'))"
        )
    n, g = half.shape
    full = n // PANEL * PANEL
    panels = half[:full].reshape(-1, PANEL, g).transpose(0, 2, 1).reshape(-1)
    return np.concatenate([panels, half[full:].T.reshape(-1)]).reshape(n, g)


def float_scales(xp, half):
    """The float32 scales [out, groups] that :func:`half_scales` stored."""
    n, g = half.shape
    full = n // PANEL * PANEL
    flat = half.reshape(-1).astype(xp.float32)
    panels = flat[: full * g].reshape(-1, g, PANEL).transpose(0, 2, 1).reshape(full, g)
    return xp.concatenate([panels, flat[full * g :].reshape(g, n - full).T])


def unpack_qweight(xp, packed, n: int, k: int, bits: int, group_size: int):
    """The qweight [n, k / PACK] that :func:`pack_qweight` packed."""
    at = _panel_bytes(k, bits, group_size)
    rows = packed.reshape(packed.shape[0], at.size // 4, PANEL, 4).transpose(0, 2, 1, 3)
    rows = rows.reshape(-1, at.size)[:n]
    out = xp.zeros((n, k // PACK[bits]), xp.uint8)
    out[:, at[at >= 0]] = rows[:, at >= 0]
    return out.view(CODE_DTYPE[bits])


def _ql_meta(x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0, act_bits=0, packed=0):
    if packed:  # panels of the [out, in] codes: check their shape, then the weight as the codes
        n, k = scales.shape[0], x.shape[-1]
        if not (isinstance(n, int) and isinstance(k, int)) or act_bits != 8:
            raise OpError(
                f"quant_linear: packed={packed} needs act_bits=8 and known in / out features", x, scales
            )
        want = (-(-n // PANEL), _panel_bytes(k, bits, group_size).size * PANEL)
        if tuple(qweight.shape) != want or qweight.dtype != _U8:
            raise OpError(f"quant_linear: a packed qweight must be uint8 {list(want)}", qweight)
        qweight = Meta((n, k // PACK[bits]), CODE_DTYPE[bits])
    if packed == 2:  # float16 scales, float32 x
        if scales.dtype != _F16 or x.dtype != np.float32:
            raise OpError("quant_linear: packed=2 takes float16 scales and float32 x", x, scales)
        scales = Meta(scales.shape, x.dtype)
    w = _weight_meta("quant_linear", qweight, scales, zeros, bits, group_size)
    if x.dtype != scales.dtype:
        raise OpError("quant_linear: x and scales must have one dtype", x, scales)
    return _linear_meta(x, w)


def _ql_vjp(g, out, x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0, act_bits=0, packed=0):
    # dx [..., in] = g [..., out] @ W [out, in]; W dequantized on the fly, never kept (QLoRA).
    # act_bits=8 rounds x itself: no gradient reaches x (LoRA refuses such bases).
    dx = None
    if not act_bits:
        dx = lambda: O.matmul(g, O.dequantize(qweight, scales, zeros, bits=bits, group_size=group_size))
    return (dx, None, None) + (() if zeros is None else (None,))


def _ql_kernel(xp, x, qweight, scales, zeros=None, bits=4, group_size=128, rows=0, act_bits=0, packed=0):
    if packed:
        qweight = unpack_qweight(xp, qweight, scales.shape[0], x.shape[-1], bits, group_size)
    if packed == 2:
        scales = float_scales(xp, scales)
    if act_bits == 8:  # exact in float64 (codes times scales), then one rounding to x's dtype
        x2 = x.reshape(-1, x.shape[-1]).astype(xp.float32)
        q, d = quantize_activations(xp, x2, group_size)
        xd = (q.astype(xp.float64) * d.astype(xp.float64)).reshape(x.shape)
        w64 = _dequantize_kernel(xp, qweight, scales.astype(xp.float64), zeros, bits, group_size)
        y = _tiled_kernel(xp, xd, w64, None, rows) if rows else _linear_kernel(xp, xd, w64)
        return y.astype(x.dtype)
    w = _dequantize_kernel(xp, qweight, scales, zeros, bits, group_size)
    if rows:
        return _tiled_kernel(xp, x, w, None, rows)
    return _linear_kernel(xp, x, w)


_QL_ATTRS = [
    *_quant_attrs(),
    attr("rows", A.INT, 0, lambda v: None if v >= 0 else "must be >= 0"),
    attr("act_bits", A.INT, 0, lambda v: None if v in ACT_BITS else "must be 0 (float) or 8"),
    attr("packed", A.INT, 0, lambda v: None if v in (0, 1, 2) else "must be 0, 1 or 2"),
]

engine_op(
    "quant_linear",
    ("x", "qweight", "scales", "zeros?"),
    _QL_ATTRS,
    _ql_meta,
    _ql_kernel,
    spmd=_weight_spmd(1),
    vjp=_ql_vjp,
    nondiff={1, 2, 3},
    doc="linear(x, dequantize(qweight, scales, zeros)) with the weight never stored in float: "
    "x [..., in] -> [..., out]. rows >= 1 computes in products of exactly `rows` rows, as "
    "tiled_linear (each row's result independent of the others); 0: one product. act_bits=8: x "
    "quantized on the fly to int8 per row and weight group (quantize_activations), "
    "y = sum over groups of (d * scale) * the integer product; 0: x stays float. packed=1 (with "
    "act_bits=8): qweight is pack_qweight's panels; packed=2: and scales float16 (half_scales). "
    "Gradient: x only, g @ dequantize(...), with act_bits=0.",
)


def weight_inputs(xs, zeros: bool = False) -> tuple:
    """x and each weight's (qweight, scales[, zeros]) among ``quant_linears``' inputs."""
    k = 3 if zeros else 2
    if len(xs) < 1 + k or (len(xs) - 1) % k:
        each = ", zeros" * zeros
        raise OpError(f"quant_linears: takes x, then (qweight, scales{each}) per weight; got {len(xs)}", *xs)
    return xs[0], [tuple(xs[i : i + k]) for i in range(1, len(xs), k)]


def _per_weight(fn, lead, xs, zeros, attrs):  # quant_linear's meta or kernel, weight by weight
    x, ws = weight_inputs(xs, zeros)
    out = []
    for i, w in enumerate(ws):
        try:
            out.append(fn(*lead, x, *w, **attrs))
        except OpError as e:
            raise OpError(f"quant_linears: weight {i}: {e}") from None
    return tuple(out)


engine_op(
    "quant_linears",
    ("*xs",),
    [*_QL_ATTRS, attr("zeros", A.BOOL, False)],
    lambda *xs, zeros=False, **a: _per_weight(_ql_meta, (), xs, zeros, a),
    lambda xp, *xs, zeros=False, **a: _per_weight(_ql_kernel, (xp,), xs, zeros, a),
    multi_output=True,
    spmd=_weight_spmd(1, group=True),
    doc="quant_linear of several weights of one x (inputs x, then each weight's qweight, scales and, with "
    "zeros, zeros; attributes shared), one output each, bit for bit: one kernel call (q/k/v; gate/up).",
)
