"""The static model file: programs in PIR text, weights in safetensors, a JSON manifest.

A directory (``model.llmkit/``)::

    manifest.json          format name + version, programs with their input/output specs,
                           weight names, user metadata, and the sha256 of every other file
    <program>.pir          one PIR text file per program (forward, prefill, decode...)
    weights.safetensors    every captured tensor, by stable name (shared between programs)
    <extra files>          tokenizer.model, ... (listed and checksummed like the rest)

The format is versioned apart from the package (``FORMAT_VERSION``); a loader reads the manifest
first and never guesses a format from a file name. Loading needs only llmkit.framework: no model
code. Truncated, corrupted or newer-version files fail with :class:`FormatError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import backend as B
from ..files import atomic_dir, recover
from ..io import SafetensorsError, load, save
from ..ir import Program, parse
from ..ir.errors import IRError
from ..tensor import Tensor
from .static_function import ConcreteProgram

FORMAT = "llmkit.static"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


class FormatError(ValueError):
    """A static model file that cannot be read: missing parts, bad checksums, a newer format."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _spec(t: Any) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": B.dtype_name(t.dtype)}


def save_programs(
    path: str | os.PathLike[str],
    programs: Mapping[str, ConcreteProgram],
    names: Mapping[int, str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write traced programs and the tensors they capture into a static model directory, atomically.

    A tensor captured by several programs is stored once; ``names`` (id(tensor) -> name) gives the
    stored names (parameter names), else the program's input names are used.
    """
    path = Path(path)
    names = dict(names or {})
    weights: dict[str, np.ndarray] = {}
    key_of: dict[int, str] = {}
    entries: dict[str, Any] = {}
    for pname, cp in programs.items():
        if cp.updated:
            raise ValueError(
                f"jit.save: program {pname!r} updates captured state (a training step); "
                "save an inference function instead"
            )
        f = cp.program.function()
        args = f.args
        user, captured = args[: cp.n_args], args[cp.n_args :]
        bindings = []
        for t, a in zip(cp.captures, captured):
            key = key_of.get(id(t))
            if key is None:
                key = names.get(id(t)) or a.name
                while key in weights:
                    key += "_"
                key_of[id(t)] = key
                weights[key] = B.to_numpy(t._data)
            bindings.append(key)
        entries[pname] = {
            "file": f"{pname}.pir",
            "function": f.name,
            "inputs": [{"name": a.name, **_spec(a.type)} for a in user],
            "weights": bindings,
            "outputs": [_spec(v.type) for v in f.outputs],
        }
    with atomic_dir(path) as tmp:
        files: dict[str, str] = {}
        for pname, cp in programs.items():
            (tmp / entries[pname]["file"]).write_text(str(cp.program))
        save(weights, tmp / WEIGHTS)
        for name, data in (extra_files or {}).items():
            if "/" in name or name in (MANIFEST, WEIGHTS) or name.endswith(".pir"):
                raise ValueError(f"jit.save: bad extra file name {name!r}")
            (tmp / name).write_bytes(data)
        for f in sorted(tmp.iterdir()):
            files[f.name] = _sha256(f)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "programs": entries,
            "weights": WEIGHTS,
            "files": files,
            "metadata": dict(metadata or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return path


class LoadedFunction:
    """One program of a static model file: call it with arrays or Tensors."""

    def __init__(
        self, name: str, program: Program, entry: dict[str, Any], weights: list[Any], compiler: str | None
    ) -> None:
        self.name, self.program, self.entry = name, program, entry
        self.weights = weights  # the arrays bound to the function arguments after the inputs
        self._compiler = compiler
        self._executor = None
        self.input_specs = entry["inputs"]
        self.output_specs = entry["outputs"]

    @property
    def executor(self):
        if self._executor is None:
            from .compile import executor_for

            self._executor = executor_for(self.program, self._compiler, self.entry["function"])
        return self._executor

    def __call__(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.input_specs):
            raise TypeError(
                f"{self.name}: takes {len(self.input_specs)} inputs "
                f"({', '.join(i['name'] for i in self.input_specs)}), got {len(inputs)}"
            )
        tensors = any(isinstance(x, Tensor) for x in inputs)
        arrays = [x._data if isinstance(x, Tensor) else np.asarray(x) for x in inputs]
        outs = self.executor.run([*arrays, *self.weights])
        res = [Tensor(o) for o in outs] if tensors else outs
        return res[0] if len(res) == 1 else tuple(res)


class StaticModel:
    """What ``jit.load`` returns: ``model(...)`` runs its only (or "forward") program;
    ``model.programs["decode"](...)`` any of them; ``model.metadata`` and ``model.files`` the rest."""

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        programs: dict[str, LoadedFunction],
        weights: dict[str, Any],
    ) -> None:
        self.path, self.manifest, self.programs, self.weights = path, manifest, programs, weights
        self.metadata = manifest.get("metadata", {})

    def file(self, name: str) -> bytes:
        """An extra file shipped in the model directory (checksummed at load)."""
        if name not in self.manifest["files"]:
            raise KeyError(f"{self.path}: no file {name!r} in the manifest")
        return (self.path / name).read_bytes()

    def __call__(self, *inputs: Any) -> Any:
        fn = self.programs.get("forward") or (
            next(iter(self.programs.values())) if len(self.programs) == 1 else None
        )
        if fn is None:
            raise TypeError(
                f"{self.path}: several programs ({', '.join(self.programs)}); call model.programs[name]"
            )
        return fn(*inputs)

    def __repr__(self) -> str:
        return f"<StaticModel {self.path} programs={list(self.programs)}>"


def load_model(
    path: str | os.PathLike[str],
    compiler: str | None = None,
    device: str = "cpu",
    verify_checksums: bool = True,
) -> StaticModel:
    """Read a static model directory written by ``jit.save`` (checks format, version and checksums)."""
    path = Path(path)
    recover(path)  # a save that a crash interrupted
    mpath = path / MANIFEST
    if not path.is_dir() or not mpath.is_file():
        raise FormatError(
            f"{path}: not a static model directory (no {MANIFEST}); "
            "write one with llmkit.jit.save or `llmkit export`"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FormatError(
            f"{mpath}: not an llmkit static model manifest (format {manifest.get('format')!r})"
            if isinstance(manifest, dict)
            else f"{mpath}: not a manifest object"
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise FormatError(
            f"{path}: written in static-model format version {version}, but this llmkit reads "
            f"up to version {FORMAT_VERSION}; upgrade llmkit"
        )
    try:
        files: dict[str, str] = manifest["files"]
        entries: dict[str, Any] = manifest["programs"]
        wfile = manifest["weights"]
    except KeyError as e:
        raise FormatError(f"{mpath}: missing field {e.args[0]!r}") from None
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise FormatError(f"{path}: file {name!r} listed in the manifest is missing")
        if verify_checksums and _sha256(f) != digest:
            raise FormatError(f"{path}: {name} is corrupted (sha256 does not match the manifest)")
    try:
        weights = {k: t._data for k, t in load(path / wfile, device=device).items()}
    except SafetensorsError as e:
        raise FormatError(f"{path}: weights unreadable: {e}") from None
    programs = {}
    for pname, entry in entries.items():
        try:
            program = parse((path / entry["file"]).read_text())
        except IRError as e:
            raise FormatError(f"{path}: program {pname!r} does not parse: {e}") from None
        missing = [w for w in entry["weights"] if w not in weights]
        if missing:
            raise FormatError(f"{path}: program {pname!r} needs weights missing from {wfile}: {missing[:5]}")
        programs[pname] = LoadedFunction(
            pname, program, entry, [weights[w] for w in entry["weights"]], compiler
        )
    return StaticModel(path, manifest, programs, weights)


def save_static(
    obj: Any,
    path: str | os.PathLike[str],
    input_spec: Sequence[Any] | None = None,
    example_inputs: Sequence[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """``jit.save``: a Layer, a StaticFunction, or a dict of them (name -> program), to ``path``.

    Each needs an input signature: a StaticFunction already traced, or ``input_spec`` (all dims
    given as ints or symbols) to trace it now.
    """
    from .static_function import InputSpec, StaticFunction, to_static

    objs = obj if isinstance(obj, Mapping) else {"forward": obj}
    programs: dict[str, ConcreteProgram] = {}
    names: dict[int, str] = {}
    for pname, o in objs.items():
        sf = o if isinstance(o, StaticFunction) else to_static(o, input_spec=input_spec)
        if sf.input_spec is None and input_spec is not None:
            sf.input_spec = list(input_spec)
        if sf._last is None:
            specs = sf.input_spec
            if specs is None:
                raise ValueError(f"jit.save: {pname!r} has not been traced; pass input_spec")
            dummies = []
            for s in specs:
                s = s if isinstance(s, InputSpec) else InputSpec(*s)
                shape = [d if isinstance(d, int) else 2 for d in s.shape]
                dummies.append(Tensor(np.zeros(shape, dtype=B.dtype(s.dtype))))
            sf.get_concrete_program(*dummies)
        programs[pname] = sf._last
        names.update(sf._state_names())
    return save_programs(path, programs, names, metadata, extra_files)
