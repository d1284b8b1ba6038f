"""Llama 3-style checkpoints made by transformers: llama3 RoPE scaling, rope_theta 500000, GQA, an
explicit head_dim, tied and untied embeddings. Logits equal transformers' eagerly, through the
engine's traced programs, and from the exported static model file.

Runs only where torch and transformers are installed (they are never runtime dependencies).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.infer import Engine, EngineConfig, SamplingParams
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.config import LlamaConfigError
from llmkit.serve.export import export_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 4096  # the built-in tokenizer's, so that the model exports with it
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that a 40-token test prompt spans kept, blended and scaled frequencies
    "original_max_position_embeddings": 64,
}


def hf_config(tied: bool, rope_scaling=LLAMA3_ROPE) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # not hidden_size // heads (8): the explicit field is honoured
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(rope_scaling),
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module", params=["tied", "untied"])
def hf_dir(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(request.param == "tied")).float()
    with torch.no_grad():  # HF inits norms to 1: make them random so a swapped norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp(f"llama3-{request.param}")
    hf.save_pretrained(d, safe_serialization=True)
    hf.eval()
    return hf, d


def hf_log_softmax(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_config_json_is_read_as_written(hf_dir):
    hf, d = hf_dir
    cfg = LlamaConfig.from_json_file(d / "config.json")
    assert cfg.rope_scaling == LLAMA3_ROPE and cfg.rope_theta == 500000.0
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 2)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    # one function gives the frequencies: transformers' own llama3 computation agrees
    rope = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    inv_freq, _ = rope(hf.config, "cpu")
    np.testing.assert_allclose(cfg.rope_inv_freq(), inv_freq.double().numpy(), rtol=1e-6)


def test_eager_logits_equal_transformers(hf_dir):
    hf, d = hf_dir
    ours = LlamaForCausalLM.from_pretrained(str(d))
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 40))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours(lf.tensor(ids)).logits.numpy(), want, rtol=1e-4, atol=1e-4)


def _check_engine(engine: Engine, hf) -> None:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (9, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=8)
    for p, out in zip(prompts, engine.generate(prompts, params)):
        ref = hf_log_softmax(hf, p + out.token_ids)
        for k, choice in enumerate(out.logprobs):
            row = ref[len(p) - 1 + k]
            assert out.token_ids[k] == int(np.argmax(row))
            top = [t for t, _ in choice.top]
            np.testing.assert_allclose([lp for _, lp in choice.top], row[top], atol=1e-4)


def test_engine_programs_equal_transformers(hf_dir):
    hf, d = hf_dir
    ours = LlamaForCausalLM.from_pretrained(str(d))
    ours.eval()
    _check_engine(Engine.from_model(ours, config=EngineConfig(max_batch=2)), hf)


def test_exported_model_file_equals_transformers(hf_dir, tmp_path, tok):
    hf, d = hf_dir
    ours = LlamaForCausalLM.from_pretrained(str(d))
    ours.eval()
    path = export_model(ours, tok, tmp_path / "m.llmkit", model_name="llama3")
    meta = json.loads((path / "manifest.json").read_text())["metadata"]
    assert meta["config"]["rope_scaling"] == LLAMA3_ROPE
    _check_engine(Engine.from_static(path, EngineConfig(max_batch=2)), hf)


def test_linear_scaling_equals_transformers(tmp_path):
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(hf_config(False, {"rope_type": "linear", "factor": 4.0})).float()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf.eval()
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path))
    ids = np.random.default_rng(2).integers(0, VOCAB, (1, 30))
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours(lf.tensor(ids)).logits.numpy(), want, rtol=1e-4, atol=1e-4)


def test_unknown_rope_type_names_the_config_key(tmp_path):
    d = hf_config(False).to_dict()
    d["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    d.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(LlamaConfigError, match=r"config\.json: .*rope_scaling\.rope_type 'dynamic'"):
        LlamaConfig.from_json_file(tmp_path / "config.json")
