"""The built-in Llama parallel plan (``parallel: {plan: llama}``), Megatron-LM's layout as data.

Weights are ``[out, in]``, so column parallel (each tp rank computes a slice of the outputs) is
``S(0)`` and row parallel (each rank contracts a slice of the inputs, giving partial sums) is
``S(1)``. An attention block is q/k/v column-parallel (whole heads per rank), o row-parallel; an MLP
is gate/up column-parallel, down row-parallel: one reduction of activations per block, after the
row-parallel product. The embedding and the lm_head are vocab parallel (each rank holds a range of
token rows): the lookup gives partial sums, and the logits stay sharded on the vocabulary, so the
cross-entropy is computed in parallel and the full logits never exist on one rank. Norms are
replicated.

Without sequence parallelism the residual stream is replicated on tp, and the row-parallel outputs
(and the embedding's) are all-reduced. With it, the residual stream and the norms are sharded on
the sequence (dim 1 of [B, S, H]): those outputs are reduce-scattered over the sequence instead, and
each norm's output is all-gathered before the column-parallel products that read it: the same bytes
moved, a tp-th of the activations' memory in between.
"""

from __future__ import annotations

import math
from typing import Any

from llmkit.framework import nn
from llmkit.framework.distributed.parallel_plan import ParallelPlan, PlanError, register_plan
from llmkit.framework.distributed.plan_search import ModelCost
from llmkit.framework.placement import Shard, local_shape

from .model import LlamaForCausalLM

COLUMN, ROW, REPLICATE = "S(0)", "S(1)", "R"


