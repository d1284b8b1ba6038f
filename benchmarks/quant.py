"""Quantized models: decode tokens/s of int8 and int4 against float32, the lm_head alone, and the
accuracy table.

Speed: the engine (``Engine.from_model``, as configured by default: compiled programs, the ops' C
kernels) on two models with random weights (speed does not depend on the values), quantized with
RTN: configs/bench.yaml's model and a 134M-parameter one (hidden 768, 12 layers, 12 heads, MLP 2048,
vocab 32000). Variants (``SPEED``): float32; int8 per output channel and int4 in groups of 128,
each weight-only (float activations) and with int8 activations (``_act8``: integer products); and
the all-tensor variants (``_all``: the lm_head and the token embedding quantized too, as GGUF's
Q8_0 / Q4_0 files) at every group size. Batch 1, 8 and 32 (``--batches``), greedy, tokens/s from the
median step time over interleaved rounds; each ratio is the median over rounds of the two measured
in the same round. Every line carries the 1-minute load average when it was measured.

The lm_head alone (``head``): the 134M model's [32000, 768] product at batch 1, 8 and 32 for every
format the lm_head can take (int8 per channel; int4 in groups of 32, 64, 128 and per channel),
weight-only and with int8 activations, against float32's ``tiled_linear`` kernel, one call at a
time, interleaved.

``--kernels``: the int8-activation kernel alone on the model's shapes (``kernels``), float16
against float32 scales of the same panels (``packed=2`` / ``packed=1``) in decode passes through
the 134M model's 84 linears, weights streamed from memory (``decode_pass_*``, ``scale_passes``), and
those passes and the float32 lm_head against a plain read of the same bytes (``stream_pass``).

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
from _common import emit, emit_paired_ratio, engine_steps, llama_134m, machine

import llmkit.framework as lf
from llmkit.framework.compiler.build import spin_between_kernels
from llmkit.infer import Engine, EngineConfig
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.quant import QuantConfig, eval_tokens, evaluate, quantize_model

MODELS = {
    "bench": lambda: LlamaConfig.from_preset("bench", vocab_size=4096),
    "134M": llama_134m,
}


def _q(bits: int, group: int, act_bits: int = 0) -> QuantConfig:
    return QuantConfig(bits, group, True, "rtn", act_bits=act_bits)


SPEED = {  # variant -> (QuantConfig, lm_head and embedding quantized) or None for float32
    "float32": None,
    "int8": (_q(8, -1), False),
    "int8_act8": (_q(8, -1, 8), False),
    "int4_g128": (_q(4, 128), False),
    "int4_g128_act8": (_q(4, 128, 8), False),
    "int4_g32_act8": (_q(4, 32, 8), False),
    "int8_all": (_q(8, -1), True),
    "int8_all_act8": (_q(8, -1, 8), True),
    "int4_g32_all": (_q(4, 32), True),
    "int4_g32_all_act8": (_q(4, 32, 8), True),
    "int4_g64_all_act8": (_q(4, 64, 8), True),
    "int4_g128_all_act8": (_q(4, 128, 8), True),
}
HEAD_FORMATS = [(8, -1), (4, 32), (4, 64), (4, 128), (4, -1)]  # what an lm_head can be stored as
ACCURACY = [(8, -1, True), (4, 32, True), (4, 64, True), (4, 128, True), (4, 128, False)]


def model_of(config: LlamaConfig, variant: tuple | None) -> LlamaForCausalLM:
    lf.seed(0)  # the same random weights for every variant
    model = LlamaForCausalLM(config)
    model.eval()
    if variant is not None:
        quantize_model(model, variant[0], lm_head=variant[1], embed=variant[1], progress=False)
    return model


def step_bytes(model: LlamaForCausalLM) -> int:
    """Weight bytes a decode step reads: every tensor once, of an untied embedding table one row."""
    state = model.state_dict()
    total = sum(t.numpy().nbytes for t in state.values())
    if not model.config.tie_word_embeddings:
        for name, t in state.items():
            if name.startswith("model.embed_tokens."):
                a = t.numpy()
                total -= a.nbytes - a[0].nbytes
    return total


def load() -> float:
    return round(os.getloadavg()[0], 2)


def prefill_seconds(engine: Engine, n: int, seed: int) -> float:
    """Seconds from a fresh ``n``-token prompt (new tokens each call: no prefix-cache hit) to its
    first token, the engine's steps as it runs them (``max_tokens_per_step`` >= n: one step)."""
    from llmkit.infer import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(rng.integers(3, engine.spec.vocab_size, n).tolist(), params)
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t


