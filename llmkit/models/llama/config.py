"""LlamaConfig: the shape of a Llama model, with Hugging Face field names.

A config reads and writes the `config.json` of a Hugging Face Llama checkpoint, so a model trained
here loads in `transformers` and a published checkpoint loads here. Field defaults are those of
`transformers.LlamaConfig`, because a `config.json` leaves out every field that has its default.

    cfg = LlamaConfig.from_preset("tiny", vocab_size=tok.vocab_size)
    cfg = LlamaConfig.from_json_file("Llama-2-7b-hf/config.json")
    cfg.rope_inv_freq()           # (head_dim // 2,) float64, scaling included
    cfg.flops_per_token(4096)     # training FLOPs per token for MFU
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llmkit.framework.files import atomic_write

SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")

# Required fields of each supported `rope_scaling["rope_type"]` ("default" means no scaling).
ROPE_SCALING_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Keys this class writes itself or folds into its fields; never kept in `extra`.
_HF_CONSUMED_KEYS = ("architectures", "model_type", "rope_parameters", "dtype")


class LlamaConfigError(ValueError):
    """A Llama config that cannot be used: the message names the field (and the file, when read from one)."""


def _invalid(message: str) -> LlamaConfigError:
    return LlamaConfigError(f"LlamaConfig: {message}")


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama decoder, named and defaulted as in `transformers.LlamaConfig`.

    `num_key_value_heads` and `head_dim` may be given as None and are then resolved on construction
    (to `num_attention_heads` and `hidden_size // num_attention_heads`). Because they are stored
    resolved, derive a config with `from_preset`/`from_dict` rather than `dataclasses.replace`, which
    would keep the old head_dim when hidden_size changes.
    """

    vocab_size: int = 32000  # embedding rows = lm_head columns
    hidden_size: int = 4096  # model width d
    intermediate_size: int = 11008  # SwiGLU inner width
    num_hidden_layers: int = 32  # decoder blocks
    num_attention_heads: int = 32  # query heads
    num_key_value_heads: int | None = None  # K/V heads (GQA); None = num_attention_heads (MHA)
    head_dim: int | None = None  # per-head width; None = hidden_size // num_attention_heads
    max_position_embeddings: int = 2048  # longest sequence the model is trained/served at
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict[str, Any] | None = None  # None, {"rope_type": "linear"|"llama3", ...}
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    hidden_act: str = "silu"  # MLP gate activation (only silu: SwiGLU)
    initializer_range: float = 0.02  # std of the normal init of weight matrices
    attention_bias: bool = False  # biases on q/k/v/o projections
    mlp_bias: bool = False  # biases on gate/up/down projections
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2  # a list in some chat checkpoints (Llama 3.1 Instruct)
    pad_token_id: int | None = None  # Llama has no pad token
    torch_dtype: str = "float32"  # dtype the weights are stored in
    extra: dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, written back

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            _check_positive_int(name, getattr(self, name))
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", heads)
        _check_positive_int("num_key_value_heads", self.num_key_value_heads)
        if heads % self.num_key_value_heads:
            raise _invalid(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({heads}): each K/V head serves a whole group of query heads"
            )
        if self.head_dim is None:
            if self.hidden_size % heads:
                raise _invalid(
                    f"num_attention_heads ({heads}) must divide hidden_size "
                    f"({self.hidden_size}), or set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise _invalid(f"head_dim ({self.head_dim}) must be even: RoPE rotates pairs")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _invalid(f"{name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_supported("hidden_act", self.hidden_act, SUPPORTED_ACTIVATIONS)
        _check_supported("torch_dtype", self.torch_dtype, SUPPORTED_DTYPES)
        for name in ("bos_token_id", "pad_token_id"):
            _check_token_id(name, getattr(self, name))
        eos = self.eos_token_id
        for token in eos if isinstance(eos, list) else [eos]:
            _check_token_id("eos_token_id", token)
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        object.__setattr__(self, "extra", dict(self.extra))

    @property
    def eos_ids(self) -> list[int]:
        """``eos_token_id`` as a list: none, one, or several stop ids (Llama 3.1 Instruct's)."""
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, list) else [] if eos is None else [eos]

    # ---- presets and HF config.json -------------------------------------------------------------

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The named flavor from `PRESETS`, with `overrides` applied to its fields."""
        if name not in PRESETS:
            raise LlamaConfigError(f"unknown Llama preset {name!r}; known presets: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Read a Hugging Face `config.json` dict (older and newer spellings).

        RoPE settings may be given as top-level `rope_theta` + `rope_scaling` or as the newer
        `rope_parameters` dict (`rope_theta`, `rope_type` and scaling fields); `dtype` is accepted
        for `torch_dtype`. Keys this class does not model are kept in `extra` and written back.
        """
        d = dict(d)
        model_type = d.get("model_type", "llama")
        if model_type != "llama":
            raise _invalid(f"model_type is {model_type!r}, expected 'llama'")
        if d.get("torch_dtype") is None and d.get("dtype") is not None:
            d["torch_dtype"] = d["dtype"]
        if d.get("rope_parameters") is not None:
            _merge_rope_parameters(d, d["rope_parameters"])
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        # A null torch_dtype means "unknown" in HF; keep our default rather than failing validation.
        kwargs = {k: v for k, v in d.items() if k in names and not (k == "torch_dtype" and v is None)}
        extra = {k: v for k, v in d.items() if k not in names and k not in _HF_CONSUMED_KEYS}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> LlamaConfig:
        """Read a `config.json` file (see `from_dict`)."""
        path = Path(path)
        try:
            d = json.loads(path.read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no model config at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LlamaConfigError(f"{path}: invalid JSON: {e}") from None
        if not isinstance(d, dict):
            raise LlamaConfigError(f"{path}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except LlamaConfigError as e:
            raise LlamaConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict, in the classic spelling every loader reads."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **self.extra, **fields}

    def to_json_file(self, path: str | os.PathLike[str]) -> None:
        """Write `to_dict()` as JSON, atomically."""
        atomic_write(path, json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- derived quantities ---------------------------------------------------------------------

    def rope_inv_freq(self, scaled: bool = True) -> np.ndarray:
        """RoPE inverse frequencies, (head_dim // 2,) float64, with `rope_scaling` applied (unless
        `scaled` is False: the base frequencies).

        Base: inv_freq[i] = rope_theta ** (-2i / head_dim). "linear" divides every frequency by
        `factor` (position interpolation). "llama3" divides only the low frequencies, whose
        wavelength 2π/f exceeds original_max_position_embeddings / low_freq_factor, keeps the high
        ones (wavelength below original / high_freq_factor), and blends linearly in
        s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor) between:
        f' = (1 - s) * f / factor + s * f. Same as transformers' `_compute_llama3_parameters`.
        """
        dim = self.head_dim
        inv_freq = 1.0 / self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if self.rope_scaling is None or not scaled:
            return inv_freq
        s = self.rope_scaling
        factor = float(s["factor"])
        if s["rope_type"] == "linear":
            return inv_freq / factor
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_context = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, blended)
        return np.where(wavelen < old_context / high, inv_freq, scaled)

    def num_parameters(self) -> int:
        """Number of parameters of LlamaForCausalLM with this config (a tied lm_head counts once)."""
        h, d, L = self.hidden_size, self.head_dim, self.num_hidden_layers
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv + h) * self.attention_bias
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h) * self.mlp_bias
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + L * (attn + mlp + 2 * h) + h  # 2 norms per block + the final norm

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at `seq_len`, for MFU.

        PaLM (Chowdhery et al. 2022, appendix B) / nanoGPT convention: 6 * N + 12 * L * H * Q * T,
        where N counts the parameters used in matmuls (all but the input embedding table, which is
        a lookup; a tied table counts once, as the lm_head), L layers, H query heads of width Q, and
        T = seq_len. 6N is 2 FLOPs per multiply-add, times 3 for forward + backward; the attention
        term is QK^T and AV over all T keys (causal masking is not discounted, as in PaLM).
        """
        n = self.num_parameters()
        if not self.tie_word_embeddings:
            n -= self.vocab_size * self.hidden_size
        attention = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return 6 * n + attention


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _invalid(f"{name} must be a positive integer, got {value!r}")


def _check_supported(name: str, value: Any, supported: Sequence[str]) -> None:
    if value not in supported:
        raise _invalid(f"{name} {value!r} is not supported (supported: {', '.join(supported)})")


def _check_token_id(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise _invalid(f"{name} must be a non-negative integer or null, got {value!r}")


def _normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate `rope_scaling`; return it with the type under "rope_type" (None for no scaling).

    Older configs spell the type "type"; newer ones "rope_type"; HF writes both in some versions.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise _invalid(f"rope_scaling must be null or a mapping, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALING_FIELDS:
        raise _invalid(
            f"rope_scaling.rope_type {rope_type!r} is not supported "
            f"(supported: default, {', '.join(ROPE_SCALING_FIELDS)})"
        )
    for key in ROPE_SCALING_FIELDS[rope_type]:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise _invalid(
                f"rope_scaling[{key!r}] must be a positive number for rope_type {rope_type!r}, got {value!r}"
            )
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise _invalid("rope_scaling high_freq_factor must exceed low_freq_factor")
    return {"rope_type": rope_type, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}}


def _merge_rope_parameters(d: dict[str, Any], params: Any) -> None:
    """Fold a newer-style `rope_parameters` dict into `rope_theta` / `rope_scaling` of `d`."""
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise _invalid(f"rope_parameters must be a mapping with rope_theta, got {params!r}")
    theta = params["rope_theta"]
    if d.get("rope_theta", theta) != theta:
        raise _invalid(f"rope_theta ({d['rope_theta']}) disagrees with rope_parameters.rope_theta ({theta})")
    d["rope_theta"] = theta
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        if d.get("rope_scaling") not in (None, scaling):
            raise _invalid(f"rope_scaling ({d['rope_scaling']}) disagrees with rope_parameters ({params})")
        d["rope_scaling"] = scaling


def _swiglu_width(hidden_size: int, multiple_of: int) -> int:
    """Llama's MLP width: 2/3 of 4 * hidden (same FLOPs as a 4x GELU MLP), rounded up."""
    return multiple_of * math.ceil(int(8 * hidden_size / 3) / multiple_of)


# Named flavors (torchtitan `llama3_args` style): LlamaConfig keyword arguments per name.
PRESETS: dict[str, dict[str, Any]] = {
    # Trains on a 2-core CPU in minutes; vocab_size is normally replaced by the tokenizer's.
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=_swiglu_width(128, 8),  # 344
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    ),
    # The fixed shape benchmarks/ measure; do not change (figures are compared across commits).
    "bench": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
    ),
    # About 56M parameters with the Llama 2 vocabulary (23M without embeddings).
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=_swiglu_width(512, 32),  # 1376
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    ),
    # meta-llama/Llama-2-7b-hf
    "7B": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        torch_dtype="float16",
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8B": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=128001,
        torch_dtype="bfloat16",
    ),
}
# meta-llama/Llama-3.1-8B: Llama 3 with llama3 RoPE scaling to a 128K context.
PRESETS["llama3.1-8B"] = {
    **PRESETS["llama3-8B"],
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
