"""Data-parallel RLHF (``parallel.dp``): two ranks against one process over the same global batch.

Every job (GRPO, PPO, DPO, the reward model) run with ``parallel.dp=2`` in one process (the sim
backend, one thread per rank) gives the one-process run's metrics at every step and its final
weights; GRPO also over MPI (``llmkit rlhf --nproc 2``, the launcher of ``llmkit train``), and from
a dp=2 checkpoint resumed on one process. ``logprob_diff_max`` is the maximum over the ranks, so
its being 0 at every step says every rank's rollouts were scored bit for bit.

Tolerance. A rank's gradient is its rows' share of the one-process gradient, and the compiled step
adds the two shares: one more float32 addition than the one-process matmul over all rows, so the
gradients differ by roundings of about 2^-24 of their largest terms (the whole batch's statistics,
in float64, likewise). SGD at lr 0.1 carries that into the weights (1.2e-7 measured after three
steps; 1e-6 allowed), and from there into the next steps' metrics (3e-7 relative measured; 1e-5
allowed; absolute 1e-8 for metrics that are sums near zero, as GRPO's first loss, ~1e-16). SGD, not
AdamW: Adam's first steps divide a gradient by its own magnitude, so a rounding in a near-zero
element moves that weight by up to lr (5e-4 measured at lr 1e-2): that would say nothing of the
data-parallel sums, and would hide a wrong one (a doubled gradient leaves Adam's first step as is).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import llmkit.framework as lf
import llmkit.framework.distributed as dist
from llmkit.cli import main as cli_main
from llmkit.rlhf.config import load_rlhf_config
from llmkit.rlhf.data import load_prompts, step_rows
from llmkit.rlhf.data_parallel import DataParallel
from llmkit.rlhf.run import TIMINGS
from llmkit.rlhf.tasks import make_task, preference_pairs
from llmkit.train.config import ConfigError
from llmkit.train.metrics import read_metrics

STEPS, PROMPTS, N = 3, 4, 4
REL, ABS, WEIGHTS = 1e-5, 1e-8, 1e-6  # see the module docstring
AVOID_E = make_task("avoid_letter", {"letter": "e"})
SEEN: list[tuple[int, list[str]]] = []  # (rank, prompts) of every reward call


def recording_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """The avoid_letter task's reward, noting which rank scored which prompts."""
    SEEN.append((dist.get_rank(), list(prompts)))
    return AVOID_E(prompts, completions)


def write(path: Path, raw: dict) -> Path:
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def policy_config(tmp: Path, policy_dir: Path, name: str, algorithm: str, **rlhf) -> Path:
    raw = {
        "algorithm": algorithm,
        "model": {"init_from": str(policy_dir)},
        "reward": {"task": "avoid_letter", "task_args": {"letter": "e"}},
        "rollout": {"prompts_per_step": PROMPTS, "n": N, "max_tokens": 8},
        "rlhf": {"kl_coef": 0.05, **rlhf},
        "optim": {"name": "sgd", "lr": 0.1},
        "train": {"steps": STEPS},
        "out_dir": str(tmp / name),
    }
    return write(tmp / f"{name}.yaml", raw)


def pairs_file(tmp: Path) -> Path:
    rows = preference_pairs(AVOID_E, 40, seed=0)
    path = tmp / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_config(tmp: Path, policy_dir: Path, name: str, reward_model: bool) -> Path:
    raw = {
        "model": {"init_from": str(policy_dir)},
        "data": {"pairs": str(pairs_file(tmp)), "val_fraction": 0.25},
        "optim": {"name": "sgd", "lr": 0.1},
        "train": {"steps": STEPS, "batch_size": 6, "max_length": 48, "eval_every": 2},
        "out_dir": str(tmp / name),
    }
    if not reward_model:
        raw["algorithm"] = "dpo"
    return write(tmp / f"{name}.yaml", raw)


def run(*args: str) -> None:
    assert cli_main([*args, "--quiet"]) == 0


