"""safetensors files: atomic writes and lazy, zero-copy, fully validated reads. Never pickle.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
N bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the raw little-endian bytes of every tensor; offsets are relative to the end
of the header and the tensors tile the data region exactly (no holes, no overlaps).

Writing uses the safetensors library (the reference writer). Reading uses the small parser below
and ``np.memmap``: the library's numpy loader (``safetensors.numpy.load_file``) copies every tensor
into memory, and it cannot read BF16 at all, whereas a mapped file costs nothing until a tensor is
touched and shares the page cache between processes serving the same weights.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import safetensors.numpy

from . import backend as B
from .files import atomic_path
from .tensor import Tensor

__all__ = ["SafetensorsError", "SafetensorsFile", "load", "load_metadata", "safe_open", "save"]

# safetensors dtype codes of the dtypes the framework supports (by name: bfloat16 loads lazily).
DTYPE_CODES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class SafetensorsError(ValueError):
    """A file is not a valid safetensors file; the message names the file and the offending entry."""


class _Entry(NamedTuple):
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # byte offsets within the data region
    end: int


# ------------------------------------------------------------------------------------- writing


def _host_array(name: str, value: Any) -> np.ndarray:
    if isinstance(value, Tensor):
        value = value.numpy()  # moves GPU tensors to the host; raises clearly for tracer values
    elif B.is_array(value):
        value = B.to_numpy(value)
    else:
        raise TypeError(f"save: {name!r} must be a Tensor or an array, got {type(value).__name__}")
    try:
        B.dtype_name(value.dtype)
    except TypeError:
        raise TypeError(
            f"save: {name!r} has dtype {value.dtype}, which safetensors files here cannot hold; "
            f"supported: {', '.join(DTYPE_CODES.values())}"
        ) from None
    # The library reads raw memory from the data pointer, so the array must be C-contiguous;
    # np.require (unlike ascontiguousarray) keeps 0-d arrays 0-d.
    return np.require(value, requirements="C")


def save(
    state_dict: Mapping[str, Any], path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> None:
    """Write tensors (Tensors or arrays, any device) to a safetensors file, atomically.

    Every value is converted before anything touches the disk; the bytes go to a temporary file in
    the same directory (``files.atomic_path``: parents created), are fsynced, and replace ``path``
    in one ``os.replace``. A failure at any
    point leaves the previous file at ``path`` as it was, and no temporary file behind.
    """
    arrays: dict[str, np.ndarray] = {}
    for name, value in state_dict.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise TypeError(f"save: tensor names must be strings other than '__metadata__', got {name!r}")
        arrays[name] = _host_array(name, value)
    if metadata is not None:
        bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise TypeError(f"save: metadata must map str to str (json.dumps other values); bad keys: {bad}")
        metadata = dict(metadata)
    with atomic_path(path) as tmp:
        # The library writes files as 0600; give ours the permissions any new file gets (umask),
        # read off a file we create first ("x": never clobber anything).
        with open(tmp, "xb") as f:
            mode = os.fstat(f.fileno()).st_mode & 0o777
        safetensors.numpy.save_file(arrays, os.fspath(tmp), metadata=metadata)
        os.chmod(tmp, mode)


# ------------------------------------------------------------------------------------- reading


def _parse_header(path: str, size: int, head: bytes) -> tuple[dict[str, _Entry], dict[str, str]]:
    """Validate the JSON header of a file of ``size`` bytes; return its entries and metadata."""

    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: {msg}")

    data_len = size - 8 - len(head)
    try:
        header = json.loads(head.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise fail(f"the header is not UTF-8 ({e})") from None
    except json.JSONDecodeError as e:
        raise fail(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise fail(f"the header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise fail("'__metadata__' must be an object mapping strings to strings")

    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise fail(f"{where}: the entry must be an object, got {info!r}")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise fail(f"{where}: the entry has no {field!r}")
        dtype = DTYPE_CODES.get(info["dtype"])
        dtype = dtype and B.dtype(dtype)
        if dtype is None:
            raise fail(f"{where}: unknown dtype {info['dtype']!r}; supported: {', '.join(DTYPE_CODES)}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise fail(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise fail(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
        begin, end = offsets
        need = math.prod(shape) * dtype.itemsize
        if end - begin != need:
            raise fail(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but shape {shape} "
                f"of {info['dtype']} needs {need}"
            )
        if end > data_len:
            raise fail(
                f"{where}: the data region is truncated: the tensor ends at byte {end}, "
                f"the file holds {data_len} bytes of data"
            )
        entries[name] = _Entry(dtype, tuple(shape), begin, end)

    # The tensors must tile the data region: sorted by offset, each starts where the last ended.
    pos, prev = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin < pos:
            raise fail(
                f"tensor {name!r} (bytes [{e.begin}, {e.end})) overlaps tensor {prev!r} (ending at {pos})"
            )
        if e.begin > pos:
            raise fail(f"bytes [{pos}, {e.begin}) before tensor {name!r} belong to no tensor")
        pos, prev = e.end, name
    if pos != data_len:
        raise fail(f"{data_len - pos} bytes after the last tensor belong to no tensor")
    return entries, metadata


class SafetensorsFile(Mapping[str, Tensor]):
    """A safetensors file opened lazily (like ``safetensors.safe_open``): a mapping from names to Tensors.

    The header is read and validated on opening; a tensor is read (or, with ``mmap``, mapped as a
    zero-copy read-only view) only when it is looked up. Mapped tensors keep the mapping alive, so
    they stay valid after the file object is closed or dropped.
    """

    def __init__(self, path: str | os.PathLike[str], device: str = "cpu", mmap: bool = True) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors data is little-endian; big-endian hosts are not supported")
        self.path = os.fspath(path)
        self.device = B.check_device(device)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise SafetensorsError(f"{self.path}: {size} bytes is shorter than the 8-byte header length")
            n = int.from_bytes(f.read(8), "little")
            if n > size - 8:
                raise SafetensorsError(
                    f"{self.path}: the header length {n} runs past the end of the file ({size} bytes)"
                )
            head = f.read(n)
        self._entries, self._metadata = _parse_header(self.path, size, head)
        self._data_start = 8 + n
        data_len = size - self._data_start
        # np.memmap cannot map zero bytes; a file of empty tensors needs no mapping anyway.
        self._region = (
            np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start, shape=(data_len,))
            if mmap and data_len
            else None
        )
        self._closed = False

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def __getitem__(self, name: str) -> Tensor:
        e = self._entries.get(name)
        if e is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        if self._closed:
            raise ValueError(f"{self.path}: the file is closed; open it again to read {name!r}")
        if e.begin == e.end:
            arr = np.empty(e.shape, dtype=e.dtype)
        elif self._region is not None:
            # .view(np.ndarray): a plain array over the mapping (memmap subclasses leak into op results).
            arr = self._region[e.begin : e.end].view(np.ndarray).view(e.dtype).reshape(e.shape)
        else:
            raw = np.empty(e.end - e.begin, dtype=np.uint8)
            with open(self.path, "rb") as f:
                f.seek(self._data_start + e.begin)
                if f.readinto(raw.data) != raw.size:
                    raise SafetensorsError(f"{self.path}: tensor {name!r}: the file shrank while reading")
            arr = raw.view(e.dtype).reshape(e.shape)
        return Tensor(B.to_device(arr, self.device))

    get_tensor = __getitem__

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a tensor, from the header (reads no data)."""
        return self._entries[name].shape

    def close(self) -> None:
        """Drop this object's reference to the mapping (tensors already taken keep theirs)."""
        self._region = None
        self._closed = True

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self)} tensors, device={self.device!r})"


def safe_open(path: str | os.PathLike[str], device: str = "cpu", mmap: bool = True) -> SafetensorsFile:
    """Open a safetensors file lazily: keys come from the header, tensors are read on access."""
    return SafetensorsFile(path, device=device, mmap=mmap)


def load(path: str | os.PathLike[str], device: str = "cpu", mmap: bool = True) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, by name (header order).

    With ``mmap`` (the default, CPU) tensors are read-only views of the mapped file: nothing is
    read until used. Without it, or for ``device="gpu"``, the data is copied.
    """
    with safe_open(path, device=device, mmap=mmap) as f:
        return {name: f[name] for name in f}


def load_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty when it has none), validating the header."""
    with safe_open(path, mmap=False) as f:
        return f.metadata()
