"""A Llama 3-style Hugging Face directory (transformers' random Llama, a byte-level BPE
tokenizer.json, a generation_config.json with several stop ids) through `llmkit export` and the
engine: the static model file carries the tokenizer, its stop ids and exact multi-byte text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llmkit.cli import main as cli_main
from llmkit.infer import Engine, EngineConfig, SamplingParams
from llmkit.models.llama.tokenizer import train_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CORPUS = [
    "héllo wörld, 日本語のテキスト 😀 and the quick brown fox 12345.\n" * 5,
    "def f(x):\n    return x\n",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama3")
    tok = train_tokenizer(CORPUS, 300, d / "tok", kind="bpe")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,  # padded past the tokenizer's 300, as many checkpoints are
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(d / "model")
    tok.save_pretrained(d / "model")
    gen = json.loads((d / "model" / "generation_config.json").read_text())
    (d / "model" / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [1, 7]}))
    return d / "model"


def test_a_bpe_model_exports_and_generates_exact_text(hf_dir: Path, tmp_path: Path) -> None:
    assert cli_main(["export", "--model", str(hf_dir), "--out", str(tmp_path / "m.llmkit")]) == 0
    engine = Engine.from_static(tmp_path / "m.llmkit", EngineConfig(max_batch=2))
    tok = engine.tokenizer
    assert (tok.kind, tok.vocab_size, tok.eos_ids) == ("bpe", 300, [1, 7])
    assert {1, 7} <= engine.eos_token_ids
    prompt = "héllo 日本"
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert out.prompt_token_ids == tok.encode(prompt) and out.prompt_token_ids[0] == tok.bos_id
    assert out.text == tok.decode(out.token_ids)
    # the engine's greedy tokens are transformers' on the same weights
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = list(out.prompt_token_ids)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert np.array_equal(ids[len(out.prompt_token_ids) :], out.token_ids[:4])
