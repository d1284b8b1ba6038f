"""Bad input to ``llmkit train``: exit code 2 and exactly one line on stderr that names what was
wrong, never a traceback. One row per input: configs, overrides, flags, data, out_dir, checkpoints.

Rows run the CLI in-process (``llmkit.cli.main``); two run it in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import llmkit.framework as lf
from llmkit.cli import main as cli_main

from .runs import raw_config


@dataclass
class Where:
    """The paths a row's arguments and setup use: ``{tmp}``, ``{cfg}`` (a valid 2-step config)
    and ``{run}`` (its out_dir, holding a finished run with one checkpoint when a row resumes)."""

    tmp: Path

    @property
    def cfg(self) -> Path:
        return self.tmp / "c.yaml"

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints" / "step-00000002"

    def file(self, name: str) -> Path:
        return self.ckpt / name

    def truncate(self, name: str) -> None:
        self.file(name).write_bytes(self.file(name).read_bytes()[:100])

    def state(self, **changes) -> None:
        """Rewrite the checkpoint's trainer_state.json with top-level keys changed."""
        path = self.ckpt / "trainer_state.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@dataclass
class Row:
    args: list[str]  # after "train"; "{tmp}", "{cfg}", "{run}" are filled in
    expect: str  # in the one stderr line
    setup: Callable[[Where], object] | None = None
    resume: bool = False  # start from a copy of the finished run


def damaged(expect: str, damage: Callable[[Where], object]) -> Row:
    """``--resume`` from a copy of the finished run whose checkpoint ``damage`` broke."""
    return Row(["{cfg}", "--resume"], expect, damage, resume=True)


def write(name: str, data: str | bytes) -> Callable[[Where], object]:
    def setup(w: Where) -> None:
        path = w.tmp / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


