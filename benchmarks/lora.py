"""Full fine-tuning vs LoRA vs QLoRA (int4 base): peak resident memory, step time, trainable
parameters and checkpoint bytes per step, on the 134M model and a ~1B-parameter config.

Each (model, variant) runs in a process of its own, so that its peak RSS (``ru_maxrss``) is its own:
it builds the model (random weights; QLoRA loads the int4 model that a preparation process
quantized with RTN and saved, so the float weights are never resident), adds the adapters (r=16,
alpha=32, every projection), and times ``--steps`` eager training steps of ``--batch`` x ``--seq``
random tokens (AdamW over the trainable parameters, as ``llmkit train`` builds it; the first step
is warm-up); full and LoRA processes alternate ``--rounds`` times and their step-time ratio is the
median of the rounds' (this shared machine drifts). Checkpoint bytes: what ``llmkit train``
writes per checkpoint, the weights plus AdamW's two moments (full), or the adapter files (written
here) plus their moments (LoRA, QLoRA).

Full fine-tuning of the ~1B config needs ~16 bytes a parameter (about 18 GB) before activations;
it runs only with ``--full-1b`` (the figure printed otherwise is that state size, computed).

Run:
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/lora.py [--models 134M,1B]
"""

from __future__ import annotations

# isort: off
import _common  # noqa: F401
import llmkit  # noqa: F401

# isort: on
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import emit, emit_paired_ratio, machine
from quant import MODELS as QUANT_MODELS

import llmkit.framework as lf
from llmkit.framework import optim
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM, lora
from llmkit.train.config import OptimSection
from llmkit.train.loop import build_optimizer
from llmkit.train.metrics import peak_rss_bytes

MODELS = {
    "134M": QUANT_MODELS["134M"],  # benchmarks/quant.py's
    "1B": lambda: LlamaConfig(  # Llama 3.2 1B's shape with the Llama 2 vocabulary: 1.1B parameters
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=1024,
    ),
}
VARIANTS = ("full", "lora", "qlora")
LORA = lora.LoraConfig(r=16, alpha=32, targets=(lora.ALL_LINEAR,))
FITS_BYTES = 6 * 2**30  # QLoRA of the 1B model must fit in 6 GB


def prepare_int4(model: str, out: Path) -> None:
    """The int4 (RTN, groups of 128) model of ``model``'s random weights, saved to ``out``."""
    from llmkit.quant import QuantConfig, quantize_model

    lf.seed(0)
    m = LlamaForCausalLM(MODELS[model]())
    quantize_model(m, QuantConfig(bits=4, group_size=128, method="rtn"), progress=False)
    m.save_pretrained(out)


def child(model: str, variant: str, int4_dir: str, steps: int, batch: int, seq: int) -> dict:
    """One variant's figures (run in its own process)."""
    lf.seed(0)
    if variant == "qlora":
        m = LlamaForCausalLM.from_pretrained(int4_dir)
    else:
        m = LlamaForCausalLM(MODELS[model]())
    if variant != "full":
        lora.apply_lora(m, LORA, seed=0)
    total = m.num_parameters()
    trainable = [p for p in m.parameters() if p.requires_grad]
    opt = build_optimizer(OptimSection(), m)
    rng = np.random.default_rng(0)
    vocab = m.config.vocab_size
    times = []
    for _ in range(steps):
        x, y = (lf.tensor(rng.integers(0, vocab, (batch, seq))) for _ in range(2))
        t0 = time.perf_counter()
        m.loss(x, y).backward()
        optim.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    moments = sum(v._data.nbytes for state in opt.states for v in state.values())
    if variant == "full":
        ckpt = sum(p._data.nbytes for p in m.parameters()) + moments
    else:
        with tempfile.TemporaryDirectory() as d:
            ckpt = lora.write_adapter(m, d) + moments
    return {
        "peak_rss_bytes": peak_rss_bytes(),
        "step_s": statistics.median(times[1:] or times),
        "trainable_params": sum(p.size for p in trainable),
        "params": total,
        "checkpoint_bytes": ckpt,
    }


def run_child(model: str, variant: str, int4_dir: Path, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--models", model, "--int4", str(int4_dir)]
    cmd += ["--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="134M,1B")
    p.add_argument("--steps", type=int, default=3, help="training steps per variant (the first is warm-up)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS), help="some of full,lora,qlora")
    p.add_argument("--rounds", type=int, default=2, help="full/LoRA processes alternated this many times")
    p.add_argument(
        "--full-1b", action="store_true", help="also run full fine-tuning of the 1B config (~18 GB)"
    )
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--int4", help=argparse.SUPPRESS)
    p.add_argument("--prepare", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.prepare:
        prepare_int4(a.models, Path(a.prepare))
        return
    if a.child:
        print(json.dumps(child(a.models, a.child, a.int4, a.steps, a.batch, a.seq)))
        return
    extra = {"batch": a.batch, "seq": a.seq, "r": LORA.r, "targets": "all-linear", **machine()}
    for model in a.models.split(","):
        with tempfile.TemporaryDirectory() as d:
            int4 = Path(d) / "int4"
            subprocess.run([sys.executable, __file__, "--prepare", str(int4), "--models", model], check=True)
            got: dict[str, dict] = {}
            step_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for rnd in range(a.rounds):  # full and LoRA alternate: both see the same stretches
                for variant in VARIANTS:
                    skip = variant not in a.variants.split(",") or (rnd and variant == "qlora")
                    if skip or (model == "1B" and variant == "full" and not a.full_1b):
                        continue
                    r = run_child(model, variant, int4, a)
                    step_s[variant].append(r["step_s"])
                    got[variant] = {
                        **r,
                        "peak_rss_bytes": max(r["peak_rss_bytes"], got.get(variant, r)["peak_rss_bytes"]),
                    }
            for variant, r in got.items():
                r["step_s"] = statistics.median(step_s[variant])
                tags = {"model": model, "variant": variant, **extra}
                emit("lora", "peak_rss", r["peak_rss_bytes"] / 2**30, "GiB", **tags)
                emit("lora", "step_time", r["step_s"], "s", **tags)
                emit("lora", "trainable_params", r["trainable_params"], "params", params=r["params"], **tags)
                emit("lora", "checkpoint_bytes", r["checkpoint_bytes"] / 2**20, "MiB", **tags)
            if "full" in got and "lora" in got:
                emit_paired_ratio(
                    "lora", "lora_step_time_vs_full", step_s["lora"], step_s["full"], model=model, **extra
                )
            elif "lora" in got:  # full's state, computed: fp32 weights, gradients, two AdamW moments
                params = got["lora"]["params"] - got["lora"]["trainable_params"]
                emit("lora", "full_state_bytes_computed", 16 * params / 2**30, "GiB", model=model, **extra)
            if model == "1B" and "qlora" in got:
                fits = got["qlora"]["peak_rss_bytes"] <= FITS_BYTES
                emit("lora", "qlora_fits_6GB", float(fits), "bool", model=model, **extra)


if __name__ == "__main__":
    main()
