"""Communication backends: ``sim`` (every rank in this process), ``mpi`` (mpi4py), ``nccl`` (cupy).

A process *hosts* some ranks: under ``sim`` every rank of every mesh (or, inside
:func:`run_ranks`, one rank per thread), under ``mpi``/``nccl`` its own. Every collective takes and
returns ``{rank: array}`` for the ranks of its group that this process hosts, so the code above
(reshard, op application, the collective ops' kernels) is written once, "for each hosted rank".

``sim`` computes a collective directly when the caller hosts the whole group, folding the members'
arrays in group order; when each thread runs one rank, the threads meet at a rendezvous and the
last to arrive runs the very same fold, so a partitioned program run on threads is bit-identical to
the eager result. ``mpi`` runs each collective on a cached sub-communicator with a nonblocking call
polled against a deadline. Every collective has a timeout (``init(timeout=...)`` or the
``LLMKIT_DIST_TIMEOUT`` environment variable, in seconds): a hang or a dead peer becomes a
:class:`CollectiveError` naming the collective, its mesh and its ranks, and under MPI an uncaught
exception ends the process with exit status 1 at once (MPI_Finalize would wait for the dead).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .. import backend as B
from ..ops.collective import register_communicator

BACKENDS = ("sim", "mpi", "nccl")
DEFAULT_TIMEOUT = 300.0
DEFAULT_SIM_WORLD = 8

Shards = dict[int, Any]  # rank -> array, for the hosted ranks of a group


class CollectiveError(RuntimeError):
    """A collective that could not finish: timed out, or a peer failed."""


def _timeout_from_env() -> float:
    raw = os.environ.get("LLMKIT_DIST_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        raise ValueError(f"LLMKIT_DIST_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if t <= 0:
        raise ValueError(f"LLMKIT_DIST_TIMEOUT must be positive, got {raw!r}")
    return t


# ---- the local math every backend shares ------------------------------------------------------


def fold(op: str, arrays: Sequence[Any]) -> Any:
    """Reduce ``arrays`` in order (the one summation order every backend's sim path uses)."""
    acc = arrays[0].copy()
    xp = B.xp_of(acc)
    for a in arrays[1:]:
        if op in ("sum", "avg"):
            acc += a
        else:
            (xp.maximum if op == "max" else xp.minimum)(acc, a, out=acc)
    if op == "avg":
        acc /= acc.dtype.type(len(arrays))
    return acc


def split(x: Any, axis: int, sizes: Sequence[int]) -> list[Any]:
    """``x`` cut along ``axis`` into consecutive pieces of ``sizes``."""
    bounds = np.cumsum(sizes)[:-1].tolist()
    return list(B.xp_of(x).split(x, bounds, axis=axis)) if len(sizes) > 1 else [x]


def concat(parts: Sequence[Any], axis: int) -> Any:
    return B.xp_of(parts[0]).concatenate(parts, axis=axis) if len(parts) > 1 else parts[0].copy()


# The collectives as functions of every member's input ({rank: x} in group order) -> {rank: y}:
# what sim computes directly and what its rendezvous runs.
def _everyone(group, out: Any) -> Shards:
    """``out`` for each member (copies: the members' arrays never alias)."""
    return {r: out if i == 0 else out.copy() for i, r in enumerate(group)}


def _all_reduce(xs: Shards, group, op: str) -> Shards:
    return _everyone(group, fold(op, [xs[r] for r in group]))


def _all_gather(xs: Shards, group, axis: int) -> Shards:
    return _everyone(group, concat([xs[r] for r in group], axis))


def _reduce_scatter(xs: Shards, group, axis: int, sizes, op: str) -> Shards:
    parts = {r: split(xs[r], axis, sizes) for r in group}
    return {r: fold(op, [parts[s][i] for s in group]) for i, r in enumerate(group)}


def _all_to_all(xs: Shards, group, split_axis: int, split_sizes, concat_axis: int) -> Shards:
    parts = {r: split(xs[r], split_axis, split_sizes) for r in group}
    return {r: concat([parts[s][i] for s in group], concat_axis) for i, r in enumerate(group)}


def _count(counters: dict[tuple, int], key: tuple) -> int:
    """The next number of ``key``'s counter (0, 1, 2...)."""
    n = counters[key] = counters.get(key, -1) + 1
    return n


def _resized(shape: Sequence[int], *changes: tuple[int, int]) -> tuple[int, ...]:
    """``shape`` with ``(axis, size)`` changes."""
    out = list(shape)
    for axis, size in changes:
        out[axis] = size
    return tuple(out)


def _own_rank(collective: Callable[..., Any]) -> Callable[..., Shards]:
    """A collective of a process hosting one rank of the group (mpi, nccl), written for that rank's
    array: ``collective(self, group, rank, x, ...) -> array``. A process hosting none gets ``{}``; a
    group of one, a copy."""

    @functools.wraps(collective)
    def run(self: Any, group: tuple, xs: Shards, *args: Any, **kwargs: Any) -> Shards:
        if not xs:
            return {}
        ((r, x),) = xs.items()
        return {r: x.copy() if len(group) == 1 else collective(self, group, r, x, *args, **kwargs)}

    return run


class Backend:
    """What every backend offers. ``what`` names the collective for errors (op, mesh, ranks)."""

    name = "backend"
    timeout: float = DEFAULT_TIMEOUT

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def hosted(self, ranks: Sequence[int]) -> list[int]:
        """The ranks among ``ranks`` that this process (or thread) holds shards for."""
        raise NotImplementedError

    def all_reduce(self, group: tuple, xs: Shards, op: str = "sum", what: str = "all_reduce") -> Shards:
        raise NotImplementedError

    def all_gather(self, group: tuple, xs: Shards, axis: int, sizes: Sequence[int], what: str = "all_gather"):
        """Concatenate the members' arrays along ``axis`` (member ``i`` holds ``sizes[i]`` there)."""
        raise NotImplementedError

    def reduce_scatter(
        self,
        group: tuple,
        xs: Shards,
        axis: int,
        sizes: Sequence[int],
        op: str = "sum",
        what: str = "reduce_scatter",
    ) -> Shards:
        """Reduce the members' arrays; member ``i`` keeps piece ``i`` (``sizes[i]`` along ``axis``)."""
        raise NotImplementedError

    def all_to_all(
        self,
        group: tuple,
        xs: Shards,
        split_axis: int,
        split_sizes: Sequence[int],
        concat_axis: int,
        concat_sizes: Sequence[int],
        what: str = "all_to_all",
    ) -> Shards:
        """Member ``i`` sends piece ``j`` of its array (cut along ``split_axis``) to member ``j`` and
        concatenates what it receives along ``concat_axis`` (member ``j`` sends ``concat_sizes[j]``)."""
        raise NotImplementedError

    def send_recv(self, moves: Sequence[tuple[int, int, Any, tuple, Any]], what: str = "send/recv") -> dict:
        """Point-to-point moves ``(src, dst, array or None, shape, dtype)``: the array is given where
        ``src`` is hosted. Returns ``{(src, dst): array}`` for the hosted destinations."""
        raise NotImplementedError

    def send(self, src: int, dst: int, x: Any, what: str = "send", tag: int | None = None) -> None:
        """Start sending ``x`` from ``src`` to ``dst`` without waiting (completed by ``recv`` on the other
        side; :meth:`flush` waits for this process's sends). Messages between two ranks arrive in
        the order sent; with a ``tag`` (an int below 20000), in that order among those of the tag,
        so a receiver may take the messages of several tags in an order of its own."""
        raise NotImplementedError

    def recv(
        self, src: int, dst: int, shape: tuple, dtype: Any, what: str = "recv", tag: int | None = None
    ) -> Any:
        raise NotImplementedError

    def flush(self) -> None:
        """Wait (within the timeout) for sends still in flight."""

    def barrier(self) -> None:
        """Every process of the world meets here (within the timeout)."""


# ---- sim ---------------------------------------------------------------------------------------


class _Meeting:
    __slots__ = ("inputs", "left", "out")

    def __init__(self, n: int) -> None:
        self.inputs: Shards = {}
        self.out: Shards | None = None
        self.left = n


class SimBackend(Backend):
    """Every rank in this process: collectives are local array math in group order."""

    name = "sim"

    def __init__(self, world_size: int = DEFAULT_SIM_WORLD, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._world = world_size
        self.timeout = timeout
        self._local = threading.local()  # .rank inside run_ranks, .seq: per-key counters
        self._cv = threading.Condition()
        self._meetings: dict[tuple, _Meeting] = {}
        self._mail: dict[tuple, Any] = {}

    @property
    def rank(self) -> int:
        return getattr(self._local, "rank", 0)

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def thread_rank(self) -> int | None:
        """The rank this thread runs inside :func:`run_ranks`, else None (all ranks hosted)."""
        return getattr(self._local, "rank", None)

    def hosted(self, ranks: Sequence[int]) -> list[int]:
        r = self.thread_rank
        if r is None:
            return list(ranks)
        return [r] if r in ranks else []

    def _seq(self, key: tuple) -> int:
        return _count(self._local.__dict__.setdefault("seq", {}), key)

    def _collective(self, group: tuple, xs: Shards, fn: Callable[[Shards], Shards], what: str) -> Shards:
        if len(xs) == len(group):
            return fn(xs)
        if not xs:
            return {}
        if self.thread_rank is None:  # nobody else can arrive: this process hosts every rank
            raise CollectiveError(
                f"{what}: given the arrays of ranks {sorted(xs)} of the group {list(group)}; under sim a "
                "process hosts every rank, so run one rank per thread with dist.run_ranks"
            )
        ((rank, x),) = xs.items()
        key = ("c", group, self._seq(("c", group)))
        deadline = time.monotonic() + self.timeout
        with self._cv:
            m = self._meetings.get(key)
            if m is None:
                m = self._meetings[key] = _Meeting(len(group))
            m.inputs[rank] = x
            if len(m.inputs) == len(group):
                try:
                    m.out = fn(m.inputs)
                finally:
                    self._cv.notify_all()
            while m.out is None:
                if not self._cv.wait(deadline - time.monotonic()) and m.out is None:
                    missing = sorted(set(group) - set(m.inputs))
                    raise CollectiveError(
                        f"{what}: timed out after {self.timeout:g}s on rank {rank} waiting for ranks "
                        f"{missing} (group {list(group)}); a rank skipped this collective or stopped"
                    )
            m.left -= 1
            if m.left == 0:
                del self._meetings[key]
            return {rank: m.out[rank]}

    def all_reduce(self, group, xs, op="sum", what="all_reduce"):
        return self._collective(group, xs, lambda a: _all_reduce(a, group, op), what)

    def all_gather(self, group, xs, axis, sizes, what="all_gather"):
        return self._collective(group, xs, lambda a: _all_gather(a, group, axis), what)

    def reduce_scatter(self, group, xs, axis, sizes, op="sum", what="reduce_scatter"):
        return self._collective(group, xs, lambda a: _reduce_scatter(a, group, axis, sizes, op), what)

    def all_to_all(self, group, xs, split_axis, split_sizes, concat_axis, concat_sizes, what="all_to_all"):
        fn = lambda a: _all_to_all(a, group, split_axis, split_sizes, concat_axis)
        return self._collective(group, xs, fn, what)

    def _one_rank(self, what: str) -> None:
        if self.thread_rank is None:  # the mail would wait for a receiver no thread runs
            raise CollectiveError(
                f"{what}: under sim a process hosts every rank; run one rank per thread with dist.run_ranks"
            )

    def send(self, src, dst, x, what="send", tag=None):
        self._one_rank(what)
        key = ("p", src, dst, tag, self._seq(("s", src, dst, tag)))
        with self._cv:
            self._mail[key] = x.copy()
            self._cv.notify_all()

    def recv(self, src, dst, shape, dtype, what="recv", tag=None):
        self._one_rank(what)
        key = ("p", src, dst, tag, self._seq(("r", src, dst, tag)))
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while key not in self._mail:
                if not self._cv.wait(deadline - time.monotonic()) and key not in self._mail:
                    raise CollectiveError(
                        f"{what}: timed out after {self.timeout:g}s on rank {dst} waiting for rank {src}"
                    )
            return self._mail.pop(key)

    def send_recv(self, moves, what="send/recv"):
        mine = set(self.hosted([m[1] for m in moves] + [m[0] for m in moves]))
        for src, dst, x, _, _ in moves:
            if src in mine and dst not in mine:
                self.send(src, dst, x, what)
        out = {}
        for src, dst, x, shape, dtype in moves:
            if dst in mine:
                out[(src, dst)] = x.copy() if src in mine else self.recv(src, dst, shape, dtype, what)
        return out

    def barrier(self) -> None:
        r = self.thread_rank
        if r is not None:
            self.all_reduce(tuple(range(self._world)), {r: np.zeros(())}, "sum", "barrier")


_sim_threads = threading.local()


def run_ranks(ranks: Sequence[int], fn: Callable[[int], Any]) -> dict[int, Any]:
    """Under ``sim``, run ``fn(rank)`` on one thread per rank (each thread hosts only its rank, so
    collectives rendezvous between the threads); returns ``{rank: result}``. The first error of
    any thread is raised (the others are stopped by their collectives' timeouts or finish). Each
    thread starts with the caller's default dtype, device and random state and then draws from a
    generator of its own, as a process would (one shared generator made every rank's draws depend
    on how the threads interleaved: a rank's LoRA adapters took another's numbers)."""
    backend = get_backend()
    if not isinstance(backend, SimBackend):
        raise RuntimeError("run_ranks runs ranks on threads of one process: it needs the sim backend")
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    caller = B.snapshot()

    def body(r: int) -> None:
        B.adopt(caller)
        backend._local.rank = r
        backend._local.seq = {}
        try:
            results[r] = fn(r)
        except BaseException as e:
            errors[r] = e
        finally:
            del backend._local.rank

    threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[min(errors)]
    return results


# ---- mpi ---------------------------------------------------------------------------------------


class MpiBackend(Backend):
    """One process per rank over mpi4py: nonblocking collectives on cached sub-communicators,
    polled against a deadline."""

    name = "mpi"

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.timeout = timeout
        self._rank = self.comm.Get_rank()
        self._size = self.comm.Get_size()
        self._comms: dict[tuple, Any] = {tuple(range(self._size)): self.comm}
        self._pending: list[tuple[Any, Any]] = []  # (request, buffer kept alive) of sends in flight
        self._tags: dict[tuple, int] = {}
        _exit_on_uncaught_error()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    def hosted(self, ranks):
        return [self._rank] if self._rank in ranks else []

    # ---- waiting -----------------------------------------------------------------------------
    def wait(self, reqs: list, what: str, peers: Sequence[int]) -> None:
        """Poll ``reqs`` (and sends in flight) until done; a timeout or a failed peer raises."""
        MPI = self.MPI
        deadline = time.monotonic() + self.timeout
        spins = 0
        statuses = [MPI.Status() for _ in reqs]
        while True:
            try:
                if MPI.Request.Testall(reqs, statuses):
                    return
            except MPI.Exception as e:
                raise CollectiveError(
                    f"{what}: failed on rank {self._rank} with peers {list(peers)}: " + _why(MPI, e, statuses)
                ) from None
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"{what}: timed out after {self.timeout:g}s on rank {self._rank} waiting for ranks "
                    f"{[p for p in peers if p != self._rank]}; a rank died, hangs or skipped this collective "
                    "(set the limit with dist.init(timeout=...) or LLMKIT_DIST_TIMEOUT)"
                )
            spins += 1
            if spins > 64:  # yield the core: ranks are often oversubscribed
                time.sleep(min(1e-3, 1e-6 * (spins - 64)))

    def _comm(self, group: tuple, what: str) -> Any:
        c = self._comms.get(group)
        if c is None:
            # MPI_Comm_create_group blocks with no deadline: first check every member is alive.
            tag = 30000 + self._tag(("g", group))
            token = np.zeros(1, np.int8)
            peers = [r for r in group if r != self._rank]
            bufs = [np.empty(1, np.int8) for _ in peers]
            reqs = [self.comm.Isend(token, dest=r, tag=tag) for r in peers]
            reqs += [self.comm.Irecv(b, source=r, tag=tag) for r, b in zip(peers, bufs)]
            self.wait(reqs, f"{what} (making the communicator of ranks {list(group)})", group)
            c = self.comm.Create_group(self.comm.group.Incl(list(group)))
            self._comms[group] = c
        return c

    def _tag(self, key: tuple) -> int:
        return _count(self._tags, key) % 10000

    @staticmethod
    def _front(x: Any, axis: int) -> np.ndarray:
        return np.ascontiguousarray(np.moveaxis(x, axis, 0))

    # ---- collectives -------------------------------------------------------------------------
    def _reduced(self, group, out, op, what, start) -> Any:
        """Run the reduction ``start(mpi_op)`` into ``out``; ``avg`` is the sum divided here."""
        MPI = self.MPI
        req = start({"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
        self.wait([req], what, group)
        if op == "avg":
            out /= out.dtype.type(len(group))
        return out

    @_own_rank
    def all_reduce(self, group, r, x, op="sum", what="all_reduce"):
        send = np.ascontiguousarray(x)
        out = np.empty_like(send)
        comm = self._comm(group, what)
        return self._reduced(group, out, op, what, lambda mop: comm.Iallreduce(send, out, op=mop))

    @_own_rank
    def all_gather(self, group, r, x, axis, sizes, what="all_gather"):
        front = self._front(x, axis)
        inner = int(np.prod(front.shape[1:]))
        counts = [s * inner for s in sizes]
        out = np.empty((sum(sizes),) + front.shape[1:], x.dtype)
        req = self._comm(group, what).Iallgatherv(front, [out, counts])
        self.wait([req], what, group)
        return np.moveaxis(out, 0, axis)

    @_own_rank
    def reduce_scatter(self, group, r, x, axis, sizes, op="sum", what="reduce_scatter"):
        front = self._front(x, axis)
        counts = [s * int(np.prod(front.shape[1:])) for s in sizes]
        out = np.empty((sizes[group.index(r)],) + front.shape[1:], x.dtype)
        comm = self._comm(group, what)
        self._reduced(group, out, op, what, lambda mop: comm.Ireduce_scatter(front, out, counts, op=mop))
        return np.moveaxis(out, 0, axis)

    @_own_rank
    def all_to_all(self, group, r, x, split_axis, split_sizes, concat_axis, concat_sizes, what="all_to_all"):
        me = group.index(r)
        pieces = [np.ascontiguousarray(p) for p in split(x, split_axis, split_sizes)]
        send = np.concatenate([p.reshape(-1) for p in pieces]) if pieces else np.empty(0, x.dtype)
        shapes = [_resized(x.shape, (split_axis, split_sizes[me]), (concat_axis, c)) for c in concat_sizes]
        rcounts = [int(np.prod(s)) for s in shapes]
        recv = np.empty(sum(rcounts), x.dtype)
        scounts = [p.size for p in pieces]
        req = self._comm(group, what).Ialltoallv([send, scounts], [recv, rcounts])
        self.wait([req], what, group)
        parts = split(recv, 0, rcounts)
        return concat([p.reshape(s) for p, s in zip(parts, shapes)], concat_axis)

    # ---- point to point ----------------------------------------------------------------------
    def _p2p_tag(self, src: int, dst: int, tag: int | None) -> int:
        """The next sequence tag between ``src`` and ``dst`` (below 10000), or a user ``tag`` moved
        above them (below the group tokens, 30000+)."""
        if tag is None:
            return self._tag(("p", src, dst))
        if not 0 <= tag < 20000:
            raise ValueError(f"a message tag must be in [0, 20000), got {tag}")
        return 10000 + tag

    def send(self, src, dst, x, what="send", tag=None):
        buf = np.ascontiguousarray(x)
        self._pending.append((self.comm.Isend(buf, dest=dst, tag=self._p2p_tag(src, dst, tag)), buf))

    def recv(self, src, dst, shape, dtype, what="recv", tag=None):
        buf = np.empty(shape, dtype)
        req = self.comm.Irecv(buf, source=src, tag=self._p2p_tag(src, dst, tag))
        # only this message is waited for: a send still in flight may wait for a receive that
        # this rank's schedule posts later (flush() waits for every send)
        self.wait([req], what, (src, dst))
        self._pending = [(p, b) for p, b in self._pending if not p.Test()]
        return buf

    def send_recv(self, moves, what="send/recv"):
        out, reqs, keep, peers = {}, [], [], set()
        for src, dst, x, shape, dtype in moves:
            tag = self._tag(("p", src, dst))
            if src == self._rank and dst == self._rank:
                out[(src, dst)] = x.copy()
            elif src == self._rank:
                buf = np.ascontiguousarray(x)
                keep.append(buf)
                reqs.append(self.comm.Isend(buf, dest=dst, tag=tag))
                peers.add(dst)
            elif dst == self._rank:
                buf = np.empty(shape, dtype)
                out[(src, dst)] = buf
                reqs.append(self.comm.Irecv(buf, source=src, tag=tag))
                peers.add(src)
        if reqs:
            self.wait(reqs, what, sorted(peers | {self._rank}))
        return out

    def flush(self) -> None:
        if self._pending:
            self.wait([p for p, _ in self._pending], "send", ())
            self._pending.clear()

    def barrier(self) -> None:
        self.wait([self.comm.Ibarrier()], "barrier", tuple(range(self._size)))


def _why(MPI: Any, e: Any, statuses: list) -> str:
    """The failed request's own error (MPI_ERR_IN_STATUS alone says nothing) and what it means."""
    codes = [c for c in (s.Get_error() for s in statuses) if c not in (MPI.SUCCESS, MPI.ERR_PENDING)]
    code = codes[0] if e.Get_error_class() == MPI.ERR_IN_STATUS and codes else e.Get_error_code()
    if MPI.Get_error_class(code) == MPI.ERR_TRUNCATE:  # a peer sent more than this collective takes
        return (
            f"{MPI.Get_error_string(code)} (the ranks called different collectives here: one skipped or "
            "added a collective the others did not)"
        )
    return f"{MPI.Get_error_string(code)} (a peer process died; its error is printed above)"


def _exit_on_uncaught_error() -> None:
    """Under MPI an uncaught exception prints its traceback and ends the process with status 1 at
    once: the normal shutdown (MPI_Finalize) would wait for peers that died or hang."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if kind is KeyboardInterrupt:
            return previous(kind, value, tb)
        traceback.print_exception(kind, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = hook


# ---- nccl ----------------------------------------------------------------------------------------


class NcclBackend(MpiBackend):
    """cupy's NCCL on one GPU per process, bootstrapped over MPI: all-reduce natively, the other
        collectives as grouped sends and receives (NCCL has no uneven all-gather). Arrays are cupy
        arrays; a collective is launched on the current stream and its completion polled against the
        deadline like MPI's. Tested only on a GPU, over a world of one (``tests/framework/test_gpu_twins.py``,
    run by ``benchmarks/gpu_check.sh``); its parent ``mpi`` runs the same collectives' contract on the CPU."""

    name = "nccl"

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        from cupy.cuda import nccl

        self.nccl = nccl
        self._nccl_comms: dict[tuple, Any] = {}

    def _ncomm(self, group: tuple, what: str) -> Any:
        c = self._nccl_comms.get(group)
        if c is None:
            mpi = self._comm(group, what)
            uid = self.nccl.get_unique_id() if mpi.Get_rank() == 0 else None
            uid = mpi.bcast(uid, root=0)
            c = self._nccl_comms[group] = self.nccl.NcclCommunicator(len(group), uid, mpi.Get_rank())
        return c

    # Point to point goes through host memory over MPI: NCCL's send blocks its stream until the
    # peer receives, and pipeline neighbours send to each other at once (1F1B's steady state).
    def send(self, src, dst, x, what="send", tag=None):
        import cupy

        super().send(src, dst, cupy.asnumpy(x), what, tag)

    def recv(self, src, dst, shape, dtype, what="recv", tag=None):
        import cupy

        return cupy.asarray(super().recv(src, dst, shape, dtype, what, tag))

    def _sync(self, what: str, group: tuple) -> None:
        import cupy

        ev = cupy.cuda.Event()
        ev.record()
        deadline = time.monotonic() + self.timeout
        while not ev.done:
            if time.monotonic() > deadline:
                for c in self._nccl_comms.values():
                    c.abort()
                raise CollectiveError(
                    f"{what}: timed out after {self.timeout:g}s on rank {self._rank} (ranks {list(group)})"
                )
            time.sleep(1e-4)

    def _dtype(self, x: Any) -> int:
        if x.dtype.name not in ("float32", "float64", "float16", "int64", "int32"):
            raise KeyError(x.dtype.name)
        return getattr(self.nccl, f"NCCL_{x.dtype.name.upper()}")

    @_own_rank
    def all_reduce(self, group, r, x, op="sum", what="all_reduce"):
        import cupy

        x = cupy.ascontiguousarray(x)
        out = cupy.empty_like(x)
        n = self.nccl
        nop = {"sum": n.NCCL_SUM, "avg": n.NCCL_SUM, "max": n.NCCL_MAX, "min": n.NCCL_MIN}[op]
        stream = cupy.cuda.get_current_stream().ptr
        self._ncomm(group, what).allReduce(x.data.ptr, out.data.ptr, x.size, self._dtype(x), nop, stream)
        self._sync(what, group)
        if op == "avg":
            out /= len(group)
        return out

    def _exchange(self, group, what, sends: dict[int, Any], recv_shapes: dict[int, tuple], dtype) -> dict:
        import cupy

        comm = self._ncomm(group, what)
        stream = cupy.cuda.get_current_stream().ptr
        out = {j: cupy.empty(s, dtype) for j, s in recv_shapes.items()}
        self.nccl.groupStart()
        for j, x in sends.items():
            comm.send(x.data.ptr, x.size, self._dtype(x), j, stream)
        for j, b in out.items():
            comm.recv(b.data.ptr, b.size, self._dtype(b), j, stream)
        self.nccl.groupEnd()
        self._sync(what, group)
        return out

    @_own_rank
    def all_gather(self, group, r, x, axis, sizes, what="all_gather"):
        import cupy

        me = group.index(r)
        shapes = {j: _resized(x.shape, (axis, s)) for j, s in enumerate(sizes) if j != me}
        x = cupy.ascontiguousarray(x)
        got = self._exchange(group, what, {j: x for j in shapes}, shapes, x.dtype)
        return concat([x if j == me else got[j] for j in range(len(group))], axis)

    @_own_rank
    def all_to_all(self, group, r, x, split_axis, split_sizes, concat_axis, concat_sizes, what="all_to_all"):
        import cupy

        me = group.index(r)
        pieces = [cupy.ascontiguousarray(p) for p in split(x, split_axis, split_sizes)]
        shapes = {
            j: _resized(x.shape, (split_axis, split_sizes[me]), (concat_axis, c))
            for j, c in enumerate(concat_sizes)
            if j != me
        }
        got = self._exchange(group, what, {j: pieces[j] for j in shapes}, shapes, x.dtype)
        return concat([pieces[me] if j == me else got[j] for j in range(len(group))], concat_axis)

    @_own_rank
    def reduce_scatter(self, group, r, x, axis, sizes, op="sum", what="reduce_scatter"):
        me = group.index(r)
        got = self.all_to_all(group, {r: x}, axis, sizes, axis, [sizes[me]] * len(group), what)[r]
        return fold(op, split(got, axis, [sizes[me]] * len(group)))


# ---- the process's backend ----------------------------------------------------------------------

_backend: Backend | None = None
_init_lock = threading.Lock()


def launched_by_mpi() -> bool:
    """True when this process was started by mpiexec/mpirun with more than one rank."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        v = os.environ.get(var)
        if v is not None and v.isdigit() and int(v) > 1:
            return True
    return False


def init(
    backend: str | None = None, *, timeout: float | None = None, world_size: int | None = None
) -> Backend:
    """Choose this process's backend (once; calling again with the same choice is a no-op).

    ``backend``: "sim", "mpi" or "nccl"; None picks "mpi" when started by mpiexec with more than
    one rank, else "sim". ``timeout``: seconds any collective may take (default
    ``LLMKIT_DIST_TIMEOUT`` or 300). ``world_size``: the number of ranks ``sim`` simulates (8).
    """
    global _backend
    if backend is None:
        backend = "mpi" if launched_by_mpi() else "sim"
    if backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {backend!r}; use one of {', '.join(BACKENDS)}")
    t = _timeout_from_env() if timeout is None else float(timeout)
    if t <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    with _init_lock:
        if _backend is not None:
            if _backend.name != backend:
                raise RuntimeError(
                    f"the distributed backend is already {_backend.name!r}; cannot switch to {backend!r}"
                )
            _backend.timeout = t
            if world_size is not None and isinstance(_backend, SimBackend):
                _backend._world = world_size
            return _backend
        if backend == "sim":
            _backend = SimBackend(world_size or DEFAULT_SIM_WORLD, t)
        elif backend == "mpi":
            _backend = MpiBackend(t)
        else:
            _backend = NcclBackend(t)
        return _backend


def get_backend() -> Backend:
    """The process's backend (initialized with the defaults on first use)."""
    return _backend if _backend is not None else init()


def get_rank() -> int:
    """This process's rank (under sim: the thread's rank inside run_ranks, else 0)."""
    return get_backend().rank


def get_world_size() -> int:
    return get_backend().world_size


@contextlib.contextmanager
def timeout(seconds: float) -> Iterator[None]:
    """Collectives inside use this timeout."""
    b = get_backend()
    before = b.timeout
    b.timeout = float(seconds)
    try:
        yield
    finally:
        b.timeout = before


register_communicator(get_backend)  # the kernels of the collective ops reach the backend through it
