"""Dynamic to static: ``to_static`` tracing, program autodiff, and the static model file."""

from __future__ import annotations

from ..tracer import TraceError
from .autodiff import append_backward
from .model_file import FORMAT_VERSION, FormatError, StaticModel
from .model_file import load_model as load
from .model_file import save_static as save
from .static_function import ConcreteProgram, InputSpec, StaticFunction, to_static

__all__ = [
    "FORMAT_VERSION",
    "ConcreteProgram",
    "FormatError",
    "InputSpec",
    "StaticFunction",
    "StaticModel",
    "TraceError",
    "append_backward",
    "load",
    "save",
    "to_static",
]
