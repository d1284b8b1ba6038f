"""Run under ``mpiexec -n 2|4`` from the repository root: ``python tests/train/mpi_pipeline_train.py
OUT SPEC...``, where a SPEC is a schedule name, ``:static`` appended for static stages. Trains each
SPEC through the trainer, one after another in this one launch (pp=2 x dp=N/2, the 4-layer model of
parallel_runs.py), into ``OUT/SPEC``; test_pipeline_mpi.py compares their metrics."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from parallel_runs import PP_LAYERS, STATIC, config, pp

import llmkit.framework.distributed as dist
from llmkit.train.trainer import Trainer

if __name__ == "__main__":
    out, specs = Path(sys.argv[1]), sys.argv[2:]
    n = dist.init().world_size
    for spec in specs:
        name, _, mode = spec.partition(":")
        cfg = config(out / spec, PP_LAYERS, *(STATIC if mode else ()), **pp(name, dp=n // 2))
        Trainer(cfg, quiet=True).fit()
