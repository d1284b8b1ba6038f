"""``parallel: auto`` in ``llmkit train``: the planner's report, then the run of its choice."""

from __future__ import annotations

import yaml

from llmkit.cli import main
from llmkit.train.config import load_config

from .runs import losses, raw_config


def test_parallel_auto_plans_prints_and_runs_the_choice(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMKIT_CACHE_DIR", str(tmp_path / "cache"))  # probes land here, not in ~
    raw = raw_config(tmp_path / "run", steps=2, save_every=0, eval_every=0)
    raw["lr_schedule"]["warmup_steps"] = 1
    raw["parallel"] = "auto"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "1 ranks of" in out and "plans fit" in out and "\nchose dp1 tp1 pp1 m1:" in out
    assert "parallel: auto -> parallel={dp: 1, tp: 1, zero: 0, recompute: none}" in out
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    ran = load_config(tmp_path / "run" / "config.yaml")
    assert not ran.parallel.auto and ran.parallel.dp == 1 and ran.parallel.recompute == "none"
    assert (tmp_path / "cache" / "planner-probe.json").is_file()
