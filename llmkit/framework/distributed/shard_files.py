"""Distributed tensors on disk: each rank writes the pieces it owns; any mesh reads the slices it needs.

``save_shards(tensors, directory)`` writes, for every rank this process hosts, one safetensors file
``rank-NNNNN.safetensors`` holding that rank's shard of each tensor it *owns*: the rank at index 0
of every mesh dim the tensor is replicated over (so each element is written once, by one rank, and
the ranks write in parallel). The file's metadata records, per tensor, its global shape and the
offset of the piece::

    {"llmkit.pieces": {"model.layers.0.mlp.up_proj.weight": {"shape": [344, 128], "start": [172, 0]}}}

``ShardReader(files)`` indexes the pieces of any set of such files, and of plain safetensors files
(whose tensors are whole pieces: a Hugging Face model directory reads the same way), and
``read(name, region)`` assembles exactly the slice asked for from the memory-mapped pieces that
intersect it, so a rank of another mesh reads only its own share (``bytes_read`` counts it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import serialization
from ..placement import Partial, Replicate
from ..tensor import Tensor
from .comm import get_backend
from .dist_array import DistArray

PIECES = "llmkit.pieces"  # safetensors metadata key


class ShardError(ValueError):
    """Pieces that do not make up the tensors they claim to: the message names file and tensor."""


RANK_FILES = "rank-*.safetensors"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def owns(x: DistArray, rank: int) -> bool:
    """Whether ``rank`` writes its shard of ``x``: index 0 along every mesh dim ``x`` is replicated on."""
    coord = x.mesh.coord(rank)
    return all(c == 0 for c, p in zip(coord, x.placements) if isinstance(p, Replicate))


def save_shards(tensors: Mapping[str, Tensor], directory: str | os.PathLike[str]) -> list[Path]:
    """Write the hosted ranks' owned pieces of distributed ``tensors`` (one file per hosted rank of
    their mesh, every file atomically); returns the files written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pieces: dict[int, dict[str, Any]] = {}
    meta: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        x = t._data
        if not isinstance(x, DistArray):
            raise TypeError(f"save_shards: {name!r} is not a distributed tensor")
        if any(isinstance(p, Partial) for p in x.placements):
            raise ValueError(f"save_shards: {name!r} is Partial {x.placements}; reduce it before saving")
        for r in get_backend().hosted(x.mesh.ranks):
            pieces.setdefault(r, {})
            meta.setdefault(r, {})
            if owns(x, r):
                pieces[r][name] = x.shards[r]
                meta[r][name] = {"shape": list(x.shape), "start": [s.start for s in x.region(r)]}
    files = []
    for r in sorted(pieces):
        f = directory / rank_file(r)
        serialization.save(pieces[r], f, metadata={PIECES: json.dumps(meta[r], separators=(",", ":"))})
        files.append(f)
    return files


@dataclass(frozen=True)
class Piece:
    file: Path
    key: str
    start: tuple[int, ...]
    shape: tuple[int, ...]  # of the piece


