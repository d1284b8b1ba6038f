"""ModelRunner: runs the prefill, decode and score programs and owns the KV pool.

The same runner serves a live model (programs traced in-process, weights read at every call) and
a static model file (programs parsed from PIR, weights from safetensors): each program is just a
function from input arrays to its outputs, the pool last (``(logits, pool)``; score: see programs.py).
A live model's score program is traced at its first use (generation and RLHF never pay for it).
The pool is donated to every call (the programs write it in place) and the returned array is kept as
the new pool. With a model on the GPU the pool moves there at the first call (the executor moves
host inputs to the program's device) and stays; the batch's token arrays go up and the outputs come
back to the host for the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmkit.framework import backend as B

from .programs import (
    BLOCK_SIZE,
    DECODE_TILE,
    PREFILL_TILE,
    EngineProgram,
    ModelSpec,
    retype_pool,
    trace_programs,
)

ProgramFn = Callable[[Sequence[np.ndarray]], tuple[np.ndarray, ...]]


@dataclass
class Scores:
    """What the score program returns besides the pool: prefill's logits at ``logit_rows`` and, for
    every row of the batch, the log-prob of its target and the K most likely tokens (float64)."""

    logits: np.ndarray  # [R, V]
    target_logprobs: np.ndarray  # [N]
    top_logprobs: np.ndarray  # [N, K], most likely first
    top_ids: np.ndarray  # [N, K] int64


@dataclass
class PrefillBatch:
    """Prompt chunks of several sequences, flattened into one row of N tokens (see programs.py)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)  # one block table per segment
    kv_len: list[int] = field(default_factory=list)
    q_start: list[int] = field(default_factory=list)
    q_len: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)

    def add_segment(self, tokens: Sequence[int], start: int, table: Sequence[int], block_size: int) -> int:
        """Add tokens at positions start.. of the sequence with ``table``; return the last token's row."""
        self.q_start.append(len(self.input_ids))
        self.q_len.append(len(tokens))
        self.kv_len.append(start + len(tokens))
        self.tables.append(list(table))
        end = start + len(tokens)
        self.input_ids.extend(map(int, tokens))
        self.positions.extend(range(start, end))
        for b in range(start // block_size, -(-end // block_size)):  # whole runs of a block's slots
            base = table[b] * block_size
            self.slots.extend(
                range(base + max(start - b * block_size, 0), base + min(end - b * block_size, block_size))
            )
        return len(self.input_ids) - 1


@dataclass
class DecodeBatch:
    """One token per sequence."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[Sequence[int]] = field(default_factory=list)

    def add(self, token: int, position: int, table: Sequence[int], block_size: int) -> None:
        self.input_ids.append(int(token))
        self.positions.append(position)
        self.slots.append(table[position // block_size] * block_size + position % block_size)
        self.tables.append(table)  # read (copied) by the decode call that follows


def _i64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class ModelRunner:
    """The programs and the KV pool ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

    ``score`` is a program, a function making one at first use, or None (a static model file
    exported before the score program existed: :attr:`can_score` is False).
    """

    def __init__(
        self,
        prefill: ProgramFn,
        decode: ProgramFn,
        spec: ModelSpec,
        num_blocks: int,
        score: ProgramFn | Callable[[], ProgramFn] | None = None,
        *,
        lazy_score: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._prefill, self._decode = prefill, decode
        self._score, self._lazy_score = score, lazy_score
        self.spec = spec
        self.num_blocks = num_blocks
        self.pool = np.zeros(spec.pool_shape(num_blocks), B.dtype(spec.pool_dtype))
        self._weight_cache: dict[int, tuple[Any, Any]] = {}  # live models: derived weight copies
        self._live: list[EngineProgram] = []  # live models: the programs reading them
        self._decode_in = [np.zeros((0, 0), np.int64)] * 5  # decode's token arrays (see decode)

    def weights_changed(self) -> None:
        """Drop copies derived from the weights (relaid layouts); they are rebuilt at the next step."""
        self._weight_cache.clear()

    def refresh_weights(self) -> None:
        """Build the copies derived from the current weights now rather than at the next step (so
        that a caller can time the refresh); nothing to do for programs reading the weights as they
        are, or for a static model file."""
        for p in self._live:
            p.capture_arrays(self._weight_cache)

    # ---- sources ------------------------------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        model: Any,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        prefill_tile: int = PREFILL_TILE,
        decode_tile: int = DECODE_TILE,
        compiler: str | None = None,
        relayout: bool = True,
        kv_dtype: str | None = None,
    ) -> ModelRunner:
        """Programs traced from a live model: every call reads the model's current parameters."""
        args = (model, block_size, prefill_tile, decode_tile, compiler, relayout)
        programs, spec = trace_programs(*args, programs=("prefill", "decode"), kv_dtype=kv_dtype)
        cache: dict[tuple[int, str], tuple[Any, Any]] = {}  # relaid weights, shared by the programs

        def bind(p: EngineProgram) -> ProgramFn:
            executor = p.concrete.executor
            return lambda arrays: tuple(executor.run([*arrays, *p.capture_arrays(cache)]))

        def trace_score() -> ProgramFn:
            p = trace_programs(*args, programs=("score",), kv_dtype=kv_dtype)[0]["score"]
            runner._live.append(p)
            return bind(p)

        prefill, decode = bind(programs["prefill"]), bind(programs["decode"])
        runner = cls(prefill, decode, spec, num_blocks, trace_score, lazy_score=True)
        runner._weight_cache = cache
        runner._live = list(programs.values())
        return runner

    @classmethod
    def from_static(cls, static_model: Any, num_blocks: int, spec: ModelSpec | None = None) -> ModelRunner:
        """Programs of a static model file (``jit.load``); needs no model code. ``spec``: the file's,
        or with another KV dtype (the programs retyped: ``retype_pool``). The score program is bound
        at its first use (``jit.load`` may have deferred parsing it until then)."""
        own = ModelSpec.from_dict(static_model.metadata["engine"])
        spec = spec or own

        def bind(name: str) -> ProgramFn:
            fn = static_model.program(name)
            if spec.kv_dtype != own.kv_dtype:  # each program as it is bound (score: at its first use)
                retype_pool([fn], spec)
            return lambda arrays: tuple(fn(*arrays))

        score = (lambda: bind("score")) if "score" in static_model.manifest["programs"] else None
        return cls(bind("prefill"), bind("decode"), spec, num_blocks, score, lazy_score=True)

    @property
    def can_score(self) -> bool:
        """Whether :meth:`score` can run (a static file exported before it existed cannot)."""
        return self._score is not None

    # ---- running ------------------------------------------------------------------------------
    def _prefill_arrays(self, batch: PrefillBatch) -> list[np.ndarray]:
        return [
            _i64(batch.input_ids)[None],
            _i64(batch.positions)[None],
            _i64(batch.slots),
            _tables(batch.tables),
            _i64(batch.kv_len),
            _i64(batch.q_start),
            _i64(batch.q_len),
            _i64(batch.logit_rows),
        ]

    def prefill(self, batch: PrefillBatch) -> np.ndarray:
        """Logits [len(logit_rows), V] (float32 or the model dtype), on the host."""
        logits, self.pool = self._prefill([*self._prefill_arrays(batch), self.pool])
        return B.to_numpy(logits)

    def score(self, batch: PrefillBatch, targets: Sequence[int]) -> Scores:
        """``prefill`` that also scores every row against ``targets`` (one token id per row)."""
        if self._score is None:
            raise ValueError("prompt_logprobs: this model file has no score program; export it again")
        if self._lazy_score:
            self._score, self._lazy_score = self._score(), False
        *outs, self.pool = self._score([*self._prefill_arrays(batch), _i64(targets), self.pool])
        return Scores(*(B.to_numpy(o) for o in outs))

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        """Logits [B, V]."""
        shape = (len(batch.tables), max(map(len, batch.tables)))
        if self._decode_in[3].shape != shape:  # the same arrays every step, written in place: the
            n = shape[0]  # program finds them bound and its replay pointing at them already
            self._decode_in = [np.zeros(s, np.int64) for s in ((n, 1), (n, 1), n, shape, n)]
        ids, positions, slots, tables, kv_len = arrays = self._decode_in
        ids[:, 0], positions[:, 0], slots[:] = batch.input_ids, batch.positions, batch.slots
        for row, t in zip(tables, batch.tables):
            row[: len(t)], row[len(t) :] = t, 0
        np.add(positions[:, 0], 1, out=kv_len)
        logits, self.pool = self._decode([*arrays, self.pool])
        return B.to_numpy(logits)
