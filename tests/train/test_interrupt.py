"""SIGINT / SIGTERM at any point of a step, then ``--resume``: the run continues exactly.

A hook fires inside step AT, before the forward, inside the backward or inside the optimizer
update, in eager and in static mode, and either sends one signal (the step finishes, its checkpoint
is saved), sends two (the step is aborted and rolled back, the previous step's checkpoint is
saved) or raises KeyboardInterrupt itself (the same rollback, without a handler in between). The
resumed run's losses must equal an uninterrupted run's bit for bit: both run the same kernels on
the same numbers in the same order, and numpy is deterministic within a process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import llmkit.framework.autograd as autograd
from llmkit.train.config import parse_config
from llmkit.train.trainer import Interrupted, Trainer

from .runs import config, losses, raw_config

STEPS, AT = 6, 3  # a signal lands inside step AT of a STEPS-step run
MODES = {"eager": {}, "static": {"mode": "static", "compiler": "none"}}


def run_config(out, mode, **train):
    return config(out, **{"steps": STEPS, "save_every": 0, "eval_every": 0, **MODES[mode], **train})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the uninterrupted run, by mode (each trained once, on first use)."""
    found: dict[str, dict[int, float]] = {}

    def get(mode: str) -> dict[int, float]:
        if mode not in found:
            out = tmp_path_factory.mktemp(f"reference-{mode}")
            Trainer(run_config(out, mode), quiet=True).fit()
            found[mode] = losses(out)
        return found[mode]

    return get


def interrupt(action: str, sig: int = signal.SIGINT) -> None:
    """What a hook does: one signal, two signals (the second one aborts), or raise."""
    if action == "raise":
        raise KeyboardInterrupt
    for _ in range({"signal": 1, "abort": 2}[action]):
        os.kill(os.getpid(), sig)


def arm(trainer: Trainer, mode: str, point: str, fire, monkeypatch) -> None:
    """Call ``fire()`` once, at ``point`` of step AT."""
    fired = []

    def once():
        if trainer.step == AT - 1 and not fired:
            fired.append(1)
            fire()

    if mode == "eager":
        if point == "before_forward":
            trainer.model.model.register_forward_pre_hook(lambda layer, args: once())  # the decoder
        elif point == "in_backward":
            sum_to = autograd.sum_to  # called for every gradient the backward walk propagates

            def hooked_sum_to(g, shape):
                once()
                return sum_to(g, shape)

            monkeypatch.setattr(autograd, "sum_to", hooked_sum_to)
        else:  # in_optimizer: after some parameters of the update have their new values
            update, calls = trainer.optimizer.update, []

            def hooked_update(*args, **kwargs):
                if trainer.step == AT - 1:
                    calls.append(1)
                    if len(calls) == 4:
                        once()
                return update(*args, **kwargs)

            trainer.optimizer.update = hooked_update
        return
    # static: the program is traced in step 1; hook one step of its plan afterwards
    step_fn = trainer.step_fn

    def arming_step_fn(batches):
        out = step_fn(batches)
        program = next(iter(trainer.static_step._cache.values()))
        names = [s.name for s in program.executor.steps]
        at = {
            "before_forward": 0,
            "in_backward": max(i for i, n in enumerate(names) if "matmul" in n),  # the last matmul
            "in_optimizer": len(names) - 1,  # the update's last op
        }[point]
        step = program.executor.steps[at]
        fn = step.fn

        def hooked(*args, **kwargs):
            once()
            return fn(*args, **kwargs)

        step.fn = hooked
        trainer.step_fn = step_fn
        return out

    trainer.step_fn = arming_step_fn