class ShardReader:
    """The tensors of a set of safetensors files, read by global slice (see the module docstring)."""

    def __init__(self, files: Sequence[str | os.PathLike[str]]) -> None:
        self.pieces: dict[str, list[Piece]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self._open: dict[Path, serialization.SafetensorsFile] = {}
        self.bytes_read = 0  # bytes this process copied out of the files
        self.rank_bytes: dict[int, int] = {}  # bytes each hosted rank's shards hold (read_placed)
        for file in map(Path, files):
            f = self._open[file] = serialization.safe_open(file)
            try:
                meta = json.loads(f.metadata().get(PIECES, "{}"))
            except json.JSONDecodeError as e:
                raise ShardError(f"{file}: metadata {PIECES!r} is not JSON ({e})") from None
            for key in f:
                shape = tuple(f.shape(key))
                info = meta.get(key, {"shape": list(shape), "start": [0] * len(shape)})
                self._add(file, key, info, shape, f[key].dtype)
        for name in self.pieces:
            self._check_cover(name)

    def _add(self, file: Path, key: str, info: Any, shape: tuple, dtype: np.dtype) -> None:
        try:
            full, start = tuple(int(d) for d in info["shape"]), tuple(int(s) for s in info["start"])
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"{file}: {key!r}: bad piece metadata {info!r}") from None
        if (
            len(full) != len(shape)
            or len(start) != len(shape)
            or any(s < 0 or s + n > d for s, n, d in zip(start, shape, full))
        ):
            raise ShardError(f"{file}: {key!r}: piece {list(shape)} at {list(start)} is outside {list(full)}")
        if self.shapes.setdefault(key, full) != full or self.dtypes.setdefault(key, dtype) != dtype:
            raise ShardError(
                f"{file}: {key!r} is {list(full)} {dtype} here, {list(self.shapes[key])} "
                f"{self.dtypes[key]} in another file"
            )
        self.pieces.setdefault(key, []).append(Piece(file, key, start, shape))

    def _check_cover(self, name: str) -> None:
        """The pieces tile the tensor: no two overlap and their volumes add up."""
        ps = self.pieces[name]
        for i, a in enumerate(ps):
            for b in ps[i + 1 :]:
                if _overlap(a.start, a.shape, b.start, b.shape) is not None and math.prod(a.shape) > 0:
                    raise ShardError(f"{name!r}: pieces in {a.file.name} and {b.file.name} overlap")
        have, want = sum(math.prod(p.shape) for p in ps), math.prod(self.shapes[name])
        if have != want:
            files = sorted({p.file.name for p in ps})
            raise ShardError(
                f"{name!r}: the pieces in {files} hold {have} of its {want} elements "
                "(a rank's file is missing from the checkpoint?)"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.pieces

    def names(self) -> list[str]:
        return list(self.pieces)

    def read(self, name: str, region: Sequence[slice] | None = None, copy: bool = True) -> np.ndarray:
        """The global slice ``region`` (whole when None) of tensor ``name``: a new array, or with
        ``copy=False`` a read-only view of the mapped file when one piece holds all of it."""
        if name not in self.pieces:
            raise KeyError(name)
        full = self.shapes[name]
        region = tuple(slice(0, d) for d in full) if region is None else tuple(region)
        start = tuple(s.start for s in region)
        shape = tuple(s.stop - s.start for s in region)
        if not copy:
            whole = (start, tuple(a + n for a, n in zip(start, shape)))
            for p in self.pieces[name]:
                if _overlap(p.start, p.shape, start, shape) == whole:
                    view = self._open[p.file][p.key]._data[
                        tuple(slice(a - o, a - o + n) for a, o, n in zip(start, p.start, shape))
                    ]
                    self.bytes_read += view.nbytes
                    return view
        out = np.empty(shape, self.dtypes[name])
        for p in self.pieces[name]:
            hit = _overlap(p.start, p.shape, start, shape)
            if hit is None:
                continue
            lo, hi = hit
            src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, p.start))
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, start))
            block = self._open[p.file][p.key]._data[src]
            out[dst] = block
            self.bytes_read += block.nbytes
        return out

    def read_placed(self, name: str, mesh: Any, placements: Sequence[Any]) -> DistArray:
        """Tensor ``name`` placed on ``mesh``: each hosted rank reads just its region (ranks holding
        the same region share one read)."""
        x = DistArray({}, mesh, placements, self.shapes[name], self.dtypes[name])
        regions: dict[tuple, np.ndarray] = {}
        for r in get_backend().hosted(mesh.ranks):
            box = tuple((s.start, s.stop) for s in x.region(r))
            if box not in regions:
                regions[box] = self.read(name, x.region(r))
            x.shards[r] = regions[box]
            self.rank_bytes[r] = self.rank_bytes.get(r, 0) + regions[box].nbytes
        return x

    @property
    def total_bytes(self) -> int:
        return sum(math.prod(s) * self.dtypes[n].itemsize for n, s in self.shapes.items())


def _overlap(a0: Sequence[int], an: Sequence[int], b0: Sequence[int], bn: Sequence[int]):
    """The intersection [lo, hi) of boxes (start, shape) a and b, or None when empty."""
    lo = tuple(max(x, y) for x, y in zip(a0, b0))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a0, an, b0, bn))
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)
