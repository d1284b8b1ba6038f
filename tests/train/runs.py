"""Tiny training runs shared by the trainer tests: a 2-layer, width-32 Llama on the built-in corpus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmkit.train.config import TrainConfig, parse_config
from llmkit.train.metrics import read_metrics

MICRO = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def raw_config(out_dir: Path | str, **train: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "tiny", **MICRO},
        "tokenizer": {"path": "builtin", "vocab_size": 512},
        "optim": {"lr": 3e-3},
        "lr_schedule": {"name": "cosine", "warmup_steps": 3},
        "train": {
            "steps": 30,
            "batch_size": 4,
            "seq_len": 16,
            "eval_every": 10,
            "eval_steps": 2,
            "log_every": 1,
            "save_every": 5,
            "keep_last": 10,
            "seed": 0,
            **train,
        },
        "out_dir": str(out_dir),
    }


def config(out_dir: Path | str, **train: Any) -> TrainConfig:
    """The tiny run's config; keyword arguments override the `train` section."""
    return parse_config(raw_config(out_dir, **train))


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step, from the run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
