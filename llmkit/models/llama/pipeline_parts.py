"""Llama as a chain for pipeline parallelism: embedding, decoder layers, then norm + head + loss.

Each piece names the sublayers it runs (Hugging Face names, so a parallel plan's globs and a
checkpoint's tensors apply to a stage as to the whole model) and costs its forward FLOPs per token
(``LlamaConfig.flops_per_token``'s count, split by piece), which balances the stages. Decoder
layers also read the RoPE tables (buffers of ``model.model``).
"""

from __future__ import annotations

from llmkit.framework.distributed.pipeline import Piece, PipelineParts
from llmkit.framework.opspec import Meta

from .model import LlamaForCausalLM, causal_positions, lm_loss

ROPE = ("model.rope_cos", "model.rope_sin")


def piece_flops(config, seq_len: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of the embedding, one decoder layer, and norm + head + loss: 2 per
    multiply-add of the matmuls, plus QK^T and AV over ``seq_len`` keys (as flops_per_token)."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * c.intermediate_size) + 4 * q * seq_len
    return float(h), float(layer), float(2 * h * c.vocab_size)


def pipeline_parts(model: LlamaForCausalLM, seq_len: int | None = None) -> PipelineParts:
    """``model`` as :class:`PipelineParts`; costs at ``seq_len`` (default: the longest context)."""
    c = model.config
    embed_flops, layer_flops, head_flops = piece_flops(c, seq_len or c.max_position_embeddings)
    head = "model.embed_tokens" if c.tie_word_embeddings else "lm_head"

    def first(layers, ids):
        return layers["model.embed_tokens"](ids)  # (B, S, H)

    def block(name: str):
        def run(layers, x):
            b, s = x.shape[0], x.shape[1]
            cos, sin = (layers[t].astype(x.dtype) for t in ROPE)
            return layers[name](x, cos, sin, causal_positions(b, s))

        return Piece((name, *ROPE), run, layer_flops)

    def last(layers, x, labels):
        return lm_loss(layers["model.norm"](x), layers[head].weight, labels)

    def boundary(shape: tuple[int, ...]) -> Meta:
        return Meta((*shape, c.hidden_size), model.model.embed_tokens.weight.dtype)

    return PipelineParts(
        model,
        Piece(("model.embed_tokens",), first, embed_flops),
        tuple(block(f"model.layers.{i}") for i in range(c.num_hidden_layers)),
        Piece(("model.norm", head), last, head_flops),
        boundary,
    )
