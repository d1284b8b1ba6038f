"""Low-rank adapters (LoRA, Hu et al. 2021) on a frozen Llama, in PEFT's file format.

``apply_lora`` wraps each target projection (a ``Linear`` or a ``QuantizedLinear``: QLoRA) in a
``LoraLinear``::

    y = base(x) + (dropout(x) @ Aᵀ @ Bᵀ) * (alpha / r)      A [r, in], B [out, r]

written with the ``linear`` op, so eager mode, ``to_static`` and the inference programs trace it
like any other layer, and the gradient reaches ``x`` through the base weight (for a quantized base:
through ``linear(x, dequantize(...))``, whose ``x`` rule needs no gradient of the codes). The
base's own parameters and buffers stay registered under their old names on the wrapper
(``q_proj.weight``, ``q_proj.qweight``...), so state dicts, checkpoints and parallel plans see the
model they saw before; the wrapper adds ``q_proj.lora_A`` and ``q_proj.lora_B``. The base is frozen
(``requires_grad`` False): only adapters get gradients.

Files (``save_adapter``/``load_adapter``) are PEFT's: ``adapter_config.json`` and
``adapter_model.safetensors`` with names such as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, so ``peft.PeftModel`` loads
llmkit's adapters on the transformers model and llmkit loads adapters trained with PEFT.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.framework import backend as B
from llmkit.framework import nn
from llmkit.framework import serialization as st
from llmkit.framework.files import atomic_dir

O = lf.ops

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # every projection of the decoder layers (PEFT: all linears but the head)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> LlamaForCausalLM


class LoraError(ValueError):
    """Bad adapter settings or files; ``key`` is the setting at fault (``r``, ``targets``...)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class LoraConfig:
    r: int = 8  # rank of the update B @ A
    alpha: float = 16.0  # the update is scaled by alpha / r
    dropout: float = 0.0  # on the adapter's input only (PEFT's lora_dropout)
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # HF module names, or ("all-linear",); PEFT's default
    init: str = "kaiming"  # PEFT's default: A ~ Kaiming-uniform(a=sqrt(5)) as nn.Linear, B = 0

    def __post_init__(self) -> None:
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if not isinstance(self.r, int) or self.r <= 0:
            raise LoraError("r", f"r must be a positive integer (the adapter rank), got {self.r!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError("dropout", f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            raise LoraError("init", f"init must be one of {', '.join(INITS)}, got {self.init!r}")
        if not self.targets:
            raise LoraError("targets", "targets must name at least one module (or be 'all-linear')")

    @property
    def scale(self) -> float:
        return self.alpha / self.r


# How A is drawn (B starts at zero: step 0 is the base): nn.Linear's default, U(±1/sqrt(in)); PEFT's
# init_lora_weights="gaussian", N(0, 1/r²)
INITS = {
    "kaiming": lambda layer: nn.init.kaiming_uniform_(layer.lora_A, a=math.sqrt(5)),
    "gaussian": lambda layer: nn.init.normal_(layer.lora_A, 0.0, 1.0 / layer.r),
}


class LoraLinear(nn.Layer):
    """``base(x) + linear(linear(dropout(x), lora_A), lora_B) * (alpha / r)``: x [..., in] -> [..., out].

    ``base`` (a ``Linear`` or ``QuantizedLinear``) is held, not registered as a sublayer: its
    tensors are registered on this layer under their own names instead (the same objects), so
    paths do not change. ``lora_A`` [r, in] and ``lora_B`` [out, r] are float Parameters in the
    dtype of the base's output.
    """

    def __init__(self, base: nn.Layer, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
            raise TypeError(
                f"LoraLinear: base must be a Linear or QuantizedLinear, got {type(base).__name__}"
            )
        object.__setattr__(self, "base", base)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.alpha, self.scale, self.p = r, alpha, alpha / r, dropout
        self.enabled = True
        self._parameters.update(base._parameters)
        self._buffers.update(base._buffers)
        dtype = base.scales.dtype if isinstance(base, nn.QuantizedLinear) else base.weight.dtype
        self.lora_A = lf.Parameter(lf.zeros(r, self.in_features, dtype=dtype))
        self.lora_B = lf.Parameter(lf.zeros(self.out_features, r, dtype=dtype))

    def delta(self) -> lf.Tensor:
        """The low-rank update [out, in] = (B @ A) * scale, as it merges into the weight."""
        return O.matmul(self.lora_B, self.lora_A) * self.scale

    def forward(self, x: lf.Tensor) -> lf.Tensor:
        y = self.base(x)
        if not self.enabled:
            return y
        h = nn.functional.dropout(x, self.p, training=self.training)
        return y + O.linear(O.linear(h, self.lora_A), self.lora_B) * self.scale  # (..., r) -> (..., out)

    def extra_repr(self) -> str:
        return f"{self.base!r}, r={self.r}, alpha={self.alpha}, dropout={self.p}"


def linear_paths(model: nn.Layer) -> dict[str, str]:
    """Every projection LoRA can wrap: path -> its module name (``q_proj``...); the head excluded."""
    out = {}
    for path, layer in model.named_sublayers():
        name = path.rpartition(".")[2]
        if name in TARGETS and isinstance(layer, (nn.Linear, nn.QuantizedLinear, LoraLinear)):
            out[path] = name
    return out


def check_targets(model: nn.Layer, targets: tuple[str, ...]) -> list[str]:
    """The paths ``targets`` select, or a ``LoraError`` naming an unknown name with a did-you-mean
    over the model's module names."""
    found = linear_paths(model)
    known = sorted(set(found.values()))
    if tuple(targets) == (ALL_LINEAR,):
        return list(found)
    for t in targets:
        if t not in known:
            every = sorted({p.rpartition(".")[2] for p, _ in model.named_sublayers()})
            close = difflib.get_close_matches(t, known + every, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise LoraError(
                "targets",
                f"unknown target module {t!r} ({hint}the model's projections: {', '.join(known)}; "
                f"or {ALL_LINEAR!r})",
            )
    return [p for p, name in found.items() if name in targets]


def check_base(layer: nn.Layer, path: str) -> None:
    """A quantized base must be one the backward can run through (``linear(x, dequantize(..))``)."""
    if isinstance(layer, nn.QuantizedLinear):
        if layer.act_bits:
            raise LoraError(
                "targets",
                f"{path} quantizes its activations too (act_bits={layer.act_bits}): rounding x has no "
                "gradient, so no adapter below it could train; LoRA takes weight-only bases "
                "(llmkit quantize without --act-bits)",
            )
        if not B.is_floating(layer.scales.dtype):
            raise LoraError("targets", f"{path}: quantized scales must be floating, got {layer.scales.dtype}")
        return
    if not isinstance(layer, nn.Linear):
        raise LoraError(
            "targets",
            f"{path} is a {type(layer).__name__}; LoRA trains over Linear and QuantizedLinear "
            "(int8/int4, `llmkit quantize`) bases only, whose backward runs through the quantized kernels",
        )


def apply_lora(model: nn.Layer, cfg: LoraConfig, seed: int | None = None) -> list[str]:
    """Freeze ``model`` and wrap each target projection in a ``LoraLinear``, in place.

    A is drawn from the framework's generator seeded with ``seed`` (the generator's state is
    restored afterwards), or from its current state when ``seed`` is None. Returns the wrapped paths.
    """
    paths = check_targets(model, cfg.targets)
    layers = dict(model.named_sublayers())
    for path in paths:
        if isinstance(layers[path], LoraLinear):
            raise LoraError("targets", f"{path} already has an adapter")
        check_base(layers[path], path)
    for path, layer in layers.items():  # any layer the gradient must pass: none may round x
        if isinstance(layer, nn.QuantizedLinear):
            check_base(layer, path)
    for p in model.parameters():
        p.requires_grad = False
    state = B.get_rng_state() if seed is not None else None
    if seed is not None:
        B.seed(seed)
    try:
        for path in paths:
            wrapped = LoraLinear(layers[path], cfg.r, cfg.alpha, cfg.dropout)
            INITS[cfg.init](wrapped)
            parent, _, name = path.rpartition(".")
            (layers[parent] if parent else model)._sublayers[name] = wrapped  # in place: order kept
    finally:
        if state is not None:
            B.set_rng_state(state)
    object.__setattr__(model, "lora_config", cfg)
    return paths


def lora_layers(model: nn.Layer) -> dict[str, LoraLinear]:
    return {p: m for p, m in model.named_sublayers() if isinstance(m, LoraLinear)}


def adapter_state(model: nn.Layer) -> dict[str, lf.Tensor]:
    """The adapter parameters by llmkit path (``model.layers.0.self_attn.q_proj.lora_A``...)."""
    return {f"{p}.{k}": getattr(m, k) for p, m in lora_layers(model).items() for k in ("lora_A", "lora_B")}


@contextlib.contextmanager
def adapters_disabled(model: nn.Layer) -> Iterator[None]:
    """Inside, the model is its base alone (RLHF's reference model, with no second copy)."""
    layers = list(lora_layers(model).values())
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m, e in zip(layers, before):
            m.enabled = e


def merge_lora(model: nn.Layer) -> list[str]:
    """Replace every ``LoraLinear`` by a plain ``Linear`` of weight ``W + (B @ A) * scale``, in place
    (a quantized base is dequantized first: the merged weight is float). Returns the merged paths."""
    layers = dict(model.named_sublayers())
    merged = []
    for path, m in lora_layers(model).items():
        base = m.base
        w = base.weight.detach()
        with nn.init.skip_init():  # the weight is set right below
            new = nn.Linear(m.in_features, m.out_features, bias=base.bias is not None, dtype=w.dtype)
        new.weight.set_value((w + m.delta().detach().astype(w.dtype))._data)
        if base.bias is not None:
            new.bias = base.bias
        new.weight.requires_grad = False  # as frozen as the base it replaces
        parent, _, name = path.rpartition(".")
        (layers[parent] if parent else model)._sublayers[name] = new
        merged.append(path)
    model.__dict__.pop("lora_config", None)
    return merged


# ---- PEFT's files ---------------------------------------------------------------------------------
def peft_name(path: str) -> str:
    """llmkit's ``...q_proj.lora_A`` -> PEFT's ``base_model.model....q_proj.lora_A.weight``."""
    return f"{PEFT_PREFIX}{path}.weight"


_UNSUPPORTED = {  # PEFT features llmkit's adapters do not have: key -> the value that means "off"
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
}


def peft_config(cfg: LoraConfig, base_model: str | None = None) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it (the fields its LoraConfig needs to rebuild ours)."""
    targets = ALL_LINEAR if cfg.targets == (ALL_LINEAR,) else sorted(cfg.targets)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": targets,
        "init_lora_weights": True if cfg.init == "kaiming" else cfg.init,
        **_UNSUPPORTED,  # every feature off
        "inference_mode": True,
    }


def read_config(directory: str | os.PathLike[str]) -> LoraConfig:
    """The ``LoraConfig`` of a PEFT adapter directory; a ``LoraError`` naming the file and field
    for anything llmkit cannot reproduce exactly."""
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraError(
            "adapter", f"{path}: no such file (an adapter directory holds {CONFIG_FILE})"
        ) from None
    except json.JSONDecodeError as e:
        raise LoraError("adapter", f"{path}: not JSON ({e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError("adapter", f"{path}: peft_type is {raw.get('peft_type')!r}; only LORA adapters load")
    for key, off in _UNSUPPORTED.items():
        if raw.get(key) not in (None, off):
            raise LoraError("adapter", f"{path}: {key}={raw[key]!r} is not supported (llmkit needs {off!r})")
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets != ALL_LINEAR:
        raise LoraError(
            "adapter", f"{path}: target_modules as a regex ({targets!r}) is not supported; list names"
        )
    init = raw.get("init_lora_weights", True)
    try:
        return LoraConfig(
            r=raw["r"],
            alpha=float(raw.get("lora_alpha", 8)),
            dropout=float(raw.get("lora_dropout", 0.0)),
            targets=tuple(targets) if isinstance(targets, list) else (targets,),
            init="kaiming" if init is True else str(init),
        )
    except LoraError as e:
        raise LoraError("adapter", f"{path}: {e}") from None
    except KeyError as e:
        raise LoraError("adapter", f"{path}: missing field {e}") from None


def write_adapter(
    model: nn.Layer,
    directory: str | os.PathLike[str],
    base_model: str | None = None,
    values: dict[str, lf.Tensor] | None = None,
) -> int:
    """Write the adapter files into the existing ``directory`` (a checkpoint writer's temporary
    one); returns the bytes written. ``save_adapter`` is the atomic form. ``values``: the adapters'
    whole values by path, where the model's own are laid out over ranks (``dist.unshard``)."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise LoraError("adapter", "the model has no adapters (apply_lora or load_adapter first)")
    d = Path(directory)
    tensors = {
        peft_name(k): np.ascontiguousarray(B.to_numpy(t._data))
        for k, t in (adapter_state(model) if values is None else values).items()
    }
    st.save(tensors, d / WEIGHTS_FILE, metadata={"format": "pt"})
    (d / CONFIG_FILE).write_text(json.dumps(peft_config(cfg, base_model), indent=2) + "\n")
    return sum(f.stat().st_size for f in (d / WEIGHTS_FILE, d / CONFIG_FILE))


def save_adapter(model: nn.Layer, directory: str | os.PathLike[str], base_model: str | None = None) -> None:
    """Write ``directory`` (replaced atomically) as PEFT's adapter directory."""
    with atomic_dir(directory) as tmp:
        write_adapter(model, tmp, base_model)


def load_adapter(model: nn.Layer, directory: str | os.PathLike[str], seed: int | None = None) -> LoraConfig:
    """Load a PEFT adapter directory into ``model``: its adapters are applied first if the model has
    none; every tensor must be there with its shape. Returns the adapter's config."""
    cfg = read_config(directory)
    have = getattr(model, "lora_config", None)
    if have is None:
        apply_lora(model, cfg, seed)
    elif (have.r, have.targets) != (cfg.r, cfg.targets):
        raise LoraError(
            "adapter",
            f"{directory}: r={cfg.r}, targets={cfg.targets} differ from the model's adapters {have}",
        )
    path = Path(directory) / WEIGHTS_FILE
    try:
        tensors = st.load(path)
    except FileNotFoundError:
        raise LoraError("adapter", f"{path}: no such file") from None
    own = adapter_state(model)
    want = {peft_name(k): k for k in own}
    # PEFT names adapters "default"; older files (and some tools) write ".lora_A.default.weight".
    got = {k.replace(".default.weight", ".weight"): v for k, v in tensors.items()}
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing or unexpected:
        raise LoraError(
            "adapter",
            f"{path}: tensor names do not match the model's adapters "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})",
        )
    for name, k in want.items():
        v, t = got[name], own[k]
        if tuple(v.shape) != t.shape:
            raise LoraError("adapter", f"{path}: {name} is {list(v.shape)}, the model's is {list(t.shape)}")
        t.set_value(B.to_device(v._data, t.device).astype(t.dtype))
    return cfg


__all__ = [
    "ALL_LINEAR",
    "TARGETS",
    "LoraConfig",
    "LoraError",
    "LoraLinear",
    "adapter_state",
    "adapters_disabled",
    "apply_lora",
    "check_targets",
    "load_adapter",
    "lora_layers",
    "merge_lora",
    "read_config",
    "save_adapter",
    "write_adapter",
]