def speed(
    name: str,
    variants: list[str],
    batches: list[int],
    rounds: int,
    prompt_len: int,
    new_tokens: int,
    prefill_len: int,
    info: dict,
) -> None:
    config = MODELS[name]()
    engines, weights = {}, {}
    ecfg = EngineConfig(max_batch=max(batches), max_tokens_per_step=max(256, prefill_len))
    for v in ["float32", *(v for v in variants if v != "float32")]:
        t = time.perf_counter()
        model = model_of(config, SPEED[v])
        weights[v] = step_bytes(model)
        engines[v] = Engine.from_model(model, None, ecfg)
        emit("quant", f"{name}_{v}_setup_s", time.perf_counter() - t, "s", model=name, load_1min=load())
    if prefill_len:  # one warm-up prefill each (kernels built), then interleaved rounds
        for e in engines.values():
            prefill_seconds(e, prefill_len, 0)
        per_round = {v: [] for v in engines}
        loads = []
        for r in range(rounds):
            for v, e in engines.items():
                per_round[v].append(prefill_len / prefill_seconds(e, prefill_len, r + 1))
            loads.append(load())
        for v, tps in per_round.items():
            emit("quant", f"{name}_{v}_prefill{prefill_len}_tokens_per_s", float(np.median(tps)), "tokens/s",
                 per_round=[round(t, 1) for t in tps], load_1min=loads, **info)  # fmt: skip
            if v != "float32":
                emit_paired_ratio("quant", f"{name}_{v}_over_float32_prefill{prefill_len}", tps,
                                  per_round["float32"], model=name, load_1min=loads)  # fmt: skip
    for batch in batches:
        per_round: dict[str, list[float]] = {v: [] for v in engines}
        loads = []
        for _ in range(rounds):
            for v, e in engines.items():
                per_round[v].append(float(np.median(engine_steps(e, batch, prompt_len, new_tokens))))
            loads.append(load())
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
                load_1min=loads,
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
                    load_1min=loads,
                    note="decode tokens/s, same run; bound: float32's GB/s over the variant's bytes",
                )


def head(rounds: int, batches: list[int], info: dict) -> None:
    """The lm_head product alone: each format's kernel against float32's, interleaved calls."""
    from llmkit.framework.compiler.native import NativeOp, build_c
    from llmkit.framework.ops.paged import pack_panels
    from llmkit.framework.ops.quant import pack_qweight
    from llmkit.framework.opspec import table
    from llmkit.quant import quantize_rtn

    ql, tl = (
        NativeOp(table()[n], build_c(table()[n].native.source)) for n in ("quant_linear", "tiled_linear")
    )
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((32000, 768)) * 0.02).astype(np.float32)
    panels = pack_panels(np.ascontiguousarray(w.T))
    calls = {"float32": lambda x: tl(np, x, panels, rows=1, panel=16)}
    for bits, group in HEAD_FORMATS:
        qw = quantize_rtn(w, QuantConfig(bits, group, True, "rtn"))
        for act in (0, 8):
            label = f"int{bits}_{'g' + str(group) if group > 0 else 'channel'}{'_act8' if act else ''}"
            # int8 activations: the panels the engine's programs hand the kernel (pack_qweight)
            q, more = (pack_qweight(qw.qweight, bits, group), {"packed": 1}) if act else (qw.qweight, {})
            calls[label] = lambda x, q=q, s=qw.scales, b=bits, g=group, a=act, more=more: ql(
                np, x, q, s, bits=b, group_size=g, act_bits=a, **more
            )
    for batch in batches:
        x = rng.standard_normal((batch, 768)).astype(np.float32)
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(rounds * 5):
            for k, f in calls.items():
                t = time.perf_counter()
                f(x)
                times[k].append(time.perf_counter() - t)
        for k, ts in times.items():
            med = float(np.median(ts))
            emit("quant", f"lm_head_{k}_batch{batch}_ms", med * 1e3, "ms", load_1min=load(), **info)
            if k != "float32":
                emit_paired_ratio(
                    "quant",
                    f"lm_head_{k}_speedup_over_float32_batch{batch}",
                    times["float32"],
                    ts,
                    load_1min=load(),
                    note="float32 time / this format's, [32000, 768] weight, same run",
                )


