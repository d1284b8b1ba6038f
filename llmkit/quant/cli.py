"""``llmkit quantize`` and ``llmkit eval``.

::

    llmkit quantize --model runs/tiny --bits 4            # -> runs/tiny-int4 (GPTQ, groups of 128)
    llmkit quantize --model DIR --bits 8 --method rtn --out DIR8
    llmkit quantize --model runs/tiny-tp2 --bits 4 --nproc 2   # two MPI processes share the work
    llmkit quantize --model runs/tiny --bits 4 --group 32 --lm-head --act-bits 8   # int8 x int4 products
    llmkit eval --model runs/tiny-int4                    # perplexity on the held-out split
    llmkit eval --model DIR --data notes.txt

``--model`` is a model directory (config.json, model.safetensors, tokenizer.model) or a training run
directory (its newest ``checkpoints/step-*/model``). The default ``--out`` is the run's directory (or
the model directory) with ``-int4`` / ``-int8`` appended, next to it, so ``llmkit export --model
runs/tiny-int4`` follows without editing a path.

A checkpoint trained with a parallel plan (its ``parallel_plan.json``, beside ``model/``) keeps
it: the quantized directory's plan places each linear's scales and zeros as its weight
(``llmkit.quant.multirank``). ``--nproc N`` runs N processes under mpiexec, sharing the work; the
result is the same bits as one process's.

The report's table has a column per way of running the codes: weight-only (float activations) and
with int8 activations (``--act-bits 8``: integer products, docs/quantize.md); ``--act-bits`` says
which one the written model runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from llmkit.framework.blas import blas_threads
from llmkit.models.llama.checkpoint import derived_path
from llmkit.train.checkpoint import model_dir

from .evaluate import SEQ_LEN, eval_tokens, evaluate
from .format import QuantConfig, QuantError
from .multirank import Ranks, derive, plan_file
from .quantize import BLAS_THREADS, quantize_model, save_quantized, set_act_bits, targets, weight_bytes


def default_out(model_dir: Path, bits: int) -> Path:
    """``runs/tiny/checkpoints/step-N/model`` -> ``runs/tiny-int<bits>``; ``DIR`` -> ``DIR-int<bits>``."""
    return derived_path(model_dir, f"-int{bits}")


def _load(model_dir: Path) -> tuple[Any, Any]:
    from llmkit.models.llama import LlamaForCausalLM, LlamaTokenizer

    model = LlamaForCausalLM.from_pretrained(str(model_dir))
    model.eval()
    tok = LlamaTokenizer.from_pretrained(model_dir)
    tok.check_fits(model.config.vocab_size, str(model_dir))
    return model, tok


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


ACT_NAMES = {0: "weight-only", 8: "int8 act"}  # report["variants"] keys: act_bits -> column name


def _table(cfg: QuantConfig, r: dict[str, Any]) -> str:
    """The report as text: a column per variant (weight-only, int8 activations), the written one
    marked with *."""
    name = f"int{cfg.bits} {'g' + str(cfg.group_size) if cfg.group_size > 0 else 'per-channel'} {cfg.method}"
    fp, b = r["perplexity"]["float"], r["bytes"]
    cols = [(bits, r["variants"][v]) for bits, v in ACT_NAMES.items()]
    ratio = f"{_mb(b['layers_quant'])}  ({b['layers_quant'] / b['layers_float']:.3f}x)"
    ppl = [f"{v['quant']:.3f}  ({100 * (v['quant'] / fp - 1):+.2f}%)" for _, v in cols]
    rows = [
        ("", "float32", *(f"{name}, {ACT_NAMES[a]}{' *' if a == cfg.act_bits else ''}" for a, _ in cols)),
        ("perplexity", f"{fp:.3f}", *ppl),
        ("mean KL (nats/token)", "-", *(f"{v['kl']:.3g}" for _, v in cols)),
        ("top-1 agreement", "-", *(f"{100 * v['top1']:.2f}%" for _, v in cols)),
        ("quantized linears", _mb(b["layers_float"]), *(ratio for _ in cols)),
        ("whole model", _mb(b["model_float"]), *(_mb(b["model_quant"]) for _ in cols)),
    ]
    lines = [f"{row[0]:<22}{row[1]:>12}   " + "".join(f"{c:<34}" for c in row[2:]).rstrip() for row in rows]
    lines.append(f"(* the written model: --act-bits {cfg.act_bits})")
    e = r["eval"]
    lines.append(f"({e['tokens']:,} tokens of {e['data']}, windows of {e['seq_len']})")
    return "\n".join(lines)


def calibration_ids(tokenizer: Any, source: str, samples: int, seq_len: int, seed: int):
    """``samples`` windows of ``seq_len`` tokens at seeded random offsets: from the built-in corpus's
    training split ("builtin"; the held-out split stays unseen) or from a text / .jsonl file."""
    from llmkit.train.config import DataSection
    from llmkit.train.data import BUILTIN, BatchSampler, load_token_data

    if samples < 1:
        raise QuantError(f"--calib-samples must be >= 1, got {samples}")
    if source == BUILTIN:
        tokens = load_token_data([BUILTIN], tokenizer, DataSection().val_fraction).train
    else:
        tokens = load_token_data([source], tokenizer, 0.0).tokens
    return BatchSampler(tokens, samples, seq_len, seed).batch(0)[0]


def quantize_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llmkit quantize", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="model directory, or a run directory (its newest checkpoint)"
    )
    p.add_argument("--bits", type=int, required=True, choices=[8, 4], help="8: int8 codes; 4: two per byte")
    p.add_argument(
        "--group",
        type=int,
        default=None,
        help="input columns per scale (default 128 for 4 bits; -1: per channel)",
    )
    p.add_argument(
        "--method", choices=["gptq", "rtn"], default="gptq", help="GPTQ (calibrated) or round to nearest"
    )
    sym = p.add_mutually_exclusive_group()
    sym.add_argument(
        "--sym", dest="sym", action="store_true", default=True, help="zero point 8 (the default)"
    )
    sym.add_argument("--asym", dest="sym", action="store_false", help="4 bits: a uint8 zero point per group")
    p.add_argument(
        "--scale-dtype",
        choices=["float32", "float16"],
        default="float32",
        help="float16: scales rounded to float16 numbers, so that int8 / int4 sym in groups of 32 "
        "export exactly as GGUF Q8_0 / Q4_0 blocks",
    )
    p.add_argument(
        "--calib", default="builtin", help="GPTQ calibration text: 'builtin' or a text/.jsonl FILE"
    )
    p.add_argument("--calib-samples", type=int, default=128, help="calibration sequences")
    p.add_argument(
        "--seq-len", type=int, default=SEQ_LEN, help="tokens per calibration and evaluation window"
    )
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ: diagonal damping, a fraction of its mean")
    p.add_argument("--lm-head", action="store_true", help="quantize the lm_head too (untied models)")
    p.add_argument(
        "--embed", action="store_true", help="quantize the token embedding too (RTN; untied models)"
    )
    p.add_argument(
        "--act-bits",
        type=int,
        default=0,
        choices=[0, 8],
        help="0: float activations (weight-only); 8: int8 activations, integer products",
    )
    p.add_argument(
        "--eval-tokens", type=int, default=0, help="held-out tokens for the report (0: the whole split)"
    )
    p.add_argument("--seed", type=int, default=0, help="calibration window offsets")
    p.add_argument("--out", default=None, help="directory to write (default: <run or model dir>-int<bits>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=int, metavar="N", help="run N processes with mpiexec, sharing the work")
    p.add_argument("--hostfile", help="with --nproc: mpiexec's hostfile, to run on several machines")
    a = p.parse_args(argv)
    if a.nproc is not None:
        from llmkit.train.cli import nproc_command, relaunch

        rest = _without(argv, {"--nproc", "--hostfile"})
        return relaunch(*nproc_command(a.nproc, a.hostfile, ["quantize", *rest]))
    if a.hostfile is not None:
        p.error("--hostfile goes with --nproc")
    group = a.group if a.group is not None else (128 if a.bits == 4 else -1)
    cfg = QuantConfig(a.bits, group, a.sym, a.method, scale_dtype=a.scale_dtype, act_bits=a.act_bits)
    src = model_dir(a.model, "--model")
    out = Path(a.out) if a.out else default_out(src, a.bits)
    if out.resolve() == src.resolve():
        raise QuantError("--out must differ from --model")
    if out.exists() and not (out / "config.json").is_file():
        raise QuantError(f"--out {out} exists and is not a model directory; refusing to replace it")
    import llmkit.framework.distributed as dist
    from llmkit.framework.distributed.parallel_plan import ParallelPlan

    dist.init()  # mpi under mpiexec (one rank per process), else sim (this process alone)
    ranks = Ranks()
    model, tok = _load(src)
    if "quantization_config" in model.config.extra:
        raise QuantError(f"{src} is already quantized; quantize its float source instead")
    layers = dict(model.named_sublayers())
    paths = targets(model, a.lm_head, a.embed)
    found = plan_file(src)
    plan = None
    if found is not None:  # checked before any work: a group straddling two shards is an error now
        plan = derive(ParallelPlan.load(found), {q: layers[q].weight.shape for q in paths}, cfg)
    if ranks.is_first and (plan is not None or ranks.size > 1):
        where = f"plan {plan.describe()} from {found}" if plan else "no parallel plan"
        print(f"llmkit quantize: {where}; {ranks.size} rank(s) on {ranks.comm.name}", flush=True)
    start = time.perf_counter()
    calib = calibration_ids(tok, a.calib, a.calib_samples, a.seq_len, a.seed) if a.method == "gptq" else None
    paths = quantize_model(model, cfg, calib, a.lm_head, a.act_order, a.damp, not a.quiet, ranks, a.embed)
    seconds = time.perf_counter() - start
    if not ranks.is_first:
        return 0  # rank 0 reports and writes
    float_model, _ = _load(src)
    variants = {}
    for act_bits, label in ACT_NAMES.items():  # the same codes, run both ways
        set_act_bits(model, act_bits)
        with blas_threads(BLAS_THREADS):  # the report's figures, too, the same for any --nproc
            ev = evaluate([float_model, model], eval_tokens(tok), a.seq_len, a.eval_tokens)
        variants[label] = {"act_bits": act_bits, "quant": ev["ppl"][1], "kl": ev["kl"], "top1": ev["top1"]}
    set_act_bits(model, cfg.act_bits)
    ev = {**ev, **variants[ACT_NAMES[cfg.act_bits]]}
    report = {
        "quantization_config": cfg.to_hf(),
        "act_order": a.act_order,
        "lm_head": a.lm_head,
        "embed": a.embed,
        "calibration": None
        if calib is None
        else {"data": a.calib, "samples": a.calib_samples, "seq_len": a.seq_len, "seed": a.seed},
        "linears": len(paths),
        "parallel": {"plan": None if found is None else str(found), "ranks": ranks.size},
        "seconds": round(seconds, 2),
        "eval": {"data": "the built-in corpus' held-out split", "tokens": ev["tokens"], "seq_len": a.seq_len},
        "perplexity": {"float": ev["ppl"][0], "quant": ev["quant"]},  # of the written variant
        "kl": ev["kl"],
        "top1": ev["top1"],
        "variants": variants,
        "bytes": weight_bytes(float_model, model, paths),
    }
    save_quantized(model, src, out, report, plan)
    print(f"llmkit quantize: {len(paths)} linears of {src} in {seconds:.1f} s -> {out}")
    print(_table(cfg, report))
    return 0


def _without(argv: list[str], options: set[str]) -> list[str]:
    """``argv`` less ``options`` and their values (``--opt V`` or ``--opt=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif arg.split("=", 1)[0] not in options:
            out.append(arg)
    return out


def eval_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llmkit eval", description="Perplexity of a float or quantized model on held-out text."
    )
    p.add_argument(
        "--model", required=True, help="model directory, or a run directory (its newest checkpoint)"
    )
    p.add_argument(
        "--data", default=None, help="a text/.jsonl file (default: the built-in corpus' held-out split)"
    )
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens per window")
    p.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many tokens (0: all)")
    a = p.parse_args(argv)
    src = model_dir(a.model, "--model")
    model, tok = _load(src)
    r = evaluate([model], eval_tokens(tok, a.data), a.seq_len, a.max_tokens)
    qc = model.config.extra.get("quantization_config")
    kind = "float" if qc is None else f"int{qc['bits']}, group {qc['group_size']}, {qc['method']}"
    if qc is not None and qc.get("act_bits"):
        kind += f", int{qc['act_bits']} activations"
    what = a.data or "the built-in corpus' held-out split"
    n = r["tokens"]
    print(f"perplexity {r['ppl'][0]:.3f}  ({src}, {kind}; {n:,} tokens of {what}, windows of {a.seq_len})")
    return 0
