"""The planner's predictions against measured runs here, and its plans for Llama-2-7B and -70B on
8, 64 and 512 GPUs of 80 GB beside published configurations.

1. ``measured``: plans of ``configs/bench.yaml`` (8 x 256 tokens per step) run as ``llmkit train``
   runs them (one process, or one per rank over MPI: ``benchmarks/parallel.py``'s worker), each
   beside the planner's prediction for that plan (``llmkit.train.auto_plan``: this host's speeds,
   the training step's own kernels' FLOP/s, the backend's alpha-beta, probed afresh right after
   the run, so under the same load from other work on the machine): the step time
   (median after warm-up, the slowest rank) and the peak memory per rank (parameters + gradients +
   optimizer state, plus the activations the autograd tape holds when the forward ends), with the
   errors in percent. The ranks share this machine's two cores, as the planner assumes.
2. ``published``: the planner's choice for Llama-2-7B and -70B (bf16 weights and gradients, fp32
   master weights and AdamW moments: 16 bytes per parameter; 1024 sequences of 4096 tokens per
   step, Llama 2's 4M-token batch) on 8, 64 and 512 A100s of 80 GB, with its predicted MFU, beside
   what others published for those sizes:

   - torchtitan, docs/performance.md (Llama 3 8B and 70B on 64 A100 80GB): FSDP2 over all 64 ranks
     (ZeRO 3, dp64), local batch 1; 8B with selective activation checkpointing at 56.8-58.2% MFU,
     70B with full checkpointing at 51.7% MFU; 2D (FSDP + TP 8) for the loss curves.
   - Megatron-LM, Narayanan et al. 2021 ("Efficient large-scale language model training on GPU
     clusters using Megatron-LM"), table 1 (A100 80GB, batch 512-1792): 7.5B with tp 4, pp 1 on
     128 GPUs; 39.1B with tp 8, pp 2 on 512; 76.1B with tp 8, pp 4 on 1024; 44-52% of peak.
   - NeMo Megatron-Bridge's H100 recipes (perf_recipes.llama.h100.llama3): Llama 3 70B on 64
     H100s with tp 4, pp 4, context parallel 2, global batch 256.

3. ``planning_seconds``: the wall time of ``llmkit plan`` (the whole command, Python's start and
   imports included) for 7B on 64 and 512 GPUs, and for this host's bench config on 64 ranks (its
   probes cached), with the CPU seconds it used (the wall time grows with the machine's load).

Run: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/planner.py [--skip-measured]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from _common import emit, machine
from parallel import launch_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "configs", "bench.yaml")

# name: (processes, parallel section, batch_size, grad_accum)
MEASURED = {
    "single": (1, {}, 8, 1),
    "single_recompute_full": (1, {"recompute": "full"}, 8, 1),
    "single_recompute_attention": (1, {"recompute": "attention"}, 8, 1),
    "single_m4": (1, {}, 2, 4),
    "dp2": (2, {"dp": 2}, 8, 1),
    "dp2_zero2_recompute_full": (2, {"dp": 2, "zero": 2, "recompute": "full"}, 8, 1),
    "tp2": (2, {"tp": 2}, 8, 1),
}


def run(n: int, parallel: dict, batch: int, accum: int, steps: int, warmup: int) -> dict:
    """One plan through ``benchmarks/parallel.py``'s train worker (``llmkit train``'s Trainer)."""
    with tempfile.TemporaryDirectory() as out:
        ov = [f"train.steps={steps}", "lr_schedule.warmup_steps=1", "train.log_every=1", f"out_dir={out}"]
        ov += [f"train.batch_size={batch}", f"train.grad_accum={accum}"]
        return launch_training(n, ov + [f"parallel.{k}={v}" for k, v in parallel.items()], warmup)


def predict(n: int, parallel: dict, batch: int, accum: int):
    from llmkit.framework.distributed import plan_search
    from llmkit.train.auto_plan import machine_for, model_cost, precision_of, step_probe
    from llmkit.train.config import load_config

    cfg = load_config(BENCH, [f"train.batch_size={batch}", f"train.grad_accum={accum}"])
    llama, cost = model_cost(cfg)
    host = machine_for(None, "mpi" if n > 1 else "sim", n, step_probe(llama, cfg))
    dp, tp = parallel.get("dp", 1), parallel.get("tp", 1)
    return plan_search.estimate(
        cost, host, batch * accum, dp, tp, 1, parallel.get("zero", 0), parallel.get("recompute", "none"),
        accum, precision=precision_of(cfg),
    )  # fmt: skip


def measured(steps: int, warmup: int) -> None:
    errors_t, errors_m = [], []
    for name, (n, parallel, batch, accum) in MEASURED.items():
        got = run(n, parallel, batch, accum, steps, warmup)
        # the planner's probes, fresh right after the run: the speeds of the machine as it was then
        # (the other work on it varies, and the ranks share its cores)
        os.environ["LLMKIT_CACHE_DIR"] = tempfile.mkdtemp()
        c = predict(n, parallel, batch, accum)
        mem = got["state_bytes"] + got["activation_bytes"]
        et = 100 * (c.step - got["seconds"]) / got["seconds"]
        em = 100 * (c.memory - mem) / mem
        errors_t.append(abs(et))
        errors_m.append(abs(em))
        emit(
            "planner",
            f"measured_{name}",
            got["seconds"],
            "s",
            ranks=n,
            plan=c.label,
            predicted_s=round(c.step, 3),
            step_error_pct=round(et, 1),
            memory_mb=round(mem / 2**20, 2),
            predicted_memory_mb=round(c.memory / 2**20, 2),
            memory_error_pct=round(em, 1),
            activation_mb=round(got["activation_bytes"] / 2**20, 2),
            state_mb=round(got["state_bytes"] / 2**20, 2),
            peak_rss_mb=round(got["peak_rss_bytes"] / 2**20),
        )
    emit("planner", "mean_abs_step_error", sum(errors_t) / len(errors_t), "%", plans=len(errors_t))
    emit("planner", "mean_abs_memory_error", sum(errors_m) / len(errors_m), "%", plans=len(errors_m))


LLAMA2 = {  # meta-llama/Llama-2-7b-hf and -70b-hf config.json
    "7B": {"preset": "7B"},
    "70B": {
        "preset": "7B",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}
PUBLISHED = {
    ("7B", 8): "torchtitan (8B, 64 A100): FSDP/ZeRO 3 over every rank, selective recompute, 57-58% MFU",
    ("7B", 64): "torchtitan (8B, 64 A100): dp64 ZeRO 3, local batch 1, selective recompute, 57-58% MFU",
    ("7B", 512): "Megatron-LM table 1 (7.5B, 128 A100): tp4 pp1, batch 512",
    ("70B", 8): "none published for 70B pretraining on 8 GPUs (1.1 TB of state needs ZeRO 3 and more)",
    ("70B", 64): "torchtitan (70B, 64 A100): dp64 ZeRO 3, full recompute, 51.7% MFU; "
    "Megatron-Bridge (70B, 64 H100): tp4 pp4 cp2",
    ("70B", 512): "Megatron-LM table 1 (76.1B, 1024 A100): tp8 pp4",
}


def published() -> None:
    from llmkit.framework.distributed import plan_search
    from llmkit.framework.distributed.parallel_plan import PlanError
    from llmkit.models.llama import LlamaConfig
    from llmkit.models.llama.sharding import llama_cost

    gpu = plan_search.gpu_machine("A100")
    for size, fields in LLAMA2.items():
        fields = dict(fields)
        config = LlamaConfig.from_preset(fields.pop("preset"), **fields)
        cost = llama_cost(config, 4096, 2)
        for world in (8, 64, 512):
            try:
                choice = plan_search.plan(
                    cost,
                    gpu,
                    world,
                    1024,
                    80e9,
                    precision=plan_search.MIXED,
                    schedules=("1f1b", "zero_bubble"),
                )
            except PlanError as e:
                emit(
                    "planner",
                    f"llama2_{size}_{world}gpu",
                    0,
                    "",
                    error=str(e),
                    published=PUBLISHED[(size, world)],
                )
                continue
            b = choice.best
            emit(
                "planner",
                f"llama2_{size}_{world}gpu",
                plan_search.mfu(b, cost, gpu, 1024) * 100,
                "% MFU",
                params_b=round(config.num_parameters() / 1e9, 2),
                plan=b.label,
                step_s=round(b.step, 3),
                memory_gb=round(b.memory / 1e9, 1),
                candidates=len(choice.ranked) + len(choice.unfit),
                fit=len(choice.ranked),
                runner_up=choice.ranked[1].label if len(choice.ranked) > 1 else None,
                published=PUBLISHED[(size, world)],
            )


def planning_seconds() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "7b.yaml")
        with open(cfg, "w") as f:
            f.write("model: {preset: 7B}\ntokenizer: {vocab_size: 4096}\n")
            f.write("train: {batch_size: 1024, seq_len: 4096}\nout_dir: x\n")
        runs = {
            "7B_64_A100": [cfg, "--world", "64", "--mem-gb", "80", "--gpu", "A100"],
            "7B_512_A100": [cfg, "--world", "512", "--mem-gb", "80", "--gpu", "A100"],
            "bench_64_this_host": [BENCH, "train.batch_size=64", "--world", "64", "--mem-gb", "0.3"],
        }
        for name, args in runs.items():
            cmd = [sys.executable, "-m", "llmkit", "plan", *args]
            subprocess.run(cmd, capture_output=True, env=env, timeout=600)  # probes cached
            cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            got = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            seconds = time.perf_counter() - t0
            cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
            chose = next(
                (line for line in got.stdout.splitlines() if line.startswith("chose")), got.stderr.strip()
            )
            emit("planner", f"planning_seconds_{name}", seconds, "s", cpu_seconds=round(cpu, 2), chose=chose)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="steps per measured run (timed after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--skip-measured", action="store_true", help="only the predictions (no training runs)")
    args = p.parse_args()
    emit("planner", "machine", 0, "", **machine())
    if not args.skip_measured:
        if shutil.which("mpiexec") is None:
            sys.exit("benchmarks/planner.py needs mpiexec for its 2-rank runs (pip install -e '.[dist]')")
        measured(args.steps, args.warmup)
    published()
    planning_seconds()


if __name__ == "__main__":
    main()
