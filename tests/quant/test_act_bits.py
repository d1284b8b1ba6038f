"""int8 activations (``act_bits=8``) and a quantized token embedding, from ``llmkit quantize`` through
the checkpoint, the engine (batch invariance, compiled and reference kernels) and the static file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.cli import main as cli_main
from llmkit.framework import jit, nn
from llmkit.generate import generate
from llmkit.infer import Engine, EngineConfig, SamplingParams, programs
from llmkit.infer.programs import runs_native, unpack_panel_weights
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.checkpoint import CheckpointError
from llmkit.quant import QuantConfig, QuantError, quantize_model, set_act_bits

from .test_format import read_weight  # the format, read independently

SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)


def tiny(tied: bool = False) -> LlamaForCausalLM:
    lf.seed(0)
    cfg = LlamaConfig.from_preset("tiny", vocab_size=4096, num_hidden_layers=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


@pytest.fixture(scope="module")
def src(tmp_path_factory, tok) -> Path:
    d = tmp_path_factory.mktemp("float") / "model"
    tiny().save_pretrained(str(d))
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def quantized(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "int4-act8"
    args = ["--bits", "4", "--group", "32", "--method", "rtn", "--act-bits", "8", "--lm-head", "--embed"]
    assert cli_main(["quantize", "--model", str(src), *args, "--eval-tokens", "512", "--out", str(out)]) == 0
    return out


def test_quantize_reports_both_variants_and_writes_the_chosen_one(quantized, capsys):
    qc = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert qc["act_bits"] == 8 and qc["version"] == 2
    report = json.loads((quantized / "quant_report.json").read_text())
    assert set(report["variants"]) == {"weight-only", "int8 act"} and report["embed"]
    assert report["perplexity"]["quant"] == report["variants"]["int8 act"]["quant"]
    # the same codes, run two ways: near each other, not equal
    wo, a8 = report["variants"]["weight-only"], report["variants"]["int8 act"]
    assert wo["quant"] != a8["quant"] and abs(a8["quant"] / wo["quant"] - 1) < 0.01
    model = LlamaForCausalLM.from_pretrained(str(quantized))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    linears = [m for m in model.sublayers() if isinstance(m, nn.QuantizedLinear)]
    assert len(linears) == 15 and all(m.act_bits == 8 for m in linears)


def test_the_table_has_a_column_per_variant(src, tmp_path, capsys):
    args = [
        "--bits",
        "8",
        "--method",
        "rtn",
        "--eval-tokens",
        "256",
        "--out",
        str(tmp_path / "q8"),
        "--quiet",
    ]
    assert cli_main(["quantize", "--model", str(src), *args]) == 0
    out = capsys.readouterr().out
    assert "int8 per-channel rtn, weight-only *" in out and "int8 per-channel rtn, int8 act" in out
    assert "(* the written model: --act-bits 0)" in out
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization_config"]["act_bits"] == 0


def test_the_quantized_embedding_reads_the_format(quantized):
    from safetensors.numpy import load_file

    t = load_file(str(quantized / "model.safetensors"))
    table = read_weight(t["model.embed_tokens.qweight"], t["model.embed_tokens.scales"], None, 4, 32)
    model = LlamaForCausalLM.from_pretrained(str(quantized))
    ids = np.array([[0, 5, 4095], [17, 17, 3]])
    got = model.model.embed_tokens(lf.tensor(ids)).numpy()
    np.testing.assert_allclose(got, table[ids], rtol=1e-6, atol=1e-7)
    assert model.model.embed_tokens.qweight.numpy().nbytes == 4096 * 128 // 2


@pytest.mark.parametrize("compiler", ["cinn", "none"])
def test_engine_is_batch_invariant_and_matches_eager(quantized, compiler):
    model = LlamaForCausalLM.from_pretrained(str(quantized))
    model.eval()
    eng = Engine.from_model(model, config=EngineConfig(max_batch=8, compiler=compiler))
    rng = np.random.default_rng(3)
    target, *others = [rng.integers(3, 4096, n).tolist() for n in (37, 5, 18, 29, 50, 9, 33, 64)]
    alone = eng.generate([target], SEEDED)[0]
    eng.reset_prefix_cache()
    batch = eng.generate([target, *others], [SEEDED] + [SEEDED.replace(seed=k) for k in range(7)])
    assert batch[0].token_ids == alone.token_ids
    assert [(x.token_id, x.logprob) for x in batch[0].logprobs] == [
        (x.token_id, x.logprob) for x in alone.logprobs
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert eng.generate([target], greedy)[0].token_ids == generate(model, [target], max_new_tokens=10)[0]


def test_a_scoring_request_beside_a_generation_changes_none_of_its_bits(quantized):
    """A prefill step with a scoring request runs the score program for every request in it: its
    quantized lm_head is prefill's (int8 activations), so a generation's first token and logprob are
    the same beside a scoring request as alone."""
    model = LlamaForCausalLM.from_pretrained(str(quantized))
    model.eval()
    eng = Engine.from_model(model, config=EngineConfig(max_batch=8))
    rng = np.random.default_rng(5)
    gen, scored = [rng.integers(3, 4096, n).tolist() for n in (23, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    alone = eng.generate([gen], params)[0]
    eng.reset_prefix_cache()
    score = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=5)
    mixed = eng.generate([gen, scored], [params, score])[0]
    pairs = [[(x.token_id, x.logprob) for x in c.logprobs] for c in (mixed, alone)]
    assert pairs[0] == pairs[1]


def test_the_static_file_holds_int8_activation_products(quantized, tmp_path):
    out = tmp_path / "q.llmkit"
    assert cli_main(["export", "--model", str(quantized), "--out", str(out), "--name", "q"]) == 0
    decode = (out / "decode.pir").read_text()
    # 14 decoder linears and the lm_head; compiled programs read the codes as the kernel's panels,
    # packed at export (pack_qweight), q/k/v and gate/up of a layer in one op each (quant_linears)
    products = 9 if runs_native(None) else 15
    assert decode.count("act_bits = 8") == products
    assert decode.count("packed = 1") == (products if runs_native(None) else 0)
    # the score program's head is the same product (and the file holds the head once)
    assert (out / "score.pir").read_text().count("act_bits = 8") == products
    sm = jit.load(out, compiler="none")  # without the C kernel: the codes unpacked once, at load
    assert unpack_panel_weights(sm.programs.values()) >= (15 if runs_native(None) else 0)
    unpacked = str(sm.programs["decode"].program)  # and the products weight by weight again
    assert "packed = 1" not in unpacked and unpacked.count("llm.quant_linear(") == 15
    assert "model_embed_tokens_qweight" in decode


def test_float16_scales_are_stored_as_float16_and_old_files_give_the_same_bits(src, tmp_path):
    """Weights quantized with float16 scales: the static file's products take them as float16
    (``packed=2``, half the scales' bytes); a file of format version 1 of the same model (float32
    scales, ``packed=1``) still loads, and the two give the same tokens and log-probs bit for bit,
    compiled or not, alone or in a batch."""
    from llmkit.quant.quantize import save_quantized

    model = LlamaForCausalLM.from_pretrained(str(src))
    cfg = QuantConfig(4, 32, True, "rtn", "float16", act_bits=8)
    quantize_model(model, cfg, lm_head=True, progress=False)
    d, new, old = tmp_path / "q", tmp_path / "new.llmkit", tmp_path / "old.llmkit"
    save_quantized(model, src, d, {})
    assert cli_main(["export", "--model", str(d), "--out", str(new), "--name", "q"]) == 0
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"]["scale_dtype"] = "float32"  # what was exported before float16 scales
    (d / "config.json").write_text(json.dumps(hf))
    assert cli_main(["export", "--model", str(d), "--out", str(old), "--name", "q"]) == 0
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    native = runs_native(None)
    # 15 products in 9 ops (q/k/v and gate/up of a layer in one quant_linears each)
    assert (new / "decode.pir").read_text().count("packed = 2") == (9 if native else 0)
    assert (old / "decode.pir").read_text().count("packed = 1") == (9 if native else 0)
    if native:
        scales = jit.load(new).weights["model.layers.0.mlp.down_proj.scales.H"]
        want = model.model.layers[0].mlp.down_proj.scales.numpy()  # [out, groups], out % 16 == 0
        lanes = want.reshape(-1, 16, want.shape[1]).transpose(0, 2, 1)  # per panel [groups, 16]
        assert scales.dtype == np.float16 and np.array_equal(scales.astype(np.float32).ravel(), lanes.ravel())
    rng = np.random.default_rng(5)
    target, *others = [rng.integers(3, 4096, n).tolist() for n in (21, 7, 40)]
    params = [SEEDED] + [SEEDED.replace(seed=k) for k in range(2)]
    for compiler in ("cinn", "none"):
        got = []
        for path in (new, old):
            eng = Engine.from_static(path, EngineConfig(max_batch=4, compiler=compiler))
            got.append(eng.generate([target], SEEDED)[0])
            got.append(eng.generate([target, *others], params)[0])
        first = [(x.token_id, x.logprob) for x in got[0].logprobs]
        assert all([(x.token_id, x.logprob) for x in g.logprobs] == first for g in got[1:]), compiler
        assert all(g.token_ids == got[0].token_ids for g in got)


def test_grouped_products_give_the_bits_of_the_separate_ones(quantized, tmp_path, monkeypatch):
    """q/k/v and gate/up as one ``quant_linears`` each (``group-quant-linear``; static format version
    3) against the separate ``quant_linear``s (the pass off, and a version-2 file as llmkit wrote it
    before): the same tokens and log-probs bit for bit, from the model and from the file, compiled
    and with the reference kernels, alone and in a batch."""
    new, old = tmp_path / "new.llmkit", tmp_path / "old.llmkit"
    model = LlamaForCausalLM.from_pretrained(str(quantized))
    model.eval()
    assert cli_main(["export", "--model", str(quantized), "--out", str(new), "--name", "q"]) == 0
    engines = [Engine.from_model(model, config=EngineConfig(max_batch=4))]
    with monkeypatch.context() as mp:
        mp.setattr(programs.GroupQuantLinear, "apply", lambda self, program: None)
        assert cli_main(["export", "--model", str(quantized), "--out", str(old), "--name", "q"]) == 0
        engines.append(Engine.from_model(model, config=EngineConfig(max_batch=4)))
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    native = runs_native(None)
    assert (new / "decode.pir").read_text().count("llm.quant_linears(") == (4 if native else 0)  # 2 layers
    assert "llm.quant_linears(" not in (old / "decode.pir").read_text()
    engines += [Engine.from_static(path, EngineConfig(max_batch=4)) for path in (new, old)]
    rng = np.random.default_rng(9)
    target, *others = [rng.integers(3, 4096, n).tolist() for n in (23, 6, 41)]
    params = [SEEDED] + [SEEDED.replace(seed=k) for k in range(2)]
    for compiler in ("cinn", "none"):  # "none": the reference kernels, another arithmetic
        if compiler == "none":
            engines = [Engine.from_static(p, EngineConfig(max_batch=4, compiler="none")) for p in (new, old)]
        got = [
            g
            for eng in engines
            for g in (eng.generate([target], SEEDED)[0], eng.generate([target, *others], params)[0])
        ]
        first = [(x.token_id, x.logprob) for x in got[0].logprobs]
        for i, g in enumerate(got[1:]):
            assert [(x.token_id, x.logprob) for x in g.logprobs] == first, (compiler, i)


def test_old_files_load_as_weight_only_and_newer_ones_are_clear_errors(quantized, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(quantized, d)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("act_bits", "version"):  # as version 1 wrote it
        del cfg["quantization_config"][key]
    (d / "config.json").write_text(json.dumps(cfg))
    model = LlamaForCausalLM.from_pretrained(str(d))
    assert all(m.act_bits == 0 for m in model.sublayers() if isinstance(m, nn.QuantizedLinear))
    assert QuantConfig.from_hf(cfg["quantization_config"]).act_bits == 0
    for bad, message in (
        ({"version": 3}, "version 3 is not one this llmkit reads"),
        ({"act_bits": 4}, "act_bits"),
    ):
        (d / "config.json").write_text(
            json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], **bad}})
        )
        with pytest.raises(CheckpointError, match=message):
            LlamaForCausalLM.from_pretrained(str(d))
    with pytest.raises(QuantError, match="version 3 is newer"):
        QuantConfig.from_hf({**cfg["quantization_config"], "version": 3})


def test_settings_that_cannot_work_are_errors():
    with pytest.raises(QuantError, match="act_bits must be 0"):
        QuantConfig(4, 32, act_bits=4)
    with pytest.raises(QuantError, match="embeddings are tied"):
        quantize_model(tiny(tied=True), QuantConfig(4, 32, method="rtn"), embed=True, progress=False)


def test_set_act_bits_switches_the_layers_and_the_config():
    model = tiny()
    quantize_model(model, QuantConfig(8, -1, method="rtn"), progress=False)
    x = lf.tensor(np.array([[1, 2, 3, 4]]))
    with lf.no_grad():
        float_act = model(x).logits.numpy()
        set_act_bits(model, 8)
        int_act = model(x).logits.numpy()
    assert model.config.extra["quantization_config"]["act_bits"] == 8
    assert not np.array_equal(float_act, int_act)
    np.testing.assert_allclose(int_act, float_act, atol=0.05 * np.abs(float_act).max())
