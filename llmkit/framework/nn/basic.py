"""The basic layers: Linear, Embedding, RMSNorm, Dropout and the small activations.

Each forward is one op call (plus a mask for Embedding's padding row), so a layer traces to
exactly the op the docstring names.
"""

from __future__ import annotations

import math
from typing import Any

from .. import backend as B
from .. import ops
from ..creation import empty, ones, zeros
from ..tape import is_grad_enabled
from ..tensor import Parameter, Tensor
from . import functional as F
from . import init
from .layer import Layer


def _new_param(shape: tuple[int, ...], dtype: Any) -> Parameter:
    return Parameter(empty(*shape, dtype=B.get_default_dtype() if dtype is None else B.dtype(dtype)))


class Linear(Layer):
    """y = x Wᵀ + b: x [..., in_features] -> y [..., out_features].

    ``weight`` is [out_features, in_features] (the Hugging Face / PyTorch layout, so checkpoints
    load without transposes); ``bias`` is [out_features] or None. Both start as PyTorch's do:
    U(-1/sqrt(in_features), 1/sqrt(in_features)).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: Any = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _new_param((out_features, in_features), dtype)
        # kaiming_uniform_ with a=sqrt(5) is PyTorch's default: the bound works out to 1/sqrt(fan_in).
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.bias = _new_param((out_features,), dtype) if bias else None
        if self.bias is not None:
            bound = 1.0 / math.sqrt(in_features) if in_features else 0.0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class _Coded(Layer):
    """A weight held as quantized codes: the buffers ``qweight``, ``scales`` and ``zeros`` (None when
    symmetric), dequantized with ``bits`` and ``group_size`` where ``weight`` is read."""

    @property
    def _codes(self) -> tuple[Tensor, Tensor, Tensor | None]:
        return (self.qweight, self.scales, self.zeros)

    @property
    def weight(self) -> Tensor:
        """The dequantized weight [out_features, in_features] (an embedding's table
        [num_embeddings, embedding_dim])."""
        return ops.dequantize(*self._codes, bits=self.bits, group_size=self.group_size)


class QuantizedLinear(_Coded):
    """A Linear whose weight is stored quantized: y = x dequantize(qweight, scales, zeros)ᵀ + b.

    Buffers (not trained), named as the quantized checkpoint format names them (docs/quantize.md):
    ``qweight`` (int8 [out, in] for 8 bits; uint8 [out, in / 2], two columns per byte, for 4),
    ``scales`` [out, groups] and, 4-bit asymmetric only, ``zeros`` uint8 [out, groups], with groups
    of ``group_size`` input columns (-1: one per output channel). ``weight`` is the dequantized
    matrix, computed by the ``dequantize`` op where it is read; traced programs hold
    ``linear(x, dequantize(...))``, which the ``quantize-linear`` pass turns into ``quant_linear``.

    ``act_bits=8`` quantizes the input too, to int8 per row and weight group, on the fly, and
    multiplies integers: the forward is ``quant_linear(x, ..., act_bits=8)`` (``ops/quant.py`` has
    the arithmetic), in eager mode and in traced programs alike. 0 (the default): x stays float.
    Where a gradient must reach ``x`` (frozen quantized layers above trained ones: QLoRA), the
    forward is ``quant_linear`` too, whose rule recomputes the weight in the backward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int = 4,
        group_size: int = 128,
        sym: bool = True,
        bias: bool = False,
        dtype: Any = None,
        act_bits: int = 0,
    ) -> None:
        super().__init__()
        if act_bits not in ops.quant.ACT_BITS:
            raise ValueError(f"QuantizedLinear: act_bits must be 0 (float) or 8, got {act_bits!r}")
        if bits == 4 and in_features % 2:
            raise ValueError(f"QuantizedLinear: 4-bit weights need an even in_features, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym, self.act_bits = bits, group_size, sym, act_bits
        groups = 1 if group_size == -1 else -(-in_features // group_size)
        codes = (out_features, in_features) if bits == 8 else (out_features, in_features // 2)
        self.register_buffer("qweight", zeros(*codes, dtype="int8" if bits == 8 else "uint8"))
        self.register_buffer("scales", ones(out_features, groups, dtype=dtype))
        self.register_buffer("zeros", None if sym else zeros(out_features, groups, dtype="uint8"))
        self.bias = _new_param((out_features,), dtype) if bias else None
        if self.bias is not None:
            init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if not self.act_bits and not (is_grad_enabled() and getattr(x, "requires_grad", False)):
            return ops.linear(x, self.weight, self.bias)
        # int8 activations; or a gradient flows through to x (QLoRA: adapters below), and
        # quant_linear's rule dequantizes again in the backward: no float weight held in between
        kw = {"bits": self.bits, "group_size": self.group_size, "act_bits": self.act_bits}
        y = ops.quant_linear(x, *self._codes, **kw)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, sym={self.sym}, bias={self.bias is not None}"
            + (f", act_bits={self.act_bits}" if self.act_bits else "")
        )


class QuantizedEmbedding(_Coded):
    """An Embedding whose table is stored quantized as a QuantizedLinear's weight (row ``i`` of the
    table is output feature ``i``): out[..., :] = dequantize(qweight[ids], scales[ids], zeros[ids]).

    Only the looked-up rows are read and dequantized (``index_select`` of the codes, then
    ``dequantize``), so a token costs its row's bytes. No gradient (the codes are integers).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bits: int = 4,
        group_size: int = 128,
        sym: bool = True,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        # the same buffers as a [num_embeddings -> embedding_dim] quantized weight
        table = QuantizedLinear(embedding_dim, num_embeddings, bits, group_size, sym, False, dtype)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.bits, self.group_size, self.sym = bits, group_size, sym
        for name in ("qweight", "scales", "zeros"):
            self.register_buffer(name, getattr(table, name))

    @property
    def in_features(self) -> int:
        """The input features of the table as a quantized weight (its groups run along a row)."""
        return self.embedding_dim

    def forward(self, ids: Tensor) -> Tensor:
        flat = ops.reshape(ids, [-1])  # (T,)
        rows = [None if t is None else ops.index_select(t, flat) for t in self._codes]
        out = ops.dequantize(*rows, bits=self.bits, group_size=self.group_size)  # (T, dim)
        return ops.reshape(out, [*ids.shape, self.embedding_dim])

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}, "
            f"sym={self.sym}"
        )


def quantize_linears(
    root: Layer, paths: list[str], bits: int, group_size: int, sym: bool, act_bits: int = 0
) -> dict[str, QuantizedLinear | QuantizedEmbedding]:
    """Replace the ``Linear`` sublayers at ``paths`` (dotted, as ``named_sublayers`` gives them) by
    ``QuantizedLinear`` layers of the same shape (and ``act_bits``), and ``Embedding`` ones by
    ``QuantizedEmbedding``, in place; their codes start at zero (fill them with
    ``load_state_dict``); a bias stays the same Parameter. Returns the new layers by path."""
    layers = dict(root.named_sublayers())
    out: dict[str, QuantizedLinear | QuantizedEmbedding] = {}
    for path in paths:
        old = layers.get(path)
        if isinstance(old, Embedding) and old.padding_idx is None:
            new = QuantizedEmbedding(
                old.num_embeddings, old.embedding_dim, bits, group_size, sym, old.weight.dtype
            )
        elif isinstance(old, Linear):
            new = QuantizedLinear(
                old.in_features, old.out_features, bits, group_size, sym, False, old.weight.dtype, act_bits
            )
            new.bias = old.bias
        else:
            what = type(old).__name__ if old is not None else "no sublayer"
            raise ValueError(f"quantize_linears: {path!r} is {what}, not a Linear or an Embedding")
        parent, _, name = path.rpartition(".")
        (layers[parent] if parent else root)._sublayers[name] = new  # in its place: containers keep order
        out[path] = new
    return out


class Embedding(Layer):
    """out[..., :] = weight[ids[...], :]: ids [...] (integers) -> [..., embedding_dim].

    ``weight`` [num_embeddings, embedding_dim] starts as N(0, 1). The row ``padding_idx`` starts at
    zero and receives no gradient, so it stays whatever it is set to (PyTorch's semantics).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, dtype: Any = None
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} is outside [0, {num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.weight = _new_param((num_embeddings, embedding_dim), dtype)
        init.normal_(self.weight)
        if padding_idx is not None:
            rows = ops.unsqueeze(ops.arange(0, num_embeddings), axis=1)
            self.weight.set_value(ops.where(rows == padding_idx, 0.0, self.weight.detach()))

    def forward(self, ids: Tensor) -> Tensor:
        out = ops.embedding(ids, self.weight)
        if self.padding_idx is not None and self.weight.requires_grad and is_grad_enabled():
            # Route the padding positions through a detached copy: same values, no gradient. This
            # costs O(tokens x dim), unlike masking the whole [num_embeddings, dim] table.
            keep = ops.unsqueeze(ids != self.padding_idx, axis=-1)
            out = ops.where(keep, out, out.detach())
        return out

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class RMSNorm(Layer):
    """y = x / sqrt(mean(x², last axis) + eps) * weight: x [..., dim] -> [..., dim].

    ``weight`` [dim] starts at 1. Half-precision inputs are normalized in float32 (as in HF Llama).
    """

    def __init__(self, dim: int, eps: float = 1e-6, dtype: Any = None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = _new_param((dim,), dtype)
        init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class Dropout(Layer):
    """In training, zero each element with probability p and scale the rest by 1/(1-p); identity in eval."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class SiLU(Layer):
    """x * sigmoid(x)."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.silu(x)


class GELU(Layer):
    """x * Φ(x) (``approximate="tanh"``: the tanh approximation)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return "" if self.approximate == "none" else f"approximate={self.approximate!r}"


class ReLU(Layer):
    """max(x, 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.relu(x)