def final_weights(out: Path) -> dict[str, np.ndarray]:
    return lf.load(out / "checkpoints" / f"step-{STEPS:08d}" / "model" / "model.safetensors")


def assert_same_run(got: Path, want: Path) -> None:
    """Every step's metrics (the wall-clock ones apart) and the final weights agree."""
    a, b = read_metrics(got / "metrics.jsonl"), read_metrics(want / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y)
        for k in x:
            if k not in TIMINGS:
                assert x[k] == pytest.approx(y[k], rel=REL, abs=ABS), (x["step"], k, x[k], y[k])
        if "logprob_diff_max" in x:
            assert x["logprob_diff_max"] == 0.0 == y["logprob_diff_max"]
    wa, wb = final_weights(got), final_weights(want)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=WEIGHTS, err_msg=k)


# ---- the split and the config ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ranks_take_contiguous_equal_shares_in_rank_order(size):
    shares = [DataParallel(r, size).rows(12) for r in range(size)]
    assert [i for s in shares for i in range(12)[s]] == list(range(12))
    assert {s.stop - s.start for s in shares} == {12 // size}


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel.dp=3", "rollout.prompts_per_step (4) must be a multiple of parallel.dp (3)"),
        ("parallel.tp=2", "parallel.tp: llmkit rlhf runs data parallel only"),
        ("parallel.dp=2 parallel.zero=1", "parallel.zero: llmkit rlhf runs data parallel only"),
        ("parallel.plan=llama", "parallel.plan: llmkit rlhf runs data parallel only"),
    ],
)
def test_what_data_parallel_rlhf_refuses(tmp_path, policy_dir, override, message):
    cfg = policy_config(tmp_path, policy_dir, "run", "grpo")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_rlhf_config(cfg, override.split())


def test_dpo_pairs_per_step_must_split_evenly(tmp_path, policy_dir):
    cfg = pair_config(tmp_path, policy_dir, "run", reward_model=False)
    with pytest.raises(ConfigError, match=r"train.batch_size \(6\) must be a multiple of parallel.dp \(4\)"):
        load_rlhf_config(cfg, ["parallel.dp=4"])


def test_a_rank_outside_a_launched_run_is_refused(tmp_path, policy_dir):
    from llmkit.rlhf.trainer import PolicyTrainer

    cfg = load_rlhf_config(policy_config(tmp_path, policy_dir, "run", "grpo"), ["parallel.dp=2"])
    with pytest.raises(RuntimeError, match="runs each rank on a thread"):
        PolicyTrainer(cfg, quiet=True)


def test_nproc_runs_llmkit_rlhf_under_mpiexec(tmp_path, policy_dir, capsys, monkeypatch):
    """``--nproc`` takes llmkit train's launcher (its mpiexec command line and checks), for each job."""
    cfg = policy_config(tmp_path, policy_dir, "run", "grpo")
    assert cli_main(["rlhf", str(cfg), "parallel.dp=2", "--nproc", "3"]) == 2
    assert "parallel.dp (2) ranks, but --nproc is 3" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        cli_main(["rlhf", str(cfg), "--hostfile", "hosts"])
    monkeypatch.setattr("shutil.which", lambda name: f"/bin/{name}")
    ran = []
    monkeypatch.setattr("llmkit.rlhf.cli.relaunch", lambda cmd, env: ran.append(cmd) or 0)
    pairs = pair_config(tmp_path, policy_dir, "pairs", reward_model=True)
    for command, config in ((["rlhf"], cfg), (["rlhf", "reward"], pairs)):
        assert cli_main([*command, str(config), "parallel.dp=2", "--nproc", "2", "--quiet"]) == 0
        tail = ["-n", "2", sys.executable, "-m", "llmkit", *command, str(config), "parallel.dp=2", "--quiet"]
        assert ran[-1][ran[-1].index("-n") :] == tail


