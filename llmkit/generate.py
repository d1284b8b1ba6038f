"""Generating text from a trained model: eager generation and the ``llmkit generate`` command.

``generate(model, prompts, ...)`` runs the prompt once (prefill), then one token at a time with the
model's contiguous KV cache: the baseline the inference engine is measured against.
``llmkit generate --model DIR --prompt TEXT`` is the command-line front end: it runs the inference
engine (``llmkit.infer``: static programs, paged KV cache), or this eager path with ``--eager``;
both sample with the same sampler, so they print the same text. It sits above both ``models`` and
``infer``, which do not import each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

import llmkit.framework as lf
from llmkit.infer.sampling import SamplingParams, sample
from llmkit.models.llama import KVCache, LlamaForCausalLM


@lf.no_grad()
def generate(
    model: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    params: SamplingParams | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """New token ids for each prompt (prompts of one batch must have the same length).

    Without ``use_cache`` every step reruns the whole sequence (the reference the cache must match).
    """
    params = params or SamplingParams(temperature=0.0)
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            "generate: prompts must be non-empty and of equal length (the eager path does not pad)"
        )
    limit = model.config.max_position_embeddings
    if next(iter(lengths)) + max_new_tokens > limit:
        raise ValueError(f"generate: prompt + max_new_tokens exceeds max_position_embeddings ({limit})")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
    rngs = [
        np.random.default_rng(None if params.seed is None else params.seed + i) for i in range(len(prompts))
    ]
    was_training = model.training
    model.eval()
    ids = np.asarray(prompts, dtype=np.int64)
    cache = KVCache(model.config.num_hidden_layers) if use_cache else None
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), dtype=bool)
    step_input = ids
    for _ in range(max_new_tokens):
        logits = model(lf.tensor(step_input), kv_cache=cache).logits.numpy()[:, -1]  # (B, V)
        nxt = np.array([sample(row, params, rng) for row, rng in zip(logits, rngs)], dtype=np.int64)
        for i, t in enumerate(nxt):
            if not done[i]:
                out[i].append(int(t))
                done[i] = int(t) in eos
        if done.all():
            break
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
        step_input = nxt[:, None] if use_cache else ids
    model.train(was_training)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llmkit generate", description="Generate text from a trained model directory."
    )
    p.add_argument(
        "--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.model)"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="run eagerly, op by op (the engine's baseline)")
    a = p.parse_args(argv)
    from llmkit.models.llama import LlamaTokenizer

    model = LlamaForCausalLM.from_pretrained(a.model)
    tok = LlamaTokenizer.from_pretrained(a.model)
    tok.check_fits(model.config.vocab_size, a.model)
    ids = tok.encode(a.prompt, add_bos=True)
    room = model.config.max_position_embeddings - len(ids)
    if a.max_new_tokens > room:
        p.error(f"--max-new-tokens {a.max_new_tokens}: at most {room} fit after this {len(ids)}-token prompt")
    try:
        params = SamplingParams(
            temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, max_tokens=a.max_new_tokens
        )
    except ValueError as e:
        p.error(str(e))
    if a.eager:
        # the engine's stop ids: the tokenizer's eos and generation_config.json's, and config.json's
        eos = [*tok.eos_ids, *model.config.eos_ids]
        new = generate(model, [ids], a.max_new_tokens, params, eos_token_id=eos)[0]
        print(a.prompt + tok.decode(new))
        return 0
    from llmkit.framework.compiler.build import spin_between_kernels
    from llmkit.infer import Engine, EngineConfig

    spin_between_kernels()  # an inference-only process
    engine = Engine.from_model(model, tok, EngineConfig(max_batch=1))
    print(a.prompt + engine.generate([ids], params)[0].text)
    return 0
