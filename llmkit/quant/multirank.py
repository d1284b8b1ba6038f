"""Quantization that reuses a training run's ParallelPlan: the work shared by ranks, the plan kept.

**The work.** ``Ranks(n)``: n ranks (every one in this process under ``sim``, one per process under
``mpi``) share the quantization of one model. Work comes in the fixed row blocks of
``gptq.row_blocks``; each rank takes a contiguous run of them (``np.array_split``) and the results
are joined by all-gathers, which only concatenate: no sum crosses ranks, so every bit is the
one-process result, on any number of ranks.

- The Hessian ``2 XᵀX / N`` of a linear's input: each rank sums its row blocks of ``XᵀX`` over every
  calibration batch, in batch order; gathered, every rank holds the whole Hessian, shared by the
  linears that read one input (q/k/v, gate/up) and by every rank's rows of them.
- GPTQ and RTN: each rank quantizes its row blocks of each weight against the whole Hessian; the
  gathered codes, scales and zeros are installed on every rank.

Why rows, whatever the training layout. A weight's rows are independent under GPTQ (one Hessian
for all), its input columns are not: quantizing column ``c`` moves every later column by an error
weighted by the inverse Hessian's Cholesky factor, which couples all the input columns. A
row-parallel (``S(1)``) weight quantized shard by shard against the diagonal Hessian blocks of its
own columns would drop that coupling (a worse result, and a different one for every tp); done
exactly, shard by shard, it would be a pipeline through the ranks. So each rank takes whole rows of
every weight, column-parallel or row-parallel. And the calibration forward runs whole in every
process: a tensor-parallel forward all-reduces the row-parallel partial sums in another order than
one process's product, so the next layer's inputs, hence its Hessians, would change in the last
bits with tp.

**The plan kept.** A quantized checkpoint's ``parallel_plan.json`` is the source plan with rules for
each quantized linear's tensors put first, derived from its weight's tp placement (``derive``):

    weight S(0), column parallel   qweight, scales, zeros S(0)   (a rank's rows and their groups)
    weight S(1), row parallel      qweight S(1) (packed columns), scales and zeros S(1) over groups;
                                   per-channel scales R (a row's one scale spans every shard)
    weight R                       R

so a server partitions the quantized model as training partitioned the float one. A row-parallel
weight's shard must hold whole groups (``check``; the check vLLM makes loading GPTQ weights under
tensor parallelism): its ``in / tp`` columns a multiple of the group size (and even, for 4 bits).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import llmkit.framework.distributed as dist
from llmkit.framework.distributed.parallel_plan import PLAN_FILE, ParallelPlan
from llmkit.framework.placement import Placement, Replicate, Shard

from .format import QuantConfig, QuantError, QuantizedWeight
from .gptq import row_blocks


class Ranks:
    """``n`` ranks sharing the quantization work (default: the MPI world, or 1 under ``sim``)."""

    def __init__(self, n: int | None = None) -> None:
        self.comm = dist.get_backend()
        sim = self.comm.name == "sim"
        n = (1 if sim else self.comm.world_size) if n is None else n
        if n < 1 or (not sim and n != self.comm.world_size):
            raise QuantError(
                f"{n} ranks: under {self.comm.name} the ranks are the {self.comm.world_size} processes"
            )
        if sim and n > self.comm.world_size:
            dist.init("sim", world_size=n)
        self.group = tuple(range(n))
        self.hosted = self.comm.hosted(self.group)

    @property
    def size(self) -> int:
        return len(self.group)

    @property
    def is_first(self) -> bool:
        """This process hosts rank 0 (it reports and writes)."""
        return 0 in self.hosted

    def _runs(self, n: int) -> list[list[slice]]:
        blocks = row_blocks(n)
        return [[blocks[i] for i in run] for run in np.array_split(np.arange(len(blocks)), self.size)]

    def rows(self, n: int) -> list[slice]:
        """The row blocks of ``n`` rows that this process's ranks take, in order."""
        runs = self._runs(n)
        return [b for r in self.hosted for b in runs[r]]

    def gather(self, mine: np.ndarray, n: int) -> np.ndarray:
        """All ``n`` rows on every rank, from ``mine``: the rows of ``rows(n)``, stacked."""
        sizes = [sum(b.stop - b.start for b in run) for run in self._runs(n)]
        parts, start = {}, 0
        for r in self.hosted:
            parts[r] = np.ascontiguousarray(mine[start : start + sizes[r]])
            start += sizes[r]
        if start != len(mine):
            raise ValueError(f"gather: {len(mine)} rows given, the hosted ranks take {start}")
        out = self.comm.all_gather(self.group, parts, 0, sizes, "quantize: gather rows")
        return next(iter(out.values()))

    def gather_weight(self, mine: QuantizedWeight, n: int) -> QuantizedWeight:
        return QuantizedWeight(*(None if a is None else self.gather(a, n) for a in mine))