@pytest.mark.parametrize("action", ["signal", "abort", "raise"])
@pytest.mark.parametrize("point", ["before_forward", "in_backward", "in_optimizer"])
@pytest.mark.parametrize("mode", list(MODES))
def test_interrupt_anywhere_in_a_step_resumes_exactly(mode, point, action, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(run_config(out, mode), quiet=True)
    arm(trainer, mode, point, lambda: interrupt(action), monkeypatch)
    handler = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN under a shell's background job
    with pytest.raises(KeyboardInterrupt) as stopped:
        trainer.fit()
    monkeypatch.undo()
    saved = AT if action == "signal" else AT - 1  # the step in flight finished, or was rolled back
    assert isinstance(stopped.value, Interrupted) and stopped.value.step == saved
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{saved:08d}"]
    state = json.loads((out / "checkpoints" / f"step-{saved:08d}" / "trainer_state.json").read_text())
    assert state["sampler"]["step"] == state["optimizer"]["step"] == state["schedule"]["last_step"] == saved
    assert signal.getsignal(signal.SIGINT) is handler  # fit put it back

    resumed = Trainer(run_config(out, mode), resume=True, quiet=True)
    assert resumed.step == saved
    resumed.fit()
    assert losses(out) == reference(mode)


@pytest.mark.parametrize("action", ["signal", "abort"])
def test_interrupt_while_the_static_step_is_traced(action, reference, tmp_path):
    """Step 1 of a static run traces (and compiles) the program: a signal there lets it finish; a
    second one aborts the trace, and the run resumes from step 0."""
    out = tmp_path / "run"
    trainer = Trainer(run_config(out, "static"), quiet=True)
    fired = []

    def during_trace(layer, args):
        if not fired:
            fired.append(1)
            interrupt(action)

    trainer.model.model.register_forward_pre_hook(during_trace)
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    assert stopped.value.step == (1 if action == "signal" else 0)
    Trainer(run_config(out, "static"), resume=True, quiet=True).fit()
    assert losses(out) == reference("static")


def test_two_signals_during_an_evaluation_keep_the_finished_step(reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(run_config(out, "eager", eval_every=AT), quiet=True)
    evaluate = trainer.evaluate

    def interrupted_evaluate():
        interrupt("abort")
        return evaluate()

    monkeypatch.setattr(trainer, "evaluate", interrupted_evaluate)
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    assert stopped.value.step == AT and sorted(losses(out)) == list(range(1, AT + 1))
    Trainer(run_config(out, "eager", eval_every=AT), resume=True, quiet=True).fit()
    assert losses(out) == reference("eager")


def test_sigterm_stops_like_sigint(reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(run_config(out, "eager"), quiet=True)
    arm(trainer, "eager", "in_backward", lambda: interrupt("signal", signal.SIGTERM), monkeypatch)
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    assert (stopped.value.signum, stopped.value.step) == (signal.SIGTERM, AT)
    Trainer(run_config(out, "eager"), resume=True, quiet=True).fit()
    assert losses(out) == reference("eager")


def test_a_signal_during_a_periodic_save_stops_after_it(tmp_path, monkeypatch):
    trainer = Trainer(config(tmp_path / "r", steps=STEPS, save_every=2, eval_every=0), quiet=True)
    save = trainer.save_checkpoint

    def save_then_signal():
        path = save()
        os.kill(os.getpid(), signal.SIGINT)
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_signal)
    with pytest.raises(Interrupted) as stopped:
        trainer.fit()
    assert stopped.value.step == 2
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-00000002"]


@pytest.mark.slow
def test_sigterm_to_the_cli_saves_and_exits_143_then_resume_is_exact(reference, tmp_path):
    """A real process and a real signal: `llmkit train` gets SIGTERM mid-run."""
    out = tmp_path / "run"
    raw = raw_config(out, steps=200, save_every=0, eval_every=0, log_every=1)
    raw["lr_schedule"] = {"name": "constant", "warmup_steps": 3}  # the same lr whatever train.steps says
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmkit.cli", "train", str(cfg), "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    (line,) = stderr.strip().splitlines()
    assert "stopped by SIGTERM at step" in line and "--resume" in line
    (ckpt,) = (out / "checkpoints").iterdir()
    stopped_at = int(ckpt.name.removeprefix("step-"))
    assert stopped_at < 200 and sorted(losses(out)) == list(range(1, stopped_at + 1))

    def shorter(out_dir):
        return parse_config(
            {**raw, "train": {**raw["train"], "steps": stopped_at + 3}, "out_dir": str(out_dir)}
        )

    Trainer(shorter(tmp_path / "uninterrupted"), quiet=True).fit()
    Trainer(shorter(out), resume=True, quiet=True).fit()
    assert losses(out) == losses(tmp_path / "uninterrupted")
