"""LoRA with the parallel plans: each adapter's A/B laid out from its base weight's placement (the
plan's rule, against Megatron's layout written out here), and dp, ZeRO and tp LoRA runs on the
``sim`` backend equal to the one-process run."""

from __future__ import annotations

import pytest

from llmkit.framework.distributed.plan import ParallelPlan
from llmkit.framework.placement import Replicate, Shard
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.lora import LoraConfig, apply_lora
from llmkit.models.llama.parallel import check_plan

R = Replicate()

# y = W x + B (A x), W [out, in], A [r, in], B [out, r]. Column-parallel W (outputs split, S(0)):
# each rank computes its outputs' slice of the update, so B is split on out with W and A is whole.
# Row-parallel W (inputs split, S(1)): each rank's A x is a partial sum over its inputs, reduced
# with W x's, so A is split on in with W and B is whole.
ADAPTERS = {
    "q_proj": (R, Shard(0)),  # (A, B)
    "k_proj": (R, Shard(0)),
    "v_proj": (R, Shard(0)),
    "gate_proj": (R, Shard(0)),
    "up_proj": (R, Shard(0)),
    "o_proj": (Shard(1), R),
    "down_proj": (Shard(1), R),
}


@pytest.fixture(scope="module")
def model():
    m = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=512, num_hidden_layers=2))
    apply_lora(m, LoraConfig(r=4, targets=("all-linear",)), seed=0)
    return m


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_adapter_placements_follow_their_base_weight(model, zero):
    plan = ParallelPlan.make("llama", dp=2, tp=2, zero=zero)
    check_plan(plan, model)
    seen = 0
    for name, p in model.named_parameters():
        layer, _, factor = name.rpartition(".")
        if factor not in ("lora_A", "lora_B"):
            continue
        want = ADAPTERS[layer.rpartition(".")[2]][factor == "lora_B"]
        got = plan.param_placements(name, p.shape)
        assert got[1] == want, name
        # ZeRO 3 shards a factor over dp on a dim tp leaves whole (the rank r of B when tp splits out)
        dp_dim = 1 if want == Shard(0) else 0
        assert got[0] == (Shard(dp_dim) if zero >= 3 else R), name
        assert plan.state_placements(name, p.shape)[0] == (Shard(dp_dim) if zero >= 1 else R), name
        seen += 1
    assert seen == 2 * 7 * 2  # A and B of 7 projections in 2 layers


def test_a_user_plan_needs_no_rule_for_the_adapters():
    """The adapters follow whatever the plan gives their base weight (here: q column, o row, the rest
    replicated by the default rule), with no glob of their own."""
    plan = ParallelPlan.make(
        {"params": {"*.q_proj.weight": "S(0)", "*.o_proj.weight": "S(1)", "*": "R"}}, tp=2
    )
    at = lambda n: plan.tp_placement(f"model.layers.0.self_attn.{n}")
    assert (at("q_proj.lora_A"), at("q_proj.lora_B")) == (R, Shard(0))
    assert (at("o_proj.lora_A"), at("o_proj.lora_B")) == (Shard(1), R)
    assert (at("v_proj.lora_A"), at("v_proj.lora_B")) == (R, R)
