"""Array backends and dtypes.

A device name picks an array module: ``"cpu"`` is numpy, ``"gpu"`` is cupy. Kernels receive that
module as ``xp`` and are written once for both. Dtypes are numpy dtype objects everywhere
(bfloat16 comes from ml_dtypes, imported at its first use: the import takes most of a second);
:func:`dtype` turns names into them and rejects anything else.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------- dtypes

# bfloat16 joins at its first use (_bfloat16)
DTYPES = {
    n: np.dtype(n)
    for n in ("float64", "float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool")
}
_BY_DTYPE = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {DTYPES[n] for n in ("float64", "float32", "float16")}
INT_DTYPES = frozenset(DTYPES[n] for n in ("int8", "uint8", "int16", "int32", "int64"))
NAMES = (*DTYPES, "bfloat16")


def _bfloat16() -> np.dtype:
    d = DTYPES.get("bfloat16")
    if d is None:
        import ml_dtypes

        d = np.dtype(ml_dtypes.bfloat16)
        _BY_DTYPE[d] = "bfloat16"
        FLOAT_DTYPES.add(d)
        DTYPES["bfloat16"] = d
    return d


def __getattr__(name: str) -> Any:
    if name == "bfloat16":
        return _bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype(x: Any) -> np.dtype:
    """Normalize a dtype given as a name, numpy dtype or scalar type; reject unsupported ones."""
    if isinstance(x, np.dtype) and x in _BY_DTYPE:
        return x
    if isinstance(x, str):
        d = DTYPES.get(x)
        if d is not None or x == "bfloat16":
            return d or _bfloat16()
    else:
        try:
            d = np.dtype(x)
        except TypeError:
            d = None
        if d is not None and d in _BY_DTYPE:
            return d
        if d is not None and d.name == "bfloat16" and "ml_dtypes" in sys.modules:
            return _bfloat16()  # an ml_dtypes bfloat16 met before any use of ours
    raise TypeError(f"unsupported dtype {x!r}; expected one of {', '.join(NAMES)}")


def dtype_name(d: Any) -> str:
    """The canonical name of a supported dtype (``"float32"``, ``"bfloat16"``...)."""
    return _BY_DTYPE[dtype(d)]


def is_floating(d: Any) -> bool:
    return dtype(d) in FLOAT_DTYPES


def is_integer(d: Any) -> bool:
    return dtype(d) in INT_DTYPES


def accumulation_dtype(d: Any) -> np.dtype:
    """The dtype sums over ``d`` run in: float32 for 16-bit floats (a running bfloat16 sum of ones
    stops growing at 256: it has 8 bits of mantissa), ``d`` itself otherwise."""
    d = dtype(d)
    return DTYPES["float32"] if d in FLOAT_DTYPES and d.itemsize < 4 else d


class _State(threading.local):
    """Per-thread settings; the class attributes are the defaults (read without a lookup miss)."""

    default_dtype = DTYPES["float32"]
    device = "cpu"
    rng: Any = None


_state = _State()


def get_default_dtype() -> np.dtype:
    """The dtype of new floating tensors (float32 unless changed)."""
    return _state.default_dtype


def set_default_dtype(d: Any) -> None:
    d = dtype(d)
    if d not in FLOAT_DTYPES:
        raise TypeError(f"default dtype must be floating, got {dtype_name(d)}")
    _state.default_dtype = d


# --------------------------------------------------------------------------------------- devices

DEVICES = ("cpu", "gpu")
_cupy: Any = None


def _load_cupy() -> Any:
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except ImportError as e:
            raise RuntimeError(
                "device 'gpu' needs cupy: install llmkit with the gpu extra (pip install 'llmkit[gpu]')"
            ) from e
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # cupy imports fine on machines without a driver
            raise RuntimeError(f"device 'gpu': cupy found no usable CUDA device ({e})") from e
        if n < 1:
            raise RuntimeError("device 'gpu': cupy found no CUDA device")
        _cupy = cupy
    return _cupy


def gpu_available() -> bool:
    try:
        _load_cupy()
    except RuntimeError:
        return False
    return True


def check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    return device


def xp_for(device: str) -> Any:
    """The array module of a device: numpy for "cpu", cupy for "gpu"."""
    if device == "cpu":
        return np
    check_device(device)
    return _load_cupy()


def is_array(x: Any) -> bool:
    """True for a numpy or cupy array (concrete values, not a tracer)."""
    return isinstance(x, np.ndarray) or (_cupy is not None and isinstance(x, _cupy.ndarray))


def device_of(array: Any) -> str:
    """Which device an array lives on."""
    return "cpu" if isinstance(array, (np.ndarray, np.generic)) else "gpu"


def xp_of(array: Any) -> Any:
    return np if isinstance(array, (np.ndarray, np.generic)) else _load_cupy()


def get_device() -> str:
    """The device new tensors are created on."""
    return _state.device


def set_device(device: str) -> None:
    xp_for(check_device(device))  # fail now, not at the first tensor
    _state.device = device


def to_numpy(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array.get() if hasattr(array, "get") else array)


def to_device(array: Any, device: str) -> Any:
    if device_of(array) == device:
        return array
    return to_numpy(array) if device == "cpu" else xp_for(device).asarray(array)


# ------------------------------------------------------------------------------------ randomness


class _Rng:
    """A seed and the generators drawn from it, one per device (made on first use)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed, self.generators = int(seed), {}


_shared_rng = _Rng()  # every thread's, but for one that took its own (``adopt``: a sim rank)


def _rng() -> _Rng:
    return _state.rng or _shared_rng


def seed(n: int) -> None:
    """Seed every device's generator; runs with the same seed draw the same numbers."""
    r = _rng()
    r.seed = int(n)
    r.generators.clear()


def generator(device: str | None = None) -> Any:
    """The seeded random generator of a device (numpy ``Generator`` or cupy's)."""
    device = device or get_device()
    r = _rng()
    g = r.generators.get(device)
    if g is None:
        xp = xp_for(device)
        g = r.generators[device] = xp.random.default_rng(r.seed if device == "cpu" else r.seed + 1)
    return g


def get_rng_state() -> dict:
    """JSON-serializable state of the CPU generator (for checkpoints)."""
    return {"seed": _rng().seed, "cpu": generator("cpu").bit_generator.state}


def set_rng_state(state: dict) -> None:
    seed(state["seed"])
    generator("cpu").bit_generator.state = state["cpu"]


def snapshot() -> dict:
    """This thread's settings: the default dtype, the device and the random state (``adopt``)."""
    return {"dtype": get_default_dtype(), "device": get_device(), "rng": get_rng_state()}


def adopt(snap: dict) -> None:
    """Make ``snapshot()``'s settings this thread's own, its generators too, drawing from then on as
    the snapshot's thread would have: a thread that stands for a process (a sim rank of
    ``dist.run_ranks``) starts as a process forked from the caller and draws apart from the others."""
    _state.default_dtype, _state.device, _state.rng = snap["dtype"], snap["device"], _Rng()
    set_rng_state(snap["rng"])


def random_seed() -> int:
    """Draw a fresh 63-bit seed from the CPU generator (ops such as dropout carry it as an attribute)."""
    return int(generator("cpu").integers(0, 2**63 - 1))
