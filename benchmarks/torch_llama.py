"""A small PyTorch Llama equivalent to ``llmkit.models.llama`` (the baseline of the GPU benchmarks).

The same architecture and parameter count as ``LlamaForCausalLM`` for a given ``LlamaConfig``:
token embedding, per layer RMSNorm -> grouped-query attention with RoPE (rotate-half form, the
config's inverse frequencies) -> residual, RMSNorm -> SwiGLU MLP -> residual, a final RMSNorm and
an untied (or tied) lm head. Attention is ``scaled_dot_product_attention`` (causal), so eager
PyTorch gets its fused attention and ``torch.compile`` fuses the rest. Benchmarks only: llmkit never
imports torch. ``tests/test_gpu_check.py`` checks its logits against Hugging Face transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, self.nh, self.hd).transpose(1, 2)  # (B, nh, S, hd)
        k = self.k_proj(h).view(b, s, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v_proj(h).view(b, s, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, self.nh * self.hd))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TorchLlama(nn.Module):
    """``TorchLlama(llmkit LlamaConfig)``; ``forward(ids (B, S) int64) -> logits (B, S, V)``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer(
            "inv_freq", torch.tensor(cfg.rope_inv_freq(), dtype=torch.float32), persistent=False
        )
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.initializer_range)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        ang = torch.outer(pos, self.inv_freq)
        ang = torch.cat([ang, ang], dim=-1)  # (S, hd)
        cos, sin = ang.cos(), ang.sin()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
