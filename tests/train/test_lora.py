"""`lora:` runs of llmkit train: step 0 is the base, only adapters train (gradients, optimizer state,
checkpoint space), the base's bytes never change, resume is exact, QLoRA over an int4 base, chat
SFT, merge-lora, and the bad-input errors."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.cli import main as cli_main
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama import lora as L
from llmkit.quant import QuantConfig, quantize_model
from llmkit.train import checkpoint
from llmkit.train.config import ConfigError, parse_config
from llmkit.train.trainer import Trainer

from .runs import MICRO, losses, raw_config

LORA = {"r": 4, "alpha": 8, "targets": "all-linear"}


def lora_run(out, lora=LORA, model=None, **train):
    raw = raw_config(out, **{"steps": 6, "save_every": 3, "eval_every": 0, **train})
    raw["optim"] = {"lr": 2e-2}
    if lora is not None:
        raw["lora"] = lora
    if model is not None:
        raw["model"] = model
    return parse_config(raw)


def base_hash(model) -> str:
    """sha256 over every base tensor (all but the adapters), by name."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if ".lora_" not in name:
            h.update(name.encode())
            h.update(np.ascontiguousarray(t.numpy()).tobytes())
    return h.hexdigest()


@pytest.mark.slow
def test_step0_is_the_base_and_only_adapters_train(tmp_path):
    full = Trainer(lora_run(tmp_path / "full", lora=None, steps=3), quiet=True)
    full.fit()
    tr = Trainer(lora_run(tmp_path / "lora", steps=6), quiet=True)
    # the frozen base is the full run's initial model, written once under out_dir/base
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "lora" / "base")
    x, y = (lf.tensor(a) for a in tr.sampler.batch(0))
    base_loss = float(saved.loss(x, y).item())
    before = base_hash(tr.model)
    adapters = L.adapter_state(tr.model)
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert {id(p) for p in tr.optimizer.params} == {id(t) for t in adapters.values()}
    tr.fit()
    got = losses(tmp_path / "lora")
    assert got[1] == losses(tmp_path / "full")[1] == base_loss  # exactly: B = 0 at step 0
    assert base_hash(tr.model) == before  # the base's bytes never change
    assert all(not p.requires_grad for n, p in tr.model.named_parameters() if ".lora_" not in n)
    ckpt = checkpoint.checkpoint_dir(tmp_path / "lora", 6)
    assert not (ckpt / "model").exists()
    assert {p.name for p in (ckpt / "adapter").iterdir()} >= {L.CONFIG_FILE, L.WEIGHTS_FILE}
    opt = lf.load(ckpt / checkpoint.OPTIMIZER)
    moments = sum(t.size for t in opt.values())
    assert moments == 2 * sum(t.size for t in adapters.values())  # AdamW's two moments, adapters only
    pointer = json.loads((ckpt / checkpoint.BASE_POINTER).read_text())
    assert pointer["path"] == str((tmp_path / "lora" / "base").resolve())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_is_exact(tmp_path, dropout):
    """Static steps; with dropout, each step's masks come from the run's checkpointed generator
    (the program's run_seed) and the resumed run's tracing draws nothing, so they repeat exactly."""
    lora = {**LORA, "dropout": dropout}
    straight = tmp_path / "straight"
    Trainer(lora_run(straight, lora, steps=6, mode="static", compiler="none"), quiet=True).fit()
    # a run stopped at step 3: its checkpoint and base, resumed to 6
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "base", cut / "base")
    shutil.copytree(checkpoint.checkpoint_dir(straight, 3), checkpoint.checkpoint_dir(cut, 3))
    resumed = Trainer(lora_run(cut, lora, steps=6, mode="static", compiler="none"), resume=True, quiet=True)
    assert resumed.step == 3
    resumed.fit()
    want, got = losses(straight), losses(cut)
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_adapter_dropout_draws_new_masks_at_every_step(tmp_path, mode):
    """The same batch at the same weights, twice: the losses differ, so each step drew its own masks
    (a static step once drew them when traced and repeated them at every step)."""
    tr = Trainer(lora_run(tmp_path, {**LORA, "dropout": 0.5}, mode=mode, compiler="none"), quiet=True)
    rng = np.random.default_rng(0)
    for m in L.lora_layers(tr.model).values():  # B = 0 would hide the adapters' input (and its masks)
        m.lora_B.set_value((0.1 * rng.standard_normal(m.lora_B.shape)).astype(np.float32))
    start = {k: t.numpy().copy() for k, t in L.adapter_state(tr.model).items()}
    batch = tr.draw(0)
    first, _ = tr.step_fn([batch])
    for k, t in L.adapter_state(tr.model).items():
        t.set_value(start[k])
    again, _ = tr.step_fn([batch])
    assert first != again


