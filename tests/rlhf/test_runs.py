"""Whole runs through ``llmkit rlhf``: GRPO, RLOO and PPO learn a built-in task, DPO and the
reward model separate held-out pairs, and a run killed with SIGKILL resumes with the same metrics.

The policy is a small random Llama (2 layers, width 128); a built-in task's reward is a property of
every token it writes, so even it moves the reward within a few steps at a large learning rate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmkit.cli import main as cli_main
from llmkit.rlhf import tasks
from llmkit.rlhf.run import TIMINGS
from llmkit.train.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def write_config(path: Path, **sections) -> Path:
    path.write_text(json.dumps(sections))  # JSON is YAML
    return path


def grpo_config(tmp_path: Path, policy_dir: Path, name: str, **over) -> Path:
    raw = {
        "algorithm": "grpo",
        "model": {"init_from": str(policy_dir)},
        "reward": {"task": "avoid_letter", "task_args": {"letter": "e"}},
        "rollout": {"prompts_per_step": 4, "n": 8, "max_tokens": 8},
        "rlhf": {"kl_coef": 0.0},
        "optim": {"lr": 1e-2},
        "train": {"steps": 14, "save_every": 0},
        "out_dir": str(tmp_path / name),
    }
    for key, value in over.items():  # section__field=value, or a top-level key
        section, _, field = key.partition("__")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[key] = value
    return write_config(tmp_path / f"{name}.yaml", **raw)


def values(rows, key):
    return [r[key] for r in rows if key in r]


# A random policy writes words without an "e" in about 30% of its words; GRPO at lr 1e-2 with 32
# samples a step takes it above 70% within 14 steps (measured on an Intel Xeon: 0.29 -> 0.99 by step 13;
# on an AMD EPYC: 0.25 -> 0.88 by step 14, margin 0.50).
GRPO_MARGIN = 0.3


def test_grpo_raises_the_reward_of_a_builtin_task(tmp_path, policy_dir, capsys):
    cfg = grpo_config(tmp_path, policy_dir, "grpo")
    assert cli_main(["rlhf", str(cfg), "--quiet"]) == 0
    rows = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    reward = values(rows, "reward_mean")
    assert len(reward) == 14
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last - first > GRPO_MARGIN, reward
    for key in (
        "reward_std", "kl", "entropy", "clip_frac", "ratio_mean", "logprob_diff_max", "response_len_mean",
        "gen_tokens_per_s", "gen_s", "train_s", "sync_s",
    ):  # fmt: skip
        assert all(key in r for r in rows if "reward_mean" in r), key
    assert all(r["logprob_diff_max"] == 0.0 and r["ratio_mean"] == 1.0 for r in rows)
    final = tmp_path / "grpo" / "checkpoints" / "step-00000014" / "model"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.model").is_file()
    assert cli_main(["plot", str(tmp_path / "grpo")]) == 0
    assert (tmp_path / "grpo" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert "reward.png" in capsys.readouterr().out


# RLOO and PPO at lr 3e-2 take the same task from about 0.25 to above 0.9 within 14 steps; the take-off
# step depends on the host (BLAS and CPU change the samples), so the run goes well past it. Measured,
# kl_coef 0, PPO with 2 epochs of 2 minibatches: on an Intel Xeon RLOO 0.25 -> 0.99 by step 8, PPO
# 0.25 -> 0.98 by step 8; on an AMD EPYC RLOO 0.25 0.31 0.34 0.46 0.33 0.40 0.45 0.59 0.74 0.88 0.99
# (its margin over 8 steps only 0.18), PPO 0.25 0.35 0.67 0.71 0.86 1.00 by step 6. There with train.seed
# 1-4, the 14-step margins are RLOO 0.67-0.71 and PPO 0.53-0.61 (over 8 steps PPO's seed 3 gave 0.03).
@pytest.mark.parametrize(
    "algorithm,extra", [("rloo", {}), ("ppo", {"rlhf__epochs": 2, "rlhf__minibatches": 2})]
)
def test_rloo_and_ppo_raise_the_reward_of_a_builtin_task(tmp_path, policy_dir, algorithm, extra):
    cfg = grpo_config(
        tmp_path,
        policy_dir,
        algorithm,
        algorithm=algorithm,
        train__steps=14,
        optim__lr=3e-2,
        **extra,
    )
    assert cli_main(["rlhf", str(cfg), "--quiet"]) == 0
    rows = read_metrics(tmp_path / algorithm / "metrics.jsonl")
    assert len(rows) == 14 and all(r["logprob_diff_max"] == 0.0 for r in rows)
    reward = values(rows, "reward_mean")
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert last - first > GRPO_MARGIN, reward
    if algorithm == "ppo":
        assert "value_loss" in rows[0] and rows[0]["clip_frac"] >= 0.0
        assert (tmp_path / "ppo" / "checkpoints" / "step-00000014" / "value_head.safetensors").is_file()
        assert any(r["ratio_mean"] != 1.0 for r in rows)  # later minibatches see updated weights


def pairs_file(tmp_path: Path, n: int) -> Path:
    """A JSONL file of the built-in avoid_letter preference set (its first n pairs)."""
    path = tmp_path / "pairs.jsonl"
    rows = tasks.preference_pairs(tasks.make_task("avoid_letter"), n, seed=0)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dpo_reaches_held_out_accuracy_above_0_9(tmp_path, policy_dir):
    cfg = write_config(
        tmp_path / "dpo.yaml",
        algorithm="dpo",
        model={"init_from": str(policy_dir)},
        data={"pairs": str(pairs_file(tmp_path, 400)), "val_fraction": 0.25},
        rlhf={"beta": 0.1},
        optim={"lr": 1e-3},
        train={"steps": 30, "batch_size": 16, "eval_every": 10},
        out_dir=str(tmp_path / "dpo"),
    )
    assert cli_main(["rlhf", str(cfg), "--quiet"]) == 0
    rows = read_metrics(tmp_path / "dpo" / "metrics.jsonl")
    assert {"accuracy", "margin"} <= set(rows[0])
    assert values(rows, "eval_accuracy")[-1] > 0.9


def test_reward_model_separates_held_out_pairs_above_0_9(tmp_path, policy_dir):
    cfg = write_config(
        tmp_path / "rm.yaml",
        model={"init_from": str(policy_dir)},
        data={"pairs": str(pairs_file(tmp_path, 400)), "val_fraction": 0.25},
        optim={"lr": 1e-3},
        train={"steps": 30, "batch_size": 16, "eval_every": 10},
        out_dir=str(tmp_path / "rm"),
    )
    assert cli_main(["rlhf", "reward", str(cfg), "--quiet"]) == 0
    rows = read_metrics(tmp_path / "rm" / "metrics.jsonl")
    assert "accuracy" in rows[0]
    assert values(rows, "eval_accuracy")[-1] > 0.9
    # the trained model is a reward source for RLHF (reward.model points at its run)
    cfg = grpo_config(tmp_path, policy_dir, "with-rm", train__steps=1, reward={"model": str(tmp_path / "rm")})
    assert cli_main(["rlhf", str(cfg), "--quiet"]) == 0


def test_resume_after_sigkill_continues_with_identical_metrics(tmp_path, policy_dir):
    cfg = grpo_config(tmp_path, policy_dir, "run", train__steps=4, train__save_every=2, optim__lr=3e-3)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "llmkit.cli", "rlhf", str(cfg), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    deadline = time.monotonic() + 600
    while not ckpt.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    subprocess.run(cmd + ["--resume"], env=env, check=True, timeout=600, capture_output=True)
    resumed = read_metrics(tmp_path / "run" / "metrics.jsonl")

    other = grpo_config(tmp_path, policy_dir, "whole", train__steps=4, train__save_every=2, optim__lr=3e-3)
    assert cli_main(["rlhf", str(other), "--quiet"]) == 0
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]
    assert [r["step"] for r in resumed] == list(range(1, 5))
    assert strip(resumed) == strip(whole)


def test_sigint_finishes_the_step_saves_and_resumes(tmp_path, policy_dir):
    cfg = grpo_config(tmp_path, policy_dir, "stop", train__steps=50, optim__lr=3e-3)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "llmkit.cli", "rlhf", str(cfg), "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "stop" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    step = len(read_metrics(metrics))
    assert f"stopped by SIGINT at step {step}; saved" in err and "continue with --resume" in err
    assert (tmp_path / "stop" / "checkpoints" / f"step-{step:08d}" / "model" / "config.json").is_file()
    out = subprocess.run(
        cmd + ["--resume", "train.steps=" + str(step + 1)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert f"resume: step {step} from" in out.stdout and f"train.steps 50 -> {step + 1}" in out.stdout
    assert len(read_metrics(metrics)) == step + 1
