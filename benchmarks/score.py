"""Scoring throughput: prompt tokens/s of echo requests through ``llmkit serve`` against the engine.

Exports the bench model (random weights, the built-in tokenizer; ``serve_load.export_bench_model``)
unless ``--model-file`` is given, starts ``llmkit serve`` on a free loopback port, and in each round
measures, in this order and on the same 64 token-id prompts:

- ``engine_prefill``: the engine the server loads (``Engine.from_static``, one BLAS thread, as the
  server runs), stepped in this process: the 64 prompts with ``max_tokens`` 1 and no scoring, i.e.
  prefill alone (one token each comes from prefill's logits; no decode step);
- ``engine_score``: the same engine scoring them (``prompt_logprobs`` 1, ``max_tokens`` 0);
- ``server_score``: 64 concurrent clients each sending one ``/v1/completions`` request with
  ``echo: true, max_tokens: 0, logprobs: 1`` (lm-eval's scoring request), all answered.

Figures are prompt tokens/s (medians over rounds) and the paired ratios server / engine within each
round (the VM's speed drifts between minutes); the target for ``server_over_engine_prefill`` is 0.8.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/score.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import emit, emit_paired_ratio, machine
from serve_load import export_bench_model, free_port, start

BENCH = "score"


def engine_tokens_per_s(engine, prompts: list[list[int]], params) -> float:
    t = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_work():
        engine.step()
    return sum(map(len, prompts)) / (time.perf_counter() - t)


async def server_tokens_per_s(url: str, prompts: list[list[int]]) -> float:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def one(p: list[int]) -> None:
            body = {"model": "bench", "prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(p)

        await one(prompts[0])  # connection and first-request costs outside the timing
        t = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return sum(map(len, prompts)) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-file", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from llmkit.framework.blas import set_blas_threads
    from llmkit.infer import Engine, EngineConfig, SamplingParams

    set_blas_threads(1)  # as llmkit serve runs (--blas-threads 1)
    tmp = tempfile.TemporaryDirectory()
    model_file = a.model_file or export_bench_model(Path(tmp.name) / "bench.llmkit")
    engine = Engine.from_static(model_file, EngineConfig(max_batch=8))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.spec.vocab_size, a.prompt_len).tolist() for _ in range(a.requests)]
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    score = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    engine_tokens_per_s(engine, prompts[:4], score)  # warm-up: first calls of both programs
    engine_tokens_per_s(engine, prompts[:4], prefill)
    port = free_port()
    proc, _ = start(model_file, port, 8)  # the server's defaults, as the engine's: 256 tokens a step
    url = f"http://127.0.0.1:{port}"
    figures: dict[str, list[float]] = {"engine_prefill": [], "engine_score": [], "server_score": []}
    try:
        for _ in range(a.rounds):
            engine.reset_prefix_cache()  # each measurement computes every prompt
            figures["engine_prefill"].append(engine_tokens_per_s(engine, prompts, prefill))
            figures["engine_score"].append(engine_tokens_per_s(engine, prompts, score))
            figures["server_score"].append(asyncio.run(server_tokens_per_s(url, prompts)))
    finally:
        proc.terminate()
        proc.wait(30)
    extra = {"requests": a.requests, "prompt_len": a.prompt_len, "rounds": a.rounds, **machine()}
    for name, values in figures.items():
        emit(BENCH, f"{name}_prompt_tokens_per_s", statistics.median(values), "tok/s", **extra)
    emit_paired_ratio(
        BENCH, "server_over_engine_prefill", figures["server_score"], figures["engine_prefill"], target=0.8
    )
    emit_paired_ratio(BENCH, "server_over_engine_score", figures["server_score"], figures["engine_score"])


if __name__ == "__main__":
    main()