def test_resume_refuses_another_base(tmp_path):
    out = tmp_path / "run"
    Trainer(lora_run(out, steps=3), quiet=True).fit()
    other = LlamaForCausalLM.from_pretrained(out / "base")
    other.model.norm.weight.set_value(other.model.norm.weight.numpy() * 2)
    other.save_pretrained(out / "base")
    with pytest.raises(
        checkpoint.ResumeError, match="base_model.json: the adapters were trained on the base"
    ):
        Trainer(lora_run(out, steps=6), resume=True, quiet=True)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A base that has seen the corpus (30 steps of full training): LoRA adapts a trained model; a
    random one's frozen norms and head leave its logits near uniform whatever the adapters do."""
    out = tmp_path_factory.mktemp("pretrained") / "run"
    Trainer(lora_run(out, lora=None, steps=30, save_every=0), quiet=True).fit()
    return checkpoint.model_dir(out)


def test_loss_falls_on_the_builtin_corpus(tmp_path, pretrained):
    raw = raw_config(tmp_path / "run", steps=40, batch_size=8, seq_len=32, eval_every=0, save_every=0)
    raw["optim"], raw["lr_schedule"] = {"lr": 1e-2, "weight_decay": 0.0}, {"name": "constant"}
    raw["model"], raw["lora"] = (
        {"init_from": str(pretrained), "preset": None},
        {"r": 8, "targets": "all-linear"},
    )
    tr = Trainer(parse_config(raw), quiet=True)
    before = tr.evaluate()["eval_loss"]  # the base's held-out loss
    tr.fit()
    # (adapters learn slowly on a 32-wide model whose embeddings, norms and head stay frozen)
    assert tr.evaluate()["eval_loss"] < before - 0.01


@pytest.fixture
def int4_base(tmp_path):
    """An int4 (RTN, groups of 16) model of the tiny run's shape, as `llmkit quantize` writes it."""
    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=512, **MICRO))
    quantize_model(model, QuantConfig(bits=4, group_size=16, method="rtn"), progress=False)
    model.save_pretrained(tmp_path / "int4")
    return tmp_path / "int4"


@pytest.mark.parametrize("mode", ["eager", pytest.param("static", marks=pytest.mark.slow)])
def test_qlora_trains_over_an_int4_base(tmp_path, int4_base, mode):
    cfg = lora_run(tmp_path / "run", model={"init_from": str(int4_base), "preset": None}, steps=6, mode=mode)
    tr = Trainer(cfg, quiet=True)
    q = L.lora_layers(tr.model)["model.layers.0.self_attn.q_proj"].base
    assert isinstance(q, lf.nn.QuantizedLinear) and q.bits == 4
    base = LlamaForCausalLM.from_pretrained(int4_base)
    x, y = (lf.tensor(a) for a in tr.sampler.batch(0))
    base_loss = float(base.loss(x, y).item())
    before = base_hash(tr.model)
    tr.fit()
    got = losses(tmp_path / "run")
    assert got[1] == pytest.approx(base_loss, rel=1e-6 if mode == "static" else 0)
    assert got[6] < got[1]
    assert base_hash(tr.model) == before
    ckpt = checkpoint.checkpoint_dir(tmp_path / "run", 6)
    assert json.loads((ckpt / checkpoint.BASE_POINTER).read_text())["path"] == str(int4_base.resolve())


