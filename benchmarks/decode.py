"""Decode throughput with a KV cache on the bench model (random weights): eager generation.

Tokens/s counts generated tokens over all sequences of the batch, prefill excluded.
Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/decode.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import emit, machine

import llmkit.framework as lf
from llmkit.models.llama import KVCache, LlamaConfig, LlamaForCausalLM


@lf.no_grad()
def eager_decode(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Seconds per decode step (median), greedy, with the contiguous eager KV cache."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (batch, prompt_len))
    cache = KVCache(model.config.num_hidden_layers)
    logits = model(lf.tensor(ids), kv_cache=cache).logits.numpy()[:, -1]
    times = []
    for _ in range(new_tokens):
        nxt = logits.argmax(-1)[:, None]
        t = time.perf_counter()
        logits = model(lf.tensor(nxt), kv_cache=cache).logits.numpy()[:, -1]
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    a = p.parse_args()
    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset(a.preset, vocab_size=4096))
    model.eval()
    for batch in (1, 8):
        step = eager_decode(model, batch, a.prompt_len, a.new_tokens)
        emit("decode", f"eager_batch{batch}_tokens_per_s", batch / step, "tokens/s", step_ms=round(step * 1e3, 2),
             prompt_len=a.prompt_len, new_tokens=a.new_tokens, **machine())
    ref = {1: (499.0, 707.0), 8: (2654.0, 4580.0)}
    for batch, (shipped, tuned) in ref.items():
        emit("decode", f"hf_generate_batch{batch}_reference", shipped, "tokens/s", tuned=tuned,
             note="transformers generate on this machine kind, from the issue")


if __name__ == "__main__":
    main()
