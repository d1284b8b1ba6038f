"""An RLHF run stopped at any point of a step (SIGINT, SIGTERM, Ctrl-C twice, kill -9 while it writes
a checkpoint), then ``--resume``: it continues exactly, as ``llmkit train`` does
(tests/train/test_interrupt.py), through the same loop and checkpoint writer.

A hook fires inside step AT, before the rollout or after the step's optimizer update (the weights
and the optimizer state already changed, the engine's weights too), and sends one signal (the step
finishes, its checkpoint is saved), two (the step is rolled back, the previous step's checkpoint is
saved) or raises KeyboardInterrupt itself. The resumed run's metrics (the wall-clock ones apart)
must equal an uninterrupted run's exactly: both run the same kernels on the same numbers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmkit.rlhf import tasks
from llmkit.rlhf.config import RewardModelConfig, RLHFConfig
from llmkit.rlhf.dpo import DPOTrainer
from llmkit.rlhf.reward_model import RewardModelTrainer
from llmkit.rlhf.run import TIMINGS
from llmkit.rlhf.trainer import PolicyTrainer
from llmkit.train.checkpoint import ResumeError, checkpoints
from llmkit.train.loop import Interrupted
from llmkit.train.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS, AT = 4, 2  # a signal lands inside step AT of a STEPS-step run


def raw_config(out: Path, policy_dir: Path, algorithm: str) -> dict:
    extra = {"epochs": 2, "minibatches": 2} if algorithm == "ppo" else {}
    return {
        "algorithm": algorithm,
        "model": {"init_from": str(policy_dir)},
        "reward": {"task": "avoid_letter", "task_args": {"letter": "e"}},
        "rollout": {"prompts_per_step": 2, "n": 4, "max_tokens": 6},
        "rlhf": {"kl_coef": 0.05, **extra},
        "optim": {"lr": 3e-3},
        "train": {"steps": STEPS, "save_every": 0},
        "out_dir": str(out),
    }


def config(out: Path, policy_dir: Path, algorithm: str = "grpo") -> RLHFConfig:
    return RLHFConfig.model_validate(raw_config(out, policy_dir, algorithm))


def metrics(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in read_metrics(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, policy_dir):
    """Metrics of the uninterrupted run, by algorithm (each run once, on first use)."""
    found: dict[str, list[dict]] = {}

    def get(algorithm: str) -> list[dict]:
        if algorithm not in found:
            out = tmp_path_factory.mktemp(f"reference-{algorithm}")
            PolicyTrainer(config(out, policy_dir, algorithm), quiet=True).fit()
            found[algorithm] = metrics(out)
            assert [r["step"] for r in found[algorithm]] == list(range(1, STEPS + 1))
        return found[algorithm]

    return get


def interrupt(action: str, sig: int = signal.SIGINT) -> None:
    """What a hook does: one signal, two signals (the second one aborts), or raise."""
    if action == "raise":
        raise KeyboardInterrupt
    for _ in range({"signal": 1, "abort": 2}[action]):
        os.kill(os.getpid(), sig)


def arm(trainer: PolicyTrainer, point: str, fire) -> None:
    """Call ``fire()`` once, at ``point`` of step AT."""
    fired = []

    def once():
        if trainer.step == AT - 1 and not fired:
            fired.append(1)
            fire()

    if point == "before_rollout":
        generate = trainer.rollouts.generate

        def hooked_generate(*args, **kwargs):
            once()
            return generate(*args, **kwargs)

        trainer.rollouts.generate = hooked_generate
    else:  # after_update: the compiled step has changed the weights and the optimizer's state
        step_fn = trainer.step_fn

        def hooked_step(*args):
            out = step_fn(*args)
            once()
            return out

        trainer.step_fn = hooked_step


@pytest.mark.parametrize(
    ("algorithm", "point", "action"),
    [
        ("grpo", "before_rollout", "signal"),
        ("grpo", "before_rollout", "abort"),
        ("grpo", "after_update", "signal"),
        ("grpo", "after_update", "abort"),
        ("grpo", "after_update", "raise"),
        ("ppo", "after_update", "abort"),  # the value head and the later minibatches rolled back too
    ],
)
def test_interrupt_anywhere_in_a_step_resumes_exactly(
    algorithm, point, action, reference, tmp_path, policy_dir
):
    out = tmp_path / "run"
    trainer = PolicyTrainer(config(out, policy_dir, algorithm), quiet=True)
    arm(trainer, point, lambda: interrupt(action))
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    saved = AT if action == "signal" else AT - 1  # the step in flight finished, or was rolled back
    assert stopped.value.step == saved and stopped.value.signum == signal.SIGINT
    assert [p.name for p in checkpoints(out)] == [f"step-{saved:08d}"]
    state = json.loads((out / "checkpoints" / f"step-{saved:08d}" / "trainer_state.json").read_text())
    assert state["step"] == state["schedule"]["last_step"] == saved
    assert signal.getsignal(signal.SIGINT) is handler  # fit put it back
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, saved + 1))

    resumed = PolicyTrainer(config(out, policy_dir, algorithm), resume=True, quiet=True)
    assert resumed.step == saved and resumed.resume_changes == []
    resumed.fit()
    assert metrics(out) == reference(algorithm)


def test_sigterm_stops_like_sigint(reference, tmp_path, policy_dir):
    out = tmp_path / "run"
    trainer = PolicyTrainer(config(out, policy_dir), quiet=True)
    arm(trainer, "after_update", lambda: interrupt("signal", signal.SIGTERM))
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, AT)
    PolicyTrainer(config(out, policy_dir), resume=True, quiet=True).fit()
    assert metrics(out) == reference("grpo")


@pytest.mark.parametrize("job", ["dpo", "reward"])
def test_offline_jobs_resume_exactly_after_an_aborted_step(job, tmp_path, policy_dir):
    """DPO and the reward model (its own model class and checkpoint) through the same loop and
    reader: two signals after step AT's update roll it back; the resumed run is the whole one."""
    pairs = tmp_path / "pairs.jsonl"
    rows = tasks.preference_pairs(tasks.make_task("avoid_letter"), 24, seed=0)
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def build(name: str, resume: bool = False):
        raw = {
            "model": {"init_from": str(policy_dir)},
            "data": {"pairs": str(pairs), "val_fraction": 0.25},
            "optim": {"lr": 1e-3},
            "train": {"steps": STEPS, "batch_size": 4, "eval_every": 2},
            "out_dir": str(tmp_path / name),
        }
        if job == "dpo":
            return DPOTrainer(RLHFConfig.model_validate({**raw, "algorithm": "dpo"}), resume, quiet=True)
        return RewardModelTrainer(RewardModelConfig.model_validate(raw), resume, quiet=True)

    build("whole").fit()
    trainer = build("run")
    arm(trainer, "after_update", lambda: interrupt("abort"))
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    assert stopped.value.step == AT - 1
    resumed = build("run", resume=True)
    assert resumed.step == AT - 1
    resumed.fit()
    assert metrics(tmp_path / "run") == metrics(tmp_path / "whole")
    assert any("eval_accuracy" in r for r in metrics(tmp_path / "run"))


