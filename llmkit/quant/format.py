"""The quantized checkpoint format (docs/quantize.md) and round-to-nearest quantization.

An HF-layout directory whose ``config.json`` carries ``quantization_config`` (:class:`QuantConfig`);
each quantized linear ``P`` holds ``P.qweight``, ``P.scales`` and, 4-bit asymmetric, ``P.zeros``
(``llmkit.framework.ops.quant`` states the layout; its ``dequantize`` op is the reader).

A group's parameters (``group_params``), per output row, for weights ``w`` of one group:

    8-bit            scale = max|w| / 127,                 zero = 0,   codes in [-127, 127]
    4-bit symmetric  scale = max|w| / 7.5,                 zero = 8,   codes in [0, 15]
    4-bit asymmetric scale = (max(w, 0) - min(w, 0)) / 15, zero = round(-min(w, 0) / scale)

and a weight's code is ``clip(round(w / scale) + zero)``: every weight within half a step of its
value, except the symmetric 4-bit maximum, clipped from 7.5 to 7 steps (still half a step). The
scale is rounded to float32 (or, ``scale_dtype="float16"``, up to a float16 number, stored as
float32: what GGUF's Q8_0/Q4_0 blocks hold) before the codes are made, so the stored scale is
the one they fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from llmkit.framework.ops.quant import ACT_BITS, BITS, CODE_DTYPE, SYM_ZERO, codes
from llmkit.models.llama.checkpoint import QUANT_VERSION as FORMAT_VERSION

METHODS = ("rtn", "gptq")
QUANT_METHOD = "llmkit"  # quantization_config.quant_method of this format
# quantization_config.version (FORMAT_VERSION): 1 (no key: weight-only products), 2 (act_bits)
CODE_RANGE = {8: (-127, 127), 4: (0, 15)}
_STEPS = {(8, True): 127.0, (4, True): 7.5, (4, False): 15.0}  # max|w| (or the range) per scale
SCALE_DTYPES = ("float32", "float16")  # the numbers a scale may be (always stored as float32)


class QuantError(ValueError):
    """Quantization settings or inputs that cannot work (printed as one line by the CLI)."""


@dataclass(frozen=True)
class QuantConfig:
    """What a quantized checkpoint's ``quantization_config`` says (besides ``quant_method``)."""

    bits: int = 4
    group_size: int = 128  # input columns per scale; -1: one scale per output channel
    sym: bool = True  # zero point 8 (4-bit) / 0 (8-bit); False: per-group uint8 zeros (4-bit only)
    method: str = "gptq"  # "rtn" (round to nearest) or "gptq" (Frantar et al. 2022)
    scale_dtype: str = "float32"  # "float16": scales rounded to float16 numbers (GGUF Q8_0/Q4_0)
    act_bits: int = 0  # 0: products with float activations (weight-only); 8: int8 x int8/int4 products

    def __post_init__(self) -> None:
        if self.act_bits not in ACT_BITS:
            raise QuantError(f"act_bits must be 0 (float activations) or 8, got {self.act_bits!r}")
        if self.bits not in BITS:
            raise QuantError(f"bits must be 4 or 8, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise QuantError(f"group_size must be an integer, got {self.group_size!r}")
        if not (self.group_size == -1 or self.group_size >= 1):
            raise QuantError(f"group_size must be >= 1 or -1 (per output channel), got {self.group_size}")
        if self.bits == 8 and not self.sym:
            raise QuantError("8-bit weights are symmetric only (W = qweight * scale): drop --asym")
        if self.method not in METHODS:
            raise QuantError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise QuantError(
                f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.scale_dtype!r}"
            )

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of config.json."""
        return {"quant_method": QUANT_METHOD, **dataclasses.asdict(self), "version": FORMAT_VERSION}

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> QuantConfig:
        if not isinstance(d, dict) or d.get("quant_method") != QUANT_METHOD:
            raise QuantError(f"quantization_config: not an {QUANT_METHOD!r} config: {d!r}")
        version = d.get("version", 1)
        if version not in range(1, FORMAT_VERSION + 1):
            raise QuantError(
                f"quantization_config: version {version!r} is newer than this llmkit reads "
                f"(1 .. {FORMAT_VERSION}): upgrade llmkit"
            )
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else math.ceil(in_features / self.group_size)

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


class QuantizedWeight(NamedTuple):
    """One weight as stored: ``qweight``, float32 ``scales`` [out, groups], uint8 ``zeros`` or None."""

    qweight: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self if a is not None)


def group_params(
    w: np.ndarray, bits: int, sym: bool, scale_dtype: str = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """Scale (float32, holding a ``scale_dtype`` number) and zero point (int) per row of ``w``
    [rows, group] (see the module docstring)."""
    w = np.asarray(w, np.float64)
    if sym:
        span = np.abs(w).max(axis=1)
    else:
        lo, hi = np.minimum(w.min(axis=1), 0.0), np.maximum(w.max(axis=1), 0.0)
        span = hi - lo
    exact = span / _STEPS[bits, sym]
    with np.errstate(over="ignore"):
        scale = exact.astype(scale_dtype)
        if scale_dtype != "float32":  # rounded up: float16's coarse steps must not push codes past the range
            scale = np.where(scale < exact, np.nextafter(scale, np.inf, dtype=scale.dtype), scale)
    scale = scale.astype(np.float32)
    if not np.isfinite(scale).all():
        raise QuantError(f"a weight of magnitude {span.max():.3g} has no {scale_dtype} scale")
    scale[scale == 0] = 1.0  # an all-zero group: any scale codes it exactly
    if sym:
        return scale, np.full(len(w), SYM_ZERO[bits], np.int64)
    return scale, np.clip(np.round(-lo / scale), *CODE_RANGE[bits]).astype(np.int64)


def quantize_codes(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int) -> np.ndarray:
    """Codes of ``w`` [rows, ...] with per-row ``scale`` and ``zero``: clip(round(w / scale) + zero)."""
    shape = (-1,) + (1,) * (np.ndim(w) - 1)
    q = np.round(np.asarray(w, np.float64) / scale.reshape(shape).astype(np.float64)) + zero.reshape(shape)
    return np.clip(q, *CODE_RANGE[bits]).astype(np.int64)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [out, in] as ``qweight``: int8 for 8 bits; for 4, uint8 [out, in / 2] with column 2j in
    the low nibble and 2j + 1 in the high one."""
    lo, hi = CODE_RANGE[bits]
    if q.min(initial=lo) < lo or q.max(initial=hi) > hi:
        raise QuantError(f"{bits}-bit codes must lie in [{lo}, {hi}]")
    if bits == 8:
        return q.astype(np.int8)
    if q.shape[1] % 2:
        raise QuantError(f"4-bit packing needs an even number of input columns, got {q.shape[1]}")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack(qweight: np.ndarray, bits: int) -> np.ndarray:
    """The codes [out, in] of a ``qweight`` (the inverse of :func:`pack`)."""
    if qweight.dtype != CODE_DTYPE[bits]:
        raise QuantError(f"a {bits}-bit qweight is {CODE_DTYPE[bits].name}, got {qweight.dtype}")
    return codes(np, qweight, bits).astype(np.int64)