def kernels(rounds: int, rows: list[int], info: dict) -> None:
    """The int8-activation kernel alone on the 134M model's shapes [out, in] at each number of rows
    (1, 8, 32: decode batches; 512: a prefill), on the panels the engine packs, against float32's
    ``tiled_linear`` on its panels (best of ``rounds * 5`` interleaved calls) and BLAS (numpy's matmul,
    timed after them). Scales are float16 numbers, held as float32 (``packed=1``) and as float16
    (``_f16``: ``packed=2``, the engine's layout for ``scale_dtype="float16"``; ``x_float32_scales``:
    the same weights' float32-scale time / this one, same run)."""
    from llmkit.framework.compiler.native import NativeOp, build_c
    from llmkit.framework.ops.paged import pack_panels
    from llmkit.framework.ops.quant import half_scales, pack_qweight
    from llmkit.framework.opspec import table
    from llmkit.quant import quantize_rtn

    ql, tl = (
        NativeOp(table()[n], build_c(table()[n].native.source)) for n in ("quant_linear", "tiled_linear")
    )
    rng = np.random.default_rng(0)
    for n, k in ((768, 768), (2048, 768), (768, 2048), (32000, 768)):
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        panels = pack_panels(np.ascontiguousarray(w.T))
        calls = {
            "float32_tiled": lambda x: tl(np, x, panels, rows=x.shape[0], panel=16),
            "float32_blas": lambda x: x @ w.T,
        }
        for bits, group in ((8, -1), (8, 32), (4, 32), (4, 128)):
            qw = quantize_rtn(w, QuantConfig(bits, group, True, "rtn", "float16"))
            p = pack_qweight(qw.qweight, bits, group)
            name = f"int{bits}_{'g' + str(group) if group > 0 else 'channel'}_act8"
            for suffix, s, packed in (("", qw.scales, 1), ("_f16", half_scales(qw.scales), 2)):
                calls[name + suffix] = lambda x, p=p, s=s, b=bits, g=group, pk=packed: ql(
                    np, x, p, s, bits=b, group_size=g, act_bits=8, packed=pk
                )
        for m in rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            best = {c: float("inf") for c in calls}
            for _ in range(rounds * 5):
                for c, f in calls.items():
                    if c == "float32_blas":
                        continue
                    t = time.perf_counter()
                    f(x)
                    best[c] = min(best[c], time.perf_counter() - t)
            for _ in range(rounds * 5):  # BLAS apart: its threads spin after each call, slowing what follows
                t = time.perf_counter()
                x @ w.T
                best["float32_blas"] = min(best["float32_blas"], time.perf_counter() - t)
            for c, t in best.items():
                extra = (
                    {} if c == "float32_tiled" else {"x_float32_tiled": round(best["float32_tiled"] / t, 3)}
                )
                if c.endswith("_f16"):
                    extra["x_float32_scales"] = round(best[c[: -len("_f16")]] / t, 3)
                gops = round(2 * m * n * k / t / 1e9, 1)
                emit(
                    "quant",
                    f"kernel_{n}x{k}_rows{m}_{c}_ms",
                    t * 1e3,
                    "ms",
                    gops=gops,
                    load_1min=load(),
                    **extra,
                    **info,
                )


