"""ModelRunner: runs the prefill and decode programs and owns the KV pool.

The same runner serves a live model (programs traced in-process, weights read at every call) and
a static model file (programs parsed from PIR, weights from safetensors): each program is just a
function from input arrays to ``(logits, pool)``. The pool is donated to every call (the programs
write it in place) and the returned array is kept as the new pool. With a model on the GPU the
pool moves there at the first call (the executor moves host inputs to the program's device) and
stays; the batch's token arrays go up and the logits come back to the host for the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmkit.framework import backend as B

from .programs import BLOCK_SIZE, DECODE_TILE, PREFILL_TILE, EngineProgram, ModelSpec, trace_programs

ProgramFn = Callable[[Sequence[np.ndarray]], tuple[np.ndarray, np.ndarray]]


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
        for i, t in enumerate(tokens):
            p = start + i
            self.input_ids.append(int(t))
            self.positions.append(p)
            self.slots.append(table[p // block_size] * block_size + p % block_size)
        return len(self.input_ids) - 1


@dataclass
class DecodeBatch:
    """One token per sequence."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)

    def add(self, token: int, position: int, table: Sequence[int], block_size: int) -> None:
        self.input_ids.append(int(token))
        self.positions.append(position)
        self.slots.append(table[position // block_size] * block_size + position % block_size)
        self.tables.append(list(table))


def _i64(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _tables(rows: list[list[int]]) -> np.ndarray:
    width = max(len(r) for r in rows)
    out = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class ModelRunner:
    """The two programs and the KV pool ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, prefill: ProgramFn, decode: ProgramFn, spec: ModelSpec, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._prefill, self._decode = prefill, decode
        self.spec = spec
        self.num_blocks = num_blocks
        self.pool = np.zeros(spec.pool_shape(num_blocks), B.dtype(spec.dtype))
        self._weight_cache: dict[int, tuple[Any, Any]] = {}  # live models: derived weight copies
        self._live: list[EngineProgram] = []  # live models: the programs reading them

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
    ) -> ModelRunner:
        """Programs traced from a live model: every call reads the model's current parameters."""
        programs, spec = trace_programs(model, block_size, prefill_tile, decode_tile, compiler, relayout)
        cache: dict[tuple[int, str], tuple[Any, Any]] = {}  # relaid weights, shared by both programs

        def bind(p: EngineProgram) -> ProgramFn:
            executor = p.concrete.executor

            def run(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
                logits, pool = executor.run([*arrays, *p.capture_arrays(cache)])
                return logits, pool

            return run

        runner = cls(bind(programs["prefill"]), bind(programs["decode"]), spec, num_blocks)
        runner._weight_cache = cache
        runner._live = list(programs.values())
        return runner

    @classmethod
    def from_static(cls, static_model: Any, num_blocks: int) -> ModelRunner:
        """Programs of a static model file (``jit.load``); needs no model code."""
        spec = ModelSpec.from_dict(static_model.metadata["engine"])

        def bind(fn) -> ProgramFn:
            return lambda arrays: fn(*arrays)

        return cls(
            bind(static_model.programs["prefill"]), bind(static_model.programs["decode"]), spec, num_blocks
        )

    # ---- running ------------------------------------------------------------------------------
    def prefill(self, batch: PrefillBatch) -> np.ndarray:
        """Logits [len(logit_rows), V] (float32 or the model dtype)."""
        arrays = [
            _i64(batch.input_ids)[None],
            _i64(batch.positions)[None],
            _i64(batch.slots),
            _tables(batch.tables),
            _i64(batch.kv_len),
            _i64(batch.q_start),
            _i64(batch.q_len),
            _i64(batch.logit_rows),
            self.pool,
        ]
        logits, self.pool = self._prefill(arrays)
        return B.to_numpy(logits)

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        """Logits [B, V]."""
        arrays = [
            _i64(batch.input_ids)[:, None],
            _i64(batch.positions)[:, None],
            _i64(batch.slots),
            _tables(batch.tables),
            _i64(batch.positions) + 1,
            self.pool,
        ]
        logits, self.pool = self._decode(arrays)
        return B.to_numpy(logits)
