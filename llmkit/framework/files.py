"""Writing files and directories so that nothing already written is ever lost, even by a crash.

``atomic_write(path, data)`` / ``atomic_open(path)`` replace a file with new bytes in one rename.

``atomic_dir(path)`` yields a fresh temporary directory next to ``path``. When the block finishes
without an error, every file and directory in it is fsynced, then it takes ``path``'s place:

- ``path`` is new: one rename;
- ``path`` is an existing directory: one atomic exchange of the two names where the OS has one
  (Linux ``renameat2(RENAME_EXCHANGE)``), so ``path`` is never missing; elsewhere two renames,
  ``path -> .<name>.old`` then ``tmp -> path``. A crash between those two leaves ``.<name>.old``;
  :func:`recover` moves it back (the next ``atomic_dir`` on ``path`` and the loaders call it).

On any error the temporary directory is removed and ``path`` is as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from time import time_ns
from typing import BinaryIO


def _old(path: Path) -> Path:
    """Where the two-rename fallback parks the directory being replaced."""
    return path.parent / f".{path.name}.old"


def recover(path: str | os.PathLike[str]) -> None:
    """Finish a replacement of directory ``path`` that a crash interrupted between its two renames.

    ``.<name>.old`` without ``path``: the new directory never arrived, so the old one goes back.
    Both present: the new one is in place and only the old one's removal was lost.
    """
    path = Path(path)
    old = _old(path)
    if not old.is_dir():
        return
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, path)
        _fsync(path.parent)


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a no-op where a directory cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():  # some filesystems refuse fsync on directories; never on files
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory bottom-up, ``root`` last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            if not os.path.islink(os.path.join(dirpath, name)):
                _fsync(Path(dirpath, name))
        _fsync(Path(dirpath))


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the OS or filesystem cannot."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not here: fall back to two renames
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def _swap_in(tmp: Path, path: Path) -> None:
    """Put directory ``tmp`` at ``path``; the directory that ``path`` held (if any) ends at ``tmp``."""
    if not path.exists():
        os.rename(tmp, path)
    elif not _exchange(tmp, path):
        old = _old(path)
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)
            raise
        os.replace(old, tmp)
    _fsync(path.parent)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    while True:  # mkdir, not mkdtemp: the directory gets the mode any new directory gets
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        with contextlib.suppress(FileExistsError):
            tmp.mkdir()
            break
    try:
        yield tmp
        _fsync_tree(tmp)
        _swap_in(tmp, path)
    finally:
        _remove(tmp)  # the failed write, or the directory that was replaced


def install_dir(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Put the finished directory ``tmp`` (next to ``path``) at ``path`` as ``atomic_dir`` does when
    its block ends: fsynced, swapped in, the directory it replaces removed. For a directory that
    several processes wrote under a name they agreed on."""
    tmp, path = Path(tmp), Path(path)
    recover(path)
    _fsync_tree(tmp)
    _swap_in(tmp, path)
    _remove(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary file name beside ``path`` for a writer that opens files itself (the gguf
    package's): when the block succeeds the file is flushed to disk and swapped in with
    ``os.replace``; on any error it is removed. Parents are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file to write that replaces ``path`` only when the block succeeds (``atomic_path``)."""
    with atomic_path(path) as tmp, open(tmp, "xb") as f:  # "x": never clobber anything
        yield f


def atomic_write(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    with atomic_open(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def cache_root() -> Path:
    """Where llmkit's caches live: ``$LLMKIT_CACHE_DIR`` if set, else ``~/.cache/llmkit``."""
    return Path(os.environ.get("LLMKIT_CACHE_DIR") or Path.home() / ".cache" / "llmkit")


def sha256(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (manifests, LoRA base pointers)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


RACY_S = 2.0  # a file changed this recently may change again within its timestamps' granularity


def has_sha256(path: str | os.PathLike[str], digest: str, full: bool = False) -> bool:
    """Whether the file's sha256 is ``digest``, reading every byte unless this user's cache records
    that the file, in its present state (device, inode, size, modification and change times, all in
    the record's name), had that digest. A match is recorded only for a file unchanged for
    ``RACY_S`` seconds, so a write within one tick of the file system's clock is never missed.
    ``full``: read every byte regardless of the record."""
    st = os.stat(path)
    state = f"{os.path.abspath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    record = cache_root() / "verified" / hashlib.sha256(f"{state}|{digest}".encode()).hexdigest()
    if not full and record.exists():
        return True
    if sha256(path) != digest:
        return False
    if time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_S * 1e9:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next load a re-read
            record.parent.mkdir(parents=True, exist_ok=True)
            record.touch()
    return True
