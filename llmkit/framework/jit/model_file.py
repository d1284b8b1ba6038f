"""The static model file: programs in PIR text, weights in safetensors, a JSON manifest.

A directory (``model.llmkit/``)::

    manifest.json          format name + version, programs with their input/output specs,
                           weight names, user metadata, and the sha256 of every other file
    <program>.pir          one PIR text file per program (forward, prefill, decode...)
    weights.safetensors    every captured tensor, by stable name (shared between programs)
    <extra files>          tokenizer.model, ... (listed and checksummed like the rest)

The format is versioned apart from the package (``FORMAT_VERSION``); a loader reads the manifest
first and never guesses a format from a file name. Loading needs only llmkit.framework: no model
code. Truncated, corrupted or newer-version files fail with :class:`FormatError`. Versions: 1; 2,
whose programs may hold ``quant_linear`` with ``packed=2`` (float16 scales); 3, and ``quant_linears``
(the engine's products of one input, q/k/v and gate/up, in one op). A loader reads every version up
to its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from .. import backend as B
from ..files import atomic_dir, has_sha256, recover, sha256
from ..ir import Program, parse
from ..ir.errors import IRError
from ..serialization import SafetensorsError, load, save
from ..tensor import Tensor
from .static_function import ConcreteProgram, InputSpec, StaticFunction, to_static

FORMAT = "llmkit.static"
FORMAT_VERSION = 3
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


class FormatError(ValueError):
    """A static model file that cannot be read: missing parts, bad checksums, a newer format."""


class TensorSpec(TypedDict):
    shape: list[int | str]  # a str is a symbolic dim ("N")
    dtype: str


class ArgSpec(TensorSpec):
    name: str


class ProgramEntry(TypedDict):
    file: str  # <program>.pir
    function: str  # the function of that file to run
    inputs: list[ArgSpec]  # the function's first arguments, given by the caller
    weights: list[str]  # names in the weights file bound to the remaining arguments, in order
    outputs: list[TensorSpec]


class Manifest(TypedDict):
    """``manifest.json``, as :func:`check_json` checks it."""

    format: str  # FORMAT
    format_version: int  # 1 .. FORMAT_VERSION
    programs: dict[str, ProgramEntry]
    weights: str  # the safetensors file's name
    files: dict[str, str]  # every other file's name -> its sha256 (hex)
    metadata: dict[str, Any]  # the saver's, free-form


_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number"}
_JSON_KINDS.update({bool: "true or false", type(None): "null"})
_SHA256 = re.compile("[0-9a-f]{64}")


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _is(value: Any, t: type) -> bool:
    """JSON's view of ``isinstance``: true and false are not integers; an integer is a number."""
    if isinstance(value, bool) and t is not bool:
        return False
    return isinstance(value, (int, float) if t is float else t)


def check_json(value: Any, hint: Any, file: str, field: str = "") -> None:
    """Raise :class:`FormatError` naming ``file`` and the field unless parsed JSON ``value`` has type
    ``hint``: a JSON scalar type, a union of them, ``list[T]``, ``dict[str, T]``, ``Any``, or a
    TypedDict or dataclass (an object with those fields, the ones without a default required)."""

    def fail(what: str) -> FormatError:
        return FormatError(f"{file}: {field or 'the top level'}: {what}")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return
    if origin in (typing.Union, types.UnionType):
        if not any(_is(value, t) for t in args):
            raise fail(f"expected {' or '.join(_JSON_KINDS[t] for t in args)}, got {_kind(value)}")
    elif origin is list or origin is dict or typing.is_typeddict(hint) or dataclasses.is_dataclass(hint):
        want = list if origin is list else dict
        if not isinstance(value, want):
            raise fail(f"expected {_JSON_KINDS[want]}, got {_kind(value)}")
        sub = f"{field}." if field else ""
        if origin is list:
            for i, v in enumerate(value):
                check_json(v, args[0], file, f"{field}[{i}]")
        elif origin is dict:
            for k, v in value.items():
                check_json(v, args[1], file, sub + k)
        else:
            for k, t in typing.get_type_hints(hint).items():
                if k in value:
                    check_json(value[k], t, file, sub + k)
                elif k in _required(hint):
                    raise FormatError(f"{file}: {sub + k}: a required field is missing")
    elif not _is(value, hint):
        raise fail(f"expected {_JSON_KINDS[hint]}, got {_kind(value)}")


