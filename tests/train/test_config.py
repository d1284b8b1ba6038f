"""The run config schema: shipped YAML files, overrides, one-line errors, dump/load, model resolution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from llmkit.models.llama.config import LlamaConfig
from llmkit.train.config import (
    ConfigError,
    ModelSection,
    dump_config,
    load_config,
    parse_config,
    resolve_model_config,
    validate_against_model,
)

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.fixture
def minimal(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: tiny\nout_dir: runs/x\n")
    return path


def test_tiny_yaml() -> None:
    cfg = load_config(CONFIGS / "tiny.yaml")
    assert cfg.model.preset == "tiny" and cfg.tokenizer.path == "builtin" and cfg.tokenizer.vocab_size == 4096
    assert cfg.data.sources == ["builtin"] and cfg.train.mode == "eager" and cfg.out_dir == "runs/tiny"
    assert cfg.optim.lr == 3e-3 and cfg.optim.betas == (0.9, 0.95) and cfg.optim.eps == 1e-8
    llama = resolve_model_config(cfg, 4096)
    validate_against_model(cfg, llama)


def test_bench_yaml_is_the_bench_shape() -> None:
    cfg = load_config(CONFIGS / "bench.yaml")
    assert (cfg.train.seq_len, cfg.train.batch_size, cfg.out_dir) == (256, 8, "runs/bench")
    llama = resolve_model_config(cfg, 4096)
    validate_against_model(cfg, llama)
    shape = (llama.vocab_size, llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers)
    assert shape == (4096, 256, 688, 4)
    assert (llama.num_attention_heads, llama.num_key_value_heads) == (8, 4)


def test_defaults(minimal: Path) -> None:
    cfg = load_config(minimal)
    assert cfg.optim.name == "adamw" and cfg.lr_schedule.name == "cosine" and cfg.parallel.dp == 1
    assert cfg.model.overrides() == {}


def test_overrides_are_yaml_values(minimal: Path) -> None:
    cfg = load_config(
        minimal,
        [
            "train.steps=10",
            "optim.lr=1e-3",  # YAML 1.2 float (PyYAML alone would give the string "1e-3")
            "optim.betas=[0.8, 0.99]",
            "parallel.recompute=full",
            "--train.seed=3",
            "data.sources=[a.txt, 'b/*.jsonl']",
            "model.hidden_size=192",
            "model.rope_scaling={rope_type: linear, factor: 2.0}",
            "optim.grad_clip=null",
            "out_dir=elsewhere",
        ],
    )
    assert cfg.train.steps == 10 and cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.8, 0.99)
    assert cfg.parallel.recompute == "full" and cfg.train.seed == 3 and cfg.optim.grad_clip is None
    assert cfg.data.sources == ["a.txt", "b/*.jsonl"] and cfg.out_dir == "elsewhere"
    assert cfg.model.overrides() == {
        "hidden_size": 192,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    assert load_config(minimal, ["data.sources=one.txt"]).data.sources == ["one.txt"]


def test_yaml_file_reads_scientific_notation_as_float(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny}\noptim: {lr: 3e-4, eps: 1E-8}\nout_dir: x\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 3e-4 and cfg.optim.eps == 1e-8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.steps=ten"], "config error: train.steps: expected an integer, got 'ten'"),
        (["train.steps=true"], "config error: train.steps: expected an integer, got True"),
        (["train.steps=0"], "config error: train.steps: expected a value > 0, got 0"),
        (["optim.lr=fast"], "config error: optim.lr: expected a number, got 'fast'"),
        (
            ["optim.learning_rate=1e-3"],
            "config error: unknown key optim.learning_rate (did you mean optim.lr?)",
        ),
        (["optimizer.lr=1e-3"], "config error: unknown key optimizer (did you mean optim?)"),
        (
            ["model.hidden_sise=64"],
            "config error: unknown key model.hidden_sise (did you mean model.hidden_size?)",
        ),
        (["train.bogus=1"], "config error: unknown key train.bogus"),
        (["optim.name=adam"], "config error: optim.name: expected 'adamw' or 'sgd', got 'adam'"),
        (["train.mode=jit"], "config error: train.mode: expected 'eager' or 'static', got 'jit'"),
        (
            ["parallel.recompute=maybe"],
            "config error: parallel.recompute: expected 'none', 'attention' or 'full', got 'maybe'",
        ),
        (
            ["train.recompute=true"],
            "config error: train.recompute moved to parallel.recompute (none | attention | full, with "
            "parallel.recompute_every: k); train.recompute: true is parallel.recompute: full",
        ),
        (
            ["parallel.auto=true", "parallel.dp=2"],
            "config error: parallel: auto picks every parallel key itself; drop dp",
        ),
        (
            ["parallel.recompute_every=0"],
            "config error: parallel.recompute_every: expected a value > 0, got 0",
        ),
        (
            ["parallel.recompute_every=3"],
            "config error: parallel.recompute_every (3) applies to a recompute policy: set "
            "parallel.recompute (attention or full) too",
        ),
        (["optim.betas=[0.9]"], "config error: optim.betas: too few items, got [0.9]"),
        (
            ["optim.betas=[0.9, 0.9, 0.9]"],
            "config error: optim.betas: expected a list of 2 items, got [0.9, 0.9, 0.9]",
        ),
        (
            ["optim.betas=[0.9, 1.5]"],
            "config error: optim.betas: each beta must be in [0, 1), got [0.9, 1.5]",
        ),
        (["data.sources=[1]"], "config error: data.sources[0]: expected a string, got 1"),
        (["data.val_fraction=1.0"], "config error: data.val_fraction: expected a value < 1, got 1.0"),
        (["parallel.zero=4"], "config error: parallel.zero: expected a value <= 3, got 4"),
        (["parallel.ppp=2"], "config error: unknown key parallel.ppp (did you mean parallel.pp?)"),
        (
            ["schedule.warmup=2"],  # an old config: any key under schedule
            "config error: schedule was renamed lr_schedule (the learning-rate schedule; "
            "parallel.schedule is the pipeline's)",
        ),
        (["parallel.zero=1"], "config error: parallel.zero: ZeRO stage 1 shards over data-parallel ranks"),
        (["parallel.sp=true"], "config error: parallel.sp: sequence parallelism shards between"),
        (["parallel.plan=megatron"], "config error: parallel.plan: 'megatron' is neither a built-in plan"),
        (
            ["parallel.plan={params: {'*': S(2)}, outputs: {'*': X}}"],
            "config error: parallel.plan: outputs: '*': bad placement 'X'",
        ),
        (
            ["parallel.dp=3"],
            "config error: train.batch_size (8) must be a multiple of parallel.dp (3)",
        ),
        (["train=5"], "config error: train: expected a mapping (a config section), got 5"),
        (
            ["model.preset=tinyy"],
            "config error: model.preset: unknown preset 'tinyy' (did you mean 'tiny'? known:",
        ),
        (["model.init_from=ckpt"], "config error: set exactly one of model.preset and model.init_from"),
        (
            ["model.num_hidden_layers=two"],
            "config error: model.num_hidden_layers: expected an integer, got 'two'",
        ),
        (["model.eos_token_id=eos"], "config error: model.eos_token_id: expected an integer, got 'eos'"),
        (
            ["tokenizer.path=tok", "tokenizer.vocab_size=1000"],
            "config error: tokenizer.vocab_size only applies",
        ),
        (["tokenizer.path=tok", "tokenizer.kind=bpe"], "config error: tokenizer.kind only applies"),
        (["tokenizer.kind=wordpiece"], "config error: tokenizer.kind"),
        (
            ["lr_schedule.warmup_steps=2000"],
            "config error: lr_schedule.warmup_steps (2000) exceeds train.steps (1000)",
        ),
        (
            ["train.compiler=cinn"],
            "config error: train.compiler=cinn compiles static programs; set train.mode=static",
        ),
        (["train.steps"], "config error: override 'train.steps' must look like section.key=value"),
        (["train..steps=1"], "config error: override 'train..steps=1' must look like section.key=value"),
        (["train.steps=[1,"], "config error: override 'train.steps=[1,': '[1,' is not a valid YAML value"),
        (["out_dir.x=1"], "config error: override 'out_dir.x=1': out_dir is not a section"),
    ],
)
def test_bad_values_give_one_clear_line(minimal: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(minimal, overrides)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config error: config file '.*nope.yaml' not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: tiny\n train: {steps: 1}\n")
    with pytest.raises(ConfigError, match=r"config error: .*bad.yaml: invalid YAML at line 3, column 2"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: expected a mapping of sections, got list"):
        load_config(bad)
    bad.write_text("")
    with pytest.raises(ConfigError, match="config error: model: required key is missing"):
        load_config(bad)
    bad.write_bytes("model: {preset: tiny}\nout_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"config file '.*bad.yaml' is not UTF-8 text \(byte 34: invalid"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"config error: config file '.*': Is a directory"):
        load_config(tmp_path)


def test_the_parallel_section_builds_the_plan(minimal: Path) -> None:
    cfg = load_config(minimal, ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=1"])
    plan = cfg.parallel.build()
    assert plan.mesh == (("dp", 2), ("tp", 2)) and plan.zero == 1 and plan.sp and plan.name == "llama"
    assert plan.describe() == "dp=2 x tp=2, zero 1, sp, plan llama"
    inline = load_config(minimal, ["parallel.tp=2", "parallel.plan={params: {'*.weight': S(0)}}"])
    assert inline.parallel.build().name is None


def test_dump_and_load_round_trip(minimal: Path, tmp_path: Path) -> None:
    cfg = load_config(minimal, ["model.hidden_size=192", "optim.betas=[0.8, 0.9]", "optim.eps=1e-10"])
    out = tmp_path / "out" / "config.yaml"
    dump_config(cfg, out)
    again = load_config(out)
    assert again == cfg and again.model.overrides() == {"hidden_size": 192}
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]
    tiny = load_config(CONFIGS / "tiny.yaml")
    assert parse_config(tiny.model_dump()) == tiny  # model_dump leaves out unset model overrides


def test_every_llama_field_is_overridable() -> None:
    names = {f.name for f in dataclasses.fields(LlamaConfig)} - {"extra"}
    assert names <= set(ModelSection.model_fields)


def test_validate_against_model(minimal: Path) -> None:
    cfg = load_config(minimal, ["train.seq_len=600"])
    llama = resolve_model_config(cfg, 4096)
    with pytest.raises(ConfigError) as info:
        validate_against_model(cfg, llama)
    assert str(info.value) == "config error: train.seq_len (600) exceeds model.max_position_embeddings (512)"


def test_resolve_model_config_from_preset(minimal: Path) -> None:
    cfg = load_config(minimal, ["model.hidden_size=192"])
    llama = resolve_model_config(cfg, 1000)
    assert llama.vocab_size == 1000 and llama.hidden_size == 192 and llama.head_dim == 48
    pinned = load_config(minimal, ["model.vocab_size=512"])
    with pytest.raises(
        ConfigError, match=r"model.vocab_size \(512\) is smaller than the tokenizer's vocabulary \(1000\)"
    ):
        resolve_model_config(pinned, 1000)
    bad = load_config(minimal, ["model.hidden_size=130"])
    with pytest.raises(
        ConfigError, match=r"config error: model: LlamaConfig: num_attention_heads \(4\) must divide"
    ):
        resolve_model_config(bad, 1000)


def test_resolve_model_config_from_checkpoint(minimal: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    hf = {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "max_position_embeddings": 1024,
    }
    (ckpt / "config.json").write_text(json.dumps(hf))
    cfg = load_config(
        minimal, ["model.preset=null", f"model.init_from={ckpt}", "model.max_position_embeddings=2048"]
    )
    llama = resolve_model_config(cfg, 32000)
    assert (llama.hidden_size, llama.num_hidden_layers, llama.max_position_embeddings) == (256, 2, 2048)
    missing = load_config(minimal, ["model.preset=null", f"model.init_from={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=r"model.init_from: cannot read .*none/config.json"):
        resolve_model_config(missing, 32000)
