"""The Llama decoder (Touvron et al. 2023) on llmkit.framework.nn.

Parameter names follow Hugging Face transformers (``model.layers.0.self_attn.q_proj.weight``...),
so checkpoints load with no renaming. Shapes in comments: B batch, S new tokens, T = past + S keys,
H hidden, Hq/Hkv query/key-value heads, D head dim, V vocab, I intermediate.

The same forward serves training (no cache), eager generation (``KVCache``, contiguous) and the
inference engine's programs (any object with the cache interface: ``past_length`` and
``update(layer, k, v) -> (k_all, v_all)``, or ``attend(layer, q, k, v) -> out`` for a cache that
computes attention itself, as the paged cache does; such callers pass ``position_ids``). Model code
never mentions ranks, devices or serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import llmkit.framework as lf
from llmkit.framework import nn
from llmkit.framework import symbolic as sym

from .config import LlamaConfig

O = lf.ops


class KVCache:
    """Contiguous per-layer key/value cache for eager generation: K/V grow by concatenation."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[lf.Tensor | None] = [None] * num_layers
        self.values: list[lf.Tensor | None] = [None] * num_layers

    @property
    def past_length(self) -> Any:
        k = self.keys[0]
        return 0 if k is None else k.shape[2]

    def update(self, layer: int, k: lf.Tensor, v: lf.Tensor) -> tuple[lf.Tensor, lf.Tensor]:
        """Append this step's k/v [B, Hkv, S, D] and return the whole [B, Hkv, T, D]."""
        if self.keys[layer] is not None:
            k = O.concat([self.keys[layer], k], axis=2)
            v = O.concat([self.values[layer], v], axis=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


@dataclass
class CausalLMOutput:
    logits: lf.Tensor  # [B, S, V]
    loss: lf.Tensor | None = None  # mean next-token cross entropy when labels are given
    kv_cache: Any = None


def causal_positions(b: Any, s: Any, past: Any = 0) -> lf.Tensor:
    """Position ids [B, S] of S new tokens after ``past`` cached ones: past, past + 1, ..."""
    return O.expand(O.unsqueeze(O.arange(past, sym.add(past, s)), axis=0), [b, s])


def lm_loss(hidden: lf.Tensor, weight: lf.Tensor, labels: lf.Tensor) -> lf.Tensor:
    """Mean cross entropy of the logits ``hidden @ weight.T`` [B, S, V] against ``labels`` [B, S]."""
    return O.cross_entropy(O.linear(hidden, weight), labels)


class LlamaAttention(nn.Layer):
    """Grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)

    def forward(self, x, cos, sin, position_ids, layer_idx: int, attention_mask=None, kv_cache=None):
        b, s = x.shape[0], x.shape[1]
        # q: (B, Hq, S, D); k, v: (B, Hkv, S, D)
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = O.rotary_embedding(q, cos, sin, position_ids)
        k = O.rotary_embedding(k, cos, sin, position_ids)
        if kv_cache is not None and hasattr(kv_cache, "attend"):
            # A cache that owns attention (the inference engine's paged KV cache) stores k/v and
            # attends; it brings its own per-sequence lengths and causality.
            out = kv_cache.attend(layer_idx, q, k, v)  # (B, Hq, S, D)
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(layer_idx, k, v)  # (B, Hkv, T, D)
            out = O.scaled_dot_product_attention(q, k, v, attention_mask, is_causal=True)  # (B, Hq, S, D)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, s, self.num_heads * self.head_dim))


class LlamaMLP(nn.Layer):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x):
        return self.down_proj(O.swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaDecoderLayer(nn.Layer):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, position_ids, attention_mask=None, kv_cache=None):
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, position_ids, self.layer_idx, attention_mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Layer):
    """Embedding, decoder blocks and the final norm: input ids [B, S] -> hidden states [B, S, H]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.LayerList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # RoPE tables [max_positions, D] in the model's dtype, computed in float64 (not saved: they
        # follow from the config).
        cos, sin = self._rope_tables(lf.get_default_dtype())
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_tables(self, dtype: Any) -> tuple[lf.Tensor, lf.Tensor]:
        c = self.config
        angles = np.arange(c.max_position_embeddings, dtype=np.float64)[:, None] * c.rope_inv_freq()[None]
        angles = np.concatenate([angles, angles], axis=-1)
        return lf.tensor(np.cos(angles), dtype=dtype), lf.tensor(np.sin(angles), dtype=dtype)

    def rope(self, dtype: Any) -> tuple[lf.Tensor, lf.Tensor]:
        """The RoPE tables [max_positions, D] in ``dtype`` (no-op casts normally)."""
        return self.rope_cos.astype(dtype), self.rope_sin.astype(dtype)

    def converted(self) -> None:
        """After ``to(dtype)``: recompute the RoPE tables from float64, not from the old dtype."""
        w = self.embed_tokens.weight
        for buf, table in zip((self.rope_cos, self.rope_sin), self._rope_tables(w.dtype)):
            nn.layer.replace_payload(buf, lf.backend.to_device(table._data, w.device))

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None):
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = causal_positions(b, s, 0 if kv_cache is None else kv_cache.past_length)
        # attention_mask [B, T] with 1 = attend, 0 = padding -> a bool mask [B, 1, 1, T] (sdpa adds causality)
        mask = None if attention_mask is None else O.unsqueeze(O.not_equal(attention_mask, 0), axis=[1, 2])
        x = self.embed_tokens(input_ids)  # (B, S, H)
        cos, sin = self.rope(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, position_ids, mask, kv_cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Layer):
    """Llama with a language-model head: ``model(input_ids, labels=...)`` as in Hugging Face."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Hugging Face's init: N(0, initializer_range) for weight matrices, zero biases, unit norms."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, std)

    def lm_weight(self) -> lf.Tensor:
        """The output projection [V, H]: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def head(self, hidden: lf.Tensor) -> lf.Tensor:
        """Logits [..., V] = hidden [..., H] @ lm_weight()ᵀ, through the lm_head layer when it has one
        (so that hooks on it apply: a parallel plan's, a quantizer's)."""
        return O.linear(hidden, self.lm_weight()) if self.config.tie_word_embeddings else self.lm_head(hidden)

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, kv_cache=None):
        """Logits [B, S, V]; with ``labels`` [B, S] also the loss of predicting token t+1 at t.

        As in Hugging Face, labels are aligned with input_ids (usually equal to them) and shifted
        here; positions labelled -100 are ignored.
        """
        hidden = self.model(input_ids, position_ids, attention_mask, kv_cache)
        logits = self.head(hidden)  # (B, S, V)
        loss = None if labels is None else O.cross_entropy(logits[:, :-1], labels[:, 1:])
        return CausalLMOutput(logits=logits, loss=loss, kv_cache=kv_cache)

    def loss(self, input_ids, labels):
        """Mean cross entropy of logits at every position against pre-shifted ``labels`` [B, S]."""
        logits = self.head(self.model(input_ids))
        return O.cross_entropy(logits, labels)

    # ---- Hugging Face checkpoints ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, dtype: Any = None) -> LlamaForCausalLM:
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype)

    def save_pretrained(self, path: str, dtype: Any = None, max_shard_size: int | None = None) -> None:
        from .checkpoint import save_pretrained

        save_pretrained(self, path, dtype=dtype, max_shard_size=max_shard_size)
