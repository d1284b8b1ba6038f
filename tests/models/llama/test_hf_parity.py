"""Parity with Hugging Face transformers on the same saved checkpoint, both directions.

Runs only where torch and transformers are installed (they are never runtime dependencies).
"""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VARIANTS = {
    "gqa": {},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
}


def config(**kw):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
    )
    return LlamaConfig(**{**base, **kw})


def hf_logits(path, ids):
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_ours_to_hf(tmp_path, name):
    lf.seed(0)
    ours = LlamaForCausalLM(config(**VARIANTS[name]))
    ours.save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, 64, (2, 12))
    np.testing.assert_allclose(
        hf_logits(tmp_path, ids), ours(lf.tensor(ids)).logits.numpy(), rtol=2e-4, atol=2e-5
    )


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_hf_to_ours(tmp_path, name):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**config(**VARIANTS[name]).to_dict())
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = np.random.default_rng(1).integers(0, 64, (2, 12))
    ours = LlamaForCausalLM.from_pretrained(tmp_path)
    np.testing.assert_allclose(
        ours(lf.tensor(ids)).logits.numpy(), hf_logits(tmp_path, ids), rtol=2e-4, atol=2e-5
    )


def test_generation_config_is_read_by_transformers(tmp_path):
    """save_pretrained's generation_config.json: transformers' own reader gets the config's ids;
    a file already there keeps its settings and gains the ids (eos united)."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "eos_token_id": [7]}')
    LlamaForCausalLM(config(eos_token_id=[2, 5], pad_token_id=3)).save_pretrained(tmp_path)
    gen = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id, gen.temperature) == (1, [7, 2, 5], 3, 0.6)
