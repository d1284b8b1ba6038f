"""A Llama decoder block's forward and gradients under data, Megatron tensor, sequence and
dp x tp parallel plans on ``sim`` (eager and static) equal the plain float64 block to 1e-12.
The same checks run over MPI in test_dist_mpi.py (float32)."""

from __future__ import annotations

import numpy as np
import pytest
from llama_block import PLANS, distributed, plain

import llmkit.framework.distributed as dist


@pytest.fixture(scope="module")
def want():
    dist.init("sim")
    return plain("float64")


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_llama_block_under_each_plan_equals_the_plain_block(plan, mode, want):
    got = distributed(plan, mode, "float64")
    names = ["output", "input grad"] + [f"param grad {i}" for i in range(len(want) - 2)]
    for name, g, w in zip(names, got, want):
        np.testing.assert_allclose(
            g, w, rtol=1e-12, atol=1e-12 * np.abs(w).max(), err_msg=f"{plan} {mode}: {name}"
        )
