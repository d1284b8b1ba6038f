"""The runs the parallel-training tests compare: configs/tiny.yaml shrunk by overrides (a 1-layer,
width-32 Llama with 2 heads, so tp=2 keeps whole heads; 4 sequences of 16 tokens, 20 steps); the
pipeline tests' model has 4 layers."""

from __future__ import annotations

from pathlib import Path

from llmkit.train.config import TrainConfig, load_config
from llmkit.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 20
SHRINK = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=32",
    "tokenizer.vocab_size=512",
    f"train.steps={STEPS}",
    "train.batch_size=4",
    "train.seq_len=16",
    "train.eval_every=10",
    "train.eval_steps=2",
    "train.log_every=1",
    "train.save_every=10",
    "train.keep_last=5",
    "lr_schedule.warmup_steps=5",
]


PP_LAYERS = "model.num_hidden_layers=4"  # interleaved pp=2 x 2 virtual stages: one layer each
PP_SCHEDULES = {  # parallel keys of each schedule; 4 rows per batch, 1 per dp rank and micro-batch
    "fthenb": {"micro_batches": 2},
    "1f1b": {"micro_batches": 2},
    "interleaved": {"micro_batches": 2, "virtual_stages": 2},
    "zero_bubble": {"micro_batches": 2},
}
STATIC = ("train.mode=static", "train.compiler=none")


def pp(schedule: str, **more: object) -> dict:
    """The parallel keys of a pp=2 run with ``schedule`` (and ``more``: dp, tp, zero...)."""
    return {"pp": 2, "schedule": schedule, **PP_SCHEDULES[schedule], **more}


def overrides(out: Path | str, **parallel: object) -> list[str]:
    """SHRINK plus out_dir and parallel.KEY=VALUE (booleans as YAML)."""
    par = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in parallel.items()]
    return [*SHRINK, f"out_dir={out}", *par]


def config(out: Path | str, *extra: str, **parallel: object) -> TrainConfig:
    return load_config(TINY, [*overrides(out, **parallel), *extra])


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def assert_same_losses(
    got: dict[int, float], want: dict[int, float], steps: range, rel: float = 1e-5
) -> None:
    assert sorted(got) == list(steps), sorted(got)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in steps)
    assert worst <= rel, f"relative difference {worst:.2e} > {rel:g}: {[(s, got[s], want[s]) for s in steps]}"
