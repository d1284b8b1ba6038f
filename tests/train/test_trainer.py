"""The training loop end to end on a very small Llama: loss falls, exact resume, Ctrl-C, errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from llmkit.cli import main as cli_main
from llmkit.framework.distributed.parallel_plan import ParallelPlan
from llmkit.models.llama import LlamaForCausalLM, LlamaTokenizer
from llmkit.train.checkpoint import ResumeError
from llmkit.train.config import ConfigError, parse_config
from llmkit.train.data import DataError
from llmkit.train.metrics import read_metrics
from llmkit.train.trainer import Trainer

from .runs import MICRO, config, losses, raw_config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    last = Trainer(config(out), quiet=True).fit()
    return out, last


def test_run_writes_metrics_checkpoints_config_and_sample(finished_run):
    out, _ = finished_run
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 31))
    for key in ("step", "loss", "lr", "tokens_per_s", "mfu", "grad_norm"):
        assert key in rows[0]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert evals[-1]["eval_ppl"] == pytest.approx(np.exp(evals[-1]["eval_loss"]))
    assert (out / "config.yaml").is_file() and (out / "sample.txt").read_text().startswith("The")
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == [f"step-{s:08d}" for s in (5, 10, 15, 20, 25, 30)]
    model_dir = out / "checkpoints" / "step-00000030" / "model"
    assert {p.name for p in model_dir.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    }
    plan = ParallelPlan.load(model_dir.parent)  # every checkpoint records its plan (here one rank)
    assert plan == ParallelPlan.make("llama") and plan.is_trivial


def test_a_checkpoint_is_a_complete_hf_directory(finished_run):
    """transformers reads the checkpoint's model directory (tokenizer without protobuf's help: the
    directory has a tokenizer.json) and encodes as the trainer did."""
    transformers = pytest.importorskip("transformers")
    out, _ = finished_run
    model_dir = out / "checkpoints" / "step-00000030" / "model"
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = LlamaTokenizer.from_pretrained(model_dir)
    texts = ["The quick brown fox.", "def f(x):\n    return x  # 2024", "héllo 🦙 </s> <s>", "  two  spaces"]
    assert [hf(t).input_ids for t in texts] == ours.encode_batch(texts)
    gen = transformers.GenerationConfig.from_pretrained(model_dir)
    assert (gen.bos_token_id, gen.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_a_run_with_a_byte_level_bpe_tokenizer(tmp_path):
    """tokenizer.kind: bpe trains Llama 3's kind of tokenizer on the built-in corpus; the
    checkpoint holds its tokenizer.json and no tokenizer.model."""
    raw = raw_config(tmp_path, steps=3, save_every=3, eval_every=3)
    raw["tokenizer"] = {"path": "builtin", "vocab_size": 512, "kind": "bpe"}
    Trainer(parse_config(raw), quiet=True).fit()
    model_dir = tmp_path / "checkpoints" / "step-00000003" / "model"
    assert "tokenizer.json" in os.listdir(model_dir) and "tokenizer.model" not in os.listdir(model_dir)
    tok = LlamaTokenizer.from_pretrained(model_dir)
    assert (tok.kind, tok.vocab_size, tok.bos_token) == ("bpe", 512, "<|begin_of_text|>")
    assert LlamaForCausalLM.from_pretrained(model_dir).config.vocab_size == 512


def test_loss_falls(finished_run):
    out, _ = finished_run
    ls = losses(out)
    assert np.mean([ls[s] for s in range(26, 31)]) < np.mean([ls[s] for s in range(1, 4)]) - 0.5


def test_resume_from_a_middle_checkpoint_is_exact(finished_run, tmp_path):
    out, _ = finished_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for step in (20, 25, 30):
        shutil.rmtree(resumed / "checkpoints" / f"step-{step:08d}")
    trainer = Trainer(config(resumed), resume=True, quiet=True)
    assert trainer.step == 15
    trainer.fit()
    a, b = losses(out), losses(resumed)
    assert sorted(b) == list(range(1, 31))
    assert [b[s] for s in range(16, 31)] == [a[s] for s in range(16, 31)]


def test_keep_last_prunes_old_checkpoints(tmp_path):
    Trainer(config(tmp_path / "r", steps=12, save_every=3, keep_last=2, eval_every=0), quiet=True).fit()
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == [
        "step-00000009",
        "step-00000012",
    ]


def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path):
    trainer = Trainer(config(tmp_path / "r", steps=10, save_every=0, eval_every=0), quiet=True)
    real = trainer.step_fn
    calls = []

    def interrupted(batches):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(batches)

    trainer.step_fn = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert [p.name for p in (tmp_path / "r" / "checkpoints").iterdir()] == ["step-00000003"]
    again = Trainer(config(tmp_path / "r", steps=10, save_every=0, eval_every=0), resume=True, quiet=True)
    assert again.step == 3
    again.fit()
    assert sorted(losses(tmp_path / "r")) == list(range(1, 11))


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ResumeError, match="--resume: no checkpoint"):
        Trainer(config(tmp_path / "r"), resume=True, quiet=True)


def test_seq_len_beyond_positions_is_rejected_before_anything_is_written(tmp_path):
    with pytest.raises(
        ConfigError, match=r"train.seq_len \(100\) exceeds model.max_position_embeddings \(64\)"
    ):
        Trainer(config(tmp_path / "r", seq_len=100), quiet=True)
    assert not (tmp_path / "r").exists()


def test_missing_and_empty_corpus(tmp_path):
    cfg = config(tmp_path / "r")
    with pytest.raises(DataError, match="nothing.txt"):
        Trainer(
            cfg.model_copy(
                update={"data": cfg.data.model_copy(update={"sources": [str(tmp_path / "nothing.txt")]})}
            ),
            quiet=True,
        )
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        Trainer(
            cfg.model_copy(
                update={"data": cfg.data.model_copy(update={"sources": [str(tmp_path / "empty.txt")]})}
            ),
            quiet=True,
        )
    assert not (tmp_path / "r").exists()


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {preset: tiny}\nout_dir: x\n")
    assert cli_main(["train", str(cfg), "optim.learning_rate=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key optim.learning_rate" in err and "optim.lr" in err
    assert cli_main(["train", str(cfg), "train.steps=ten"]) == 2
    assert "train.steps" in capsys.readouterr().err


def test_cli_help_and_unknown_command(capsys):
    assert cli_main(["--help"]) == 0
    assert "train" in capsys.readouterr().out
    assert cli_main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["train", "--help"])
    assert e.value.code == 0


def test_cli_train_plot_and_generate(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    raw = {
        "model": {"preset": "tiny", **MICRO},
        "tokenizer": {"path": "builtin", "vocab_size": 512},
        "lr_schedule": {"warmup_steps": 1},
        "train": {
            "steps": 4,
            "batch_size": 2,
            "seq_len": 16,
            "eval_every": 2,
            "eval_steps": 1,
            "log_every": 1,
        },
        "out_dir": str(tmp_path / "run"),
    }
    cfg.write_text(json.dumps(raw))  # JSON is YAML
    assert cli_main(["train", str(cfg), "--quiet"]) == 0
    assert "done: step 4" in capsys.readouterr().out
    assert cli_main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "loss.png" in capsys.readouterr().out
    model = tmp_path / "run" / "checkpoints" / "step-00000004" / "model"
    assert (
        cli_main(
            ["generate", "--model", str(model), "--prompt", "The", "--max-new-tokens", "5", "--seed", "1"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("The")


def test_cli_tokenizer_train(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world, the quick brown fox\n" * 50 + "jumps over the lazy dog 123\n" * 50)
    assert (
        cli_main(
            [
                "tokenizer",
                "train",
                "--input",
                str(text),
                "--vocab-size",
                "300",
                "--out",
                str(tmp_path / "tok"),
            ]
        )
        == 0
    )
    tok = LlamaTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.vocab_size == 300 and tok.decode(tok.encode("the quick fox")) == "the quick fox"
    assert tok.kind == "sentencepiece" and "300-token sentencepiece tokenizer" in capsys.readouterr().out
    args = ["tokenizer", "train", "--input", str(text), "--vocab-size", "280", "--out", str(tmp_path / "bpe")]
    assert cli_main([*args, "--kind", "bpe"]) == 0
    tok = LlamaTokenizer.from_pretrained(tmp_path / "bpe")
    assert (tok.kind, tok.vocab_size, tok.bos_token) == ("bpe", 280, "<|begin_of_text|>")
    assert tok.decode(tok.encode("the quick fox 日本")) == "the quick fox 日本"  # bytes: nothing is unknown


def test_generate_rejects_a_tokenizer_that_does_not_match_the_model(tmp_path, capsys):
    from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
    from llmkit.train.corpus import builtin_tokenizer

    LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=400, **MICRO)).save_pretrained(tmp_path / "m")
    builtin_tokenizer(512).save_pretrained(tmp_path / "m")
    assert cli_main(["generate", "--model", str(tmp_path / "m"), "--prompt", "x"]) == 2
    assert "tokenizer vocab (512) is larger than the model's (400)" in capsys.readouterr().err


def test_gpu_device_without_cupy_is_a_config_error(tmp_path, capsys):
    import llmkit.framework as lf

    if lf.backend.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match=r"train.device: device 'gpu' needs cupy"):
        Trainer(config(tmp_path / "r", device="gpu"), quiet=True)
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_run_and_its_resume_on_each_device(device, mode, tmp_path, assert_on_device):
    """The trainer's GPU twin: a short run in each mode on the device (weights, optimizer state
    and the loss all there), its checkpoint written from the device and read back onto it to
    resume; the losses finite and falling."""
    out = tmp_path / "r"
    run = dict(device=device, mode=mode, eval_every=4, save_every=4, keep_last=2)
    trainer = Trainer(config(out, steps=4, **run), quiet=True)
    trainer.fit()
    assert_on_device(*trainer.model.parameters())
    resumed = Trainer(config(out, steps=8, **run), resume=True, quiet=True)
    assert resumed.step == 4
    resumed.fit()
    assert_on_device(*resumed.model.parameters())
    ls = losses(out)
    assert sorted(ls) == list(range(1, 9)) and np.isfinite(list(ls.values())).all()
    assert np.mean([ls[s] for s in range(6, 9)]) < np.mean([ls[s] for s in range(1, 4)])
