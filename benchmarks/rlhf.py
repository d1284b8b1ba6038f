"""RLHF: rollouts on the inference engine vs eager generation, weight sync, and where a step's time goes.

1. Generation tokens/s of one step's rollouts (``--prompts`` corpus prompts, ``--n`` samples each,
   ``--max-tokens`` new tokens, temperature 1, no early stop) on the same policy in the same
   process, interleaved over ``--rounds``: the engine as RLHF runs it (``Rollouts``: every request
   queued at once, continuous batching, compiled decode reading the live parameters), the engine
   with relaid weight copies (what ``rlhf.exact_logprobs: false`` runs), and eager ``generate``
   (the model's own forward with a contiguous KV cache, each prompt's samples as one batch). The
   headline is engine / eager (issue target: >= 5x).
2. ``sync_s``: what making the engine see new weights costs after an optimizer step (the prefix
   cache reset, and, for relaid weights, rebuilding the copies), median over rounds.
3. ``--steps`` steps of ``llmkit rlhf`` (GRPO on a built-in task, as ``configs/rlhf-tiny.yaml``), with
   exact log-probs and without, alternating over ``--rounds``: the share of the step in generation,
   training and sync, and the cost of running the trainer's forward on the engine's kernels (the
   paired ratio of step and training times).
4. Data parallel: ``--steps`` steps of ``llmkit rlhf configs/rlhf-tiny.yaml`` run as users run them
   (the CLI, in a subprocess), on one process and with ``parallel.dp=--dp --nproc --dp`` (mpiexec),
   alternating over ``--rounds``: step, generation and training times after the first step (which
   compiles), and the paired one-process / data-parallel step-time ratio. The ranks share the
   machine's cores (each gets cores / dp BLAS threads), so on a small machine this measures the
   overhead more than the scaling.

The policy is ``--model`` (a checkpoint or run directory; default ``runs/tiny`` when it exists) or a
random tiny Llama.

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/rlhf.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, emit_paired_ratio, machine

import llmkit.framework as lf
from llmkit.generate import generate
from llmkit.infer import SamplingParams
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.rlhf.config import load_rlhf_config
from llmkit.rlhf.rollout import Rollouts
from llmkit.rlhf.run import TIMINGS
from llmkit.rlhf.tasks import corpus_prompts
from llmkit.rlhf.trainer import PolicyTrainer
from llmkit.train.checkpoint import model_dir
from llmkit.train.corpus import builtin_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def policy(path: str | None) -> tuple[LlamaForCausalLM, object, str]:
    from llmkit.models.llama import LlamaTokenizer

    if path is None and (ROOT / "runs" / "tiny").is_dir():
        path = str(ROOT / "runs" / "tiny")
    if path is not None:
        src = model_dir(path)
        return LlamaForCausalLM.from_pretrained(src), LlamaTokenizer.from_pretrained(src), str(src)
    lf.seed(0)
    return (
        LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=4096)),
        builtin_tokenizer(4096),
        "random",
    )


def eager_rollout(model, tok, prompts, n, max_tokens) -> tuple[int, float]:
    """Eager generate, one call per prompt with its n samples as the batch: (tokens, seconds)."""
    params = SamplingParams(temperature=1.0, seed=0)
    t0 = time.perf_counter()
    tokens = 0
    for p in prompts:
        ids = tok.encode(p, add_bos=True)
        tokens += sum(map(len, generate(model, [ids] * n, max_tokens, params)))
    return tokens, time.perf_counter() - t0


def engine_rollout(ro: Rollouts, prompts, n, step) -> tuple[int, float]:
    batch = ro.generate(prompts, n, seed=0, step=step)
    return batch.num_tokens, batch.seconds


def rollouts(args, model, tok) -> None:
    prompts = corpus_prompts(args.prompts, seed=0)
    kw = dict(max_tokens=args.max_tokens, temperature=1.0, max_batch=args.prompts * args.n)
    engines = {
        "live": Rollouts(model, tok, exact=True, **kw),
        "relaid": Rollouts(model, tok, exact=False, **kw),
    }
    for ro in engines.values():
        ro.params = ro.params.replace(ignore_eos=True)  # every sample writes max_tokens, as eager does
        engine_rollout(ro, prompts, args.n, 0)  # warm-up: compile, first-touch
    eager_rollout(model, tok, prompts[:1], args.n, 2)
    speeds: dict[str, list[float]] = {k: [] for k in (*engines, "eager")}
    syncs: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.rounds):
        for name, ro in engines.items():
            tokens, secs = engine_rollout(ro, prompts, args.n, r + 1)
            speeds[name].append(tokens / secs)
            syncs[name].append(ro.sync())
        tokens, secs = eager_rollout(model, tok, prompts, args.n, args.max_tokens)
        speeds["eager"].append(tokens / secs)
    shape = {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens}
    for name, values in speeds.items():
        emit("rlhf", f"rollout_tokens_per_s_{name}", statistics.median(values), "tokens/s", **shape)
    emit_paired_ratio("rlhf", "rollout_speedup_engine_vs_eager", speeds["live"], speeds["eager"], **shape)
    emit_paired_ratio("rlhf", "rollout_speedup_relaid_vs_eager", speeds["relaid"], speeds["eager"], **shape)
    for name, values in syncs.items():
        emit("rlhf", f"sync_s_{name}", statistics.median(values), "s")


def steps(args, model_path: str) -> None:
    """Steps of the GRPO job, exact log-probs on and off, alternating over ``--rounds`` (a drifting
    machine loads both alike): time shares, and the cost of exact as the paired step-time ratio."""
    config = ROOT / "configs" / "rlhf-tiny.yaml"
    per: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.rounds):
        for exact in (True, False):
            with tempfile.TemporaryDirectory() as out:
                overrides = [
                    f"model.init_from={model_path}",
                    f"train.steps={args.steps}",
                    "train.save_every=0",
                    "lr_schedule.warmup_steps=0",
                    f"rlhf.exact_logprobs={str(exact).lower()}",
                    f"out_dir={out}",
                ]
                PolicyTrainer(load_rlhf_config(config, overrides), quiet=True).fit()
                rows = [r for r in _rows(Path(out)) if "gen_s" in r][1:]  # the first step compiles
                per[exact].append(
                    {k: statistics.mean(r[k] for r in rows) for k in TIMINGS}
                    | {"logprob_diff_max": max(r["logprob_diff_max"] for r in rows)}
                )
    for exact, runs in per.items():
        tag = "exact" if exact else "not_exact"
        total = statistics.median(r["step_s"] for r in runs)
        emit("rlhf", f"step_s_{tag}", total, "s", steps=args.steps - 1, rounds=args.rounds)
        for key, name in (("gen_s", "generation"), ("train_s", "training")):
            share = statistics.median(r[key] / r["step_s"] for r in runs)
            emit("rlhf", f"{name}_share_{tag}", share, "fraction")
        emit("rlhf", f"sync_s_step_{tag}", statistics.median(r["sync_s"] for r in runs), "s")
        emit("rlhf", f"logprob_diff_max_{tag}", max(r["logprob_diff_max"] for r in runs), "nats")
    for key, name in (("step_s", "step"), ("train_s", "train")):
        ours, theirs = [r[key] for r in per[True]], [r[key] for r in per[False]]
        emit_paired_ratio("rlhf", f"{name}_time_exact_over_not_exact", ours, theirs)


def data_parallel(args, model_path: str) -> None:
    config = ROOT / "configs" / "rlhf-tiny.yaml"
    per: dict[int, list[dict]] = {1: [], args.dp: []}
    for _ in range(args.rounds):
        for dp in per:
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, "-m", "llmkit", "rlhf", str(config), f"model.init_from={model_path}"]
                cmd += [f"train.steps={args.steps}", "train.save_every=0", "lr_schedule.warmup_steps=0"]
                cmd += [f"out_dir={out}", "--quiet"]
                if dp > 1:
                    cmd += [f"parallel.dp={dp}", "--nproc", str(dp)]
                subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
                rows = [r for r in _rows(Path(out)) if "gen_s" in r][1:]  # the first step compiles
                per[dp].append({k: statistics.mean(r[k] for r in rows) for k in TIMINGS})
    for dp, runs in per.items():
        for key in ("step_s", "gen_s", "train_s"):
            emit("rlhf", f"{key}_dp{dp}", statistics.median(r[key] for r in runs), "s", steps=args.steps - 1)
    one, many = [r["step_s"] for r in per[1]], [r["step_s"] for r in per[args.dp]]
    emit_paired_ratio("rlhf", f"step_time_dp1_over_dp{args.dp}", one, many, nproc=args.dp)


def _rows(out: Path) -> list[dict]:
    from llmkit.train.metrics import read_metrics

    return read_metrics(out / "metrics.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="checkpoint or run directory (default runs/tiny, else random)"
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="llmkit rlhf steps per setting (0: skip parts 3, 4)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks of part 4 (0: skip it)")
    p.add_argument(
        "--parts", default="rollouts,steps,dp", help="which parts to run: rollouts (1, 2), steps (3), dp (4)"
    )
    args = p.parse_args()
    emit("rlhf", "machine", 0, "", **machine())
    model, tok, source = policy(args.model)
    emit("rlhf", "policy", 0, "", source=source, parameters=sum(x.size for x in model.parameters()))
    parts = set(args.parts.split(","))
    if "rollouts" in parts:
        rollouts(args, model, tok)
    if args.steps and source != "random":  # llmkit rlhf runs start from a checkpoint
        if "steps" in parts:
            steps(args, source)
        if "dp" in parts and args.dp > 1 and shutil.which("mpiexec") is not None:
            data_parallel(args, source)


if __name__ == "__main__":
    main()
