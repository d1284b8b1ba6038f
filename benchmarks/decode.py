"""Decode throughput on the bench model (random weights): the inference engine vs eager generation.

Tokens/s counts generated tokens over all sequences of the batch, prefill excluded, from the median
step time. Eager generation (contiguous KV cache, one op at a time) and the engine (static decode
program over the paged KV cache) run in the same process, interleaved, with the same BLAS threads,
and the ratio of the two is the headline figure. The engine runs as configured by default
(batch-invariant; the compiler's kernels: fused groups, the decode ops' C kernels, the step replayed
in one C call) and, for comparison, with the op table's reference kernels (``compiler="none"``:
one-row BLAS products in decode) and with plain GEMMs (no batch-invariance guarantee). Kernel
threads spin between kernels as in ``llmkit serve`` and ``llmkit generate`` (``--no-spin``: they
sleep at once, as in training); their spinning after an engine step can take a core from the eager
step that follows for up to a few hundred microseconds.

``--device gpu`` runs the model (weights initialized on the CPU, then moved), the eager loop and the
engines on the GPU; ``--batches 1,8,32`` picks the batch sizes. ``--kv-int8`` adds the default engine
with an int8 KV cache (``kv_dtype="int8"``) and its ratio to the float32 cache's, same run.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/decode.py
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _common import emit, engine_steps, machine

import llmkit.framework as lf
from llmkit.framework.blas import get_blas_threads, set_blas_threads
from llmkit.framework.compiler.build import spin_between_kernels
from llmkit.infer import Engine, EngineConfig
from llmkit.models.llama import KVCache, LlamaConfig, LlamaForCausalLM


@lf.no_grad()
def eager_steps(model, batch: int, prompt_len: int, new_tokens: int) -> list[float]:
    """Seconds per decode step, greedy, with the contiguous eager KV cache."""
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
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (medians over all)")
    p.add_argument("--blas-threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument(
        "--no-spin", action="store_true", help="kernel threads sleep at once after a kernel (as in training)"
    )
    p.add_argument("--kv-int8", action="store_true", help="also the engine with an int8 KV cache")
    a = p.parse_args()
    set_blas_threads(a.blas_threads)
    spun = not a.no_spin
    if spun:
        spin_between_kernels()  # as llmkit serve / generate run
    batches = [int(b) for b in a.batches.split(",")]
    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset(a.preset, vocab_size=4096))
    model.eval()
    model.to(a.device)
    lf.set_device(a.device)  # the eager loop's token tensors
    variants = {  # name -> engine settings; "engine" is the default configuration
        "engine": dict(),
        "engine_reference_kernels": dict(compiler="none"),
        "engine_plain_gemm": dict(compiler="none", prefill_tile=0, decode_tile=0),
        **({"engine_kv_int8": dict(kv_dtype="int8")} if a.kv_int8 else {}),
    }
    cfg = dict(max_batch=max(batches))
    engines = {k: Engine.from_model(model, None, EngineConfig(**cfg, **v)) for k, v in variants.items()}
    from llmkit.framework.compiler.runtime import CPUS

    info = dict(
        prompt_len=a.prompt_len,
        new_tokens=a.new_tokens,
        blas_threads=get_blas_threads(),
        kernel_threads=CPUS,  # the compiler's kernels (and the engine's C kernels) may use these
        kernel_threads_spin=spun,
        device=a.device,
        **machine(),
    )
    emit("decode", "load_average_1min", os.getloadavg()[0], "load", **info)
    for batch in batches:
        samples: dict[str, list[float]] = {"eager": [], **{k: [] for k in variants}}
        for _ in range(a.rounds):
            samples["eager"] += eager_steps(model, batch, a.prompt_len, a.new_tokens)
            for k, eng in engines.items():
                samples[k] += engine_steps(eng, batch, a.prompt_len, a.new_tokens)
        med = {k: float(np.median(v)) for k, v in samples.items()}
        for k in samples:
            extra = variants.get(k, {})
            emit(
                "decode",
                f"{k}_batch{batch}_tokens_per_s",
                batch / med[k],
                "tokens/s",
                step_ms=round(med[k] * 1e3, 2),
                **extra,
                **info,
            )
        emit(
            "decode",
            f"engine_over_eager_batch{batch}",
            med["eager"] / med["engine"],
            "x",
            note="same run, same BLAS threads; the engine as configured by default (batch-invariant)",
        )
        emit(
            "decode",
            f"batch_invariance_cost_batch{batch}",
            med["engine_reference_kernels"] / med["engine_plain_gemm"],
            "x",
            note="reference-kernel engine step time (batch-invariant) over plain GEMMs (no guarantee)",
        )
        if a.kv_int8:
            emit(
                "decode",
                f"kv_int8_over_float_batch{batch}",
                med["engine"] / med["engine_kv_int8"],
                "x",
                note="the default engine's tokens/s with an int8 KV cache over a float32 one, same run",
            )
    ref = {1: (499.0, 707.0), 8: (2654.0, 4580.0)} if a.device == "cpu" else {}  # this CPU kind's
    for batch, (shipped, tuned) in ref.items():
        emit(
            "decode",
            f"hf_generate_batch{batch}_reference",
            shipped,
            "tokens/s",
            tuned=tuned,
            note="transformers generate on this machine kind, from the issue",
        )


if __name__ == "__main__":
    main()
