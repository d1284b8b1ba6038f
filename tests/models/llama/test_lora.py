"""LoRA adapters (llmkit/models/llama/lora.py) against PEFT on the transformers model, finite
differences in float64 (through a float base and through int4/int8 bases), and their errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import jit
from llmkit.models.llama import LlamaForCausalLM, lora
from llmkit.quant import QuantConfig, quantize_model

from .test_hf_parity import config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = np.random.default_rng(0).integers(0, 64, (2, 12))


def tiny(seed=0) -> LlamaForCausalLM:
    lf.seed(seed)
    return LlamaForCausalLM(config())  # test_hf_parity's: 2 layers of width 32, GQA


def randomize_adapters(model, seed=1, std=0.2):
    """Adapters with nonzero B (PEFT's init makes B = 0, which would hide any mistake in B's use)."""
    rng = np.random.default_rng(seed)
    for t in lora.adapter_state(model).values():
        t.set_value(rng.normal(0.0, std, t.shape).astype(t.dtype))


def hf_model(path):
    m = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return m.eval()


def torch_logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def logits(model, ids=IDS):
    return model(lf.tensor(ids)).logits.numpy()


@pytest.mark.parametrize(
    "cfg",
    [
        lora.LoraConfig(r=4, alpha=8),  # PEFT's default targets: q_proj, v_proj
        lora.LoraConfig(r=3, alpha=5, dropout=0.1, targets=("all-linear",)),
        lora.LoraConfig(r=2, alpha=2, targets=("k_proj", "o_proj", "down_proj")),
    ],
)
def test_ours_saved_loads_in_peft_with_equal_logits(tmp_path, cfg):
    model = tiny()
    model.save_pretrained(tmp_path / "base")
    lora.apply_lora(model, cfg, seed=3)
    randomize_adapters(model)
    model.eval()
    lora.save_adapter(model, tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(hf_model(tmp_path / "base"), tmp_path / "adapter").eval()
    np.testing.assert_allclose(logits(model), torch_logits(pm), rtol=0, atol=1e-5)
    # the adapted layers are the ones PEFT found from the same target names
    wrapped = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(lora.lora_layers(model))


def test_peft_adapter_loads_into_llmkit(tmp_path):
    tiny().save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    pcfg = peft.LoraConfig(
        r=4, lora_alpha=12, lora_dropout=0.05, target_modules=["q_proj", "o_proj", "up_proj"]
    )
    pm = peft.get_peft_model(hf_model(tmp_path / "base"), pcfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)
    pm.eval()
    pm.save_pretrained(tmp_path / "adapter")
    ours = LlamaForCausalLM.from_pretrained(tmp_path / "base")
    got = lora.load_adapter(ours, tmp_path / "adapter")
    assert (got.r, got.alpha, got.dropout, set(got.targets)) == (
        4,
        12.0,
        0.05,
        {"q_proj", "o_proj", "up_proj"},
    )
    ours.eval()
    np.testing.assert_allclose(logits(ours), torch_logits(pm), rtol=0, atol=1e-5)


def test_merged_equals_base_plus_adapter_and_disabled_is_the_base(tmp_path):
    model = tiny()
    base = logits(model)
    lora.apply_lora(model, lora.LoraConfig(r=4, alpha=8, targets=("all-linear",)), seed=0)
    np.testing.assert_array_equal(logits(model), base)  # B = 0: step 0 is the base exactly
    randomize_adapters(model)
    adapted = logits(model)
    assert np.abs(adapted - base).max() > 1e-2
    with lora.adapters_disabled(model):
        np.testing.assert_array_equal(logits(model), base)
    merged = lora.merge_lora(model)
    assert len(merged) == 14 and not lora.lora_layers(model)
    np.testing.assert_allclose(logits(model), adapted, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "merged")  # a plain model directory: transformers reads it
    np.testing.assert_allclose(torch_logits(hf_model(tmp_path / "merged")), adapted, rtol=0, atol=1e-5)


def test_state_names_stay_and_only_adapters_train():
    model = tiny()
    before = set(model.state_dict())
    paths = lora.apply_lora(model, lora.LoraConfig(r=2, targets=("q_proj", "gate_proj")), seed=0)
    assert paths == [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.gate_proj")]
    after = set(model.state_dict())
    assert after - before == {f"{p}.{k}" for p in paths for k in ("lora_A", "lora_B")}
    assert before <= after
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == after - before
    a = lora.lora_layers(model)[paths[0]].lora_A.numpy()
    bound = 1 / np.sqrt(32)  # Kaiming-uniform(a=sqrt(5)) over fan_in = 32: U(-1/sqrt(in), 1/sqrt(in))
    assert a.shape == (2, 32) and np.abs(a).max() <= bound and np.abs(a).max() > 0.5 * bound


def test_to_static_traces_the_adapters_exactly():
    model = tiny()
    lora.apply_lora(model, lora.LoraConfig(r=4, targets=("all-linear",)), seed=0)
    randomize_adapters(model)

    class Logits(lf.nn.Layer):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(ids).logits

    f = jit.to_static(Logits(model), input_spec=[jit.InputSpec(["B", "S"], "int64")], compiler="none")
    np.testing.assert_array_equal(f(lf.tensor(IDS)).numpy(), logits(model))


# ---- gradients against finite differences, float64 --------------------------------------------------
def _fd_check(model, ids, labels, entries=4, seed=0):
    """Autograd's dloss/dA and dloss/dB of every adapter against central differences at a few
    random entries each."""
    model.zero_grad()
    loss = model.loss(lf.tensor(ids), lf.tensor(labels))
    loss.backward()
    rng = np.random.default_rng(seed)
    eps = 1e-6
    for name, t in lora.adapter_state(model).items():
        g = t.grad.numpy()
        base = t.numpy().copy()
        for _ in range(entries):
            j = tuple(int(rng.integers(0, n)) for n in t.shape)
            vals = []
            for step in (eps, -eps):
                v = base.copy()
                v[j] += step
                t.set_value(v)
                with lf.no_grad():
                    vals.append(float(model.loss(lf.tensor(ids), lf.tensor(labels)).item()))
            t.set_value(base)
            num = (vals[0] - vals[1]) / (2 * eps)
            np.testing.assert_allclose(g[j], num, rtol=1e-6, atol=1e-9, err_msg=f"{name}{j}")


def _labels(ids):
    return np.concatenate([ids[:, 1:], ids[:, :1]], axis=1)


def test_adapter_gradients_match_finite_differences_float64():
    model = tiny()
    model.to("float64")
    lora.apply_lora(model, lora.LoraConfig(r=2, alpha=4, targets=("all-linear",)), seed=0)
    randomize_adapters(model)
    ids = IDS[:, :6]
    _fd_check(model, ids, _labels(ids))


@pytest.mark.parametrize(
    "qc",
    [
        QuantConfig(bits=4, group_size=8, method="rtn"),
        QuantConfig(bits=4, group_size=16, sym=False, method="rtn"),
        QuantConfig(bits=8, group_size=-1, method="rtn"),
    ],
    ids=["int4", "int4-asym", "int8"],
)
def test_adapter_gradients_through_a_quantized_base(qc):
    """QLoRA: the base stays quantized; the loss and the adapters' gradients equal those of a float64
    model holding the dequantized weights, and finite differences of the quantized model's loss."""
    qmodel = tiny()
    quantize_model(qmodel, qc, progress=False)
    qmodel.to("float64")
    ref = tiny()
    ref.to("float64")
    qlayers = dict(qmodel.named_sublayers())
    state = {}
    for k, v in qmodel.state_dict().items():
        if k.endswith(".scales"):
            p = k.removesuffix(".scales")
            state[p + ".weight"] = qlayers[p].weight.numpy()  # dequantized in float64
        elif not k.endswith((".qweight", ".zeros")):
            state[k] = v.numpy()
    ref.load_state_dict(state)
    cfg = lora.LoraConfig(r=2, alpha=4, targets=("q_proj", "v_proj", "down_proj"))
    for m in (qmodel, ref):
        lora.apply_lora(m, cfg, seed=0)
        randomize_adapters(m)
    assert isinstance(lora.lora_layers(qmodel)["model.layers.0.self_attn.q_proj"].base, lf.nn.QuantizedLinear)
    ids = IDS[:, :6]
    grads = {}
    for m in (qmodel, ref):
        loss = m.loss(lf.tensor(ids), lf.tensor(_labels(ids)))
        loss.backward()
        grads[id(m)] = (float(loss.item()), {k: t.grad.numpy() for k, t in lora.adapter_state(m).items()})
    (lq, gq), (lr, gr) = grads[id(qmodel)], grads[id(ref)]
    assert lq == pytest.approx(lr, rel=1e-12)
    for k in gr:
        np.testing.assert_allclose(gq[k], gr[k], rtol=1e-9, atol=1e-12, err_msg=k)
    _fd_check(qmodel, ids, _labels(ids), entries=3)