def store(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, cfg: QuantConfig) -> QuantizedWeight:
    """Codes and per-group parameters as the tensors the format stores."""
    return QuantizedWeight(
        pack(q, cfg.bits),
        np.ascontiguousarray(scales, np.float32),
        None if cfg.sym else zeros.astype(np.uint8),
    )


def join(parts: list[QuantizedWeight], in_features: int, cfg: QuantConfig) -> QuantizedWeight:
    """Row blocks of one weight (in order) as one; no blocks: a weight of zero rows."""
    if not parts:
        empty = np.zeros((0, cfg.groups(in_features)), np.int64)
        return store(np.zeros((0, in_features), np.int64), empty.astype(np.float32), empty, cfg)
    return QuantizedWeight(*(None if a[0] is None else np.concatenate(a) for a in zip(*parts)))


def quantize_rtn(w: np.ndarray, cfg: QuantConfig) -> QuantizedWeight:
    """Round to nearest: each group's parameters from its own weights, every code the nearest (rows
    are independent, so any row block of ``w`` gives the same rows of the result)."""
    n_out, n_in = w.shape
    g = cfg.group_width(n_in)
    scales = np.empty((n_out, cfg.groups(n_in)), np.float32)
    zeros = np.empty(scales.shape, np.int64)
    q = np.empty(w.shape, np.int64)
    for j in range(scales.shape[1]):
        cols = slice(j * g, min((j + 1) * g, n_in))
        scales[:, j], zeros[:, j] = group_params(w[:, cols], cfg.bits, cfg.sym, cfg.scale_dtype)
        q[:, cols] = quantize_codes(w[:, cols], scales[:, j], zeros[:, j], cfg.bits)
    return store(q, scales, zeros, cfg)


def check_shape(name: str, out_features: int, in_features: int, cfg: QuantConfig) -> None:
    """A weight the format can store (4-bit packs column pairs)."""
    if cfg.bits == 4 and in_features % 2:
        raise QuantError(f"{name}: 4-bit weights need an even number of input columns, got {in_features}")
