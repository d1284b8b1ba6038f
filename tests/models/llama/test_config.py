"""LlamaConfig against independent references: HF config.json files written out literally, Meta's
reference RoPE scaling loop, published parameter counts, and HF state-dict shapes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from llmkit.models.llama.config import PRESETS, LlamaConfig, atomic_write

# meta-llama/Llama-2-7b-hf/config.json, verbatim.
LLAMA2_7B_JSON = """
{
  "_name_or_path": "meta-llama/Llama-2-7b-hf",
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 11008,
  "max_position_embeddings": 4096,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 32,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}
"""

# meta-llama/Llama-3.2-1B/config.json, verbatim: tied embeddings, explicit head_dim, llama3 RoPE.
LLAMA32_1B_JSON = """
{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}
"""

# The same model as transformers v5 writes it: `rope_parameters` and `dtype`.
LLAMA32_1B_V5_JSON = """
{
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0"
}
"""


def hf_state_dict_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of transformers' LlamaForCausalLM, listed one by one."""
    h, i, q = c.hidden_size, c.intermediate_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)}
            shapes |= {p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if c.mlp_bias:
            shapes |= {
                p + "mlp.gate_proj.bias": (i,),
                p + "mlp.up_proj.bias": (i,),
                p + "mlp.down_proj.bias": (h,),
            }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def meta_llama3_scaling(
    freqs: list[float], factor: float, low: float, high: float, old_ctx: int
) -> list[float]:
    """Meta's reference `apply_scaling` (llama-models, Llama 3.1), a per-frequency loop."""
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def plain_inv_freq(theta: float, dim: int) -> np.ndarray:
    return np.array([math.exp(-(2 * k / dim) * math.log(theta)) for k in range(dim // 2)])


# ---- HF config.json ---------------------------------------------------------------------------


def test_llama2_7b_config_json_matches_preset() -> None:
    cfg = LlamaConfig.from_dict(json.loads(LLAMA2_7B_JSON))
    preset = LlamaConfig.from_preset("7B")
    assert {k: v for k, v in vars(cfg).items() if k != "extra"} == {
        k: v for k, v in vars(preset).items() if k != "extra"
    }
    assert cfg.head_dim == 128 and cfg.num_key_value_heads == 32
    assert cfg.extra == {
        "_name_or_path": "meta-llama/Llama-2-7b-hf",
        "pretraining_tp": 1,
        "transformers_version": "4.31.0.dev0",
        "use_cache": True,
    }


def test_config_json_round_trip_keeps_unknown_keys(tmp_path: Path) -> None:
    cfg = LlamaConfig.from_dict(json.loads(LLAMA32_1B_JSON))
    path = tmp_path / "config.json"
    cfg.to_json_file(path)
    written = json.loads(path.read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["model_type"] == "llama"
    # Every key of the original file comes back with its value.
    assert {k: written[k] for k in json.loads(LLAMA32_1B_JSON)} == json.loads(LLAMA32_1B_JSON)
    assert LlamaConfig.from_json_file(path) == cfg


def test_rope_parameters_spelling_equals_classic_spelling() -> None:
    classic = LlamaConfig.from_dict(json.loads(LLAMA32_1B_JSON))
    v5 = LlamaConfig.from_dict(json.loads(LLAMA32_1B_V5_JSON))
    assert v5.rope_theta == 500000.0 and v5.torch_dtype == "bfloat16"
    assert v5.rope_scaling == classic.rope_scaling
    np.testing.assert_array_equal(v5.rope_inv_freq(), classic.rope_inv_freq())
    default = LlamaConfig.from_dict({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert default.rope_theta == 1e6 and default.rope_scaling is None
    assert "rope_parameters" not in default.to_dict() and "dtype" not in v5.to_dict()


def test_old_type_key_is_accepted() -> None:
    cfg = LlamaConfig.from_dict({"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_missing_fields_take_hf_defaults() -> None:
    cfg = LlamaConfig.from_dict({"model_type": "llama"})
    assert (cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, cfg.rope_theta) == (32000, 4096, 1e-6, 10000.0)
    assert cfg.num_key_value_heads == 32 and cfg.head_dim == 128 and cfg.torch_dtype == "float32"


# ---- parameter counts and FLOPs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "published"),
    [("7B", 6_738_415_616), ("llama3-8B", 8_030_261_248), ("llama3.1-8B", 8_030_261_248)],
)
def test_num_parameters_matches_published_counts(name: str, published: int) -> None:
    assert LlamaConfig.from_preset(name).num_parameters() == published


def test_num_parameters_of_tied_model() -> None:
    assert LlamaConfig.from_dict(json.loads(LLAMA32_1B_JSON)).num_parameters() == 1_235_814_400


@pytest.mark.parametrize(
    "cfg",
    [
        *(LlamaConfig.from_preset(name) for name in ("tiny", "bench", "small")),
        LlamaConfig.from_preset("tiny", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        LlamaConfig.from_preset("tiny", head_dim=48),
    ],
    ids=["tiny", "bench", "small", "biases+tied", "head_dim"],
)
def test_num_parameters_matches_state_dict_shapes(cfg: LlamaConfig) -> None:
    assert cfg.num_parameters() == sum(math.prod(s) for s in hf_state_dict_shapes(cfg).values())


def test_flops_per_token_palm_formula() -> None:
    cfg = LlamaConfig.from_preset("tiny")
    shapes = hf_state_dict_shapes(cfg)
    matmul_params = sum(math.prod(s) for k, s in shapes.items() if k != "model.embed_tokens.weight")
    assert cfg.flops_per_token(256) == 6 * matmul_params + 12 * 4 * 4 * 32 * 256
    tied = LlamaConfig.from_preset("tiny", tie_word_embeddings=True)
    assert tied.flops_per_token(256) == 6 * tied.num_parameters() + 12 * 4 * 4 * 32 * 256


def test_presets() -> None:
    bench = LlamaConfig.from_preset("bench")
    assert (bench.vocab_size, bench.hidden_size, bench.intermediate_size) == (4096, 256, 688)
    assert (bench.num_hidden_layers, bench.num_attention_heads, bench.num_key_value_heads) == (4, 8, 4)
    assert bench.max_position_embeddings == 1024
    tiny = LlamaConfig.from_preset("tiny", vocab_size=1000)
    assert tiny.vocab_size == 1000 and tiny.max_position_embeddings == 512 and tiny.intermediate_size % 8 == 0
    assert 30e6 <= LlamaConfig.from_preset("small").num_parameters() <= 60e6
    # Overriding the width re-derives head_dim (presets are kwargs, not resolved configs).
    assert LlamaConfig.from_preset("tiny", hidden_size=192).head_dim == 48
    assert set(PRESETS) >= {"tiny", "bench", "small", "7B", "llama3-8B"}


# ---- RoPE ---------------------------------------------------------------------------------------


def test_rope_inv_freq_default() -> None:
    cfg = LlamaConfig.from_preset("7B")
    inv = cfg.rope_inv_freq()
    assert inv.dtype == np.float64 and inv.shape == (64,)
    np.testing.assert_allclose(inv, plain_inv_freq(10000.0, 128), rtol=1e-13)
    np.testing.assert_allclose(LlamaConfig(hidden_size=8, num_attention_heads=2).rope_inv_freq(), [1.0, 0.01])


def test_rope_inv_freq_linear() -> None:
    cfg = LlamaConfig.from_preset("tiny", rope_scaling={"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(cfg.rope_inv_freq(), plain_inv_freq(10000.0, 32) / 4.0, rtol=1e-13)


@pytest.mark.parametrize("source", ["llama3.1-8B", "llama3.2-1B"])
def test_rope_inv_freq_llama3_matches_meta_reference(source: str) -> None:
    if source == "llama3.2-1B":
        cfg = LlamaConfig.from_dict(json.loads(LLAMA32_1B_JSON))
    else:
        cfg = LlamaConfig.from_preset(source)
    s = cfg.rope_scaling
    base = plain_inv_freq(500000.0, cfg.head_dim)
    ref = meta_llama3_scaling(
        list(base),
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["original_max_position_embeddings"],
    )
    np.testing.assert_allclose(cfg.rope_inv_freq(), ref, rtol=1e-12)
    # All three regions occur, so the test covers each branch.
    wavelen = 2 * np.pi / base
    assert (
        (wavelen < 8192 / 4).any() and (wavelen > 8192).any() and ((wavelen > 2048) & (wavelen < 8192)).any()
    )


# ---- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(hidden_size=130, num_attention_heads=4),
            r"num_attention_heads \(4\) must divide hidden_size \(130\)",
        ),
        (dict(num_attention_heads=32, num_key_value_heads=5), r"num_key_value_heads \(5\) must divide"),
        (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not supported \(supported: silu\)"),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4}),
            r"rope_scaling.rope_type 'yarn' is not supported",
        ),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8}), r"rope_scaling\['low_freq_factor'\]"),
        (dict(rope_scaling={"factor": 8}), r"rope_scaling.rope_type None is not supported"),
        (dict(vocab_size="big"), r"vocab_size must be a positive integer, got 'big'"),
        (dict(num_hidden_layers=0), r"num_hidden_layers must be a positive integer, got 0"),
        (dict(rms_norm_eps=-1.0), r"rms_norm_eps must be a positive number"),
        (dict(tie_word_embeddings="yes"), r"tie_word_embeddings must be true or false"),
        (dict(head_dim=33), r"head_dim \(33\) must be even"),
        (dict(torch_dtype="float8"), r"torch_dtype 'float8' is not supported"),
        (dict(eos_token_id=[1, -2]), r"eos_token_id must be a non-negative integer"),
    ],
)
def test_invalid_configs_raise_clear_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)


def test_from_dict_errors() -> None:
    with pytest.raises(ValueError, match="model_type is 'mistral', expected 'llama'"):
        LlamaConfig.from_dict({"model_type": "mistral"})
    with pytest.raises(ValueError, match=r"rope_theta \(10000\) disagrees with rope_parameters.rope_theta"):
        LlamaConfig.from_dict({"rope_theta": 10000, "rope_parameters": {"rope_theta": 500000}})


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(
        ValueError, match=r"unknown Llama preset 'huge'; known presets: tiny, bench, small, 7B"
    ):
        LlamaConfig.from_preset("huge")


def test_from_json_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no model config at"):
        LlamaConfig.from_json_file(tmp_path / "config.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json: invalid JSON"):
        LlamaConfig.from_json_file(tmp_path / "bad.json")


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.json"
    path.write_text("old")

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, "new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["config.json"]  # the temporary file is gone too
