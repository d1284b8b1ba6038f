"""``jit.load`` trusts nothing in a static model directory: every file it reads is listed and checksummed,
names stay inside the directory, and any malformed manifest is a FormatError naming the field."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import jit

X = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.fixture
def saved(tmp_path) -> Path:
    lf.seed(3)
    return jit.save(
        lf.nn.Linear(4, 3),
        tmp_path / "m.llmkit",
        input_spec=[jit.InputSpec(["N", 4], "float32")],
        metadata={"note": "hi"},
        extra_files={"notes.txt": b"notes"},
    )


def manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


def write(path: Path, m: Any) -> None:
    (path / "manifest.json").write_text(json.dumps(m))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_an_empty_file_list_checks_nothing_and_is_refused(saved):
    w = saved / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF  # a corrupted weight, same size
    w.write_bytes(bytes(data))
    with pytest.raises(jit.FormatError, match="weights.safetensors is corrupted"):
        jit.load(saved)
    m = manifest(saved)
    m["files"] = {}
    write(saved, m)
    with pytest.raises(jit.FormatError, match=r"weights: 'weights.safetensors' is not listed .* in files"):
        jit.load(saved)
    m["files"] = {"weights.safetensors": sha(bytes(data))}  # the program file unlisted
    write(saved, m)
    with pytest.raises(jit.FormatError, match=r"programs.forward.file: 'forward.pir' is not listed"):
        jit.load(saved)


def test_a_verified_file_is_read_again_only_once_it_changed(saved, monkeypatch):
    """The first load reads every byte; later loads trust the user cache's record of that check
    while the file is as it was (inode, size, times), unless verify=True; a write is caught."""
    from llmkit.framework import files

    reads: list[str] = []
    real = files.sha256
    monkeypatch.setattr(files, "sha256", lambda p: reads.append(Path(p).name) or real(p))
    w = saved / "weights.safetensors"
    jit.load(saved)
    jit.load(saved)  # written just now: no record yet (a write in the same clock tick would hide)
    assert reads.count("weights.safetensors") == 2
    monkeypatch.setattr(files, "RACY_S", 0.0)
    jit.load(saved)
    reads.clear()
    jit.load(saved)
    assert reads == []
    jit.load(saved, verify=True)
    assert reads.count("weights.safetensors") == 1
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    with open(w, "r+b") as f:  # in place: the same inode and size
        f.write(bytes(data))
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # and an older modification time
    with pytest.raises(jit.FormatError, match="weights.safetensors is corrupted"):
        jit.load(saved)


@pytest.mark.parametrize(
    "name", ["../outside.txt", "/tmp/outside.txt", "sub/../notes.txt", "..", "manifest.json"]
)
def test_names_outside_the_directory_are_refused(saved, name):
    outside = saved.parent / "outside.txt"
    outside.write_bytes(b"outside")
    m = manifest(saved)
    m["files"][name] = sha(b"outside")
    write(saved, m)
    with pytest.raises(jit.FormatError, match=r"files: .* is not the plain name of a file"):
        jit.load(saved)


def test_links_out_of_the_directory_are_refused_and_links_inside_it_are_read(saved):
    (saved.parent / "outside.txt").write_bytes(b"outside")
    (saved / "link.txt").symlink_to(saved.parent / "outside.txt")
    m = manifest(saved)
    m["files"]["link.txt"] = sha(b"outside")
    write(saved, m)
    with pytest.raises(jit.FormatError, match="'link.txt' links outside the model directory"):
        jit.load(saved)
    (saved / "link.txt").unlink()
    (saved / "link.txt").symlink_to("notes.txt")
    m["files"]["link.txt"] = sha(b"notes")
    write(saved, m)
    assert jit.load(saved).file("link.txt") == b"notes"


def test_extra_files_are_checked_when_read(saved):
    model = jit.load(saved)
    assert model.file("notes.txt") == b"notes"
    (saved / "notes.txt").write_bytes(b"NOTES")
    with pytest.raises(jit.FormatError, match="notes.txt is corrupted"):
        model.file("notes.txt")
    with pytest.raises(jit.FormatError, match="no file 'tokenizer.model' in the manifest"):
        model.file("tokenizer.model")


def test_a_program_file_that_is_not_utf8_is_a_format_error(saved):
    data = b"\xff\xfe" + (saved / "forward.pir").read_bytes()
    (saved / "forward.pir").write_bytes(data)
    m = manifest(saved)
    m["files"]["forward.pir"] = sha(data)
    write(saved, m)
    with pytest.raises(jit.FormatError, match="forward.pir is not UTF-8 text"):
        jit.load(saved)
    (saved / "manifest.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(jit.FormatError, match="not valid JSON"):
        jit.load(saved)


def _set(m: dict, path: str, value: Any) -> None:
    *parents, last = path.split("/")
    for p in parents:
        m = m[int(p)] if isinstance(m, list) else m[p]
    if value is _DELETE:
        del m[last]
    else:
        m[int(last) if isinstance(m, list) else last] = value


_DELETE = object()
_SWAPPED = ["bias", "weight"]


@pytest.mark.parametrize(
    "where, value, message",
    [
        ("files", [], "files: expected an object, got an array"),
        ("files/forward.pir", 5, "files.forward.pir: expected a string, got an integer"),
        ("files/forward.pir", "abc", "files.forward.pir: not a sha256 hex digest"),
        ("programs", "forward", "programs: expected an object, got a string"),
        ("programs/forward", None, "programs.forward: expected an object, got null"),
        ("programs/forward/inputs", _DELETE, "programs.forward.inputs: a required field is missing"),
        (
            "programs/forward/inputs/0/shape/0",
            None,
            r"inputs\[0\].shape\[0\]: expected an integer or a string",
        ),
        ("programs/forward/inputs/0/shape/1", 5, r"programs.forward.inputs: do not match the arguments"),
        ("programs/forward/outputs/0/dtype", "int64", r"programs.forward.outputs: do not match the results"),
        (
            "programs/forward/function",
            "nope",
            "programs.forward.function: forward.pir has no function 'nope'",
        ),
        (
            "programs/forward/weights",
            ["weight"],
            "1 inputs and 1 weights, but forward.pir's function takes 3",
        ),
        ("programs/forward/weights", ["weight", "nope"], r"weights\[1\]: 'nope' is not in"),
        ("programs/forward/weights", _SWAPPED, r"weights\[0\]: 'bias' is float32\[3\] in the weights file"),
        ("programs/forward/file", "notes.txt", r"program 'forward' \(notes.txt\) does not parse"),
        ("weights", _DELETE, "weights: a required field is missing"),
        ("weights", "notes.txt", "weights unreadable"),
        ("weights", ["weights.safetensors"], "weights: expected a string, got an array"),
        ("format_version", -1, "format_version: must be at least 1, got -1"),
        ("format_version", 0, "format_version: must be at least 1, got 0"),
        ("format_version", "1", "format_version: expected an integer, got a string"),
        ("format_version", 1.0, "format_version: expected an integer, got a number"),
        ("format_version", True, "format_version: expected an integer, got true or false"),
        ("format_version", _DELETE, "format_version: a required field is missing"),
        ("format", 1, "not an llmkit static model manifest"),
        ("metadata", "hi", "metadata: expected an object, got a string"),
    ],
)
def test_each_malformed_manifest_names_its_field(saved, where, value, message):
    m = manifest(saved)
    _set(m, where, value)
    write(saved, m)
    with pytest.raises(jit.FormatError, match=message):
        jit.load(saved)


def test_a_manifest_that_is_not_an_object(saved):
    write(saved, [1, 2])
    with pytest.raises(jit.FormatError, match="not an llmkit static model manifest"):
        jit.load(saved)


# ---- fuzzing --------------------------------------------------------------------------------------


def test_random_mutations_of_a_real_manifest_raise_only_format_errors(saved, mutate_json):
    rng = random.Random(16)
    original = manifest(saved)
    outcomes = {"refused": 0, "loaded": 0}
    for i in range(400):
        m = copy.deepcopy(original)
        for _ in range(rng.randint(1, 3)):
            mutate_json(m, rng)
        write(saved, m)
        try:
            model = jit.load(saved, compiler="none")
        except jit.FormatError:
            outcomes["refused"] += 1
            continue
        except Exception as e:
            pytest.fail(f"mutation {i}: {type(e).__name__}: {e}\n{json.dumps(m)[:2000]}")
        outcomes["loaded"] += 1
        for fn in model.programs.values():  # what loads runs
            assert fn(X).shape == (2, 3)
    assert outcomes["refused"] > 300 and outcomes["loaded"] > 10, outcomes
