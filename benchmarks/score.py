"""Scoring throughput: prompt tokens/s of echo requests through ``llmkit serve`` against the engine.

Exports the bench model (random weights, the built-in tokenizer; ``serve_load.export_bench_model``),
or with ``--model`` a larger shape of random weights (``SHAPES``: the LM head's share of the work,
and so the bound on scoring against plain prefill, shrinks as the layers widen), unless
``--model-file`` is given, starts ``llmkit serve`` on a free loopback port, and in each round
measures, on the same 64 token-id prompts, three figures:

- ``engine_prefill``: the engine the server loads (``Engine.from_static``, one BLAS thread and kernel
  threads spinning between kernels, as the server runs), through its public API in this process:
  ``engine.generate`` of the 64 prompts with ``max_tokens`` 1 and no scoring, i.e. prefill alone
  (the one token comes from prefill's logits; no decode step);
- ``engine_score``: the same engine doing the server's work, ``engine.generate`` with
  ``prompt_logprobs`` 1 and ``max_tokens`` 0 (the score program: the LM head, logsumexp and top-k
  at every position, so it costs more than plain prefill);
- ``server_score``: 64 concurrent clients each sending one ``/v1/completions`` request with
  ``echo: true, max_tokens: 0, logprobs: 1`` (lm-eval's scoring request), all answered, through
  aiohttp (the transport of lm-eval's ``local-completions`` with ``num_concurrent``), each response
  parsed as JSON and checked.

The order of the three rotates from round to round (no figure always runs first or last), the
engine's prefix cache is emptied before each engine figure, and each round records the 1-minute
load average. Figures are prompt tokens/s (medians over rounds) and the paired ratios within each
round (the VM's speed drifts between minutes), and the CPU time each figure took (the engine's: this
process; the server's: its process, and apart its event loop thread; the client's, which runs on the
same cores), which a shared machine's load moves much less than the rates:
``server_over_engine_score`` is the HTTP path's cost on the same work (target 0.8);
``server_over_engine_prefill`` (the issue's wording) adds the score program's own cost over plain
prefill, which is bounded by the work: the LM head at every position instead of one per prompt
(docs/serve.md gives the arithmetic).

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/score.py [--rounds 5]
     [--model 1B --requests 16 --prompt-len 64 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from _common import emit, emit_paired_ratio, load_average, machine
from serve_load import export_bench_model, free_port, start

BENCH = "score"
# --model: LlamaConfig fields of random-weight shapes besides the bench preset (vocabulary 32,000,
# the Llama 2 tokenizer's size; the prompts use the built-in tokenizer's ids, which it contains)
_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5)
SHAPES = {
    "134M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, **_LLAMA2),
    "mid": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4, **_LLAMA2),
    "1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, **_LLAMA2),  # TinyLlama-1.1B's shape
}  # fmt: skip


def export_shape(name: str, out: Path) -> Path:
    """A random-weight Llama of shape ``SHAPES[name]`` with the built-in tokenizer, as a static file."""
    import llmkit.framework as lf
    from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
    from llmkit.serve.export import export_model
    from llmkit.train.corpus import builtin_tokenizer

    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[name]))
    model.eval()
    return export_model(model, builtin_tokenizer(4096), out, model_name="bench")


def process_cpu_s(pid: int | None = None, thread: bool = False) -> float:
    """CPU seconds (user + system) of this process or of ``pid``: every thread, or with ``thread``
    only its main thread (the server's event loop)."""
    if pid is None:
        return time.process_time()
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
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


async def server_tokens_per_s(url: str, prompts: list[list[int]], pid: int, cpu: dict[str, list]) -> float:
    connector = aiohttp.TCPConnector(limit=len(prompts))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(600)) as client:

        async def one(p: list[int]) -> None:
            body = {"model": "bench", "prompt": p, "max_tokens": 0, "echo": True, "logprobs": 1}
            async with client.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                got = await r.json()
            assert len(got["choices"][0]["logprobs"]["token_logprobs"]) == len(p)

        await asyncio.gather(*(one(p) for p in prompts[:8]))  # connections and first requests untimed
        c, loop, mine, t = process_cpu_s(pid), process_cpu_s(pid, True), process_cpu_s(), time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t
        cpu["server_score"].append(process_cpu_s(pid) - c)
        cpu["server_event_loop"].append(process_cpu_s(pid, True) - loop)
        cpu["client"].append(process_cpu_s() - mine)
        return sum(map(len, prompts)) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-file", type=Path, default=None)
    ap.add_argument("--model", choices=["bench", *SHAPES], default="bench", help="the shape to export")
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
    out = Path(tmp.name) / "bench.llmkit"
    model_file = a.model_file or (
        export_bench_model(out) if a.model == "bench" else export_shape(a.model, out)
    )
    # max_batch 8 and the default 256 tokens a step, as the server below
    engine = Engine.from_static(model_file, EngineConfig(max_batch=8))
    rng = np.random.default_rng(0)
    vocab = min(engine.spec.vocab_size, engine.tokenizer.vocab_size)  # ids the server can echo as text
    prompts = [rng.integers(3, vocab, a.prompt_len).tolist() for _ in range(a.requests)]
    prefill = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    score = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)
    engine_tokens_per_s(engine, prompts[:4], score)  # warm-up: first calls of both programs
    engine_tokens_per_s(engine, prompts[:4], prefill)
    port = free_port()
    proc, _ = start(model_file, port, 8)
    url = f"http://127.0.0.1:{port}"
    cpu: dict[str, list[float]] = {
        n: [] for n in ("engine_prefill", "engine_score", "server_score", "server_event_loop", "client")
    }
    measure = {
        "engine_prefill": lambda: engine_tokens_per_s(engine, prompts, prefill, cpu["engine_prefill"]),
        "engine_score": lambda: engine_tokens_per_s(engine, prompts, score, cpu["engine_score"]),
        "server_score": lambda: asyncio.run(server_tokens_per_s(url, prompts, proc.pid, cpu)),
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
    extra = {"model": "file" if a.model_file else a.model, "requests": a.requests, "prompt_len": a.prompt_len}
    extra.update(rounds=a.rounds, **machine())
    extra["load_1min"] = loads
    for name, values in figures.items():
        emit(BENCH, f"{name}_prompt_tokens_per_s", statistics.median(values), "tok/s", **extra)
    tokens = a.requests * a.prompt_len
    whose = {"server_score": "the server process", "server_event_loop": "the server's event loop thread"}
    for name, values in cpu.items():  # robust to a shared machine's load, unlike the rates
        who = whose.get(name, "this process" + (" (the client)" if name == "client" else ""))
        emit(BENCH, f"{name}_cpu_ms_per_1k_tokens", statistics.median(values) * 1e6 / tokens, "ms", of=who)
    emit_paired_ratio(
        BENCH, "server_over_engine_score", figures["server_score"], figures["engine_score"], target=0.8
    )
    emit_paired_ratio(  # the literal figure: bounded below 0.8 by the LM head's work (docs/serve.md)
        BENCH, "server_over_engine_prefill", figures["server_score"], figures["engine_prefill"], target=0.8
    )
    emit_paired_ratio(
        BENCH, "engine_score_over_engine_prefill", figures["engine_score"], figures["engine_prefill"]
    )


if __name__ == "__main__":
    main()
