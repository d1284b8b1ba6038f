"""The quantized format: packing, the dequantizing ops against a reader written here from the format's
text (docs/quantize.md), round to nearest, and quantized checkpoints on disk."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llmkit.framework as lf
from llmkit.framework import nn
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.checkpoint import CheckpointError
from llmkit.quant import QuantConfig, QuantError, install, pack, quantize_rtn, targets, unpack

O = lf.ops


def read_weight(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int, group: int):
    """The format, read independently (float64): input column c of row n is code q, in group c // group
    (group -1: the whole row); 8 bits: int8 q, W = q * scale; 4 bits: byte j of a row holds column
    2j in its low nibble and 2j + 1 in its high one, W = (q - zero) * scale, zero 8 when symmetric."""
    if bits == 8:
        q = qweight.astype(np.int64)
    else:
        b = qweight.astype(np.int64)
        q = np.empty((b.shape[0], 2 * b.shape[1]), np.int64)
        q[:, 0::2], q[:, 1::2] = b % 16, b // 16
    col_group = np.arange(q.shape[1]) // (q.shape[1] if group == -1 else group)
    zero = 0 if bits == 8 else 8 if zeros is None else zeros.astype(np.int64)[:, col_group]
    return (q - zero) * scales.astype(np.float64)[:, col_group]


def formats():
    """(bits, group_size, sym) settings the format allows, with any group size."""
    return st.one_of(
        st.tuples(st.just(8), st.sampled_from([-1, 1, 3, 32]), st.just(True)),
        st.tuples(st.just(4), st.sampled_from([-1, 2, 5, 32, 64, 128]), st.booleans()),
    )


@st.composite
def quantized(draw):
    """Random codes, scales and zeros of a random shape (4 bits: an even number of columns)."""
    bits, group, sym = draw(formats())
    out = draw(st.integers(1, 9))
    n_in = draw(st.integers(1, 40)) * (2 if bits == 4 else 1)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cfg = QuantConfig(bits, group, sym, "rtn")
    lo, hi = (-127, 127) if bits == 8 else (0, 15)
    q = rng.integers(lo, hi + 1, (out, n_in))
    scales = rng.uniform(0.01, 2.0, (out, cfg.groups(n_in))).astype(np.float32)
    zeros = None if sym else rng.integers(0, 16, scales.shape).astype(np.uint8)
    return cfg, q, scales, zeros


@settings(max_examples=60, deadline=None)
@given(quantized())
def test_packing_round_trips(case):
    cfg, q, _, _ = case
    qweight = pack(q, cfg.bits)
    assert qweight.dtype == (np.int8 if cfg.bits == 8 else np.uint8)
    assert qweight.shape == (q.shape[0], q.shape[1] // (2 if cfg.bits == 4 else 1))
    np.testing.assert_array_equal(unpack(qweight, cfg.bits), q)


@settings(max_examples=60, deadline=None)
@given(quantized())
def test_ops_reproduce_the_weights_the_format_describes(case):
    cfg, q, scales, zeros = case
    qweight = pack(q, cfg.bits)
    want = read_weight(qweight, scales, zeros, cfg.bits, cfg.group_size)
    args = [lf.tensor(qweight, dtype=qweight.dtype), lf.tensor(scales)]
    args += [] if zeros is None else [lf.tensor(zeros, dtype="uint8")]
    attrs = {"bits": cfg.bits, "group_size": cfg.group_size}
    np.testing.assert_allclose(O.dequantize(*args, **attrs).numpy(), want, rtol=1e-6, atol=0)
    x = np.random.default_rng(0).standard_normal((3, q.shape[1]))
    for rows in (0, 2):
        y = O.quant_linear(lf.tensor(x.astype(np.float32)), *args, **attrs, rows=rows).numpy()
        np.testing.assert_allclose(y, x @ want.T, rtol=1e-4, atol=1e-4 * np.abs(want).sum(1).max())


@pytest.mark.parametrize(
    ("bits", "group", "sym", "scale_dtype"),
    [
        (8, -1, True, "float32"),
        (8, 16, True, "float32"),
        (4, 32, True, "float32"),
        (4, 32, False, "float32"),
        (8, 32, True, "float16"),
        (4, 32, True, "float16"),
    ],
)
def test_rtn_keeps_every_weight_within_half_a_step(bits, group, sym, scale_dtype):
    rng = np.random.default_rng(bits + group)
    w = rng.standard_normal((24, 96)).astype(np.float32) * rng.uniform(0.01, 3, (24, 1)).astype(np.float32)
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 40.0  # an outlier
    w[6] = np.abs(w[6])  # all positive: the asymmetric zero point sits at a range end
    qw = quantize_rtn(w, QuantConfig(bits, group, sym, "rtn", scale_dtype))
    deq = read_weight(*qw, bits, group)
    if scale_dtype == "float16":  # float16 numbers, as GGUF's blocks hold them
        np.testing.assert_array_equal(qw.scales.astype(np.float16).astype(np.float32), qw.scales)
    step = qw.scales.astype(np.float64)[:, np.arange(96) // (96 if group == -1 else group)]
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6))
    assert np.all(deq[3] == 0)


def test_config_rejects_what_the_format_cannot_hold():
    for kw, msg in [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"bits": 8, "sym": False}, "symmetric only"),
        ({"group_size": 0}, "group_size"),
        ({"method": "awq"}, "method"),
        ({"scale_dtype": "bfloat16"}, "scale_dtype must be one of float32, float16"),
    ]:
        with pytest.raises(QuantError, match=msg):
            QuantConfig(**kw)
    with pytest.raises(QuantError, match="even number"):
        pack(np.zeros((2, 3), np.int64), 4)
    with pytest.raises(QuantError, match=r"\[0, 15\]"):
        pack(np.full((2, 2), 16), 4)
    cfg = QuantConfig(4, 128, False, "gptq")
    assert QuantConfig.from_hf(cfg.to_hf()) == cfg
    hf = {"quant_method": "llmkit", "bits": 4, "group_size": 128, "sym": False, "method": "gptq"}
    hf["scale_dtype"] = "float32"
    assert cfg.to_hf() == {**hf, "act_bits": 0, "version": 2}
    assert QuantConfig.from_hf(hf) == cfg  # a version 1 config (no act_bits): weight-only


def test_quantized_linear_is_a_linear_with_the_dequantized_weight():
    lf.seed(0)
    root = nn.Sequential(nn.Linear(64, 24), nn.Linear(24, 8, bias=False))
    x = lf.randn(5, 64)
    cfg = QuantConfig(4, 32, False, "rtn")
    qw = quantize_rtn(root[0].weight.numpy(), cfg)
    bias = root[0].bias
    layers = nn.quantize_linears(root, ["0"], cfg.bits, cfg.group_size, cfg.sym)
    assert root[0] is layers["0"] and root[0].bias is bias and isinstance(root[1], nn.Linear)
    layers["0"].qweight.set_value(qw.qweight)
    layers["0"].scales.set_value(qw.scales)
    layers["0"].zeros.set_value(qw.zeros)
    want = x.numpy().astype(np.float64) @ read_weight(*qw, 4, 32).T + bias.numpy()
    np.testing.assert_allclose(root[0](x).numpy(), want, rtol=1e-5, atol=1e-5)
    assert sorted(root.state_dict()) == ["0.bias", "0.qweight", "0.scales", "0.zeros", "1.weight"]
    with pytest.raises(ValueError, match="'1.weight' is no sublayer"):
        nn.quantize_linears(root, ["1.weight"], 4, 32, True)


def _tiny(tmp_path, cfg: QuantConfig):
    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=300, num_hidden_layers=1))
    layers = dict(model.named_sublayers())
    install(model, {p: quantize_rtn(layers[p].weight.numpy(), cfg) for p in targets(model)}, cfg)
    model.save_pretrained(str(tmp_path / "q"))
    return model, tmp_path / "q"


def test_a_quantized_checkpoint_loads_back_as_written(tmp_path):
    cfg = QuantConfig(4, 64, False, "rtn")
    model, d = _tiny(tmp_path, cfg)
    conf = json.loads((d / "config.json").read_text())
    assert conf["quantization_config"] == cfg.to_hf()
    back = LlamaForCausalLM.from_pretrained(str(d))
    want, got = model.state_dict(), back.state_dict()
    assert sorted(want) == sorted(got)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        np.testing.assert_array_equal(got[k].numpy(), v.numpy(), err_msg=k)
    assert isinstance(back.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    ids = lf.tensor(np.arange(12).reshape(2, 6))
    np.testing.assert_array_equal(back(ids).logits.numpy(), model(ids).logits.numpy())


def test_bad_quantized_checkpoints_are_clear_errors(tmp_path):
    _, d = _tiny(tmp_path, QuantConfig(8, -1, True, "rtn"))
    conf = json.loads((d / "config.json").read_text())

    def load_with(qc):
        (d / "config.json").write_text(json.dumps({**conf, "quantization_config": qc}))
        return LlamaForCausalLM.from_pretrained(str(d))

    good = conf["quantization_config"]
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        load_with({**good, "quant_method": "gptq"})
    with pytest.raises(CheckpointError, match="bits must be one of"):
        load_with({**good, "bits": 2})
    with pytest.raises(CheckpointError, match="group_size"):
        load_with({**good, "group_size": 0})
    with pytest.raises(CheckpointError, match=r"qweight: checkpoint \[.*\] vs config"):
        load_with({**good, "bits": 4, "group_size": 128})  # int8 codes read as 4-bit: wrong shape
    with pytest.raises(CheckpointError, match="missing 7: .*zeros"):
        load_with({**good, "bits": 4, "sym": False})  # also asymmetric without zeros


def test_the_reader_in_the_docs_reads_what_we_write(tmp_path):
    """docs/quantize.md's numpy reader (its ``dequantize``), run on checkpoints written here."""
    doc = (Path(__file__).parents[2] / "docs" / "quantize.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "def dequantize" in b)
    reader: dict = {}
    exec(block[: block.index("cfg = json.load")], reader)  # the imports and the function
    for i, cfg in enumerate(
        [QuantConfig(8, -1, True, "rtn"), QuantConfig(4, 64, True), QuantConfig(4, 32, False)]
    ):
        model, d = _tiny(tmp_path / str(i), cfg)
        qc = json.loads((d / "config.json").read_text())["quantization_config"]
        tensors = {k: v.numpy() for k, v in lf.load(d / "model.safetensors").items()}
        for path in targets(model):
            got = reader["dequantize"](tensors, path, qc)
            layer = dict(model.named_sublayers())[path]
            np.testing.assert_array_equal(got.astype(np.float32), layer.weight.numpy())
