"""The embedded framework: tensors, eager autodiff, the op table, nn, optim and io.

``import llmkit.framework as lf``. This package imports nothing else from llmkit.
"""

from __future__ import annotations

from . import backend, methods, ops
from .autograd import grad
from .backend import get_default_dtype, get_device, seed, set_default_dtype, set_device
from .creation import (
    arange,
    empty,
    full,
    full_like,
    ones,
    ones_like,
    rand,
    randint,
    randn,
    tensor,
    zeros,
    zeros_like,
)
from .opspec import OpError
from .tape import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .tensor import Parameter, Tensor

methods.install()


from . import nn, optim  # noqa: E402  (they build on the names above)

# the hand-written C kernels, which eager ops run too (dispatch.register_eager_native): loaded with the
# framework, so that an op computes the same in every process whatever else it imported
from .compiler import native as _native  # noqa: E402, F401
from .serialization import load, save  # noqa: E402

__all__ = [
    "OpError",
    "Parameter",
    "Tensor",
    "arange",
    "backend",
    "bfloat16",
    "empty",
    "enable_grad",
    "full",
    "full_like",
    "get_default_dtype",
    "get_device",
    "grad",
    "is_grad_enabled",
    "load",
    "nn",
    "no_grad",
    "ones",
    "ones_like",
    "ops",
    "optim",
    "rand",
    "randint",
    "randn",
    "save",
    "seed",
    "set_default_dtype",
    "set_device",
    "set_grad_enabled",
    "tensor",
    "zeros",
    "zeros_like",
]


def __getattr__(name: str) -> object:
    if name == "bfloat16":  # imported at first use (backend._bfloat16)
        return backend.bfloat16
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