def test_chat_sft_with_adapters(tmp_path, pretrained):
    from .test_sft import chat_file

    raw = raw_config(
        tmp_path / "run", steps=60, batch_size=4, seq_len=32, eval_every=0, save_every=0, log_every=10
    )
    raw["data"] = {"sources": [str(chat_file(tmp_path, repeat=20))], "val_fraction": 0.0}
    raw["optim"] = {"lr": 1e-2}
    raw["lr_schedule"] = {"name": "constant"}
    raw["lora"] = {"r": 8, "alpha": 16, "targets": "all-linear"}
    raw["model"] = {"init_from": str(pretrained), "preset": None}
    Trainer(parse_config(raw), quiet=True).fit()
    got = losses(tmp_path / "run")
    assert got[60] < 0.9 * got[10]  # the two replies, on the assistant's tokens only


@pytest.mark.slow
def test_merge_lora_writes_a_model_that_quantize_takes(tmp_path):
    tr = Trainer(lora_run(tmp_path / "run", steps=3), quiet=True)
    tr.fit()
    tr.model.eval()
    ids = lf.tensor(tr.sampler.batch(0)[0])
    adapted = tr.model(ids).logits.numpy()
    ckpt = checkpoint.checkpoint_dir(tmp_path / "run", 3)
    assert cli_main(["checkpoint", "merge-lora", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(merged(ids).logits.numpy(), adapted, rtol=0, atol=1e-5)
    assert not L.lora_layers(merged)
    q = ["quantize", "--model", str(tmp_path / "merged"), "--bits", "8", "--method", "rtn", "--seq-len", "32"]
    assert cli_main([*q, "--out", str(tmp_path / "int8")]) == 0
    assert (tmp_path / "int8" / "config.json").is_file()


# ---- bad input ------------------------------------------------------------------------------------
def test_unknown_target_names_the_key_with_a_did_you_mean(tmp_path):
    with pytest.raises(
        ConfigError, match=r"lora.targets: unknown target module 'up_prj' \(did you mean 'up_proj'\?"
    ):
        Trainer(lora_run(tmp_path / "run", lora={"targets": ["q_proj", "up_prj"]}), quiet=True)


@pytest.mark.parametrize("r", [0, -1])
def test_rank_must_be_positive(tmp_path, r):
    with pytest.raises(ConfigError, match=rf"lora.r: expected a value > 0, got {r}"):
        lora_run(tmp_path / "run", lora={"r": r})


def test_a_quantized_format_without_a_backward_is_refused(tmp_path, int4_base):
    config = json.loads((int4_base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 16}
    (int4_base / "config.json").write_text(json.dumps(config))
    cfg = lora_run(tmp_path / "run", model={"init_from": str(int4_base), "preset": None})
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        Trainer(cfg, quiet=True)


def test_lora_in_a_run_dir_points_to_merge_lora(tmp_path):
    Trainer(lora_run(tmp_path / "run", steps=3), quiet=True).fit()
    with pytest.raises(ConfigError, match="is a LoRA run.*llmkit checkpoint merge-lora"):
        checkpoint.model_dir(tmp_path / "run")


def test_lora_tiny_yaml_adapts_the_tiny_model():
    from pathlib import Path

    from llmkit.train.config import apply_lora_section, load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "lora-tiny.yaml")
    assert cfg.lora is not None and cfg.model.init_from is not None
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=cfg.tokenizer.vocab_size))
    paths = apply_lora_section(model, cfg.lora, cfg.train.seed)
    assert len(paths) == 7 * model.config.num_hidden_layers