def scale_passes(rounds: int, info: dict) -> None:
    """float16 against float32 scales where it counts, weights streamed from memory: one row through
    the 134M model's 84 decoder linears (12 layers of q, k, v, o, gate, up, down; about 48 MB of int4
    g32 panels, more than the caches hold, as a decode step reads them), the same panels with float32
    scales (``packed=1``) and float16 (``packed=2``), passes alternated, ``rounds * 10`` of each."""
    from llmkit.framework.compiler.native import NativeOp, build_c
    from llmkit.framework.ops.quant import CODE_DTYPE, half_scales, pack_qweight
    from llmkit.framework.opspec import table

    ql = NativeOp(table()["quant_linear"], build_c(table()["quant_linear"].native.source))
    rng = np.random.default_rng(0)
    shapes = [(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]
    for bits in (4, 8):
        mats = []
        for n, k in shapes * 12:  # speed does not depend on the values: random codes, float16 numbers
            codes = rng.integers(0, 256, (n, k // (2 if bits == 4 else 1)), dtype=np.uint8)
            s = rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16).astype(np.float32)
            mats.append((k, pack_qweight(codes.view(CODE_DTYPE[bits]), bits, 32), s, half_scales(s)))
        xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in (768, 2048)}

        def run(half: bool, mats=mats, xs=xs, bits=bits) -> float:
            t = time.perf_counter()
            for k, p, s, h in mats:
                ql(np, xs[k], p, h if half else s, bits=bits, group_size=32, act_bits=8, packed=1 + half)
            return time.perf_counter() - t

        run(False), run(True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds * 10):
            for half in (False, True) if r % 2 == 0 else (True, False):
                times[half].append(run(half))
        for half, ts in times.items():
            emit("quant", f"decode_pass_int{bits}_g32_{'f16' if half else 'f32'}_scales_ms",
                 float(np.median(ts)) * 1e3, "ms", load_1min=load(), **info)  # fmt: skip
        note = "float32-scale time / float16-scale time, same panels"
        emit_paired_ratio("quant", f"decode_pass_int{bits}_g32_f16_scales_speedup", times[False], times[True],
                          load_1min=load(), note=note)  # fmt: skip


STREAM = r"""
#include <immintrin.h>
typedef struct { const uint8_t *p; int64_t n, chunk, sum[2]; } KERNEL_FN_s;
static void KERNEL_FN_part(void *a, int64_t c, int64_t w) { /* 32 bytes a load, summed (kept) */
  KERNEL_FN_s *s = (KERNEL_FN_s *)a;
  const int64_t e = (c + 1) * s->chunk < s->n ? (c + 1) * s->chunk : s->n;
  __m256i acc = _mm256_setzero_si256();
  for (int64_t i = c * s->chunk; i + 32 <= e; i += 32)
    acc = _mm256_add_epi8(acc, _mm256_loadu_si256((const __m256i *)(s->p + i)));
  s->sum[w > 0] += _mm256_extract_epi64(acc, 0);
}
void KERNEL_FN(void **bufs, const int64_t *sizes, int64_t nthreads) { /* bytes [n], sum [1] */
  KERNEL_FN_s s = {(const uint8_t *)bufs[0], sizes[0], (sizes[0] + 2 * nthreads - 1) / nthreads / 2, {0, 0}};
  llmkit_par_for((s.n + s.chunk - 1) / s.chunk, nthreads, KERNEL_FN_part, &s);
  *(int64_t *)bufs[1] = s.sum[0] + s.sum[1];
}
"""


def stream_pass(rounds: int, info: dict) -> None:
    """How near the int4 g32 kernel (``packed=2``) comes to memory speed in decode: one row through the
    134M model's 84 decoder linears (about 48 MB, more than the caches hold) against a plain read of
    the same bytes in the same 84 calls (each matrix's bytes in a buffer of its own, both threads on
    it), and the lm_head's float32 [32000, 768] against a read of its 98 MB. C calls alone (ctypes,
    no op dispatch), passes alternated; ``stream_fraction`` = read time / kernel time, per round."""
    import ctypes

    from llmkit.framework.compiler.native import build_c
    from llmkit.framework.compiler.native.quant_int import f16c_code, int_isa_code
    from llmkit.framework.compiler.native.run import CPUS
    from llmkit.framework.ops.paged import pack_panels
    from llmkit.framework.ops.quant import half_scales, pack_qweight
    from llmkit.framework.opspec import table

    rng, keep, st = np.random.default_rng(0), [], np.zeros(8, np.int64)
    ql, tl = (build_c(table()[n].native.source) for n in ("quant_linear", "tiled_linear"))
    rd = build_c(STREAM)

    def call(fn, arrays, sizes):
        keep.append(arrays)
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        ints = (ctypes.c_int64 * len(sizes))(*sizes)
        return lambda: fn(ptrs, ints, CPUS)

    def read(nbytes):
        return call(rd, (rng.integers(0, 256, nbytes, dtype=np.uint8), st), [nbytes])

    kernel, stream, nbytes = [], [], 0
    for n, k in ([(768, 768)] * 4 + [(2048, 768)] * 2 + [(768, 2048)]) * 12:
        p = pack_qweight(rng.integers(0, 256, (n, k // 2), dtype=np.uint8), 4, 32)
        h = half_scales(rng.uniform(1e-3, 1e-2, (n, k // 32)).astype(np.float16).astype(np.float32))
        x, y = rng.standard_normal((1, k)).astype(np.float32), np.empty((1, n), np.float32)
        kernel.append(call(ql, (x, p, h, y, st), [1, k, n, 4, 32, 0, 8, int_isa_code(), 2, f16c_code()]))
        stream.append(read(p.nbytes + h.nbytes))
        nbytes += p.nbytes + h.nbytes
    w = pack_panels(rng.standard_normal((768, 32000)).astype(np.float32))  # the engine's panels
    x, y = rng.standard_normal((1, 768)).astype(np.float32), np.empty((1, 32000), np.float32)
    passes = {
        "decode_linears_int4_g32": (kernel, stream, nbytes),
        "lm_head_float32": ([call(tl, (x, w, y, st), [1, 768, 32000, 0, 2])], [read(w.nbytes)], w.nbytes),
    }
    for name, (fk, fs, nb) in passes.items():
        times: dict[str, list[float]] = {"kernel": [], "read": []}
        for r in range(rounds * 10 + 1):
            for side in ("kernel", "read") if r % 2 else ("read", "kernel"):
                t = time.perf_counter()
                for f in fk if side == "kernel" else fs:
                    f()
                if r:  # the first round warms up
                    times[side].append(time.perf_counter() - t)
        for side, ts in times.items():
            t = float(np.median(ts))
            emit("quant", f"{name}_{side}_GB_per_s", nb / t / 1e9, "GB/s", MB=round(nb / 1e6, 1),
                 ms=round(t * 1e3, 3), load_1min=load(), **info)  # fmt: skip
        note = "read time / kernel time of the same bytes, same round"
        emit_paired_ratio("quant", f"{name}_stream_fraction", times["read"], times["kernel"],
                          load_1min=load(), note=note)  # fmt: skip


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
    p.add_argument("--prefill-len", type=int, default=512, help="prefill figures: prompt tokens (0: none)")
    p.add_argument(
        "--model", default="runs/tiny", help="trained model (or run) directory for the accuracy table"
    )
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--variants", nargs="+", default=list(SPEED), choices=list(SPEED))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--skip-head", action="store_true", help="no lm_head-alone figures")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="the int8-activation kernel alone (rows 1, 8, 32, 512), and float16 against float32 scales",
    )
    a = p.parse_args()
    spin_between_kernels()  # as llmkit serve runs
    info = dict(prompt_len=a.prompt_len, new_tokens=a.new_tokens, **machine())
    emit("quant", "load_average_1min", os.getloadavg()[0], "load", **info)
    if a.kernels:
        kernels(a.rounds, [*a.batches, 512], info)
        scale_passes(a.rounds, info)
        stream_pass(a.rounds, info)
    if not a.skip_head:
        head(a.rounds, a.batches, info)
    if not a.skip_speed:
        for name in a.models:
            speed(name, a.variants, a.batches, a.rounds, a.prompt_len, a.new_tokens, a.prefill_len,
                  {"model": name, **info})  # fmt: skip
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
