"""LlamaForCausalLM against an independent float64 numpy forward, checkpoint io, generation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.generate import generate
from llmkit.models.llama import KVCache, LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.checkpoint import CheckpointError


def small_config(**kw):
    base = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
    )
    return LlamaConfig(**{**base, **kw})


def reference_forward(sd: dict[str, np.ndarray], cfg: LlamaConfig, ids: np.ndarray) -> np.ndarray:
    """Llama in float64 numpy, written from the paper and HF's modeling_llama (no llmkit.nn)."""
    W = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    b, s = ids.shape
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w

    # inverse frequencies with rope scaling, from the formulas (linear: /factor; llama3: piecewise)
    inv = cfg.rope_theta ** (-np.arange(0, d, 2) / d)
    rs = cfg.rope_scaling
    if rs and rs["rope_type"] == "linear":
        inv = inv / rs["factor"]
    elif rs and rs["rope_type"] == "llama3":
        out = []
        for f in inv:
            wl = 2 * math.pi / f
            lo = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
            hi = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
            if wl < hi:
                out.append(f)
            elif wl > lo:
                out.append(f / rs["factor"])
            else:
                sm = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / (
                    rs["high_freq_factor"] - rs["low_freq_factor"]
                )
                out.append((1 - sm) * f / rs["factor"] + sm * f)
        inv = np.array(out)
    ang = np.arange(s)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)  # (S, D/2)

    def rope(x):  # (B, H, S, D), rotate_half convention: pairs (i, i + D/2)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = W["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(b, s, hq, d).transpose(0, 2, 1, 3)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(b, s, hk, d).transpose(0, 2, 1, 3)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(b, s, hk, d).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, hq // hk, axis=1), np.repeat(v, hq // hk, axis=1)
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
        att = np.where(causal, att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, hq * d)
        x = x + o @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    head = W["model.embed_tokens.weight"] if cfg.tie_word_embeddings else W["lm_head.weight"]
    return x @ head.T


CONFIGS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "rope_linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "rope_llama3": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "rope_theta": 500.0,
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_float64_numpy_reference(name):
    lf.seed(1)
    cfg = small_config(**CONFIGS[name])
    model = LlamaForCausalLM(cfg).to("float64")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    got = model(lf.tensor(ids)).logits.numpy()
    want = reference_forward({k: v.numpy() for k, v in model.state_dict().items()}, cfg, ids)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)


def test_loss_is_shifted_cross_entropy():
    lf.seed(0)
    cfg = small_config()
    model = LlamaForCausalLM(cfg).to("float64")
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7))
    out = model(lf.tensor(ids), labels=lf.tensor(ids))
    logits = out.logits.numpy()[:, :-1]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -np.mean(np.take_along_axis(logp, ids[:, 1:, None], -1))
    assert out.loss.item() == pytest.approx(want, rel=1e-10)
    assert model(lf.tensor(ids)).loss is None


def test_kv_cache_forward_equals_full_forward():
    lf.seed(2)
    cfg = small_config()
    model = LlamaForCausalLM(cfg).to("float64")
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 9))
    full = model(lf.tensor(ids)).logits.numpy()
    cache = KVCache(cfg.num_hidden_layers)
    a = model(lf.tensor(ids[:, :5]), kv_cache=cache).logits.numpy()
    b = model(lf.tensor(ids[:, 5:8]), kv_cache=cache).logits.numpy()
    c = model(lf.tensor(ids[:, 8:]), kv_cache=cache).logits.numpy()
    np.testing.assert_allclose(np.concatenate([a, b, c], 1), full, rtol=1e-10, atol=1e-11)


def test_greedy_generation_with_cache_equals_without():
    lf.seed(3)
    cfg = small_config(initializer_range=0.5)
    model = LlamaForCausalLM(cfg)
    prompts = [[1, 5, 7, 9], [3, 3, 2, 8]]
    with_cache = generate(model, prompts, max_new_tokens=12, use_cache=True)
    without = generate(model, prompts, max_new_tokens=12, use_cache=False)
    assert with_cache == without
    assert all(len(t) == 12 for t in with_cache)


def test_attention_mask_ignores_padded_keys():
    lf.seed(4)
    cfg = small_config()
    model = LlamaForCausalLM(cfg).to("float64")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 6))
    mask = np.array([[1, 1, 1, 1, 0, 0]])
    a = model(lf.tensor(ids), attention_mask=lf.tensor(mask)).logits.numpy()[:, :4]
    b = model(lf.tensor(ids[:, :4])).logits.numpy()
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11)


def test_hf_parameter_names():
    names = set(LlamaForCausalLM(small_config(num_hidden_layers=1)).state_dict())
    assert names == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        *[
            f"model.layers.0.{n}.weight"
            for n in (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            )
        ],
    }


@pytest.mark.parametrize("shard", [None, 20_000])
def test_save_and_load_pretrained_round_trip(tmp_path, shard):
    lf.seed(5)
    model = LlamaForCausalLM(small_config())
    model.save_pretrained(tmp_path / "m", max_shard_size=shard)
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    if shard:
        assert "model.safetensors.index.json" in files and any(f.startswith("model-00001-of-") for f in files)
    else:
        assert files == ["config.json", "generation_config.json", "model.safetensors"]
    gen = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert gen == {"bos_token_id": model.config.bos_token_id, "eos_token_id": model.config.eos_token_id}
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert lf.serialization.load_metadata(next((tmp_path / "m").glob("*.safetensors"))) == {"format": "pt"}
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "m")
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[k].numpy(), v.numpy())


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    lf.seed(6)
    model = LlamaForCausalLM(small_config())
    model.save_pretrained(tmp_path / "m", dtype="bfloat16")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "m")
    w = loaded.state_dict()["model.norm.weight"]
    assert w.dtype == np.float32


def test_checkpoint_shape_mismatch_is_a_clear_error(tmp_path):
    LlamaForCausalLM(small_config()).save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch: model.layers.0.mlp.down_proj.weight: checkpoint "
        r"\[32, 48\] vs config \[32, 40\]",
    ):
        LlamaForCausalLM.from_pretrained(tmp_path / "m")


def test_checkpoint_missing_and_unexpected_keys(tmp_path):
    model = LlamaForCausalLM(small_config())
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    del sd["model.norm.weight"]
    sd["model.extra.weight"] = np.zeros(3, np.float32)
    (tmp_path / "m").mkdir()
    model.config.to_json_file(tmp_path / "m" / "config.json")
    lf.save(sd, tmp_path / "m" / "model.safetensors")
    with pytest.raises(
        CheckpointError, match="missing 1: model.norm.weight; unexpected 1: model.extra.weight"
    ):
        LlamaForCausalLM.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupted_weights_are_a_clear_error(tmp_path, damage):
    LlamaForCausalLM(small_config()).save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(lf.serialization.SafetensorsError, match="model.safetensors"):
        LlamaForCausalLM.from_pretrained(tmp_path / "m")


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LlamaForCausalLM.from_pretrained(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    small_config().to_json_file(tmp_path / "m" / "config.json")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        LlamaForCausalLM.from_pretrained(tmp_path / "m")


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model = LlamaForCausalLM(small_config())
    model.save_pretrained(tmp_path / "m")
    before = (tmp_path / "m" / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(lf, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left behind
