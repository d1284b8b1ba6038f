"""``llmkit plan CONFIG --world N --mem-gb M [--gpu NAME]`` and ``parallel: auto`` in ``llmkit train``:
the planner (``framework/distributed/plan_search.py``) on a run config's model, batch and precision.

Without ``--gpu`` the machine is this host: its matmul and memory speeds and the backend's
collectives, probed once and cached (``framework/distributed/probe.py``), shared out among the
ranks that run on it. With ``--gpu A100|H100|H200`` it is a cluster of those (8 per node, their
published peaks at an MFU-style efficiency).
"""

from __future__ import annotations

import os
import shlex
from typing import Any

from llmkit.framework.distributed import plan_search
from llmkit.framework.distributed.parallel_plan import PlanError

from .args import ArgumentParser
from .config import ConfigError, TrainConfig, load_config, resolve_model_config

GB = plan_search.GB


def precision_of(cfg: TrainConfig) -> plan_search.Precision:
    """llmkit keeps AdamW's moments in float32 whatever the weights' dtype."""
    w = 2 if cfg.train.dtype == "bfloat16" else 4
    return plan_search.Precision(w, w, 8)


def model_cost(cfg: TrainConfig) -> tuple[Any, plan_search.ModelCost]:
    from llmkit.models.llama.sharding import llama_cost

    if cfg.tokenizer.path == "builtin":
        vocab = cfg.tokenizer.vocab_size
    else:
        from llmkit.models.llama import LlamaTokenizer

        vocab = LlamaTokenizer.from_pretrained(cfg.tokenizer.path).vocab_size
    llama = resolve_model_config(cfg, vocab)
    return llama, llama_cost(llama, cfg.train.seq_len, 2 if cfg.train.dtype == "bfloat16" else 4)


PROBE_PARAMS = 50e6  # a layer larger than this is too slow to probe here: the bare matmul's speed


