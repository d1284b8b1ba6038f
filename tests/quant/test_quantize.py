"""``llmkit quantize`` and ``llmkit eval`` on a model trained by configs/tiny.yaml, and the quantized
model through the engine, ``llmkit export`` and ``llmkit serve``."""

from __future__ import annotations

import json
import re

import numpy as np
import openai
import pytest
from serve.conftest import API_KEY, start_server  # tests/ is on sys.path (pytest rootdir)

import llmkit.framework as lf
from llmkit.cli import main as cli_main
from llmkit.framework import nn
from llmkit.infer import Engine, EngineConfig, SamplingParams
from llmkit.models.llama import LlamaForCausalLM
from llmkit.quant.cli import default_out
from llmkit.train.checkpoint import model_dir

# slow: the session fixture trains the tiny model first (~1.5 min on 2 free cores, far longer on a
# shared machine), which counts against the first test's timeout
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

RUNS = {  # name -> llmkit quantize arguments
    "int8": ["--bits", "8", "--method", "rtn"],
    "int4-rtn": ["--bits", "4", "--group", "128", "--method", "rtn"],
    "int4": ["--bits", "4"],  # GPTQ, groups of 128, symmetric, 128 calibration sequences: the defaults
}


@pytest.fixture(scope="module")
def quantized(trained_tiny, tmp_path_factory):
    """Each run's output directory and its report."""
    out = {}
    for name, args in RUNS.items():
        d = tmp_path_factory.mktemp("q") / name
        assert cli_main(["quantize", "--model", str(trained_tiny), *args, "--out", str(d), "--quiet"]) == 0
        out[name] = (d, json.loads((d / "quant_report.json").read_text()))
    return out


def test_int8_perplexity_is_within_half_a_percent_of_float(quantized):
    ppl = quantized["int8"][1]["perplexity"]
    assert abs(ppl["quant"] / ppl["float"] - 1) < 0.005, ppl


def test_int4_gptq_is_within_five_percent_and_below_rtn(quantized):
    gptq, rtn = quantized["int4"][1], quantized["int4-rtn"][1]
    assert gptq["perplexity"]["float"] == rtn["perplexity"]["float"]
    assert gptq["perplexity"]["quant"] < 1.05 * gptq["perplexity"]["float"]
    assert gptq["perplexity"]["quant"] < rtn["perplexity"]["quant"], (gptq["perplexity"], rtn["perplexity"])
    assert gptq["kl"] < rtn["kl"] and gptq["top1"] > rtn["top1"]


def test_quantized_layers_take_a_quarter_and_an_eighth_of_the_bytes(quantized):
    for name, limit in (("int8", 0.27), ("int4", 0.15)):
        b = quantized[name][1]["bytes"]
        assert b["layers_quant"] <= limit * b["layers_float"], (name, b)


def test_the_directory_holds_the_format(quantized, trained_tiny):
    d, report = quantized["int4"]
    conf = json.loads((d / "config.json").read_text())
    assert conf["quantization_config"] == {
        "quant_method": "llmkit",
        "bits": 4,
        "group_size": 128,
        "sym": True,
        "method": "gptq",
        "scale_dtype": "float32",
        "act_bits": 0,
        "version": 2,
    }
    assert set(report["variants"]) == {"weight-only", "int8 act"}
    assert report["perplexity"]["quant"] == report["variants"]["weight-only"]["quant"]
    assert (d / "tokenizer.model").read_bytes() == (model_dir(trained_tiny) / "tokenizer.model").read_bytes()
    tensors = lf.load(d / "model.safetensors")
    lin = "model.layers.0.mlp.down_proj"  # [128, 344]: groups 128, 128, 88
    assert f"{lin}.weight" not in tensors and f"{lin}.zeros" not in tensors
    assert (tensors[f"{lin}.qweight"].dtype, tensors[f"{lin}.qweight"].shape) == (np.uint8, (128, 172))
    assert (tensors[f"{lin}.scales"].dtype, tensors[f"{lin}.scales"].shape) == (np.float32, (128, 3))
    for float_name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[float_name].dtype == np.float32
    assert report["linears"] == 28 and report["calibration"]["samples"] == 128


def test_eval_reports_the_same_perplexity_as_quantize(quantized, capsys):
    d, report = quantized["int4"]
    assert cli_main(["eval", "--model", str(d)]) == 0
    out = capsys.readouterr().out
    assert "int4, group 128, gptq" in out
    assert float(re.search(r"perplexity ([\d.]+)", out).group(1)) == pytest.approx(
        report["perplexity"]["quant"], abs=1e-3
    )


def test_default_out_follows_the_run():
    from pathlib import Path

    assert default_out(Path("runs/tiny/checkpoints/step-00000600/model"), 4) == Path("runs/tiny-int4")
    assert default_out(Path("models/mine"), 8) == Path("models/mine-int8")


def test_bad_arguments_are_one_line_errors(trained_tiny, tmp_path, capsys):
    run = ["quantize", "--model", str(trained_tiny)]
    assert cli_main([*run, "--bits", "8", "--asym", "--out", str(tmp_path / "x")]) == 2
    assert "symmetric only" in capsys.readouterr().err
    assert cli_main(["quantize", "--model", str(tmp_path), "--bits", "4"]) == 2
    assert "neither a model directory" in capsys.readouterr().err
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    assert cli_main([*run, "--bits", "4", "--out", str(tmp_path / "keep")]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def exported(quantized, tmp_path_factory):
    d = quantized["int4"][0]
    out = tmp_path_factory.mktemp("export") / "tiny-int4.llmkit"
    assert cli_main(["export", "--model", str(d), "--out", str(out), "--name", "tiny-int4"]) == 0
    return out


def test_the_static_file_runs_quantized_ops_as_the_live_model_does(quantized, exported):
    d = quantized["int4"][0]
    decode = (exported / "decode.pir").read_text()
    assert decode.count("llm.quant_linear(") == 28 and "llm.dequantize(" not in decode
    model = LlamaForCausalLM.from_pretrained(str(d))
    model.eval()
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    served = Engine.from_static(exported, EngineConfig(max_batch=4))
    live = Engine.from_model(model, config=EngineConfig(max_batch=4))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4096, n).tolist() for n in (6, 21, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    for p, x, y in zip(prompts, served.generate(prompts, params), live.generate(prompts, params)):
        assert x.token_ids == y.token_ids  # one program, one set of codes: bit for bit
        assert [c.top for c in x.logprobs] == [c.top for c in y.logprobs]
        with lf.no_grad():  # the eager quantized model (dequantize, then linear) agrees
            logits = model(lf.tensor(np.array([p + x.token_ids]))).logits.numpy()[0].astype(np.float64)
        for k, c in enumerate(x.logprobs):
            row = logits[len(p) - 1 + k]
            ref = row - row.max() - np.log(np.exp(row - row.max()).sum())
            np.testing.assert_allclose([lp for _, lp in c.top], ref[[t for t, _ in c.top]], atol=1e-4)


def test_the_server_answers_as_the_engine_does(exported, tmp_path):
    engine = Engine.from_static(exported, EngineConfig(max_batch=4))
    prompts = ["The module", "Return the value of", "class"]
    want = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    server = start_server(exported, tmp_path / "server.log", api_key=API_KEY)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        for prompt, w in zip(prompts, want):
            r = client.completions.create(model="tiny-int4", prompt=prompt, max_tokens=12, temperature=0)
            assert r.choices[0].text == w.text and r.usage.completion_tokens == len(w.token_ids)
    finally:
        assert server.stop() == 0, server.log.read_text()