# ---- the plan a quantized checkpoint keeps ------------------------------------------------------

QUANT_TENSORS = ("qweight", "scales", "zeros")


def plan_file(model_dir: str | Path) -> Path | None:
    """The ``parallel_plan.json`` of a model directory: its own, or its training checkpoint's
    (``checkpoints/step-N/parallel_plan.json`` beside ``model/``); None when there is none."""
    model_dir = Path(model_dir)
    for f in (model_dir / PLAN_FILE, model_dir.parent / PLAN_FILE):
        if f.is_file():
            return f
    return None


def _in_dim(p: Placement) -> bool:
    return isinstance(p, Shard) and p.dim in (1, -1)


def placements(weight: Placement, cfg: QuantConfig) -> dict[str, Placement]:
    """The tp placements of a quantized linear's ``qweight``, ``scales``, ``zeros`` from its weight's
    (see the module docstring)."""
    if _in_dim(weight):
        groups = Replicate() if cfg.group_size == -1 else Shard(1)
        return {"qweight": Shard(1), "scales": groups, "zeros": groups}
    return dict.fromkeys(QUANT_TENSORS, weight)


def check(name: str, shape: Sequence[int], weight: Placement, tp: int, cfg: QuantConfig) -> None:
    """A row-parallel weight's shards hold whole groups (and whole bytes of 4-bit codes)."""
    if not _in_dim(weight) or tp == 1:
        return
    n_in = shape[1]
    unit = cfg.group_size if cfg.group_size != -1 else 2 if cfg.bits == 4 else 1
    if n_in % (tp * unit):
        what = f"groups of {unit} input columns" if cfg.group_size != -1 else "4-bit codes packed in pairs"
        raise QuantError(
            f"{name} {list(shape)} is row parallel ({weight}) over tp={tp}: shards of {n_in / tp:g} input "
            f"columns would cut {what} across a shard boundary; the shard size must be a multiple "
            f"of {unit} (pick a group size that divides {n_in // tp}, or a plan with fewer tp ranks)"
        )


def derive(plan: ParallelPlan, shapes: dict[str, Sequence[int]], cfg: QuantConfig) -> ParallelPlan:
    """The plan of a quantized checkpoint: for each quantized linear ``P`` (``shapes``: ``P`` -> its
    weight's shape), rules for ``P.qweight``, ``P.scales``, ``P.zeros`` first, then ``plan``'s rules.
    Layers that agree share one rule (``model.layers.*.mlp.down_proj.scales``)."""
    tp = plan.size("tp")
    exact: dict[str, Placement] = {}
    for path, shape in shapes.items():
        weight = plan.tp_placement(f"{path}.weight")
        check(f"{path}.weight", shape, weight, tp, cfg)
        for t, p in placements(weight, cfg).items():
            if t != "zeros" or not cfg.sym:
                exact[f"{path}.{t}"] = p
    shared: dict[str, set[Placement]] = {}
    for name, p in exact.items():
        shared.setdefault(re.sub(r"\.\d+\.", ".*.", name), set()).add(p)
    rules = [(g, next(iter(ps))) for g, ps in shared.items() if len(ps) == 1]
    split = {g for g, ps in shared.items() if len(ps) > 1}
    rules += [(n, p) for n, p in exact.items() if re.sub(r"\.\d+\.", ".*.", n) in split]
    return dataclasses.replace(plan, params=(*rules, *plan.params))