def llama_plan(sp: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(parameter rules, output rules) on the tp mesh dim."""
    params = {
        "model.embed_tokens.weight": COLUMN,  # [V, H]: a range of vocabulary rows per rank
        "*.self_attn.[qkv]_proj.*": COLUMN,  # weights [heads * D, H] and biases [heads * D]
        "*.self_attn.o_proj.weight": ROW,  # [H, heads * D]
        "*.mlp.gate_proj.*": COLUMN,
        "*.mlp.up_proj.*": COLUMN,
        "*.mlp.down_proj.weight": ROW,
        "*_proj.bias": REPLICATE,  # o/down biases are added once, after the reduction
        "lm_head.weight": COLUMN,  # [V, H]: logits sharded on the vocabulary
        "*norm.weight": REPLICATE,
    }
    stream = "S(1)" if sp else REPLICATE  # the residual stream [B, S, H] between the tp regions
    outputs = {"model.embed_tokens": stream, "*.self_attn.o_proj": stream, "*.mlp.down_proj": stream}
    if sp:
        outputs.update({"*.input_layernorm": REPLICATE, "*.post_attention_layernorm": REPLICATE})
        outputs["model.norm"] = REPLICATE
    return params, outputs


register_plan("llama", llama_plan)


# What each recompute policy of the plan checkpoints in a decoder layer (``Layer.recompute``: the
# part keeps its input and recomputes its activations in the backward, eagerly and traced).
# "attention" is the attention block: q/k/v, RoPE, the attention core and o_proj (the core itself
# keeps no S x S probabilities: its kernel recomputes them tile by tile in the backward already).
RECOMPUTED_PART = {"attention": lambda layer: layer.self_attn, "full": lambda layer: layer}


def apply_recompute(plan: ParallelPlan, model: Any) -> None:
    """Mark the decoder layers' parts that ``plan``'s recompute policy recomputes."""
    for i, layer in enumerate(model.model.layers):
        for part in RECOMPUTED_PART.values():
            part(layer).recompute(False)
        policy = plan.recompute_at(i)
        if policy != "none":
            RECOMPUTED_PART[policy](layer).recompute()


def check_plan(plan: ParallelPlan, model: Any) -> None:
    """The plan fits this model: every parameter has a rule that fits its shape, and tp keeps
    whole attention heads on each rank where it shards the q/k/v projections."""
    plan.check({n: p.shape for n, p in model.named_parameters()})
    tp, c = plan.size("tp"), model.config
    for proj, heads, key in (
        ("q", c.num_attention_heads, "num_attention_heads"),
        ("k", c.num_key_value_heads, "num_key_value_heads"),
        ("v", c.num_key_value_heads, "num_key_value_heads"),
    ):
        if plan.tp_placement(f"model.layers.0.self_attn.{proj}_proj.weight") == Shard(0) and heads % tp:
            raise PlanError(
                "params",
                f"tp={tp} does not divide model.{key} ({heads}): column-parallel {proj}_proj keeps whole "
                "heads on each rank",
            )


def predict_traffic(
    plan: ParallelPlan, config: Any, batch_size: int, seq_len: int, itemsize: int = 4
) -> dict:
    """Bytes each rank sends per training step under ``plan`` (ring collectives: an all-reduce of N
    bytes over n ranks sends 2(n-1)/n N, an all-gather or reduce-scatter (n-1)/n N), by cause:

    - ``tp_stream``: per layer two row-parallel reductions forward (o, down) and two backward (the
      inputs of the column-parallel q/k/v and gate/up), plus the embedding's and the lm_head's: 2(2L+1)
      all-reduces of a [B/dp, S, H] activation; with sp as many reduce-scatter + all-gather pairs
      (Korthikanti et al. 2022, 4.2.2: the same bytes, (n-1)/n N each); the vocab-parallel
      cross-entropy adds three [B/dp, S] all-reduces;
    - ``dp_grads``: the gradients of a tp rank's weights, all-reduced (reduce-scattered under ZeRO 2+);
    - ``zero_gather``: ZeRO 1-2 all-gather the updated weights; ZeRO 3 gathers them in the forward.
    """
    dp, tp = plan.size("dp"), plan.size("tp")
    with nn.init.skip_init():  # the shapes, without drawing (or touching) a 7B model's weights
        model = LlamaForCausalLM(config)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    per_tp = sum(math.prod(local_shape(s, [tp], [plan.tp_placement(n)], [0])) for n, s in shapes.items())
    weights = per_tp * itemsize  # one tp rank's weights, whole over dp
    ring = (tp - 1) / tp
    act = batch_size // dp * seq_len * config.hidden_size * itemsize
    rows = batch_size // dp * seq_len * itemsize
    layers = config.num_hidden_layers
    d = (dp - 1) / dp
    return {
        "tp_stream": 2 * (2 * layers + 1) * 2 * ring * act + 3 * 2 * ring * rows,
        "dp_grads": (d if plan.zero >= 2 else 2 * d) * weights,
        "zero_gather": d * weights if plan.zero else 0.0,
    }


def llama_cost(config: Any, seq_len: int, act_itemsize: int = 4) -> ModelCost:
    """The planner's view of Llama at ``seq_len``: parameters, forward FLOPs (``pipeline.piece_flops``)
    and the activations each piece keeps per token, counted from the forward's saved tensors (per
    layer: the two norms' inputs and outputs, the attention and MLP outputs and the residual sums
    are 6 H wide and replicated over tp; q, k, v, RoPE's q and k, the attention output and its
    [B, S, Hq D] copy are 4 Q + 3 KV; gate, up and SwiGLU 3 I, all cut by tp). Recomputing the
    attention block drops its 4 Q + 3 KV; recomputing the whole layer keeps its input only. The
    embedding keeps its H-wide output; the head its norm's output and the V-wide logits (vocab
    parallel: cut by tp)."""
    from .pipeline_parts import piece_flops

    c = config
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    embed_f, layer_f, head_f = piece_flops(c, seq_len)
    attention_f = 2 * (h * q + 2 * h * kv + q * h) + 4 * q * seq_len
    embed_p = c.vocab_size * h
    head_p = h + (0 if c.tie_word_embeddings else c.vocab_size * h)
    layer_p = (c.num_parameters() - embed_p - head_p) // c.num_hidden_layers
    b = act_itemsize
    return ModelCost(
        name=getattr(c, "name_or_path", None) or "llama",
        layers=c.num_hidden_layers,
        hidden=h,
        layer_params=layer_p,
        edge_params=(embed_p, head_p),
        layer_flops=layer_f,
        edge_flops=(embed_f, head_f),
        layer_act={
            "none": (6 * h * b, (4 * q + 3 * kv + 3 * i) * b),
            "attention": (6 * h * b, 3 * i * b),
            "full": (h * b, 0.0),
        },
        edge_act=((h * b, 0.0), (h * b, c.vocab_size * b)),
        recompute_flops={"none": 0.0, "attention": attention_f, "full": layer_f},
        seq_len=seq_len,
        act_itemsize=b,
        heads=math.gcd(c.num_attention_heads, c.num_key_value_heads),
    )
