"""``llmkit export --format gguf``: the file read back with the gguf package's own reader.

Every tensor's llama.cpp name, shape and (dequantized with ``gguf.quants``) values equal llmkit's
weights, q/k rows put back from llama.cpp's RoPE pair order with an index map written here;
hyperparameters and tokenizer metadata equal the model's; Q8_0/Q4_0 blocks hold llmkit's codes
and scales exactly; layouts that do not map are refused in one line.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.cli import main as cli_main
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.quant.format import QuantConfig
from llmkit.quant.quantize import quantize_model, save_quantized

gguf = pytest.importorskip("gguf")


def export(model_dir, out, *args):
    assert cli_main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(out), *args]) == 0
    return gguf.GGUFReader(out)


def field(reader, key):
    return reader.fields[key].contents()


def from_llama_cpp_rows(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: its row h*D + 2i is HF's h*D + i, its h*D + 2i + 1 is HF's
    h*D + D/2 + i (the two halves rotate-half pairs)."""
    d = x.shape[0] // n_heads
    src = np.empty(x.shape[0], np.int64)
    for h in range(n_heads):
        for i in range(d // 2):
            src[h * d + i] = h * d + 2 * i
            src[h * d + d // 2 + i] = h * d + 2 * i + 1
    return x[src]


def expected_tensors(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> the HF weight it holds (float), from llama.cpp's naming."""
    sd = {n: t.numpy() for n, t in model.state_dict().items()}
    want = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    if not model.config.tie_word_embeddings:
        want["output.weight"] = sd["lm_head.weight"]
    hf = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    layers = dict(model.named_sublayers())
    for i in range(model.config.num_hidden_layers):
        for ours, theirs in hf.items():
            want[f"blk.{i}.{ours}.weight"] = layers[f"model.layers.{i}.{theirs}"].weight.numpy()
    return want


def read_back(reader, cfg) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized [rows, cols] as numpy holds it, q/k rows in HF order."""
    out = {}
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if ".attn_q." in t.name:
            a = from_llama_cpp_rows(a, cfg.num_attention_heads)
        elif ".attn_k." in t.name:
            a = from_llama_cpp_rows(a, cfg.num_key_value_heads)
        out[t.name] = a
    return out


def test_float32_tensors_hyperparameters_and_sentencepiece_vocab(trained, tok, tmp_path):
    model, d = trained
    cfg = model.config
    r = export(d, tmp_path / "m.gguf")
    want = expected_tensors(model)
    assert {t.name for t in r.tensors} == set(want)
    for t in r.tensors:  # ne order: columns first
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert tuple(t.shape.tolist()) == tuple(reversed(want[t.name].shape))
    got = read_back(r, cfg)
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    hp = {
        "general.architecture": "llama",
        "general.file_type": 0,  # ALL_F32
        "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size,
        "llama.block_count": cfg.num_hidden_layers,
        "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads,
        "llama.rope.dimension_count": cfg.head_dim,
        "llama.vocab_size": cfg.vocab_size,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": tok.bos_id,
        "tokenizer.ggml.eos_token_id": tok.eos_id,
        "tokenizer.ggml.unknown_token_id": tok.unk_id,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,  # llmkit trains without sentencepiece's dummy prefix
    }
    assert {k: field(r, k) for k in hp} == hp
    assert field(r, "llama.rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.rms_norm_eps)
    assert "tokenizer.ggml.padding_token_id" not in r.fields  # llmkit's tokenizers have no pad piece
    pieces = field(r, "tokenizer.ggml.tokens")
    assert pieces == [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    types = field(r, "tokenizer.ggml.token_type")
    assert types[:4] == [2, 3, 3, 6]  # <unk>: UNKNOWN, <s> </s>: CONTROL, <0x00>: BYTE
    assert types.count(6) == 256 and set(types[259:]) == {1}
    scores = field(r, "tokenizer.ggml.scores")
    assert len(scores) == tok.vocab_size and scores[300] > scores[4000]  # BPE merges' order
    assert "[INST]" in field(r, "tokenizer.chat_template")


def test_float16_weights_keep_norms_float32(trained, tmp_path):
    model, d = trained
    r = export(d, tmp_path / "m16.gguf", "--dtype", "float16")
    assert field(r, "general.file_type") == 1  # MOSTLY_F16
    got = read_back(r, model.config)
    for t in r.tensors:
        w = expected_tensors(model)[t.name]
        if w.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(got[t.name], w)
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            np.testing.assert_array_equal(got[t.name], w.astype(np.float16).astype(np.float32))


def _quantized_dir(trained, tmp_path, cfg: QuantConfig, intermediate_size: int = 384):
    """A model quantized by llmkit (RTN) and saved as `llmkit quantize` saves it; its MLP is 384
    wide (by default) so that every linear has whole groups of 32."""
    _, src = trained
    lf.seed(1)
    model = LlamaForCausalLM(
        LlamaConfig.from_preset(
            "tiny", vocab_size=4096, num_hidden_layers=2, intermediate_size=intermediate_size
        )
    )
    quantize_model(model, cfg, progress=False)
    out = tmp_path / "quant"
    save_quantized(model, src, out, {})
    return LlamaForCausalLM.from_pretrained(str(out)), out


@pytest.mark.parametrize(("bits", "qtype", "file_type"), [(8, "Q8_0", 7), (4, "Q4_0", 2)])
def test_quantized_blocks_hold_llmkits_codes_exactly(trained, tmp_path, bits, qtype, file_type):
    model, d = _quantized_dir(trained, tmp_path, QuantConfig(bits, 32, True, "rtn", "float16"))
    r = export(d, tmp_path / "q.gguf")
    assert field(r, "general.file_type") == file_type
    got = read_back(r, model.config)
    layers = dict(model.named_sublayers())
    for t in r.tensors:
        want = expected_tensors(model)[t.name]  # the dequantized weights llmkit computes with
        np.testing.assert_array_equal(got[t.name], want, err_msg=t.name)
        quantized = t.name.startswith("blk.") and not t.name.endswith("norm.weight")
        assert t.tensor_type == (
            gguf.GGMLQuantizationType[qtype] if quantized else gguf.GGMLQuantizationType.F32
        )
    # the raw bytes of one block: llmkit's float16 scale, then its codes in llama.cpp's order
    v = layers["model.layers.0.self_attn.v_proj"]  # v: no RoPE permutation
    raw = next(t for t in r.tensors if t.name == "blk.0.attn_v.weight").data  # (out, blocks * bytes)
    row = raw[3].reshape(-1, 34 if bits == 8 else 18)[1]  # row 3, block 1 (columns 32..63)
    assert row[:2].view(np.float16)[0] == v.scales.numpy()[3, 1]
    q = v.qweight.numpy()[3]
    if bits == 8:
        np.testing.assert_array_equal(row[2:].view(np.int8), q[32:64])
    else:
        codes = np.stack([q & 15, q >> 4], axis=1).reshape(-1)[32:64]  # column 2j low nibble, 2j + 1 high
        np.testing.assert_array_equal(row[2:] & 15, codes[:16])
        np.testing.assert_array_equal(row[2:] >> 4, codes[16:])


def test_a_quantized_embedding_is_written_as_blocks_too(trained, tmp_path):
    """`llmkit quantize --embed`: token_embd is Q8_0 (its codes as they are), never left out."""
    _, src = trained
    lf.seed(2)
    model = LlamaForCausalLM(
        LlamaConfig.from_preset("tiny", vocab_size=4096, num_hidden_layers=1, intermediate_size=384)
    )
    quantize_model(model, QuantConfig(8, 32, True, "rtn", "float16"), progress=False, embed=True)
    out = tmp_path / "quant"
    save_quantized(model, src, out, {})
    model = LlamaForCausalLM.from_pretrained(str(out))
    assert isinstance(model.model.embed_tokens, lf.nn.QuantizedEmbedding)
    r = export(out, tmp_path / "e.gguf")
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = model.model.embed_tokens.weight.numpy()  # the dequantized table llmkit looks up
    np.testing.assert_array_equal(read_back(r, model.config)["token_embd.weight"], want)


def test_rows_that_are_not_whole_blocks_fall_back_to_exact_float32(trained, tmp_path, capsys):
    """tiny's MLP is 344 wide: down_proj's rows are 10 groups of 32 and one of 24, which no Q4_0
    row holds; like llama.cpp's converter, that tensor is written unquantized (float32, exact)."""
    model, d = _quantized_dir(trained, tmp_path, QuantConfig(4, 32, True, "rtn", "float16"), 344)
    out = tmp_path / "q.gguf"
    assert cli_main(["export", "--model", str(d), "--format", "gguf", "--out", str(out)]) == 0
    assert "2 quantized linears as float32" in capsys.readouterr().out
    r = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "F32"
    assert types["blk.0.ffn_up.weight"] == types["blk.1.attn_q.weight"] == "Q4_0"
    got = read_back(r, model.config)
    for name, w in expected_tensors(model).items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        (QuantConfig(4, 128, True, "rtn"), r"int4 in groups of 128 does not map exactly"),
        (QuantConfig(4, 32, True, "rtn"), r"int4 in groups of 32 .*scales are not float16 numbers"),
        (QuantConfig(8, -1, True, "rtn"), r"int8 per output channel does not map exactly"),
        (QuantConfig(4, 32, False, "rtn", "float16"), r"int4 asymmetric .*a zero point per group"),
    ],
    ids=["int4-g128", "int4-g32-float32-scales", "int8-per-channel", "int4-asym"],
)
def test_layouts_that_do_not_map_are_refused_in_one_line(trained, tmp_path, capsys, cfg, why):
    _, d = _quantized_dir(trained, tmp_path, cfg)
    out = tmp_path / "q.gguf"
    assert cli_main(["export", "--model", str(d), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.layers.0.self_attn.q_proj" in err
    assert __import__("re").search(why, err)
    assert "--scale-dtype float16" in err and "--dtype float32 (exact)" in err
    assert not out.exists() and not list(tmp_path.glob(".q.gguf.*"))  # nothing half-written
    # the nearest exact option: the dequantized weights, float32
    model = LlamaForCausalLM.from_pretrained(str(d))
    got = read_back(export(d, out, "--dtype", "float32"), model.config)
    for name, w in expected_tensors(model).items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def meta_rope_factors(theta, dim, factor, low, high, old_context):
    """llama.cpp's convert_hf_to_gguf.py rule, as a float64 loop: each base frequency's divisor."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_llama3_rope_freqs_tied_embeddings_and_explicit_head_dim(tok, tmp_path):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    scaling["original_max_position_embeddings"] = 64
    cfg = LlamaConfig.from_preset(
        "tiny", vocab_size=4096, num_hidden_layers=1, head_dim=16, rope_theta=500000.0,
        rope_scaling=scaling, tie_word_embeddings=True, attention_bias=True,
    )  # fmt: skip
    lf.seed(2)
    model = LlamaForCausalLM(cfg)
    rng = np.random.default_rng(2)  # biases start at zero: random ones, so that their row order shows
    state = {n: t.numpy() for n, t in model.state_dict().items()}
    model.load_state_dict(
        {
            n: rng.standard_normal(a.shape).astype(a.dtype) if n.endswith(".bias") else a
            for n, a in state.items()
        }
    )
    d = tmp_path / "llama3"
    model.save_pretrained(str(d))
    tok.save_pretrained(d)
    r = export(d, tmp_path / "l3.gguf")
    got = read_back(r, cfg)
    assert "output.weight" not in got  # tied: llama.cpp reads token_embd
    np.testing.assert_array_equal(got["token_embd.weight"], model.model.embed_tokens.weight.numpy())
    assert field(r, "llama.attention.key_length") == 16 and field(r, "llama.rope.dimension_count") == 16
    np.testing.assert_allclose(
        got["rope_freqs.weight"], meta_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 64), rtol=1e-6
    )
    for name, w in expected_tensors(model).items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    attn = model.model.layers[0].self_attn  # biases: q/k in llama.cpp's row order too
    for proj in ("q", "k", "v"):
        np.testing.assert_array_equal(
            got[f"blk.0.attn_{proj}.bias"], getattr(attn, f"{proj}_proj").bias.numpy()
        )


def test_byte_level_bpe_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
        r"\s*[\r\n]+|\s+(?!\S)|\s+"
    )  # Llama 3's
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    t.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(["the quick brown fox jumps over the lazy dog, 1234 times!"] * 50, trainer)
    t.add_tokens(["<user-word>"])  # an added token that is not special
    d = tmp_path / "bpe"
    lf.seed(3)
    model = LlamaForCausalLM(
        LlamaConfig.from_preset("tiny", vocab_size=t.get_vocab_size() + 3, num_hidden_layers=1,
                                bos_token_id=0, eos_token_id=[1, 2])
    )  # fmt: skip
    model.save_pretrained(str(d))
    t.save(str(d / "tokenizer.json"))
    template = "{% for m in messages %}<|start|>{{ m['content'] }}<|eot_id|>{% endfor %}"
    tc = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True}
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    r = export(d, tmp_path / "bpe.gguf")
    assert field(r, "tokenizer.ggml.model") == "gpt2" and field(r, "tokenizer.ggml.pre") == "llama-bpe"
    vocab = t.get_vocab()
    tokens = field(r, "tokenizer.ggml.tokens")
    n = model.config.vocab_size
    assert len(tokens) == n and tokens[: n - 3] == sorted(vocab, key=vocab.get)
    assert tokens[n - 3 :] == [f"[PAD{i}]" for i in range(n - 3, n)]  # rows the tokenizer never emits
    types = field(r, "tokenizer.ggml.token_type")
    assert types[:3] == [3, 3, 3] and types[vocab["<user-word>"]] == 4 and types[vocab["the"]] == 1
    assert types[n - 3 :] == [5, 5, 5]
    merges = json.loads(t.to_str())["model"]["merges"]
    assert field(r, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert field(r, "tokenizer.ggml.bos_token_id") == 0
    assert field(r, "tokenizer.ggml.eos_token_id") == vocab["<|eot_id|>"]
    assert field(r, "tokenizer.ggml.add_bos_token") is True
    assert field(r, "tokenizer.chat_template") == template


def test_unknown_pre_tokenizer_and_missing_package_are_one_line_errors(
    trained, tmp_path, capsys, monkeypatch
):
    _, d = trained
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    assert cli_main(["export", "--model", str(d), "--format", "gguf", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "pip install llmkit[gguf]" in capsys.readouterr().err
    monkeypatch.undo()
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 2, "ab": 3}, merges=[("a", "b")]))
    t.pre_tokenizer = pre_tokenizers.Sequence(  # a split llama.cpp has no name for
        [pre_tokenizers.Split(Regex(r"\d+"), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    bpe = tmp_path / "odd"
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=300, num_hidden_layers=1))
    model.save_pretrained(str(bpe))
    t.save(str(bpe / "tokenizer.json"))
    out = tmp_path / "y.gguf"
    assert cli_main(["export", "--model", str(bpe), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json: pre_tokenizer" in err and len(err.strip().splitlines()) == 1


def test_llama_cpp_logits_equal_llmkits(trained, tmp_path):
    """llama.cpp itself on the exported float32 file (only where llama-cpp-python is installed)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model, d = trained
    path = tmp_path / "m.gguf"
    export(d, path)
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    ids = np.random.default_rng(0).integers(3, 4096, 20).tolist()
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    with lf.no_grad():
        ours = model(lf.tensor(np.array([ids]))).logits.numpy()[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-3, atol=1e-3)
