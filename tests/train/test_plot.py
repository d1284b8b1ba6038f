"""``llmkit plot``: a training run's loss, an RLHF run's reward and KL, a quantized model's report,
and several runs in one figure; what cannot be plotted is a one-line error naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmkit.cli import main as cli_main
from llmkit.train.plot import run_panels

PNG = b"\x89PNG\r\n\x1a\n"
REPORT = {  # the fields of quant_report.json that llmkit quantize writes (docs/quantize.md)
    "quantization_config": {
        "quant_method": "llmkit",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "method": "gptq",
    },
    "eval": {"data": "the built-in corpus' held-out split", "tokens": 19584, "seq_len": 128},
    "perplexity": {"float": 93.38, "quant": 93.45},
    "kl": 0.00165,
    "top1": 0.9657,
    "bytes": {
        "layers_float": 2899968,
        "layers_quant": 385792,
        "model_float": 7098880,
        "model_quant": 4584704,
    },
}


def write_run(d: Path, rows: list[dict]) -> Path:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    train = write_run(
        tmp_path / "tiny",
        [{"step": s, "loss": 8.0 - s / 10} for s in range(1, 21)] + [{"step": 20, "eval_loss": 6.5}],
    )
    rlhf = write_run(
        tmp_path / "rlhf-tiny",
        [{"step": s, "reward_mean": 0.4 + s / 50, "kl": s / 100, "loss": 0.1} for s in range(1, 11)],
    )
    quant = tmp_path / "rlhf-tiny-int4"
    quant.mkdir()
    (quant / "quant_report.json").write_text(json.dumps(REPORT))
    return {"train": train, "rlhf": rlhf, "quant": quant}


def test_each_job_gets_its_panels(runs):
    assert [p.name for p in run_panels(runs["train"])] == ["loss"]
    assert [p.name for p in run_panels(runs["rlhf"])] == ["reward", "kl"]  # RLHF: reward and KL only
    ppl, size = run_panels(runs["quant"])
    assert (ppl.name, ppl.kind, size.name) == ("perplexity", "bars", "weights")
    categories, series = ppl.data
    assert [(label, values) for label, values, _ in series] == [
        ("float32", [93.38]),
        ("int4 g128 gptq", [93.45]),
    ]
    assert series[1][2] == ["93.450 (+0.07%)"]
    assert "19,584 held-out tokens" in ppl.title and "top-1 agreement 96.6%" in ppl.title
    categories, series = size.data
    assert categories == ["quantized linears", "whole model"]
    assert [values for _, values, _ in series] == [[2.899968, 7.09888], [0.385792, 4.584704]]


def test_one_run_writes_its_first_panel_and_several_runs_one_figure(runs, tmp_path, capsys):
    for job, name in (("train", "loss"), ("rlhf", "reward"), ("quant", "perplexity")):
        assert cli_main(["plot", str(runs[job])]) == 0
        assert (runs[job] / f"{name}.png").read_bytes()[:8] == PNG
        assert f"{name}.png" in capsys.readouterr().out
    assert cli_main(["plot", *map(str, runs.values())]) == 0
    assert (tmp_path / "pipeline.png").read_bytes()[:8] == PNG
    assert cli_main(["plot", str(runs["train"]), str(runs["quant"]), "--out", str(tmp_path / "two.png")]) == 0
    assert (tmp_path / "two.png").read_bytes()[:8] == PNG


def test_what_cannot_be_plotted_is_a_one_line_error(runs, tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl or quant_report.json" in capsys.readouterr().err
    report = runs["quant"] / "quant_report.json"
    report.write_text(json.dumps({**REPORT, "perplexity": {"float": 93.4}}))
    assert cli_main(["plot", str(runs["quant"])]) == 2
    err = capsys.readouterr().err
    assert f"{report}: not a quantization report (KeyError" in err and len(err.strip().splitlines()) == 1
    (runs["train"] / "metrics.jsonl").write_text(json.dumps({"step": 1, "lr": 0.1}) + "\n")
    assert cli_main(["plot", str(runs["train"])]) == 2
    assert "has no values to plot" in capsys.readouterr().err