def _required(record: Any) -> set[str]:
    if typing.is_typeddict(record):
        return set(record.__required_keys__)
    none = dataclasses.MISSING
    return {f.name for f in dataclasses.fields(record) if f.default is none and f.default_factory is none}


def _check_file_name(path: Path, name: str, where: str) -> None:
    """A listed file must be a plain name of a file inside ``path`` (no ``..``, ``/`` or links out)."""
    if name in ("", ".", "..", MANIFEST) or any(c in name for c in "/\\\0"):
        raise FormatError(f"{where}: {name!r} is not the plain name of a file in the model directory")
    f = path / name
    if not f.is_file():
        raise FormatError(f"{path}: file {name!r} listed in the manifest is missing")
    if f.resolve().parent != path.resolve():
        raise FormatError(f"{where}: {name!r} links outside the model directory")


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
        user, captured = f.args[: cp.n_args], f.args[cp.n_args :]
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
        for pname, cp in programs.items():
            (tmp / entries[pname]["file"]).write_text(str(cp.program))
        save(weights, tmp / WEIGHTS)
        for name, data in (extra_files or {}).items():
            if "/" in name or name in (MANIFEST, WEIGHTS) or name.endswith(".pir"):
                raise ValueError(f"jit.save: bad extra file name {name!r}")
            (tmp / name).write_bytes(data)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "programs": entries,
            "weights": WEIGHTS,
            "files": {f.name: sha256(f) for f in sorted(tmp.iterdir())},
            "metadata": dict(metadata or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return path


class LoadedFunction:
    """One program of a static model file: call it with arrays or Tensors."""

    def __init__(
        self,
        name: str,
        program: Program,
        entry: dict[str, Any],
        weights: list[Any],
        compiler: str | None,
        text: str | None = None,
        compiled: bool = False,
    ) -> None:
        self.name, self.program, self.entry = name, program, entry
        self.weights = weights  # the arrays bound to the function arguments after the inputs
        self._compiler, self._text, self._compiled = compiler, text, compiled
        self._executor = None
        self.input_specs, self.output_specs = entry["inputs"], entry["outputs"]

    @property
    def executor(self):
        if self._executor is None:
            from ..executor import Executor
            from .compile import executor_for

            func = self.entry["function"]
            self._executor = (  # compiled: from the cache of compiled programs, at load
                Executor(self.program, func, native=True)
                if self._compiled
                else executor_for(self.program, self._compiler, func, key=self._text)
            )
        return self._executor

    def rewrite(self, tag: str, edit: Callable[[Program], None]) -> None:
        """Change the program before its first call: ``edit`` changes the stored text's program in
        place, the same way for the same ``tag``; compiled programs are cached under text and tag
        (a hit needs no parse, and no edit)."""
        key = f"{self._text}\0{tag}"
        program = _compiled(key, self._compiler)
        self._compiled = program is not None
        if program is None:
            program = parse(self._text)
            edit(program)
            program.verify()
        self.program, self._text = program, key

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
        self._load: Callable[[str], LoadedFunction] | None = None  # load_model's, for its lazy programs

    def program(self, name: str) -> LoadedFunction:
        """``programs[name]``, loaded now if ``jit.load`` deferred it (KeyError: no such program)."""
        if name not in self.programs and self._load is not None and name in self.manifest["programs"]:
            self.programs[name] = self._load(name)
        return self.programs[name]

    def file(self, name: str) -> bytes:
        """An extra file shipped in the model directory (its bytes checked against the manifest)."""
        digest = self.manifest["files"].get(name)
        if digest is None:
            raise FormatError(f"{self.path}: no file {name!r} in the manifest")
        data = (self.path / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise FormatError(f"{self.path}: {name} is corrupted (sha256 does not match the manifest)")
        return data

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
    verify: bool = False,
    lazy: Sequence[str] = (),
) -> StaticModel:
    """Read a static model directory written by ``jit.save``, trusting nothing in it.

    The manifest must have the schema of :class:`Manifest` and a version this llmkit reads; every
    file the loader reads (programs, weights, extra files) must be listed in ``files`` under a plain
    name inside the directory and match its sha256 (read in full at the first load of each file;
    later loads of the file unchanged since, by its inode, size and times, trust the user's cache
    record of that check: ``files.has_sha256``; ``verify=True`` reads every byte again); the
    weights are memory-mapped, not read; each program's function must take exactly the
    listed inputs and weights, with the listed shapes and dtypes. Anything else is a
    :class:`FormatError` naming the file and the field. The programs named in ``lazy`` are parsed
    and checked at their first ``model.program(name)`` instead (a server that may never run one
    does not wait for it at start).
    """
    path = Path(path)
    recover(path)  # a save that a crash interrupted
    mpath = path / MANIFEST
    if not path.is_dir() or not mpath.is_file():
        if (path / "config.json").is_file():
            raise FormatError(
                f"{path}: a model directory (config.json), not a static model file; write one with "
                f"`llmkit export --model {path} --out {path.name}.llmkit`"
            )
        raise FormatError(
            f"{path}: not a static model directory (no {MANIFEST}); "
            "write one with llmkit.jit.save or `llmkit export`"
        )
    try:
        manifest = json.loads(mpath.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        what = repr(manifest.get("format")) if isinstance(manifest, dict) else f"a JSON {_kind(manifest)}"
        raise FormatError(f"{mpath}: not an llmkit static model manifest (format {what})")
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise FormatError(
            f"{path}: written in static-model format version {version}, but this llmkit reads "
            f"up to version {FORMAT_VERSION}; upgrade llmkit"
        )
    check_json(manifest, Manifest, str(mpath))
    if version < 1:
        raise FormatError(f"{mpath}: format_version: must be at least 1, got {version}")
    files, entries, wfile = manifest["files"], manifest["programs"], manifest["weights"]
    for name, digest in files.items():
        _check_file_name(path, name, f"{mpath}: files")
        if not _SHA256.fullmatch(digest):
            raise FormatError(f"{mpath}: files.{name}: not a sha256 hex digest: {digest!r}")
    reads = {wfile: "weights", **{e["file"]: f"programs.{p}.file" for p, e in entries.items()}}
    for name, field in reads.items():
        if name not in files:
            raise FormatError(f"{mpath}: {field}: {name!r} is not listed (with its sha256) in files")
    for name, digest in files.items():
        if not has_sha256(path / name, digest, full=verify):
            raise FormatError(f"{path}: {name} is corrupted (sha256 does not match the manifest)")
    try:
        weights = {k: t._data for k, t in load(path / wfile, device=device).items()}
    except SafetensorsError as e:
        raise FormatError(f"{path}: weights unreadable: {e}") from None

    def load_program(pname: str) -> LoadedFunction:
        return _load_program(path, pname, entries[pname], weights, wfile, compiler)

    model = StaticModel(path, manifest, {p: load_program(p) for p in entries if p not in lazy}, weights)
    model._load = load_program
    return model


def _load_program(
    path: Path, pname: str, entry: dict[str, Any], weights: dict[str, Any], wfile: str, compiler: str | None
) -> LoadedFunction:
    """One program of the manifest, parsed and checked against its entry (arguments, outputs, weights)."""
    where = f"{path / MANIFEST}: programs.{pname}"
    try:
        text = (path / entry["file"]).read_bytes().decode("utf-8")
        program = _compiled(text, compiler)
        compiled = program is not None
        program = program or parse(text)
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: program {pname!r}: {entry['file']} is not UTF-8 text ({e})") from None
    except IRError as e:
        first = str(e).splitlines()[0]  # the position and the problem (the rest quotes the text)
        raise FormatError(f"{path}: program {pname!r} ({entry['file']}) does not parse: {first}") from None
    fn = program.functions.get(entry["function"])
    if fn is None:
        raise FormatError(
            f"{where}.function: {entry['file']} has no function {entry['function']!r} "
            f"(it has {', '.join(map(repr, program.functions)) or 'none'})"
        )
    n_in, names = len(entry["inputs"]), entry["weights"]
    if len(fn.args) != n_in + len(names):
        raise FormatError(
            f"{where}: {n_in} inputs and {len(names)} weights, but {entry['file']}'s function takes "
            f"{len(fn.args)} arguments"
        )
    if entry["inputs"] != [{"name": a.name, **_spec(a.type)} for a in fn.args[:n_in]]:
        raise FormatError(f"{where}.inputs: do not match the arguments of {entry['file']}'s function")
    if entry["outputs"] != [_spec(v.type) for v in fn.outputs]:
        raise FormatError(f"{where}.outputs: do not match the results of {entry['file']}'s function")
    bound = []
    for i, (w, a) in enumerate(zip(names, fn.args[n_in:])):
        if w not in weights:
            raise FormatError(f"{where}.weights[{i}]: {w!r} is not in {wfile}")
        have, want = _spec(weights[w]), _spec(a.type)
        if have != want:
            raise FormatError(
                f"{where}.weights[{i}]: {w!r} is {have['dtype']}{have['shape']} in the weights file, "
                f"but {entry['file']} takes {want['dtype']}{want['shape']}"
            )
        bound.append(weights[w])
    return LoadedFunction(pname, program, entry, bound, compiler, text, compiled)


def _compiled(text: str, compiler: str | None) -> Program | None:
    """The program of ``text`` as the CINN compiler left it when it last compiled the same text
    (the compiled-program cache), or None: the loader then parses and the first call compiles."""
    from .compile import default_compiler

    if (compiler or default_compiler()) != "cinn":
        return None
    from ..compiler import available, program_cache

    return program_cache.load(text) if available() else None


def save_static(
    obj: Any,
    path: str | os.PathLike[str],
    input_spec: Sequence[Any] | None = None,
    example_inputs: Sequence[Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> Path:
    """``jit.save``: a Layer, a StaticFunction, or a dict of them (name -> program), to ``path``.

    Each needs an input signature: a StaticFunction already traced, ``input_spec`` (all dims
    given as ints or symbols) to trace it now, or ``example_inputs`` to trace it on (their shapes
    become the saved program's fixed input shapes).
    """
    objs = obj if isinstance(obj, Mapping) else {"forward": obj}
    programs: dict[str, ConcreteProgram] = {}
    names: dict[int, str] = {}
    for pname, o in objs.items():
        sf = o if isinstance(o, StaticFunction) else to_static(o, input_spec=input_spec)
        if sf.input_spec is None and input_spec is not None:
            sf.input_spec = list(input_spec)
        if sf._last is None and example_inputs is not None:
            sf.get_concrete_program(
                *(x if isinstance(x, Tensor) else Tensor(np.asarray(x)) for x in example_inputs)
            )
        elif sf._last is None:
            if sf.input_spec is None:
                raise ValueError(
                    f"jit.save: {pname!r} has not been traced; pass input_spec or example_inputs"
                )
            trace_specs(sf)
        programs[pname] = sf._last
        names.update(sf._state_names())
    return save_programs(path, programs, names, metadata, extra_files)


def trace_specs(sf: StaticFunction) -> ConcreteProgram:
    """Trace StaticFunction ``sf`` for every input its ``input_spec`` allows (InputSpecs, or their
    fields as tuples): on zeros of those shapes and dtypes, a symbolic dim at size 1."""
    specs = [s if isinstance(s, InputSpec) else InputSpec(*s) for s in sf.input_spec]
    zeros = [np.zeros([d if isinstance(d, int) else 1 for d in s.shape], B.dtype(s.dtype)) for s in specs]
    return sf.get_concrete_program(*(Tensor(z) for z in zeros))
