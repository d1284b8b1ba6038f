"""The RLHF config: the training config's machinery (typed sections, dotted overrides, one-line
errors naming the key), its own consistency rules, and the CLI's messages."""

from __future__ import annotations

import json
import re

import pytest

from llmkit.cli import main as cli_main
from llmkit.rlhf.config import load_reward_config, load_rlhf_config
from llmkit.train.checkpoint import model_dir
from llmkit.train.config import ConfigError

BASE = {"algorithm": "grpo", "reward": {"task": "avoid_letter"}, "out_dir": "runs/x"}


def write(tmp_path, raw):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(raw))
    return path


def test_defaults_and_overrides(tmp_path):
    cfg = load_rlhf_config(write(tmp_path, BASE), ["rollout.n=4", "rlhf.kl_estimator=k1", "optim.lr=1e-4"])
    assert cfg.rollout.n == 4 and cfg.rlhf.kl_estimator == "k1" and cfg.optim.lr == 1e-4
    assert cfg.rlhf.exact_logprobs is True and cfg.model.init_from == "runs/tiny"


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["algorithm=a2c"], "algorithm: expected 'grpo', 'ppo', 'rloo' or 'dpo', got 'a2c'"),
        (["rollout.n=1"], "rollout.n: grpo compares samples of a prompt; use n >= 2"),
        (["rollout.temperature=0"], "rollout.temperature: expected a value > 0"),
        (["rlhf.kl_estimator=k2"], "rlhf.kl_estimator: expected 'k1' or 'k3'"),
        (["rollout.max_tokenz=3"], "unknown key rollout.max_tokenz (did you mean rollout.max_tokens?)"),
        (["reward.function=m:f"], "reward: set exactly one of reward.function, reward.model and reward.task"),
        (["algorithm=dpo"], "data.pairs: DPO needs preference pairs"),
        (["lr_schedule.warmup_steps=500"], "lr_schedule.warmup_steps (500) exceeds train.steps (100)"),
        (["schedule.warmup=2"], "schedule was renamed lr_schedule (the learning-rate schedule;"),
        # adapter dropout: the online algorithms' log-probs are exact; the offline jobs' resume is
        (["lora.dropout=0.05"], "lora.dropout (0.05): the trainer's log-probs must equal the rollout engine"),
        (
            ["algorithm=dpo", "data.pairs=builtin:avoid_letter", "lora.dropout=0.1"],
            "lora.dropout (0.1): rlhf checkpoints do not hold the random state that draws the masks",
        ),
        # data parallel only: every other parallel key is refused by name, never ignored
        *(
            ([f"parallel.{key}={value}"], f"parallel.{key}: llmkit rlhf runs data parallel only")
            for key, value in [
                ("pp", 2),
                ("micro_batches", 4),
                ("schedule", "gpipe"),
                ("virtual_stages", 2),
                ("pp_stages", "[0-0, 1-1]"),
                ("recompute", "full"),
                ("recompute_every", 3),
                ("auto", "true"),
                ("tp", 2),
                ("sp", "true"),
                ("zero", 1),
                ("plan", "llama"),
            ]
        ),
        (["parallel=auto"], "parallel.auto: llmkit rlhf runs data parallel only"),
        (["parallel.pp=2", "parallel.recompute=full"], "parallel.pp: llmkit rlhf runs data parallel only"),
    ],
)
def test_errors_name_the_key(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match="config error: " + re.escape(match)):
        load_rlhf_config(write(tmp_path, BASE), overrides)


def test_reward_model_config(tmp_path):
    cfg = load_reward_config(write(tmp_path, {"out_dir": "runs/rm"}))
    assert cfg.data.pairs == "builtin:avoid_letter" and cfg.train.steps == 200
    with pytest.raises(ConfigError, match="unknown key rollout"):
        load_reward_config(write(tmp_path, {"rollout": {"n": 2}}))
    with pytest.raises(ConfigError, match="parallel.recompute: llmkit rlhf runs data parallel only"):
        load_reward_config(write(tmp_path, {"parallel": {"dp": 1, "recompute": "full"}}))
    with pytest.raises(ConfigError, match=r"lora.dropout \(0.05\): rlhf checkpoints do not hold the random"):
        load_reward_config(write(tmp_path, {"lora": {"dropout": 0.05}}))


def test_model_dir_finds_a_runs_newest_checkpoint(tmp_path):
    for step in (2, 10):
        d = tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "model"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d.parent / "COMPLETE").write_text("done\n")
    incomplete = tmp_path / "run" / "checkpoints" / "step-00000020" / "model"  # no commit marker
    incomplete.mkdir(parents=True)
    (incomplete / "config.json").write_text("{}")
    assert model_dir(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step-00000010" / "model"
    assert model_dir(tmp_path / "run" / "checkpoints" / "step-00000002" / "model").name == "model"
    with pytest.raises(
        ConfigError, match=r"model.init_from: '.*missing' does not exist; train the model first"
    ):
        model_dir(tmp_path / "missing")
    with pytest.raises(ConfigError, match="neither a model directory"):
        model_dir(tmp_path)


def test_cli_prints_config_errors_and_a_missing_checkpoint_in_one_line(tmp_path, capsys):
    cfg = write(tmp_path, {**BASE, "model": {"init_from": str(tmp_path / "nothing")}})
    assert cli_main(["rlhf", str(cfg), "rollout.n=0"]) == 2
    assert "llmkit rlhf: config error: rollout.n: expected a value > 0, got 0" in capsys.readouterr().err
    assert cli_main(["rlhf", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "model.init_from" in err and "llmkit train configs/tiny.yaml" in err and "Traceback" not in err
    assert cli_main(["rlhf", "reward", str(cfg)]) == 2  # the reward job rejects the RLHF keys
    assert "unknown key algorithm" in capsys.readouterr().err
