"""Durable writes: every file fsynced before its directory is renamed into place, and a directory being
replaced is never lost, even to a crash between the renames."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import files, jit
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM

SPEC = [jit.InputSpec(["N", 4], "float32")]


def linear(seed: int) -> lf.nn.Linear:
    lf.seed(seed)
    return lf.nn.Linear(4, 3)


def write_plain(path: Path) -> None:
    """The files a trainer checkpoint holds, written as plain (not self-syncing) files."""
    with files.atomic_dir(path) as tmp:
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text("{}")
        (tmp / "trainer_state.json").write_text("{}")
        (tmp / "manifest.json").write_text("{}")
        (tmp / "forward.pir").write_text("builtin.module {}")


def write_jit(path: Path) -> None:
    jit.save(linear(0), path, input_spec=SPEC)


def write_pretrained(path: Path) -> None:
    config = LlamaConfig.from_preset("tiny", num_hidden_layers=1, vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.parametrize(
    "write, names",
    [
        (write_plain, {"config.json", "trainer_state.json", "manifest.json", "forward.pir", "model"}),
        (write_jit, {"manifest.json", "forward.pir", "weights.safetensors"}),
        (write_pretrained, {"config.json", "model.safetensors"}),
    ],
    ids=["checkpoint-files", "jit.save", "save_pretrained"],
)
def test_every_file_is_fsynced_before_the_directory_is_renamed(tmp_path, monkeypatch, write, names):
    events: list[tuple[str, str]] = []
    real_fsync, real_swap = os.fsync, files._swap_in

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def swap_in(tmp: Path, path: Path) -> None:
        events.append(("swap", str(tmp)))
        real_swap(tmp, path)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(files, "_swap_in", swap_in)
    for _ in range(2):  # a new directory, then one replacing it
        events.clear()
        write(tmp_path / "out")
        (swap,) = [i for i, e in enumerate(events) if e[0] == "swap"]
        tmp = events[swap][1]
        synced = {Path(p).name for kind, p in events[:swap] if kind == "fsync" and p.startswith(tmp + "/")}
        assert names <= synced, names - synced
        assert ("fsync", tmp) in events[:swap]  # the directory's own entries too


def test_replacing_a_directory_swaps_it_in_one_step(tmp_path, monkeypatch):
    write_jit(tmp_path / "m")

    def no_rename_of(rename):
        def checked(a, b):
            if Path(a) == tmp_path / "m":
                raise AssertionError("moving it away first would leave a moment without the directory")
            rename(a, b)

        return checked

    monkeypatch.setattr(os, "replace", no_rename_of(os.replace))
    monkeypatch.setattr(os, "rename", no_rename_of(os.rename))
    jit.save(linear(1), tmp_path / "m", input_spec=SPEC)
    monkeypatch.undo()
    x = np.ones((2, 4), np.float32)
    got = jit.load(tmp_path / "m", compiler="none")(x)
    np.testing.assert_array_equal(got, linear(1)(lf.tensor(x)).numpy())
    assert sorted(os.listdir(tmp_path)) == ["m"]


def crash_at_replace(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Where the filesystem has no atomic exchange: the process dies at its n-th ``os.replace`` of a
    directory (that one and every later one fail, so no handler can undo anything)."""
    real, calls = os.replace, [0]

    def replace(a, b):
        calls[0] += os.path.isdir(a)
        if calls[0] >= n:
            raise KeyboardInterrupt("crash")
        real(a, b)

    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", replace)


def recover_by_recover(path: Path) -> None:
    files.recover(path)


def recover_by_writing_again(path: Path) -> None:
    with pytest.raises(RuntimeError), files.atomic_dir(path):
        raise RuntimeError("a later write that fails: the old directory is back all the same")


def recover_by_loading(path: Path) -> None:
    jit.load(path)


@pytest.mark.parametrize("recover", [recover_by_recover, recover_by_writing_again, recover_by_loading])
def test_a_crash_between_the_two_renames_leaves_the_old_directory_which_comes_back(
    tmp_path, monkeypatch, recover
):
    path = tmp_path / "m"
    write_jit(path)
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    with monkeypatch.context() as m:
        crash_at_replace(m, 2)  # path -> .m.old done; tmp -> path never happens
        with pytest.raises(KeyboardInterrupt):
            jit.save(linear(1), path, input_spec=SPEC)
    assert not path.exists() and (tmp_path / ".m.old").is_dir()
    recover(path)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert not (tmp_path / ".m.old").exists()


def test_a_crash_after_the_second_rename_keeps_the_new_directory(tmp_path, monkeypatch):
    path = tmp_path / "m"
    write_pretrained(path)
    with monkeypatch.context() as m:
        crash_at_replace(m, 3)  # both renames done; the old directory not yet removed
        with pytest.raises(KeyboardInterrupt):
            write_jit(path)
    assert (path / "manifest.json").is_file() and (tmp_path / ".m.old").is_dir()
    jit.load(path)
    assert not (tmp_path / ".m.old").exists()


def test_a_failed_second_rename_puts_the_old_directory_back_at_once(tmp_path, monkeypatch):
    path = tmp_path / "m"
    write_pretrained(path)
    real, calls = os.replace, [0]

    def replace(a, b):
        calls[0] += os.path.isdir(a)
        if calls[0] == 2 and os.path.isdir(a):
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        write_jit(path)
    assert (path / "config.json").is_file() and not (path / "manifest.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_from_pretrained_recovers_a_crashed_replacement(tmp_path, monkeypatch):
    path = tmp_path / "model"
    write_pretrained(path)
    with monkeypatch.context() as m:
        crash_at_replace(m, 2)
        with pytest.raises(KeyboardInterrupt):
            write_pretrained(path)
    assert not path.exists()
    assert LlamaForCausalLM.from_pretrained(path).config.vocab_size == 64


def test_a_file_is_never_replaced_by_a_directory(tmp_path):
    f = tmp_path / "notes"
    f.write_text("keep me")
    with pytest.raises(NotADirectoryError, match="not a directory"), files.atomic_dir(f):
        pass
    assert f.read_text() == "keep me" and os.listdir(tmp_path) == ["notes"]


def test_written_directories_and_files_get_the_usual_permissions(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain.txt").write_text("")
    with files.atomic_dir(tmp_path / "d") as tmp:
        (tmp / "x").write_text("")
    files.atomic_write(tmp_path / "f.txt", "x")
    mode = lambda p: p.stat().st_mode & 0o777
    assert mode(tmp_path / "d") == mode(tmp_path / "plain")
    assert mode(tmp_path / "f.txt") == mode(tmp_path / "plain.txt")
