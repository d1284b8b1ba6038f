"""``--resume`` with a changed config: what may change applies from the checkpoint's step on and is
listed; what cannot (the model, the tokenizer, the optimizer kind, the seed) is refused by key."""

from __future__ import annotations

import json
import math

import pytest

from llmkit.cli import main as cli_main
from llmkit.train.config import ConfigError, parse_config
from llmkit.train.metrics import read_metrics
from llmkit.train.trainer import Trainer

from .runs import raw_config

LR, WARMUP, MIN_RATIO = 3e-3, 2, 0.1


def run(out, steps=6, **sections):
    raw = raw_config(out, steps=steps, save_every=0, eval_every=0)
    raw["optim"] = {"lr": LR}
    raw["lr_schedule"] = {"name": "cosine", "warmup_steps": WARMUP, "min_lr_ratio": MIN_RATIO}
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return parse_config(raw)


def cosine_lr(step, total, lr=LR):
    """The lr of 1-based step `step` in a `total`-step warmup + cosine run, in float64."""
    s = step - 1  # optimizer steps taken before it
    if s < WARMUP:
        return lr * (s + 1) / WARMUP
    q = min(1.0, (s - WARMUP) / (total - WARMUP))
    return lr * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * q)))


def logged_lr(out):
    return {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r}


@pytest.fixture
def finished(tmp_path):
    """A finished 6-step run."""
    out = tmp_path / "run"
    Trainer(run(out), quiet=True).fit()
    return out


def test_more_steps_replan_the_schedule_from_the_saved_step(finished):
    trainer = Trainer(run(finished, steps=12), resume=True, quiet=True)
    assert trainer.resume_changes[0] == "train.steps 6 -> 12"
    assert trainer.resume_changes[1].startswith("lr at step 6 ")
    trainer.fit()
    lrs = logged_lr(finished)
    assert sorted(lrs) == list(range(1, 13))
    for step in range(1, 7):  # as planned for 6 steps
        assert lrs[step] == pytest.approx(cosine_lr(step, 6), rel=1e-12)
    for step in range(7, 13):  # the 12-step schedule from step 7 on, not flat at the minimum
        assert lrs[step] == pytest.approx(cosine_lr(step, 12), rel=1e-12)
    assert lrs[7] > 2 * MIN_RATIO * LR


def test_changed_optimizer_and_schedule_settings_apply(finished):
    trainer = Trainer(
        run(finished, steps=9, optim__lr=1e-3, optim__weight_decay=0.05, lr_schedule__min_lr_ratio=0.5),
        resume=True,
        quiet=True,
    )
    assert trainer.resume_changes[:4] == [
        "optim.lr 0.003 -> 0.001",
        "optim.weight_decay 0.1 -> 0.05",
        "lr_schedule.min_lr_ratio 0.1 -> 0.5",
        "train.steps 6 -> 9",
    ]
    decay_group = trainer.optimizer.param_groups[0]
    assert decay_group["weight_decay"] == 0.05
    trainer.fit()
    q = [(s - 1 - WARMUP) / (9 - WARMUP) for s in range(7, 10)]
    want = [1e-3 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * x))) for x in q]
    assert [logged_lr(finished)[s] for s in range(7, 10)] == pytest.approx(want, rel=1e-12)


def test_unchanged_config_lists_nothing(finished):
    assert Trainer(run(finished), resume=True, quiet=True).resume_changes == []


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"model__hidden_size": 64}, "model.hidden_size"),
        ({"model__num_hidden_layers": 3}, "model.num_hidden_layers"),
        ({"tokenizer__vocab_size": 600}, "tokenizer.vocab_size"),
        ({"optim__name": "sgd"}, "optim.name"),
        ({"train__seed": 1}, "train.seed"),
    ],
)
def test_changes_that_cannot_apply_are_refused_by_key_before_anything_is_written(finished, override, key):
    before = {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=rf"config error: {key} cannot change on --resume \(checkpoint: "):
        Trainer(run(finished, **override), resume=True, quiet=True)
    assert {p: p.read_bytes() for p in finished.rglob("*") if p.is_file()} == before


def test_fewer_steps_than_the_checkpoint_is_refused(finished):
    with pytest.raises(ConfigError, match=r"train.steps \(4\) is below the step of .*step-00000006 \(6\)"):
        Trainer(run(finished, steps=4), resume=True, quiet=True)


def test_changed_batch_shape_and_dtype_apply(finished):
    trainer = Trainer(
        run(finished, steps=8, train__batch_size=2, train__grad_accum=2, train__dtype="bfloat16"),
        resume=True,
        quiet=True,
    )
    assert {"train.batch_size 4 -> 2", "train.grad_accum 1 -> 2", "train.dtype float32 -> bfloat16"} <= set(
        trainer.resume_changes
    )
    trainer.fit()
    assert trainer.step == 8 and trainer.sampler.step == 6 + 2 * 2
    assert trainer.model.parameters()[0].dtype.name == "bfloat16"


@pytest.mark.parametrize("order", ["flag_first", "override_first"])
def test_cli_resume_with_overrides_in_any_order_prints_the_changes(tmp_path, capsys, order):
    out = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(run(out).model_dump(mode="json")))
    assert cli_main(["train", str(cfg), "--quiet"]) == 0
    args = ["--resume", "train.steps=8"] if order == "flag_first" else ["train.steps=8", "--resume"]
    capsys.readouterr()
    assert cli_main(["train", str(cfg), *args, "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"resume: step 6 from {out / 'checkpoints' / 'step-00000006'}"
    assert lines[1].startswith("resume: train.steps 6 -> 8, lr at step 6 ")
    assert "done: step 8" in lines[-1]


def test_listing_checkpoints_finishes_a_replacement_a_crash_interrupted(tmp_path):
    # The two-rename fallback of files.atomic_dir parks the old directory as .<name>.old; a crash
    # before the new one arrives leaves only that: the run's checkpoint list must bring it back.
    from llmkit.train.checkpoint import checkpoints

    root = tmp_path / "checkpoints"
    (root / "step-00000002").mkdir(parents=True)
    (root / "step-00000002" / "COMPLETE").write_text("step 2\n")
    (root / ".step-00000004.old").mkdir()
    (root / ".step-00000004.old" / "trainer_state.json").write_text("{}")
    (root / ".step-00000004.old" / "COMPLETE").write_text("step 4\n")
    assert [p.name for p in checkpoints(tmp_path)] == ["step-00000002", "step-00000004"]
    assert (root / "step-00000004" / "trainer_state.json").exists()
    assert not (root / ".step-00000004.old").exists()