# A run whose process is killed (SIGKILL, nothing runs after it) while it writes its step-AT
# checkpoint: the model and optimizer files are in the staging directory, the state and the marker
# not yet.
KILLED_WHILE_SAVING = """
import os, signal, sys
from llmkit.train import checkpoint
from llmkit.cli import main

write_rest = checkpoint._write_rest

def killed(s, tmp, meta):
    if s.step == {at}:
        assert (tmp / "model" / "model.safetensors").is_file() and (tmp / "optimizer.safetensors").is_file()
        os.kill(os.getpid(), signal.SIGKILL)
    write_rest(s, tmp, meta)

checkpoint._write_rest = killed
sys.exit(main(sys.argv[1:]))
"""


def test_kill_9_while_a_checkpoint_is_written_resumes_exactly_from_the_one_before(
    reference, tmp_path, policy_dir
):
    out = tmp_path / "run"
    raw = raw_config(out, policy_dir, "grpo")
    raw["train"]["save_every"] = 1
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    script = KILLED_WHILE_SAVING.format(at=AT)
    killed = subprocess.run(
        [sys.executable, "-c", script, "rlhf", str(cfg), "--quiet"], env=env, capture_output=True, timeout=600
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-3000:]
    assert [p.name for p in checkpoints(out)] == [f"step-{AT - 1:08d}"]  # the half-written one does not count
    assert not (out / "checkpoints" / f"step-{AT:08d}").exists()
    done = subprocess.run(
        [sys.executable, "-m", "llmkit", "rlhf", str(cfg), "--quiet", "--resume"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resume: step {AT - 1} from" in done.stdout
    assert metrics(out) == reference("grpo")
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no staging left


def test_a_damaged_rlhf_checkpoint_is_refused_as_training_s_is(tmp_path, policy_dir):
    """One reader: the checkpoint's parts must describe one step, named by file and key."""
    out = tmp_path / "run"
    raw = raw_config(out, policy_dir, "grpo")
    raw["train"]["steps"] = 1
    PolicyTrainer(RLHFConfig.model_validate(raw), quiet=True).fit()
    state_file = out / "checkpoints" / "step-00000001" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert set(state) == {"step", "optimizer", "schedule", "config"}
    state_file.write_text(json.dumps({**state, "step": 3}))
    with pytest.raises(
        ResumeError, match=r"trainer_state.json: its parts are at different steps \(trainer 3, "
    ):
        PolicyTrainer(config(out, policy_dir), resume=True, quiet=True)
    state_file.write_text(json.dumps({**state, "schedule": "cosine"}))
    with pytest.raises(
        ResumeError, match=r"trainer_state.json: schedule: Input should be a valid dictionary"
    ):
        PolicyTrainer(config(out, policy_dir), resume=True, quiet=True)
