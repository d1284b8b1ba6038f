"""Layers: ``Layer`` (alias ``Module``), the basic layers, containers, ``init`` and ``functional``."""

from __future__ import annotations

from . import functional, init
from .basic import (
    GELU,
    Dropout,
    Embedding,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    ReLU,
    RMSNorm,
    SiLU,
    quantize_linears,
)
from .container import LayerDict, LayerList, ModuleDict, ModuleList, Sequential
from .layer import HookHandle, IncompatibleKeys, Layer, Module, StateDictError

__all__ = [
    "GELU",
    "Dropout",
    "Embedding",
    "HookHandle",
    "IncompatibleKeys",
    "Layer",
    "LayerDict",
    "LayerList",
    "Linear",
    "Module",
    "ModuleDict",
    "ModuleList",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "RMSNorm",
    "ReLU",
    "Sequential",
    "SiLU",
    "StateDictError",
    "functional",
    "init",
    "quantize_linears",
]