ROWS: dict[str, Row] = {
    # ---- the config file
    "missing config": Row(["{tmp}/nope.yaml"], "config file '{tmp}/nope.yaml' not found"),
    "config is a directory": Row(["{tmp}"], "config file '{tmp}': Is a directory"),
    "config not UTF-8": Row(
        ["{tmp}/x.yaml"], "'{tmp}/x.yaml' is not UTF-8 text (byte 7", write("x.yaml", b"model: \xff\xfe\n")
    ),
    "invalid YAML": Row(
        ["{tmp}/x.yaml"], "x.yaml: invalid YAML at line 2, column 1", write("x.yaml", "model: [\n")
    ),
    "config is a list": Row(
        ["{tmp}/x.yaml"], "expected a mapping of sections, got list", write("x.yaml", "- a\n")
    ),
    "empty config": Row(["{tmp}/x.yaml"], "model: required key is missing", write("x.yaml", "")),
    "no out_dir": Row(
        ["{tmp}/x.yaml"], "out_dir: required key is missing", write("x.yaml", "model: {preset: tiny}\n")
    ),
    "unknown section": Row(["{cfg}", "trian.steps=3"], "unknown key trian (did you mean train?)"),
    # ---- overrides
    "unknown key": Row(
        ["{cfg}", "optim.learning_rate=1"], "unknown key optim.learning_rate (did you mean optim.lr?)"
    ),
    "wrong type": Row(["{cfg}", "train.steps=ten"], "train.steps: expected an integer, got 'ten'"),
    "out of range": Row(["{cfg}", "optim.lr=-1"], "optim.lr: expected a value > 0, got -1"),
    "unknown preset": Row(["{cfg}", "model.preset=huge"], "unknown preset 'huge'"),
    "init_from missing": Row(
        ["{cfg}", "model.preset=null", "model.init_from={tmp}/none"],
        "model.init_from: cannot read {tmp}/none/config.json",
    ),
    "warmup beyond steps": Row(
        ["{cfg}", "lr_schedule.warmup_steps=9"],
        "lr_schedule.warmup_steps (9) exceeds train.steps (2): set lr_schedule.warmup_steps=2 or fewer",
    ),
    "unknown mode": Row(["{cfg}", "train.mode=jit"], "train.mode: expected 'eager' or 'static', got 'jit'"),
    "cinn needs static": Row(
        ["{cfg}", "train.compiler=cinn"], "train.compiler=cinn compiles static programs"
    ),
    "too few betas": Row(["{cfg}", "optim.betas=[0.9]"], "optim.betas: too few items"),
    "unknown plan": Row(["{cfg}", "parallel.plan=megatron"], "parallel.plan: 'megatron' is neither"),
    "zero without dp": Row(
        ["{cfg}", "parallel.zero=2"], "parallel.zero: ZeRO stage 2 shards over data-parallel"
    ),
    "override without =": Row(
        ["{cfg}", "train.steps"], "override 'train.steps' must look like section.key=value"
    ),
    "override without key": Row(["{cfg}", "=3"], "override '=3' must look like section.key=value"),
    "override not YAML": Row(["{cfg}", "optim.lr=["], "override 'optim.lr=[': '[' is not a valid YAML value"),
    "override into a value": Row(
        ["{cfg}", "out_dir.x=1"], "override 'out_dir.x=1': out_dir is not a section"
    ),
    # ---- the model against the data
    "seq_len beyond positions": Row(
        ["{cfg}", "train.seq_len=100"], "train.seq_len (100) exceeds model.max_position_embeddings (64)"
    ),
    "vocab below tokenizer": Row(
        ["{cfg}", "model.vocab_size=300"],
        "model.vocab_size (300) is smaller than the tokenizer's vocabulary (512)",
    ),
    "heads do not divide width": Row(["{cfg}", "model.hidden_size=33"], "model: "),
    "tokenizer dir missing": Row(["{cfg}", "tokenizer={{path: {tmp}/none}}"], "{tmp}/none"),
    "data file missing": Row(
        ["{cfg}", "data.sources={tmp}/none.txt"], "data source '{tmp}/none.txt' does not exist"
    ),
    "data is a directory": Row(["{cfg}", "data.sources={tmp}"], "data source '{tmp}' is a directory"),
    "data not UTF-8": Row(
        ["{cfg}", "data.sources={tmp}/bad.txt"], "{tmp}/bad.txt: not UTF-8 text", write("bad.txt", b"ok \xff")
    ),
    "data bad JSONL": Row(
        ["{cfg}", "data.sources={tmp}/d.jsonl"], "{tmp}/d.jsonl:1: invalid JSON", write("d.jsonl", "{oops\n")
    ),
    "too little data": Row(
        ["{cfg}", "data.sources={tmp}/t.txt"], "fewer than seq_len + 1 = 17", write("t.txt", "hi")
    ),
    # ---- out_dir
    "out_dir is a file": Row(
        ["{cfg}", "out_dir={tmp}/f"],
        "out_dir '{tmp}/f': '{tmp}/f' is a file, not a directory",
        write("f", "x"),
    ),
    "out_dir under a file": Row(
        ["{cfg}", "out_dir={tmp}/f/run"], "out_dir '{tmp}/f/run': '{tmp}/f' is a file", write("f", "x")
    ),
    # ---- flags
    "no config": Row(
        [], "llmkit train: the following arguments are required: config (see llmkit train --help)"
    ),
    "unknown flag": Row(["{cfg}", "--resmue"], "llmkit train: unrecognized arguments: --resmue"),
    "flag with a value": Row(["{cfg}", "--quiet=3"], "argument --quiet: ignored explicit argument '3'"),
    # ---- checkpoints
    "resume without checkpoint": Row(
        ["{cfg}", "--resume"], "--resume: no checkpoint under {run}/checkpoints"
    ),
    "trainer_state not JSON": damaged(
        "step-00000002/trainer_state.json: not valid JSON",
        lambda w: w.file("trainer_state.json").write_text("{"),
    ),
    "trainer_state missing": damaged(
        "trainer_state.json: missing (an incomplete checkpoint?)",
        lambda w: w.file("trainer_state.json").unlink(),
    ),
    "trainer_state a list": damaged(
        "trainer_state.json: Input should be a valid dictionary",
        lambda w: w.file("trainer_state.json").write_text("[]"),
    ),
    "step not a number": damaged(
        "trainer_state.json: step: Input should be a valid integer", lambda w: w.state(step="2")
    ),
    "parts at other steps": damaged(
        "its parts are at different steps (trainer 5, optimizer 2, schedule 2)", lambda w: w.state(step=5)
    ),
    "rng state broken": damaged("trainer_state.json: rng:", lambda w: w.state(rng={})),
    "optimizer file missing": damaged(
        "optimizer.safetensors", lambda w: w.file("optimizer.safetensors").unlink()
    ),
    "optimizer file truncated": damaged(
        "optimizer.safetensors: the header length", lambda w: w.truncate("optimizer.safetensors")
    ),
    "weights missing": damaged("model.safetensors", lambda w: w.file("model/model.safetensors").unlink()),
    "model config corrupt": damaged(
        "model/config.json: invalid JSON", lambda w: w.file("model/config.json").write_text("{")
    ),
    "resume changes the model": Row(
        ["{cfg}", "--resume", "model.hidden_size=64"],
        "model.hidden_size cannot change on --resume (checkpoint: 32, now: 64)",
        resume=True,
    ),
    "resume changes the tokenizer": Row(
        ["{cfg}", "tokenizer.vocab_size=600", "--resume"],
        "tokenizer.vocab_size cannot change on --resume",
        resume=True,
    ),
    "resume to fewer steps": Row(
        ["{cfg}", "--resume", "train.steps=1"], "train.steps (1) is below the step of", resume=True
    ),
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run (one checkpoint, step 2) for the rows that resume."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli_main(["train", str(write_config(out.parent, out)), "--quiet"]) == 0
    return out


def write_config(directory: Path, out_dir: Path) -> Path:
    raw = raw_config(out_dir, steps=2, save_every=0, eval_every=0, log_every=1)
    raw["lr_schedule"]["warmup_steps"] = 1
    path = directory / "c.yaml"
    path.write_text(json.dumps(raw))
    return path


def prepare(row: Row, w: Where, finished: Path | None) -> tuple[list[str], str]:
    """Set the row's files up; its arguments and expected text with the paths filled in."""
    write_config(w.tmp, w.run)
    if row.resume:
        shutil.copytree(finished, w.run)
    if row.setup is not None:
        row.setup(w)
    fill = {"tmp": w.tmp, "cfg": w.cfg, "run": w.run}
    return [a.format(**fill) for a in row.args], row.expect.format(**fill)


def run_row(row: Row, w: Where, finished: Path | None) -> tuple[int, str]:
    args, expect = prepare(row, w, finished)
    try:
        return cli_main(["train", *args]), expect
    except SystemExit as e:  # argparse exits
        return int(e.code), expect


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_is_one_line_and_exit_2(name, tmp_path, capsys, request):
    row = ROWS[name]
    finished = request.getfixturevalue("finished_run") if row.resume else None
    code, expect = run_row(row, Where(tmp_path), finished)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("llmkit train: ") and expect in lines[0], lines[0]


def test_the_table_is_long_enough():
    assert len(ROWS) >= 30


def test_a_shorter_run_of_a_shipped_config_names_the_warmup_key(capsys):
    """configs/bench.yaml warms up for 20 steps: a 10-step try of it says which key to set."""
    root = Path(__file__).resolve().parents[2]
    assert cli_main(["train", str(root / "configs" / "bench.yaml"), "train.steps=10"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "llmkit train: config error: lr_schedule.warmup_steps (20) exceeds train.steps (10): "
        "set lr_schedule.warmup_steps=10 or fewer for a run of 10 steps"
    )


@pytest.mark.skipif(lf.backend.gpu_available(), reason="a GPU is present")
def test_gpu_without_cupy(tmp_path, capsys):
    code, _ = run_row(Row(["{cfg}", "train.device=gpu"], ""), Where(tmp_path), None)
    (line,) = capsys.readouterr().err.splitlines()
    assert code == 2 and "train.device: device 'gpu' needs cupy" in line


@pytest.mark.slow
def test_vocab_larger_than_the_corpus_allows(tmp_path, capsys):
    """Sentencepiece finds out only by training (about 10 s), so this row runs apart."""
    code, _ = run_row(Row(["{cfg}", "tokenizer.vocab_size=100000"], ""), Where(tmp_path), None)
    (line,) = capsys.readouterr().err.splitlines()
    assert code == 2 and "config error: tokenizer.vocab_size: cannot train a 100000-piece tokenizer" in line


@pytest.mark.parametrize("name", ["config not UTF-8", "trainer_state not JSON"])
def test_bad_input_in_a_subprocess(name, tmp_path, finished_run):
    args, expect = prepare(ROWS[name], Where(tmp_path), finished_run)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "llmkit.cli", "train", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert expect in line and "Traceback" not in done.stderr
