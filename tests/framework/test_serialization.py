"""lf.save / lf.load: safetensors round trips, files from independent writers, corruption, atomicity."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import llmkit.framework as lf
from llmkit.framework import serialization
from llmkit.framework.serialization import SafetensorsError


def sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f64": rng.standard_normal((2, 3)),
        "f32": rng.standard_normal((4,)).astype(np.float32),
        "f16": rng.standard_normal((3, 1)).astype(np.float16),
        "bf16": rng.standard_normal((2, 2, 2)).astype(ml_dtypes.bfloat16),
        "i64": np.arange(5, dtype=np.int64) - 2,
        "i32": np.array([[1, -2]], np.int32),
        "i16": np.array([7], np.int16),
        "i8": np.array([-8, 8], np.int8),
        "u8": np.array([0, 255], np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def assert_same(got: dict[str, lf.Tensor], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].numpy().tobytes() == v.tobytes(), k  # bit-exact


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_every_dtype(tmp_path, mmap):
    data = sample()
    path = tmp_path / "all.safetensors"
    lf.save({k: lf.tensor(v) for k, v in data.items()}, path, metadata={"format": "np", "step": "3"})
    got = lf.load(path, mmap=mmap)
    assert_same(got, data)
    assert all(type(t._data) is np.ndarray for t in got.values())
    assert got["f32"]._data.flags.writeable is (not mmap)  # mapped tensors are read-only views
    assert serialization.load_metadata(path) == {"format": "np", "step": "3"}


def test_files_from_the_safetensors_library_load_bit_exactly(tmp_path):
    data = sample()
    path = tmp_path / "lib.safetensors"
    safetensors.numpy.save_file(data, str(path), metadata={"who": "library"})
    assert_same(lf.load(path), data)
    assert serialization.load_metadata(path) == {"who": "library"}


def test_our_files_read_back_with_the_safetensors_library(tmp_path):
    data = {k: v for k, v in sample().items() if k != "bf16"}  # its numpy reader has no BF16
    path = tmp_path / "ours.safetensors"
    lf.save(data, path)
    got = safetensors.numpy.load_file(str(path))
    for k, v in data.items():
        np.testing.assert_array_equal(got[k], v)


def build(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """The published layout by hand: u64 little-endian header size, JSON header, raw data."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if length is None else length) + head + data