# ---- whole runs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpo_single(tmp_path_factory, policy_dir) -> Path:
    tmp = tmp_path_factory.mktemp("grpo")
    run("rlhf", str(policy_config(tmp, policy_dir, "single", "grpo", minibatches=2)))
    return tmp / "single"


@pytest.mark.slow
def test_grpo_on_two_ranks_is_the_one_process_run(grpo_single, tmp_path, policy_dir):
    """Also: each rank rolled out whole prompts (a prompt's n samples together, its group), rank 0
    the first half of the step's, rank 1 the second. Two minibatches cut across the ranks' rows."""
    cfg = policy_config(tmp_path, policy_dir, "dp2", "grpo", minibatches=2)
    SEEN.clear()
    run("rlhf", str(cfg), "parallel.dp=2", f"reward.function={__name__}:recording_reward", "reward.task=null",
        "reward.task_args={}")  # fmt: skip
    assert_same_run(tmp_path / "dp2", grpo_single)
    prompts = load_prompts(None, 0)
    for step in range(STEPS):
        rows = [r["prompt"] for r in step_rows(prompts, PROMPTS, 0, step) for _ in range(N)]
        seen = dict(SEEN[2 * step : 2 * step + 2])
        assert seen == {0: rows[: len(rows) // 2], 1: rows[len(rows) // 2 :]}, step


@pytest.mark.slow
def test_ppo_on_two_ranks_is_the_one_process_run(tmp_path, policy_dir):
    """PPO whitens its advantages with the whole batch's mean and deviation, and trains a value head."""
    cfg = policy_config(tmp_path, policy_dir, "single", "ppo")
    run("rlhf", str(cfg))
    run("rlhf", str(cfg), "parallel.dp=2", f"out_dir={tmp_path / 'dp2'}")
    assert_same_run(tmp_path / "dp2", tmp_path / "single")
    value_head = "checkpoints/step-00000003/value_head.safetensors"
    a, b = lf.load(tmp_path / "dp2" / value_head), lf.load(tmp_path / "single" / value_head)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=WEIGHTS)


@pytest.mark.slow
@pytest.mark.parametrize("job", ["dpo", "reward"])
def test_pair_jobs_on_two_ranks_are_the_one_process_run(tmp_path, policy_dir, job):
    """DPO and the reward model: each rank takes 3 of a step's 6 pairs; the reference's log-probs
    and the held-out evaluation (10 pairs) are scored in shares and gathered."""
    cfg = pair_config(tmp_path, policy_dir, "single", reward_model=job == "reward")
    command = ["rlhf", "reward"] if job == "reward" else ["rlhf"]
    run(*command, str(cfg))
    run(*command, str(cfg), "parallel.dp=2", f"out_dir={tmp_path / 'dp2'}")
    assert_same_run(tmp_path / "dp2", tmp_path / "single")


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_process(grpo_single, tmp_path, policy_dir, capsys):
    cfg = policy_config(tmp_path, policy_dir, "run", "grpo", minibatches=2)
    run("rlhf", str(cfg), "parallel.dp=2", "train.steps=2")
    run("rlhf", str(cfg), "--resume")
    out = capsys.readouterr().out
    assert "resume: step 2 from" in out and "parallel.dp 2 -> 1" in out and "train.steps 2 -> 3" in out
    assert_same_run(tmp_path / "run", grpo_single)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the dist extra's openmpi)")
def test_grpo_over_mpi_is_the_one_process_run(grpo_single, tmp_path, policy_dir):
    from train.test_parallel_mpi import llmkit, ok  # the MPI tests' launcher (subprocess, timeout)

    cfg = policy_config(tmp_path, policy_dir, "mpi", "grpo", minibatches=2)
    stdout = ok(llmkit("rlhf", str(cfg), "parallel.dp=2", "--nproc", "2", "--quiet", timeout=300))
    assert stdout.count("done: step 3") == 1  # rank 0 alone prints, logs and writes
    assert_same_run(tmp_path / "mpi", grpo_single)
