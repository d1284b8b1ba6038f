"""Compiled programs cached by content, so that loading the same program again does no compiler work.

``compile_program(program, key=text)`` looks up sha256(the program's text, the toolchain's identity,
the framework's source) in ``<kernel cache>/programs/``. An entry holds the fused program's text and,
per fusion group in program order, what running its kernel needs besides the loop IR (sizes, outputs,
work) and its candidates' kernel names; the kernels themselves are in the kernel cache. A hit parses
the fused text and binds the groups to their shared objects: no fusion passes, lowering or C
rendering (about a second for a 134M model's three programs). Any change to the framework's code,
the toolchain or the settings compiled into the kernels changes every key; an unreadable entry, or
a kernel missing from the cache, is a miss (compiled as usual, then stored). The cache is trusted
as the kernel cache is: it holds code that runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .. import backend as B
from ..files import atomic_write
from ..ir import Program, parse
from ..ir.errors import IRError
from . import build, runtime
from .codegen_c import STREAM_BYTES
from .lower import Axis, Input, Lowered, group_parts


@functools.cache
def _code_digest() -> str:
    """sha256 of the framework's source (Python and C): a new llmkit never reads an old entry."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _entry(key: str) -> Path:
    tc = build.toolchain()
    ident = f"{tc.ident if tc else ''}|{STREAM_BYTES}"  # the settings compiled into the kernels
    h = hashlib.sha256(f"{_code_digest()}\0{ident}\0{key}".encode()).hexdigest()
    return build.cache_dir() / "programs" / f"{h[:32]}.json"


def _groups(program: Program) -> list[Any]:
    return [op for f in program.functions.values() for op in f.body if op.name == "cinn.fusion"]


def load(key: str) -> Program | None:
    """The compiled program stored under ``key``, its groups bound to their kernels; None on a miss
    (always with ``LLMKIT_CINN_DUMP`` set: the kernels' sources are written as they are compiled)."""
    if os.environ.get("LLMKIT_CINN_DUMP"):
        return None
    try:
        entry = json.loads(_entry(key).read_text())
        program = parse(entry["program"], verify=False)
        ops, groups = _groups(program), entry["groups"]
        names = [n for g in groups if g for _, n in g["kernels"]]
        if len(ops) != len(groups) or not all((build.cache_dir() / f"{n}.so").exists() for n in names):
            return None
        fns = build.build(dict.fromkeys(names, ""))
        for op, g in zip(ops, groups):
            if g is not None:
                low = Lowered(
                    g["label"],
                    [Axis("work", g["work"], False)],
                    [Input(f"in{k}", None, (), False) for k in range(g["inputs"])],
                    [(buf, B.dtype(dt), tuple(shape)) for buf, dt, shape in g["outputs"]],
                    g["sizes"],
                    [tuple(s) for s in g["size_sources"]],
                    g["num_sizes"],
                    head=group_parts(op)[2],
                    inplace=g["inplace"],
                )
                cands = [(label, n, fns[n]) for label, n in g["kernels"] if fns[n] is not None]
                runtime._KERNELS[op] = runtime.FusedKernel(op, low, cands)
    except (OSError, ValueError, KeyError, TypeError, IRError):
        return None
    return program


def store(key: str, program: Program) -> None:
    """Record ``program`` (compiled: its groups' kernels built) under ``key``; best effort."""
    groups = []
    for op in _groups(program):
        k = runtime._KERNELS.get(op)
        var = None if k is None else k.variants.get(tuple(True for _ in range(len(next(iter(k.variants))))))
        if k is None or var is None or var.strided:
            groups.append(None)
            continue
        groups.append(
            {
                "label": k.label,
                "work": var.work,
                "inputs": len(next(iter(k.variants))),
                "outputs": [(buf, B.dtype_name(dt), list(shape)) for buf, dt, shape in k.outputs],
                "sizes": var.sizes,
                "size_sources": k.size_sources,
                "num_sizes": len(k.size_names),
                "inplace": k.inplace,
                "kernels": list(zip(var.labels, var.names)),
            }
        )
    with contextlib.suppress(OSError):
        path = _entry(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"program": str(program), "groups": groups}))
