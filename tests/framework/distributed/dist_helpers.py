"""An independent reference of the layout of a distributed value, written from the definition in
docs/parallel.md (nested ``np.array_split`` of index ranges, Partial = reduction of the locals),
shared by the sim tests and the MPI check scripts. It never calls llmkit's layout code."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


def kind(p) -> tuple:
    """("R",), ("S", dim) or ("P", op) from a placement (read through its public fields)."""
    name = type(p).__name__
    if name == "Shard":
        return ("S", p.dim)
    if name == "Partial":
        return ("P", p.reduce)
    return ("R",)


def ref_index(shape, mesh_shape, placements, coord):
    """Index arrays (one per tensor dim) of the global elements at mesh coordinate ``coord``."""
    idx = [np.arange(n) for n in shape]
    for m, p in enumerate(placements):
        k = kind(p)
        if k[0] == "S":
            idx[k[1]] = np.array_split(idx[k[1]], mesh_shape[m])[coord[m]]
    return idx


def ref_local(g, mesh_shape, placements, coord):
    """What the rank at ``coord`` holds of global value ``g`` (Partial dims aside)."""
    return g[np.ix_(*ref_index(g.shape, mesh_shape, placements, coord))] if g.ndim else g


def coords(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def ref_global(locals_by_coord, shape, mesh_shape, placements):
    """The global value the locals stand for: Partial mesh dims reduced one at a time in mesh-dim
    order, replicas checked equal, every element covered."""
    partial = [m for m, p in enumerate(placements) if kind(p)[0] == "P"]
    g = np.full(shape, np.nan)
    seen = np.zeros(shape, bool)
    groups: dict = {}
    for c in coords(mesh_shape):
        key = tuple(0 if m in partial else x for m, x in enumerate(c))
        groups.setdefault(key, {})[c] = np.asarray(locals_by_coord[c], np.float64)
    for key, vals in groups.items():
        for m in partial:
            merged: dict = {}
            for c, v in sorted(vals.items()):
                merged.setdefault(tuple(0 if i == m else x for i, x in enumerate(c)), []).append(v)
            op = kind(placements[m])[1]
            vals = {c: REDUCE[op](np.stack(vs), axis=0) for c, vs in merged.items()}
        (v,) = vals.values()
        idx = np.ix_(*ref_index(shape, mesh_shape, placements, key)) if len(shape) else ()
        if seen[idx].any():
            assert np.array_equal(g[idx][seen[idx]], v[seen[idx]]), "replicas differ"
        g[idx] = v
        seen[idx] = True
    assert seen.all(), "some elements are held by no rank"
    return g


def make_locals(rng, g_shape, mesh_shape, placements):
    """Random integer-valued locals for ``placements`` (so sums are exact), equal along Replicate
    mesh dims, and the global value they stand for."""
    base = rng.integers(-8, 8, g_shape).astype(np.float64)
    partial = any(kind(p)[0] == "P" for p in placements)
    drawn: dict = {}
    locs = {}
    for c in coords(mesh_shape):
        loc = ref_local(base, mesh_shape, placements, c)
        if partial:
            key = tuple(0 if kind(p)[0] == "R" else x for p, x in zip(placements, c))
            if key not in drawn:
                drawn[key] = rng.integers(-8, 8, loc.shape).astype(np.float64)
            loc = drawn[key]
        locs[c] = loc
    return locs, ref_global(locs, g_shape, mesh_shape, placements)


def run_mpi(
    script: str, n: int, *args: str, timeout: float = 120, flags: tuple = (), env: dict | None = None
):
    """Run ``python script args`` under ``mpiexec -n n``; returns the CompletedProcess."""
    cmd = [
        "mpiexec",
        "--oversubscribe",
        "--allow-run-as-root",
        *flags,
        "-n",
        str(n),
        sys.executable,
        str(Path(__file__).parent / script),
        *args,
    ]
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_MCA_rmaps_base_oversubscribe="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
