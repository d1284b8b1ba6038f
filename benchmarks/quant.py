"""Quantized models: decode tokens/s of int8 and int4 against float32, and the accuracy table.

Speed: the engine (``Engine.from_model``, as configured by default: compiled programs, the ops' C
kernels) on two models with random weights (speed does not depend on the values), quantized with
RTN: configs/bench.yaml's model and a 134M-parameter one (hidden 768, 12 layers, 12 heads, MLP 2048,
vocab 32000). Variants: float32; int8 per output channel; int4 in groups of 128 (symmetric); and
both again with the lm_head quantized (``--lm-head``; on the 134M model the float lm_head alone is
a fifth of the weights). Batch 1 and 8, greedy, tokens/s from the median step time over interleaved
rounds; each ratio is the median over rounds of the two measured in the same round.

The bound of each variant: a decode step reads every weight once (of the embedding table one row
per sequence), ``weight_MB`` per step, so ``GB_per_s`` = weight bytes / median step time is the
memory speed the step achieved. ``format_bound_x`` = float32's weight bytes / the variant's is the
speedup if the variant streamed its weights as fast as float32 does (the most the format allows
when float32 is memory bound); ``GB_per_s_of_float32`` = the variant's GB/s / float32's says how
near the kernel comes to that (1: the format is the limit; well below 1: the kernel is).

Accuracy (``--model``, a trained model or run directory, default runs/tiny): perplexity on the
held-out split, mean KL of next-token distributions and top-1 agreement against the float model,
for every method (rtn, gptq) and setting (int8 per channel; int4 groups of 32, 64, 128; 128
asymmetric). Skipped, with a line saying so, when the directory does not exist.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/quant.py
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from _common import emit, emit_paired_ratio, engine_steps, machine

import llmkit.framework as lf
from llmkit.framework.compiler.build import spin_between_kernels
from llmkit.infer import Engine, EngineConfig
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.quant import QuantConfig, eval_tokens, evaluate, quantize_model

MODELS = {
    "bench": lambda: LlamaConfig.from_preset("bench", vocab_size=4096),
    "134M": lambda: LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=1024,
    ),
}
SPEED = {  # variant -> (QuantConfig, lm_head quantized) or None for float32
    "float32": None,
    "int8": (QuantConfig(8, -1, True, "rtn"), False),
    "int4": (QuantConfig(4, 128, True, "rtn"), False),
    "int8_lm_head": (QuantConfig(8, -1, True, "rtn"), True),
    "int4_lm_head": (QuantConfig(4, 128, True, "rtn"), True),
}
ACCURACY = [(8, -1, True), (4, 32, True), (4, 64, True), (4, 128, True), (4, 128, False)]


def model_of(config: LlamaConfig, variant: tuple | None) -> LlamaForCausalLM:
    lf.seed(0)  # the same random weights for every variant
    model = LlamaForCausalLM(config)
    model.eval()
    if variant is not None:
        quantize_model(model, variant[0], lm_head=variant[1], progress=False)
    return model


def step_bytes(model: LlamaForCausalLM) -> int:
    """Weight bytes a decode step reads: every tensor once, of an untied embedding table one row."""
    total = sum(t.numpy().nbytes for t in model.state_dict().values())
    if not model.config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight.numpy()
        total -= emb.nbytes - emb[0].nbytes
    return total


def speed(name: str, rounds: int, prompt_len: int, new_tokens: int, info: dict) -> None:
    config = MODELS[name]()
    engines, weights = {}, {}
    for v, q in SPEED.items():
        t = time.perf_counter()
        model = model_of(config, q)
        weights[v] = step_bytes(model)
        engines[v] = Engine.from_model(model, None, EngineConfig(max_batch=8))
        emit("quant", f"{name}_{v}_setup_s", time.perf_counter() - t, "s", model=name)
    for batch in (1, 8):
        per_round: dict[str, list[float]] = {v: [] for v in engines}
        for _ in range(rounds):
            for v, e in engines.items():
                per_round[v].append(float(np.median(engine_steps(e, batch, prompt_len, new_tokens))))
        gbps = {v: weights[v] / float(np.median(steps)) / 1e9 for v, steps in per_round.items()}
        for v, steps in per_round.items():
            med = float(np.median(steps))
            emit(
                "quant",
                f"{name}_{v}_batch{batch}_tokens_per_s",
                batch / med,
                "tokens/s",
                step_ms=round(med * 1e3, 2),
                weight_MB=round(weights[v] / 1e6, 2),
                MB_per_token=round(weights[v] / batch / 1e6, 2),
                GB_per_s=round(gbps[v], 2),
                **info,
            )
        for v in engines:
            if v != "float32":
                emit_paired_ratio(
                    "quant",
                    f"{name}_{v}_over_float32_batch{batch}",
                    [1 / s for s in per_round[v]],
                    [1 / s for s in per_round["float32"]],
                    model=name,
                    format_bound_x=round(weights["float32"] / weights[v], 3),
                    GB_per_s_of_float32=round(gbps[v] / gbps["float32"], 3),
                    note="decode tokens/s, same run; bound: float32's GB/s over the variant's bytes",
                )


def accuracy(model_dir: Path, samples: int) -> None:
    from llmkit.models.llama import LlamaTokenizer
    from llmkit.quant.cli import calibration_ids, resolve_model_dir

    src = resolve_model_dir(model_dir)
    tok = LlamaTokenizer.from_pretrained(src)
    base = LlamaForCausalLM.from_pretrained(str(src))
    base.eval()
    tokens = eval_tokens(tok)
    calib = calibration_ids(tok, "builtin", samples, 128, 0)
    for bits, group, sym in ACCURACY:
        for method in ("rtn", "gptq"):
            model = LlamaForCausalLM.from_pretrained(str(src))
            model.eval()
            cfg = QuantConfig(bits, group, sym, method)
            t = time.perf_counter()
            quantize_model(model, cfg, calib, progress=False)
            seconds = time.perf_counter() - t
            r = evaluate([base, model], tokens)
            fp, qp = r["ppl"]
            label = (
                f"int{bits}_{'g' + str(group) if group > 0 else 'channel'}{'' if sym else '_asym'}_{method}"
            )
            emit(
                "quant",
                f"{label}_perplexity",
                qp,
                "ppl",
                float_perplexity=round(fp, 4),
                change_pct=round(100 * (qp / fp - 1), 3),
                kl=r["kl"],
                top1=round(r["top1"], 5),
                tokens=r["tokens"],
                quantize_s=round(seconds, 2),
                model=str(src),
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--model", default="runs/tiny", help="trained model (or run) directory for the accuracy table"
    )
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--skip-speed", action="store_true")
    a = p.parse_args()
    spin_between_kernels()  # as llmkit serve runs
    info = dict(prompt_len=a.prompt_len, new_tokens=a.new_tokens, **machine())
    emit("quant", "load_average_1min", os.getloadavg()[0], "load", **info)
    if not a.skip_speed:
        for name in a.models:
            speed(name, a.rounds, a.prompt_len, a.new_tokens, {"model": name, **info})
    if Path(a.model).exists():
        accuracy(Path(a.model), a.calib_samples)
    else:
        emit(
            "quant",
            "accuracy_skipped",
            0,
            "",
            note=f"no {a.model}: llmkit train configs/tiny.yaml",
        )


if __name__ == "__main__":
    main()
