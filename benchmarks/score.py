"""Scoring throughput: prompt tokens/s of echo requests through ``llmkit serve`` against the engine.

Exports the bench model (random weights, the built-in tokenizer; ``serve_load.export_bench_model``)
unless ``--model-file`` is given, starts ``llmkit serve`` on a free loopback port, and in each round
measures, on the same 64 token-id prompts, three figures:

- ``engine_prefill``: the engine the server loads (``Engine.from_static``, one BLAS thread and kernel
  threads spinning between kernels, as the server runs), through its public API in this process:
  ``engine.generate`` of the 64 prompts with ``max_tokens`` 1 and no scoring, i.e. prefill alone
  (the one token comes from prefill's logits; no decode step);
- ``engine_score``: the same engine doing the server's work, ``engine.generate`` with
  ``prompt_logprobs`` 1 and ``max_tokens`` 0 (the score program: the LM head, logsumexp and top-k
  at every position, so it costs more than plain prefill);
- ``server_score``: 64 concurrent clients each sending one ``/v1/completions`` request with
  ``echo: true, max_tokens: 0, logprobs: 1`` (lm-eval's scoring request), all answered.

The order of the three rotates from round to round (no figure always runs first or last), the
engine's prefix cache is emptied before each engine figure, and each round records the 1-minute
load average. Figures are prompt tokens/s (medians over rounds) and the paired ratios within each
round (the VM's speed drifts between minutes), and the CPU time each figure took (the engine's: this
process; the server's: its process, the client's share not counted), which a shared machine's load
moves much less than the rates: ``server_over_engine_score`` is the HTTP path's cost
on the same work; ``server_over_engine_prefill`` (the issue's figure, target 0.8) adds the score
program's own cost over plain prefill. The client runs on the same cores as the server.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/score.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from _common import emit, emit_paired_ratio, load_average, machine
from serve_load import export_bench_model, free_port, start

BENCH = "score"


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, every thread) of this process or of ``pid``."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_tokens_per_s(engine, prompts: list[list[int]], params, cpu: list[float] | None = None) -> float:
    engine.reset_prefix_cache()  # each measurement computes every prompt
    c, t = process_cpu_s(), time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    if cpu is not None:
        cpu.append(process_cpu_s() - c)
    assert all(len(o.prompt_logprobs or [None] * len(p)) == len(p) for o, p in zip(outs, prompts))
    return sum(map(len, prompts)) / dt


async def server_tokens_per_s(url: str, prompts: list[list[int]], pid: int, cpu: list[float]) -> float:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def one(p: list[int]) -> None:
            body = {"model": "bench", "prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(p)

        await one(prompts[0])  # connection and first-request costs outside the timing
        c, t = process_cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t
        cpu.append(process_cpu_s(pid) - c)
        return sum(map(len, prompts)) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-file", type=Path, default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from llmkit.framework.blas import set_blas_threads
    from llmkit.framework.compiler.build import spin_between_kernels
    from llmkit.infer import Engine, EngineConfig, SamplingParams

    set_blas_threads(1)  # as llmkit serve runs (--blas-threads 1) ...
    spin_between_kernels()  # ... and its kernel threads
    tmp = tempfile.TemporaryDirectory()
    model_file = a.model_file or export_bench_model(Path(tmp.name) / "bench.llmkit")
    # max_batch 8 and the default 256 tokens a step, as the server below
    engine = Engine.from_static(model_file, EngineConfig(max_batch=8))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, engine.spec.vocab_size, a.prompt_len).tolist() for _ in range(a.requests)]
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    score = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    engine_tokens_per_s(engine, prompts[:4], score)  # warm-up: first calls of both programs
    engine_tokens_per_s(engine, prompts[:4], prefill)
    port = free_port()
    proc, _ = start(model_file, port, 8)
    url = f"http://127.0.0.1:{port}"
    cpu: dict[str, list[float]] = {"engine_prefill": [], "engine_score": [], "server_score": []}
    measure = {
        "engine_prefill": lambda: engine_tokens_per_s(engine, prompts, prefill, cpu["engine_prefill"]),
        "engine_score": lambda: engine_tokens_per_s(engine, prompts, score, cpu["engine_score"]),
        "server_score": lambda: asyncio.run(server_tokens_per_s(url, prompts, proc.pid, cpu["server_score"])),
    }
    names = list(measure)
    figures: dict[str, list[float]] = {n: [] for n in names}
    loads = []
    try:
        for r in range(a.rounds):
            loads.append(load_average())
            for name in names[r % 3 :] + names[: r % 3]:  # rotated: each figure in each place
                figures[name].append(measure[name]())
    finally:
        proc.terminate()
        proc.wait(30)
    extra = {"requests": a.requests, "prompt_len": a.prompt_len, "rounds": a.rounds, **machine()}
    extra["load_1min"] = loads
    for name, values in figures.items():
        emit(BENCH, f"{name}_prompt_tokens_per_s", statistics.median(values), "tok/s", **extra)
    tokens = a.requests * a.prompt_len
    for name, values in cpu.items():  # robust to a shared machine's load, unlike the rates
        who = "the server process" if name == "server_score" else "this process"
        emit(BENCH, f"{name}_cpu_ms_per_1k_tokens", statistics.median(values) * 1e6 / tokens, "ms", of=who)
    emit_paired_ratio(BENCH, "server_over_engine_score", figures["server_score"], figures["engine_score"])
    emit_paired_ratio(
        BENCH, "server_over_engine_prefill", figures["server_score"], figures["engine_prefill"], target=0.8
    )
    emit_paired_ratio(
        BENCH, "engine_score_over_engine_prefill", figures["engine_score"], figures["engine_prefill"]
    )


if __name__ == "__main__":
    main()
