"""quantize_model on small random Llamas: which layers, the lm_head when asked, GPTQ layer by layer."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import nn
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.quant import QuantConfig, QuantError, quantize_model, targets


def tiny(**overrides) -> LlamaForCausalLM:
    lf.seed(0)
    cfg = LlamaConfig.from_preset("tiny", **{"vocab_size": 512, "num_hidden_layers": 2, **overrides})
    return LlamaForCausalLM(cfg).eval()


def logits(model, ids):
    with lf.no_grad():
        return model(lf.tensor(ids)).logits.numpy().astype(np.float64)


def test_targets_are_the_decoder_linears_and_the_lm_head_when_asked():
    model = tiny()
    paths = targets(model)
    assert len(paths) == 14 and all(p.startswith("model.layers.") for p in paths)
    assert targets(model, lm_head=True)[-1] == "lm_head"
    with pytest.raises(QuantError, match="tied"):
        targets(tiny(tie_word_embeddings=True), lm_head=True)


@pytest.mark.parametrize("lm_head", [False, True])
def test_gptq_beats_rtn_on_its_calibration_text_layer_by_layer(lm_head):
    ids = np.random.default_rng(0).integers(3, 512, (24, 32))
    ref = logits(tiny(), ids)
    err = {}
    for method in ("rtn", "gptq"):
        model = tiny()
        cfg = QuantConfig(4, 64, True, method)
        paths = quantize_model(model, cfg, ids if method == "gptq" else None, lm_head=lm_head, progress=False)
        layers = dict(model.named_sublayers())
        assert all(isinstance(layers[p], nn.QuantizedLinear) for p in paths)
        assert isinstance(layers["lm_head"], nn.QuantizedLinear) == lm_head
        assert isinstance(layers["model.embed_tokens"], nn.Embedding)
        assert model.config.extra["quantization_config"] == cfg.to_hf()
        err[method] = np.mean((logits(model, ids) - ref) ** 2)
    assert err["gptq"] < 0.8 * err["rtn"], err


def test_gptq_needs_calibration_and_4_bit_needs_even_widths():
    with pytest.raises(QuantError, match="calibration"):
        quantize_model(tiny(), QuantConfig(4, 128, True, "gptq"), None, progress=False)
    with pytest.raises(QuantError, match="even number of input columns"):
        quantize_model(tiny(intermediate_size=345), QuantConfig(4, 128, True, "rtn"), progress=False)


def test_gptq_on_non_finite_activations_names_the_linear():
    model = tiny()
    norm = dict(model.named_sublayers())["model.layers.1.post_attention_layernorm"]
    norm.weight.set_value(np.full(norm.weight.shape, np.nan, np.float32))  # the MLP's inputs are NaN
    ids = np.random.default_rng(0).integers(3, 512, (4, 16))
    with pytest.raises(QuantError, match=r"^model\.layers\.1\.mlp\.gate_proj: GPTQ: the Hessian has \d+ non"):
        quantize_model(model, QuantConfig(4, 64, True, "gptq"), ids, progress=False)
