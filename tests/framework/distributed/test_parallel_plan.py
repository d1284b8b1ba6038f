"""ParallelPlan: the built-in Llama plan against Megatron-LM's layout written out here, the ZeRO
stages as placement policies, user plans, errors, and the JSON file read back exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmkit.framework.distributed.parallel_plan import ParallelPlan, PlanError
from llmkit.framework.placement import Replicate, Shard
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.sharding import check_plan

R = Replicate()

# Megatron-LM (Shoeybi et al. 2019, sections 3 and 4) for weights stored [out, in]: column parallel
# splits the outputs (dim 0), row parallel the inputs (dim 1); vocab-parallel embedding and head
# split the vocabulary rows; norms are replicated.
MEGATRON = {
    "embed_tokens.weight": Shard(0),
    "q_proj.weight": Shard(0),
    "k_proj.weight": Shard(0),
    "v_proj.weight": Shard(0),
    "o_proj.weight": Shard(1),
    "gate_proj.weight": Shard(0),
    "up_proj.weight": Shard(0),
    "down_proj.weight": Shard(1),
    "lm_head.weight": Shard(0),
    "input_layernorm.weight": R,
    "post_attention_layernorm.weight": R,
    "norm.weight": R,
}


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=512, num_hidden_layers=2))


def megatron(name: str):
    return next(
        p for suffix, p in sorted(MEGATRON.items(), key=lambda kv: -len(kv[0])) if name.endswith(suffix)
    )


def test_the_llama_plan_is_megatrons_layout(model):
    plan = ParallelPlan.make("llama", dp=2, tp=2)
    check_plan(plan, model)
    for name, p in model.named_parameters():
        assert plan.param_placements(name, p.shape) == (R, megatron(name)), name


def test_biases_follow_their_projection():
    plan = ParallelPlan.make("llama", tp=2)
    assert plan.tp_placement("model.layers.3.self_attn.k_proj.bias") == Shard(0)  # column: split with outputs
    assert plan.tp_placement("model.layers.3.mlp.up_proj.bias") == Shard(0)
    assert plan.tp_placement("model.layers.3.self_attn.o_proj.bias") == R  # row: added after the reduction
    assert plan.tp_placement("model.layers.3.mlp.down_proj.bias") == R


def test_sequence_parallel_reshards_the_stream_between_tp_regions():
    tp = ParallelPlan.make("llama", tp=2)
    sp = ParallelPlan.make("llama", tp=2, sp=True)
    for layer in ("model.embed_tokens", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        assert tp.output_placement(layer) == R  # all-reduce of the partial sums
        assert sp.output_placement(layer) == Shard(1)  # reduce-scatter over the sequence of [B, S, H]
    for norm in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"):
        assert tp.output_placement(norm) is None
        assert sp.output_placement(norm) == R  # all-gathered before the column-parallel products
    assert sp.output_placement("model.layers.0.self_attn.q_proj") is None
    assert tp.params == sp.params


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_are_placement_policies(zero):
    plan = ParallelPlan.make("llama", dp=4, tp=2, zero=zero)
    # (what is sharded over dp) for parameters, gradients, optimizer state
    sharded = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 1), 3: (1, 1, 1)}[zero]
    for name, shape, dim in [
        ("model.layers.0.self_attn.q_proj.weight", (128, 128), 1),  # tp shards dim 0: dp takes dim 1
        ("model.layers.0.self_attn.o_proj.weight", (128, 128), 0),
        ("model.norm.weight", (128,), 0),
    ]:
        tp = plan.tp_placement(name)
        got = (
            plan.param_placements(name, shape),
            plan.grad_placements(name, shape),
            plan.state_placements(name, shape),
        )
        want = tuple((Shard(dim) if s else R, tp) for s in sharded)
        assert got == want, name


def test_a_parameter_no_glob_matches_is_named(model):
    plan = ParallelPlan.make({"params": {"*_proj.weight": "S(0)"}}, tp=2)
    with pytest.raises(
        PlanError, match=r"parameter 'model.embed_tokens.weight' matches no glob .*'\*_proj.weight'"
    ):
        plan.check({n: p.shape for n, p in model.named_parameters()})
    default = ParallelPlan.make({"params": {"*_proj.weight": "S(0)", "*": "R"}}, tp=2)
    default.check({n: p.shape for n, p in model.named_parameters()})
    assert default.tp_placement("model.embed_tokens.weight") == R
    assert default.tp_placement("model.layers.0.mlp.up_proj.weight") == Shard(0)  # first match wins


def test_a_user_plan_is_a_few_lines_of_yaml(tmp_path, model):
    f = tmp_path / "plan.yaml"
    f.write_text(
        "params:\n"
        "  '*.mlp.[gu]*_proj.weight': S(0)\n"
        "  '*.mlp.down_proj.weight': S(1)\n"
        "  '*': R\n"
        "outputs:\n"
        "  '*.mlp.down_proj': R\n"
    )
    plan = ParallelPlan.make(str(f), tp=2)
    check_plan(plan, model)
    assert plan.name is None and plan.tp_placement("model.layers.1.mlp.gate_proj.weight") == Shard(0)
    assert plan.tp_placement("model.layers.1.self_attn.q_proj.weight") == R
    assert plan.output_placement("model.layers.1.mlp.down_proj") == R


@pytest.mark.parametrize(
    ("spec", "kw", "key", "message"),
    [
        ("nope", {}, "", "'nope' is neither a built-in plan (llama) nor a plan file"),
        ({"params": {"*": "S(x)"}}, {}, "params", "'*': bad placement 'S(x)'"),
        ({"params": {"*": "P(sum)"}}, {}, "params", "'*': P(sum) is not a layout"),
        ({"params": {}}, {}, "params", "a plan needs at least one parameter rule"),
        ({"params": {"*": "R"}, "output": {}}, {}, "", "unknown key 'output'"),
        ({"params": ["*"]}, {}, "params", "expected a mapping of glob -> placement"),
        ("llama", {"zero": 2}, "zero", "ZeRO stage 2 shards over data-parallel ranks; it needs dp > 1"),
        ("llama", {"sp": True}, "sp", "it needs tp > 1"),
        ("llama", {"dp": 0}, "mesh", "dp must be a positive integer, got 0"),
    ],
)
def test_bad_plans_name_the_key(spec, kw, key, message):
    with pytest.raises(PlanError) as info:
        ParallelPlan.make(spec, **kw)
    assert info.value.key == key and message in str(info.value)


def test_shard_dims_must_fit_the_parameter(model):
    plan = ParallelPlan.make({"params": {"*norm.weight": "S(1)", "*": "R"}}, tp=2)
    with pytest.raises(
        PlanError, match=r"'model.layers.0.input_layernorm.weight' \[128\]: S\(1\) is out of range"
    ):
        check_plan(plan, model)
    tiny = {"model.norm.weight": (1,)}
    with pytest.raises(PlanError, match=r"cuts a dim of 1 into tp=2 pieces"):
        ParallelPlan.make({"params": {"*": "S(0)"}}, tp=2).check(tiny)


def test_tp_must_keep_whole_heads():
    model = LlamaForCausalLM(
        LlamaConfig.from_preset("tiny", vocab_size=64, num_hidden_layers=1, num_key_value_heads=1)
    )
    with pytest.raises(PlanError, match=r"tp=2 does not divide model.num_key_value_heads \(1\)"):
        check_plan(ParallelPlan.make("llama", tp=2), model)


@pytest.mark.parametrize("kw", [{}, {"dp": 2, "tp": 2, "sp": True, "zero": 3}])
def test_the_json_file_loads_back_exactly(tmp_path, kw):
    plan = ParallelPlan.make("llama", **kw)
    plan.save(tmp_path / "parallel_plan.json")
    again = ParallelPlan.load(tmp_path)
    assert again == plan and again.params == plan.params and again.outputs == plan.outputs
    again.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "parallel_plan.json").read_bytes()
    raw = json.loads((tmp_path / "parallel_plan.json").read_text())
    assert raw["mesh"] == {"dp": kw.get("dp", 1), "tp": kw.get("tp", 1)} and raw["plan"] == "llama"
    assert next(iter(raw["params"])) == "model.embed_tokens.weight"  # rule order is kept: first match wins


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r.update(version=2), "expected 'llmkit.parallel_plan' version 1"),
        (lambda r: r.update(extra=1), "unexpected or missing keys ['extra']"),
        (lambda r: r.update(mesh={"dp": 2}), "mesh: dims must be ['dp', 'tp'], got ['dp']"),
        (lambda r: r.update(sp="yes"), "sp: expected true or false, got 'yes'"),
        (lambda r: r["params"].update({"*": "S("}), "params: '*': bad placement 'S('"),
    ],
)
def test_a_damaged_plan_file_is_refused_by_name(tmp_path, edit, message):
    raw = ParallelPlan.make("llama").to_json()
    edit(raw)
    (tmp_path / "parallel_plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanError) as info:
        ParallelPlan.load(tmp_path)
    assert "parallel_plan.json: " in str(info.value) and message in str(info.value)
    (tmp_path / "parallel_plan.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        ParallelPlan.load(tmp_path)


@pytest.mark.parametrize(
    "kw",
    [
        {"dp": 4},
        {"dp": 4, "zero": 1},
        {"dp": 4, "zero": 3},
        {"tp": 2},
        {"tp": 2, "sp": True},
        {"dp": 2, "tp": 2},
    ],
)
def test_predicted_traffic_follows_zero_and_megatron(model, kw):
    from llmkit.models.llama.sharding import predict_traffic

    plan = ParallelPlan.make("llama", **kw)
    dp, tp, zero = plan.size("dp"), plan.size("tp"), plan.zero
    c = model.config
    got = predict_traffic(plan, c, batch_size=8, seq_len=16)
    psi = sum(int(np.prod(p.shape)) for p in model.parameters())  # every weight of this model is split by tp
    norms = sum(int(np.prod(p.shape)) for n, p in model.named_parameters() if n.endswith("norm.weight"))
    per_tp = (psi - norms) / tp + norms
    # ZeRO (Rajbhandari et al. 2020, 7.2): a ring all-reduce sends 2 (d-1)/d of the gradients, a
    # reduce-scatter or an all-gather (d-1)/d
    d = (dp - 1) / dp
    assert got["dp_grads"] == pytest.approx((d if zero >= 2 else 2 * d) * per_tp * 4)
    assert got["zero_gather"] == pytest.approx(d * per_tp * 4 if zero else 0)
    # Megatron (Shoeybi et al. 2019, 3): 4 all-reduces of [b, s, h] per layer, + the embedding's and
    # the head's (forward and backward), + 3 [b, s] reductions of the vocab-parallel cross-entropy;
    # with sequence parallelism (Korthikanti et al. 2022, 4.2.2) each all-reduce is a reduce-scatter
    # and an all-gather: the same bytes
    b, t = 8 // dp, (tp - 1) / tp
    want = (4 * c.num_hidden_layers + 2) * 2 * t * b * 16 * c.hidden_size * 4 + 3 * 2 * t * b * 16 * 4
    assert got["tp_stream"] == pytest.approx(want)


def test_recompute_policy_per_layer_round_trips(tmp_path):
    plan = ParallelPlan.make("llama", dp=2, recompute="attention", recompute_every=3)
    assert [plan.recompute_at(i) for i in range(7)] == ["attention", "none", "none"] * 2 + ["attention"]
    assert plan.recomputed_layers(7) == 3 and ParallelPlan.make("llama").recomputed_layers(7) == 0
    assert plan.describe() == "dp=2 x tp=1, recompute attention every 3 layers, plan llama"
    plan.save(tmp_path / "parallel_plan.json")
    assert ParallelPlan.load(tmp_path) == plan
    old = plan.to_json()  # a plan file written before recompute existed reads as recompute none
    del old["recompute"], old["recompute_every"]
    assert ParallelPlan.from_json(old).recompute == "none"
    with pytest.raises(PlanError, match="recompute: must be one of"):
        ParallelPlan.make("llama", recompute="some")
    with pytest.raises(PlanError, match="recompute_every: must be a positive integer, got 0"):
        ParallelPlan.make("llama", recompute="full", recompute_every=0)


def test_apply_recompute_marks_the_policy_parts(model):
    from llmkit.models.llama.sharding import apply_recompute

    apply_recompute(ParallelPlan.make("llama", recompute="attention", recompute_every=2), model)
    layers = model.model.layers
    on = lambda layer: bool(layer.__dict__.get("_recompute"))
    marked = [(on(la), on(la.self_attn)) for la in layers]
    assert marked == [(False, i % 2 == 0) for i in range(len(layers))]
    apply_recompute(ParallelPlan.make("llama", recompute="full"), model)
    assert all(la.__dict__.get("_recompute") and not la.self_attn.__dict__.get("_recompute") for la in layers)