def test_hand_built_file_with_bf16_and_padding(tmp_path):
    bf = np.array([1.5, -2.0, 0.0078125], dtype=ml_dtypes.bfloat16)
    i16 = np.array([[1, 2], [3, -4]], np.int16)
    head = json.dumps(
        {
            "__metadata__": {"k": "v"},
            "w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
            "n": {"dtype": "I16", "shape": [2, 2], "data_offsets": [6, 14]},
        }
    ).encode()
    head += b" " * (-len(head) % 8)  # writers pad the header with spaces for alignment
    path = tmp_path / "hand.safetensors"
    path.write_bytes(build(head, bf.tobytes() + i16.tobytes()))
    with serialization.safe_open(path) as f:
        assert list(f) == ["w", "n"] and f.shape("n") == (2, 2) and f.metadata() == {"k": "v"}
        np.testing.assert_array_equal(f["w"].numpy(), bf)
        np.testing.assert_array_equal(f["n"].numpy(), i16)
    with pytest.raises(ValueError, match="closed"):
        f["w"]


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "shorter than the 8-byte header length"),
        (build(GOOD, b"\0" * 8, length=10_000), "header length 10000 runs past the end"),
        (build(b"\xff\xfe{}"), "not UTF-8"),
        (build(b"{nope"), "not valid JSON"),
        (build(b"[1, 2]"), "must be a JSON object"),
        (build({"__metadata__": {"k": 1}}), "'__metadata__' must be an object mapping strings"),
        (
            build({"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
            "tensor 'a': the entry has no 'dtype'",
        ),
        (
            build({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8),
            "tensor 'a': the entry has no 'shape'",
        ),
        (
            build({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
            "tensor 'a': the entry has no 'data_offsets'",
        ),
        (
            build({"a": {"dtype": "C64", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
            "tensor 'a': unknown dtype 'C64'",
        ),
        (
            build({"a": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}, b"\0" * 8),
            "tensor 'a': shape must",
        ),
        (
            build({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
            "tensor 'a': data_offsets must",
        ),
        (
            build({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
            "tensor 'a': data_offsets \\[0, 8\\] hold 8 bytes, but shape \\[3\\] of F32 needs 12",
        ),
        (
            build(GOOD, b"\0" * 5),
            "tensor 'a': the data region is truncated: the tensor ends at byte 8, the file holds 5",
        ),
        (
            build(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                b"\0" * 8,
            ),
            "tensor 'b' \\(bytes \\[4, 8\\)\\) overlaps tensor 'a'",
        ),
        (
            build({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
            "bytes \\[0, 4\\) before tensor 'a' belong to no tensor",
        ),
        (build(GOOD, b"\0" * 12), "4 bytes after the last tensor belong to no tensor"),
    ],
)
def test_corrupt_files_raise_one_clear_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    for read in (lf.load, serialization.load_metadata, serialization.safe_open):
        with pytest.raises(SafetensorsError, match=message) as info:
            read(path)
        assert str(info.value).startswith(f"{path}: ")


def test_lazy_file_reads_only_what_is_asked(tmp_path):
    path = tmp_path / "lazy.safetensors"
    lf.save({"a": lf.ones(3), "b": lf.zeros(2, 2)}, path)
    f = serialization.safe_open(path, mmap=False)
    assert len(f) == 2 and "b" in f and repr(f).endswith("2 tensors, device='cpu')")
    with open(path, "r+b") as raw:  # corrupting a's bytes after opening: b is still fine
        raw.seek(os.path.getsize(path) - 20)
        raw.write(b"\xff" * 4)
    np.testing.assert_array_equal(f["b"].numpy(), np.zeros((2, 2)))
    with pytest.raises(KeyError, match="no tensor 'c'"):
        f["c"]


def test_save_rejects_bad_input_before_touching_the_disk(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="'a' must be a Tensor or an array"):
        lf.save({"a": [1, 2]}, path)
    with pytest.raises(TypeError, match="'__metadata__'"):
        lf.save({"__metadata__": lf.zeros(1)}, path)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        lf.save({"a": lf.zeros(1)}, path, metadata={"step": 3})
    with pytest.raises(TypeError, match="dtype uint16"):
        lf.save({"a": np.zeros(2, np.uint16)}, path)
    assert os.listdir(tmp_path) == []


def test_non_contiguous_arrays_are_saved_by_value(tmp_path):
    a = np.arange(12.0).reshape(3, 4).T
    lf.save({"t": a, "s": lf.tensor(a)[1:, ::2]}, tmp_path / "v.safetensors")
    got = lf.load(tmp_path / "v.safetensors")
    np.testing.assert_array_equal(got["t"].numpy(), a)
    np.testing.assert_array_equal(got["s"].numpy(), a[1:, ::2])


class Exploding(lf.Tensor):
    """A tensor whose conversion to host memory fails, as a lost device or a tracer would."""

    def numpy(self) -> np.ndarray:
        raise RuntimeError("conversion failed")


def test_failed_save_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    lf.save({"w": lf.ones(4)}, path)
    old = path.read_bytes()

    with pytest.raises(RuntimeError, match="conversion failed"):
        lf.save({"w": lf.zeros(4), "boom": Exploding(np.zeros(2, np.float32))}, path)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["ckpt.safetensors"]

    def half_written(arrays, filename, metadata=None):  # dies after writing part of the file
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        lf.save({"w": lf.zeros(4)}, path)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["ckpt.safetensors"]
    np.testing.assert_array_equal(lf.load(path)["w"].numpy(), np.ones(4))


def test_save_replaces_an_open_mapping_safely(tmp_path):
    path = tmp_path / "m.safetensors"
    lf.save({"w": lf.ones(3)}, path)
    mapped = lf.load(path)["w"]
    lf.save({"w": lf.zeros(3)}, path)  # a new file replaces the name; the old mapping is untouched
    np.testing.assert_array_equal(mapped.numpy(), np.ones(3))
    np.testing.assert_array_equal(lf.load(path)["w"].numpy(), np.zeros(3))


def test_saved_files_get_umask_permissions_not_the_temp_files(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    lf.save({"w": lf.ones(1)}, tmp_path / "p.safetensors")
    assert os.stat(tmp_path / "p.safetensors").st_mode & 0o777 == 0o666 & ~umask