def step_probe(llama: Any, cfg: TrainConfig) -> tuple[str, Any] | None:
    """(key, probe) of this model's training speeds here: one decoder layer with the embedding and
    head, forward + backward in eager mode on up to 2048 tokens, as model FLOPs
    (``ModelCost.train_flops``) per second; then the run's optimizer step with clipping, as
    parameters per second (each the median of 3 after a warm-up: the typical speed on a shared
    machine, as the trainer's own step times are)."""
    import dataclasses
    import math
    import time

    import numpy as np

    import llmkit.framework as lf
    from llmkit.framework import optim
    from llmkit.models.llama import LlamaForCausalLM
    from llmkit.models.llama.sharding import llama_cost

    from .loop import build_optimizer

    one = dataclasses.replace(llama, num_hidden_layers=1)
    cost = llama_cost(one, cfg.train.seq_len)
    if cost.layer_params > PROBE_PARAMS:
        return None
    seq = cfg.train.seq_len
    rows = max(1, min(cfg.train.batch_size, 2048 // seq))
    key = (
        f"llama h{one.hidden_size} i{one.intermediate_size} v{one.vocab_size} "
        f"heads{one.num_attention_heads}/{one.num_key_value_heads} {rows}x{seq} {cfg.train.dtype} "
        f"{cfg.optim.name}"
    )

    def probe() -> float:
        model = LlamaForCausalLM(one)
        if cfg.train.dtype != "float32":
            model.to(cfg.train.dtype)
        ids = lf.tensor(np.random.default_rng(0).integers(0, one.vocab_size, (rows, seq)))
        params = model.parameters()
        opt = build_optimizer(cfg.optim, model)
        times, updates = [], []
        for _ in range(4):
            t0 = time.perf_counter()
            model.loss(ids, ids).backward()
            t1 = time.perf_counter()
            optim.clip_grad_norm_(params, cfg.optim.grad_clip or math.inf)
            opt.step()
            opt.zero_grad()
            times.append(t1 - t0)
            updates.append(time.perf_counter() - t1)
        n = sum(p.size for p in params)
        return cost.train_flops(rows * seq) / float(np.median(times[1:])), n / float(np.median(updates[1:]))

    return key, probe


def machine_for(
    gpu: str | None, backend: str, world: int, speed: tuple[str, Any] | None = None
) -> plan_search.Machine:
    if gpu is not None:
        return plan_search.gpu_machine(gpu)
    from llmkit.framework.distributed.probe import local_machine

    return local_machine(backend, world, speed)


def run_planner(
    cfg: TrainConfig,
    world: int,
    mem: float,
    gpu: str | None = None,
    backend: str | None = None,
    schedules: tuple[str, ...] = ("1f1b", "zero_bubble"),
    top: int = 10,
) -> tuple[plan_search.Choice, str]:
    """The choice for ``cfg`` on ``world`` ranks of ``mem`` bytes, and its report (table + reasons)."""
    if world < 1:
        raise ConfigError(f"--world must be at least 1, got {world}")
    if not mem > 0:
        raise ConfigError(f"--mem-gb must be above 0, got {mem / GB:g}")
    backend = backend or ("sim" if world == 1 else "mpi")
    llama, cost = model_cost(cfg)
    machine = machine_for(gpu, backend, world, None if gpu else step_probe(llama, cfg))
    batch = cfg.train.batch_size * cfg.train.grad_accum
    choice = plan_search.plan(
        cost, machine, world, batch, mem, precision=precision_of(cfg), schedules=schedules
    )
    flops = f"{plan_search.EFFICIENCY:.0%} of the published peak" if gpu else "measured matmul"
    flops = "measured training step" if machine.whole_step else flops
    lines = [
        f"plan: {llama.num_parameters() / 1e9:.3g}B parameters, {batch} x {cfg.train.seq_len} tokens a step, "
        f"{world} ranks of {mem / GB:.3g} GB on {machine.name} ({machine.flops / 1e9:.4g} GFLOP/s per rank, "
        f"{flops})",
        plan_search.table(choice, cost, machine, batch, top),
        mfu_note(gpu is not None),
        *choice.reasons(),
    ]
    return choice, "\n".join(lines)


def mfu_note(gpu: bool) -> str:
    """What the MFU column is: a prediction whose ceiling is the model's own efficiency."""
    if gpu:
        return (
            f"MFU is predicted, not measured: the model runs matmuls at {plan_search.EFFICIENCY:.0%} of "
            f"the published peak, so no plan can show more than {plan_search.EFFICIENCY:.0%} "
            "(published runs: 40-58%)"
        )
    return "MFU is predicted: model FLOPs over this host's measured bare-matmul speed, not a published peak"


def overrides(c: plan_search.Candidate, cfg: TrainConfig) -> list[str]:
    """Config overrides that run candidate ``c`` (the whole ``parallel`` section, and the batch cut
    into micro-batches: gradient accumulation without a pipeline, the pipeline's own with one)."""
    batch = cfg.train.batch_size * cfg.train.grad_accum
    par = {"dp": c.dp, "tp": c.tp, "zero": c.zero, "recompute": c.recompute}
    if c.pp > 1:
        par.update(pp=c.pp, micro_batches=c.micro_batches, schedule=c.schedule)
        accum = 1
    else:
        accum = c.micro_batches
    section = ", ".join(f"{k}: {v}" for k, v in par.items())
    return [f"parallel={{{section}}}", f"train.batch_size={batch // accum}", f"train.grad_accum={accum}"]


def plan_main(argv: list[str]) -> int:
    """``llmkit plan CONFIG [overrides] --world N --mem-gb M [--gpu NAME] [--top K]``."""
    p = ArgumentParser(
        prog="llmkit plan",
        description="Pick the fastest dp x tp x pp x ZeRO x recompute x micro-batch plan that fits.",
    )
    p.add_argument("config", help="YAML run config (its model, batch, sequence length and dtype)")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    p.add_argument("--world", type=int, required=True, metavar="N", help="ranks (processes or GPUs)")
    p.add_argument("--mem-gb", type=float, required=True, metavar="M", help="memory per rank, GB (1e9 B)")
    p.add_argument("--gpu", help=f"plan for GPUs ({', '.join(plan_search.GPUS)}) instead of this host")
    p.add_argument("--backend", choices=["sim", "mpi"], help="this host's backend (default: mpi over 1 rank)")
    p.add_argument("--top", type=int, default=10, help="candidates shown")
    a = p.parse_intermixed_args(argv)
    cfg = load_config(a.config, a.overrides)
    choice, report = run_planner(cfg, a.world, a.mem_gb * GB, a.gpu, a.backend, top=a.top)
    print(report)
    print(f"run it: llmkit train {' '.join(map(shlex.quote, [a.config, *overrides(choice.best, cfg)]))}")
    return 0


def host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_auto(cfg: TrainConfig, nproc: int | None, say: Any = print) -> list[str]:
    """``parallel: auto``: plan for ``--nproc`` ranks (one without it) with this host's memory shared
    among them, print the report, and return the overrides that run the choice. Under mpiexec every
    rank would plan on its own probe: refused (plan first, then launch)."""
    from llmkit.framework.distributed.comm import launched_by_mpi

    if launched_by_mpi():
        raise ConfigError(
            "parallel: auto plans before the processes start: run llmkit train --nproc N, or run "
            "llmkit plan and give mpiexec its overrides"
        )
    world = nproc or 1
    try:
        choice, report = run_planner(cfg, world, host_memory() / world)
    except PlanError as e:
        raise ConfigError(f"parallel: auto: {e}") from None
    say(report)
    extra = overrides(choice.best, cfg)
    say(f"parallel: auto -> {' '.join(extra)}")
    return extra