# ---- bad input ------------------------------------------------------------------------------------
def test_unknown_target_says_did_you_mean():
    with pytest.raises(lora.LoraError, match=r"unknown target module 'q_prj' \(did you mean 'q_proj'\?"):
        lora.apply_lora(tiny(), lora.LoraConfig(targets=("q_prj",)))
    with pytest.raises(lora.LoraError, match="'lm_head'.*the model's projections: down_proj"):
        lora.apply_lora(tiny(), lora.LoraConfig(targets=("lm_head",)))


@pytest.mark.parametrize("r", [0, -2])
def test_rank_must_be_positive(r):
    with pytest.raises(lora.LoraError, match=f"r must be a positive integer .*got {r}"):
        lora.LoraConfig(r=r)


def test_twice_is_an_error():
    model = tiny()
    lora.apply_lora(model, lora.LoraConfig())
    with pytest.raises(lora.LoraError, match="already has an adapter"):
        lora.apply_lora(model, lora.LoraConfig())


def test_adapter_files_errors_name_the_file(tmp_path):
    model = tiny()
    lora.apply_lora(model, lora.LoraConfig(r=2))
    lora.save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / lora.CONFIG_FILE).read_text())
    (tmp_path / "a" / lora.CONFIG_FILE).write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(lora.LoraError, match=r"adapter_config.json: use_dora=True is not supported"):
        lora.load_adapter(tiny(), tmp_path / "a")
    (tmp_path / "a" / lora.CONFIG_FILE).write_text(json.dumps({**cfg, "r": 3}))
    with pytest.raises(
        lora.LoraError,
        match=r"adapter_model.safetensors: .*lora_A.weight is \[2, 32\], the model's is \[3, 32\]",
    ):
        lora.load_adapter(tiny(), tmp_path / "a")
    with pytest.raises(lora.LoraError, match="no such file"):
        lora.load_adapter(tiny(), tmp_path / "missing")


def test_a_base_with_int8_activations_is_refused():
    """act_bits=8 rounds each layer's input: no gradient passes, so LoRA refuses the base."""
    from llmkit.quant.quantize import set_act_bits

    model = tiny()
    quantize_model(model, QuantConfig(bits=4, group_size=8, method="rtn"), progress=False)
    set_act_bits(model, 8)
    with pytest.raises(
        lora.LoraError, match=r"q_proj quantizes its activations too \(act_bits=8\).*without --act-bits"
    ):
        lora.apply_lora(model, lora.LoraConfig(targets=("q_proj",)))
    assert not lora.lora_layers(model)  # nothing changed
