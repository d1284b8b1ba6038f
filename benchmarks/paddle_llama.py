"""The PaddlePaddle peer of ``train_throughput.py --paddle``: llmkit's Llama written in Paddle, one
train step timed in dygraph and under ``paddle.jit.to_static``.

Runs in a Python of its own that has paddle installed (never llmkit's: Paddle pins its own numpy and
protobuf), started by ``train_throughput.py`` as ``PYTHON paddle_llama.py SPEC.json``; imports no
llmkit. SPEC holds the model config (``LlamaConfig.to_dict()`` plus ``rope_inv_freq``), the optimizer
(lr, betas, eps, weight decay, clip norm 1.0), ``warmup`` and the path of the batches (.npz, ``x`` and
``y``, [N, B, S] int64); the parent sets the thread count in the environment (OMP_NUM_THREADS,
MKL_NUM_THREADS, FLAGS_paddle_num_threads) before paddle loads.

The model as ``torch_llama.py``: token embedding, per layer RMSNorm -> grouped-query attention with
RoPE (rotate-half form) -> residual, RMSNorm -> SwiGLU MLP -> residual, final RMSNorm, lm head; mean
cross entropy; AdamW (decoupled weight decay) with global-norm clipping. Attention is written out
(matmul, causal mask, softmax, matmul): on the CPU Paddle's ``scaled_dot_product_attention`` took
about twice as long forward + backward at this shape (8 x 8 heads x 256 x 32, Paddle 3.3.1 on the
2-core AMD host: 0.47 s against 0.22 s, loaded). ``to_static`` converts the forward
and the loss (Paddle's default: SOT); backward and the optimizer run as in dygraph, as Paddle trains
a converted model.

Protocol (one JSON object per line): after building both models and warming them up (``warmup``
steps, at least 3, every one on batch 0, so that the losses must fall: the sanity check) it prints
``{"ready": ...}`` with the warm-up losses; then each stdin line ``{"run": [i, j]}`` runs batches
i..j-1, the two variants' steps interleaved, and answers ``{"dygraph": [s...], "to_static": [s...]}``
(seconds per step, from the batch as numpy to the loss as a float, as llmkit's steps are timed).
EOF ends it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn


def _normal(std: float) -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=nn.initializer.Normal(std=std))


def _linear(cfg: dict, n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(
        n_in, n_out, weight_attr=_normal(cfg["initializer_range"]), bias_attr=None if bias else False
    )


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x):
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    h = x.shape[-1] // 2
    return paddle.concat([-x[..., h:], x[..., :h]], axis=-1)


class Block(nn.Layer):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        d, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        ab, mb, inner = cfg["attention_bias"], cfg["mlp_bias"], cfg["intermediate_size"]
        self.input_layernorm = RMSNorm(d, cfg["rms_norm_eps"])
        self.q_proj = _linear(cfg, d, self.nh * hd, ab)
        self.k_proj = _linear(cfg, d, self.nkv * hd, ab)
        self.v_proj = _linear(cfg, d, self.nkv * hd, ab)
        self.o_proj = _linear(cfg, self.nh * hd, d, ab)
        self.post_attention_layernorm = RMSNorm(d, cfg["rms_norm_eps"])
        self.gate_proj = _linear(cfg, d, inner, mb)
        self.up_proj = _linear(cfg, d, inner, mb)
        self.down_proj = _linear(cfg, inner, d, mb)

    def forward(self, x, cos, sin, mask):
        b, s = x.shape[0], x.shape[1]
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape([b, s, self.nh, self.hd]).transpose([0, 2, 1, 3])  # (B, nh, S, hd)
        k = self.k_proj(h).reshape([b, s, self.nkv, self.hd]).transpose([0, 2, 1, 3])  # (B, nkv, S, hd)
        v = self.v_proj(h).reshape([b, s, self.nkv, self.hd]).transpose([0, 2, 1, 3])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        if rep > 1:
            k, v = k.repeat_interleave(rep, axis=1), v.repeat_interleave(rep, axis=1)
        scores = paddle.matmul(q, k, transpose_y=True) * (self.hd**-0.5) + mask
        a = paddle.matmul(F.softmax(scores, axis=-1), v)
        x = x + self.o_proj(a.transpose([0, 2, 1, 3]).reshape([b, s, self.nh * self.hd]))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class PaddleLlama(nn.Layer):
    """``PaddleLlama(config dict)``; ``forward(ids, labels)`` -> mean cross entropy (a scalar)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.vocab = cfg["vocab_size"]
        self.embed_tokens = nn.Embedding(
            self.vocab, cfg["hidden_size"], weight_attr=_normal(cfg["initializer_range"])
        )
        self.layers = nn.LayerList([Block(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.tied = cfg["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = _linear(cfg, cfg["hidden_size"], self.vocab, False)
        self.register_buffer(
            "inv_freq", paddle.to_tensor(np.asarray(cfg["rope_inv_freq"], np.float32)), persistable=False
        )
        n = cfg["max_position_embeddings"]
        causal = np.triu(np.full((n, n), -np.inf, np.float32), 1)  # -inf above the diagonal
        self.register_buffer("causal", paddle.to_tensor(causal), persistable=False)

    def forward(self, ids, labels):
        pos = paddle.arange(ids.shape[1], dtype="float32")
        ang = paddle.outer(pos, self.inv_freq)
        ang = paddle.concat([ang, ang], axis=-1)  # (S, hd)
        cos, sin = ang.cos(), ang.sin()
        s = ids.shape[1]
        mask = self.causal[:s, :s]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.norm(x)
        logits = (
            paddle.matmul(x, self.embed_tokens.weight, transpose_y=True) if self.tied else self.lm_head(x)
        )
        return F.cross_entropy(logits.reshape([-1, self.vocab]), labels.reshape([-1]))


def train_step(spec: dict, static: bool):
    """A train step of a fresh model (seed 0): ``step(x, y) -> loss`` on numpy int64 batches."""
    paddle.seed(0)
    model = PaddleLlama(spec["model"])
    o = spec["optim"]
    opt = paddle.optimizer.AdamW(
        learning_rate=o["lr"],
        beta1=o["betas"][0],
        beta2=o["betas"][1],
        epsilon=o["eps"],
        weight_decay=o["weight_decay"],
        parameters=model.parameters(),
        grad_clip=nn.ClipGradByGlobalNorm(o["clip"]),
    )
    forward = paddle.jit.to_static(model) if static else model

    def step(x, y):
        loss = forward(paddle.to_tensor(x), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        return float(loss)

    return step


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    data = np.load(spec["batches"])
    xs, ys = data["x"], data["y"]
    steps = {"dygraph": train_step(spec, False), "to_static": train_step(spec, True)}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    first_s = {}
    for i in range(max(3, spec["warmup"])):
        if i == 1:  # after the first (tracing) steps: CPU seconds per wall second, the threads at work
            cpu, wall = sum(os.times()[:2]), time.perf_counter()
        for name, step in steps.items():
            t = time.perf_counter()
            losses[name].append(step(xs[0], ys[0]))
            if i == 0:
                first_s[name] = time.perf_counter() - t
    cpu_per_wall = (sum(os.times()[:2]) - cpu) / (time.perf_counter() - wall)
    _say(
        {
            "ready": True,
            "paddle": paddle.__version__,
            "threads": os.environ.get("OMP_NUM_THREADS"),
            "cpu_per_wall": cpu_per_wall,
            "ln_vocab": math.log(spec["model"]["vocab_size"]),
            "losses": losses,
            "first_step_s": first_s,
        }
    )
    for line in sys.stdin:
        i, j = json.loads(line)["run"]
        times: dict[str, list[float]] = {name: [] for name in steps}
        for k in range(i, j):
            for name, step in steps.items():
                t = time.perf_counter()
                step(xs[k], ys[k])
                times[name].append(time.perf_counter() - t)
        _say(times)


if __name__ == "__main__":
    main()
