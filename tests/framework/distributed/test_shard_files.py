"""Distributed tensors on disk (shard_files.py) on ``sim``: every element written once by its owner,
any region read back from the pieces equals numpy's slice of the global value, a reader on another
mesh gets the shards the independent layout reference (dist_helpers.py) says, and damaged sets of
files are named."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from dist_helpers import ref_local

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.framework import serialization
from llmkit.framework.distributed.shard_files import PIECES, ShardError, ShardReader, rank_file, save_shards

R, S = dist.Replicate, dist.Shard
MESH = dist.ProcessMesh((2, 2), ["dp", "tp"])
LAYOUTS = [(R(), R()), (R(), S(0)), (S(1), S(0)), (S(0), S(0)), (S(0), R()), (R(), S(1))]


@pytest.fixture(autouse=True, scope="module")
def sim():
    dist.init("sim")


def global_values(rng):
    return {
        "w": rng.standard_normal((5, 7)).astype(np.float32),
        "b": rng.standard_normal((3,)).astype(np.float64),
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_pieces_cover_each_element_once_and_read_back_any_region(tmp_path, layout):
    rng = np.random.default_rng(0)
    values = global_values(rng)
    tensors = {
        "w": dist.shard_tensor(values["w"], MESH, layout),
        "b": dist.shard_tensor(values["b"], MESH, [R(), R()]),
    }
    files = save_shards(tensors, tmp_path)
    assert [f.name for f in files] == [rank_file(r) for r in range(4)]
    # each element once: the pieces' bytes add up to the tensors' bytes
    stored = sum(a.nbytes for f in files for a in (t.numpy() for t in serialization.load(f).values()))
    assert stored == sum(v.nbytes for v in values.values())
    reader = ShardReader(files)
    assert reader.shapes == {"w": (5, 7), "b": (3,)} and reader.total_bytes == stored
    np.testing.assert_array_equal(reader.read("b"), values["b"])
    for r0, r1, c0, c1 in [(0, 5, 0, 7), (1, 4, 2, 6), (2, 3, 6, 7), (0, 1, 0, 1)]:
        before = reader.bytes_read
        got = reader.read("w", (slice(r0, r1), slice(c0, c1)))
        np.testing.assert_array_equal(got, values["w"][r0:r1, c0:c1])
        assert reader.bytes_read - before == got.nbytes  # only the slice asked for is copied


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(LAYOUTS[:4], repeat=2))[::3], ids=str)
def test_a_reader_on_another_layout_reads_only_its_regions(tmp_path, src, dst):
    value = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    files = save_shards({"w": dist.shard_tensor(value, MESH, src)}, tmp_path)
    other = dist.ProcessMesh((4, 1), ["dp", "tp"])  # another mesh over the same 4 ranks
    for mesh in (MESH, other):
        reader = ShardReader(files)
        x = reader.read_placed("w", mesh, dst)
        for r in mesh.ranks:
            np.testing.assert_array_equal(x.shards[r], ref_local(value, mesh.shape, dst, mesh.coord(r)))
            assert reader.rank_bytes[r] == x.shards[r].nbytes
        np.testing.assert_array_equal(dist.unshard(lf.Tensor(x)).numpy(), value)


def test_a_plain_safetensors_file_reads_as_whole_pieces(tmp_path):
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    serialization.save({"w": value}, tmp_path / "model.safetensors")
    reader = ShardReader([tmp_path / "model.safetensors"])
    np.testing.assert_array_equal(reader.read("w", (slice(1, 3), slice(0, 2))), value[1:3, :2])
    view = reader.read("w", copy=False)  # one piece holds it: a view of the mapped file
    assert not view.flags.writeable and np.array_equal(view, value)


def test_missing_and_damaged_pieces_are_named(tmp_path):
    value = np.arange(20, dtype=np.float32).reshape(4, 5)
    files = save_shards({"w": dist.shard_tensor(value, MESH, [S(0), S(1)])}, tmp_path)
    with pytest.raises(ShardError, match=r"'w': the pieces in .* hold 16 of its 20 elements .*missing"):
        ShardReader(files[:3])
    meta = json.loads(serialization.load_metadata(files[1])[PIECES])
    meta["w"]["start"] = [3, 4]
    serialization.save(
        {"w": serialization.load(files[1])["w"]}, files[1], metadata={PIECES: json.dumps(meta)}
    )
    with pytest.raises(
        ShardError, match=r"rank-00001.safetensors: 'w': piece \[2, 2\] at \[3, 4\] is outside"
    ):
        ShardReader(files)
    meta["w"]["start"] = [0, 0]
    serialization.save(
        {"w": serialization.load(files[1])["w"]}, files[1], metadata={PIECES: json.dumps(meta)}
    )
    with pytest.raises(ShardError, match="overlap"):
        ShardReader(files)


def test_partial_values_are_refused(tmp_path):
    x = dist.shard_tensor(np.ones((2, 2), np.float32), MESH, [dist.Partial(), R()])
    with pytest.raises(ValueError, match="'g' is Partial"):
        save_shards({"g": x}, tmp_path)
