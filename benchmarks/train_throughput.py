"""Training throughput (tokens/s, MFU) and peak memory of one train step on a config's model.

Random token batches of the config's batch_size x seq_len (throughput does not depend on the text).
Modes: eager (tape autograd); static arrives with the to_static issue. ``--torch`` also times
Hugging Face transformers on PyTorch in the same process, as a same-run baseline.

Run:
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/train_throughput.py
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
from _common import emit, machine

import llmkit.framework as lf
from llmkit.framework import optim
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.train.config import load_config
from llmkit.train.metrics import matmul_peak_flops


def model_config(cfg) -> LlamaConfig:
    overrides = cfg.model.overrides()
    return LlamaConfig.from_preset(cfg.model.preset, **{"vocab_size": 4096, **overrides})


def eager_step_fn(llama: LlamaConfig, lr: float):
    lf.seed(0)
    model = LlamaForCausalLM(llama)
    opt = optim.AdamW(model.parameters(), lr=lr)

    def step(x, y):
        loss = model.loss(lf.tensor(x), lf.tensor(y))
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def torch_step_fn(llama: LlamaConfig, lr: float):
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama.to_dict()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    lossf = torch.nn.CrossEntropyLoss()

    def step(x, y):
        logits = model(torch.from_numpy(x)).logits
        loss = lossf(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(y).reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def measure(name, step, batches, warmup, tokens_per_step, flops_per_token, peak):
    for x, y in batches[:warmup]:
        step(x, y)
    t0 = time.perf_counter()
    times = []
    for x, y in batches[warmup:]:
        t = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t)
    med = float(np.median(times))
    tps = tokens_per_step / med
    emit(
        "train_throughput",
        f"{name}_tokens_per_s",
        tps,
        "tokens/s",
        step_ms=round(med * 1e3, 1),
        mfu=round(tps * flops_per_token / peak, 4),
        steps=len(times),
        wall_s=round(time.perf_counter() - t0, 1),
    )
    return tps


def peak_memory(step, batch) -> float:
    """Peak traced allocation (MiB) over one step after a warm-up step."""
    step(*batch)
    tracemalloc.start()
    step(*batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/bench.yaml")
    p.add_argument("--mode", default="eager", choices=["eager"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--torch", action="store_true", help="also time transformers on PyTorch (same process)")
    a = p.parse_args()
    cfg = load_config(a.config)
    llama = model_config(cfg)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(0)
    batches = [
        (rng.integers(0, llama.vocab_size, (b, s)), rng.integers(0, llama.vocab_size, (b, s)))
        for _ in range(a.warmup + a.steps)
    ]
    peak = matmul_peak_flops()
    fpt = llama.flops_per_token(s)
    emit(
        "train_throughput",
        "matmul_peak_gflops",
        peak / 1e9,
        "GFLOP/s",
        params=llama.num_parameters(),
        batch=b,
        seq_len=s,
        **machine(),
    )
    eager = measure("eager", eager_step_fn(llama, cfg.optim.lr), batches, a.warmup, b * s, fpt, peak)
    emit(
        "train_throughput",
        "eager_peak_memory_mib",
        peak_memory(eager_step_fn(llama, cfg.optim.lr), batches[0]),
        "MiB",
    )
    ref = {"torch_2.13_eager_as_shipped": 5300.0, "torch_2.13_eager_tuned": 10800.0}
    for k, v in ref.items():
        emit(
            "train_throughput",
            f"eager_over_{k}",
            eager / v,
            "x",
            reference_tokens_per_s=v,
            note="reference figure from the issue, measured on this machine kind",
        )
    if a.torch:
        t = measure("torch_eager", torch_step_fn(llama, cfg.optim.lr), batches, a.warmup, b * s, fpt, peak)
        emit("train_throughput", "eager_over_torch_same_run", eager / t, "x")


if __name__ == "__main__":
    main()
