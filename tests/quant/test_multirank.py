"""Quantization with a training run's parallel plan (llmkit/quant/multirank.py), on sim ranks: the
same bits on 1, 2 and 4 ranks; scales and zeros placed as their weights, and a served rank's shards
dequantize to its slice of the weight; a group straddling two shards is an error; a tp=2 training
checkpoint quantizes with its plan kept."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import blas
from llmkit.framework.distributed.parallel_plan import ParallelPlan
from llmkit.framework.placement import Replicate, Shard, local_region
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.quant import QuantConfig, QuantError, quantize_model
from llmkit.quant.multirank import Ranks, derive, placements

from .test_format import read_weight


def tiny(**overrides) -> LlamaForCausalLM:
    """Widths of several row blocks (gptq.ROWS = 64), uneven among 4 ranks (344 = 5 blocks + 24)."""
    lf.seed(0)
    cfg = LlamaConfig.from_preset("tiny", **{"vocab_size": 320, "num_hidden_layers": 2, **overrides})
    return LlamaForCausalLM(cfg).eval()


def quantized_state(cfg: QuantConfig, n: int, lm_head: bool = False) -> dict[str, np.ndarray]:
    model = tiny()
    ids = np.random.default_rng(0).integers(3, 320, (20, 24))  # 2 batches of CALIB_BATCH = 16
    quantize_model(model, cfg, ids if cfg.method == "gptq" else None, lm_head, progress=False, ranks=Ranks(n))
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "cfg,lm_head",
    [
        (QuantConfig(4, 32, False, "gptq"), True),
        (QuantConfig(8, -1, True, "gptq"), False),
        (QuantConfig(4, 64, True, "rtn"), True),
    ],
    ids=["int4-g32-asym-gptq-head", "int8-gptq", "int4-g64-rtn-head"],
)
def test_quantized_weights_are_the_same_bits_on_1_2_and_4_ranks(cfg, lm_head):
    one = quantized_state(cfg, 1, lm_head)
    assert "lm_head.qweight" in one if lm_head else "lm_head.weight" in one
    for n in (2, 4):
        got = quantized_state(cfg, n, lm_head)
        assert got.keys() == one.keys()
        for k in one:
            assert got[k].dtype == one[k].dtype and got[k].tobytes() == one[k].tobytes(), (n, k)


@pytest.mark.skipif(blas.get_blas_threads() is None, reason="numpy's BLAS is not OpenBLAS")
def test_the_bits_do_not_depend_on_the_processes_blas_threads():
    """One process and N ranks start with different BLAS thread counts (``--nproc`` shares the cores
    out); OpenBLAS's float32 products round differently with it on some CPUs (AMD EPYC, AVX-512)."""
    cfg, before = QuantConfig(4, 32, False, "gptq"), blas.get_blas_threads()
    try:
        states = []
        for n in (1, 3):
            blas.set_blas_threads(n)
            states.append(quantized_state(cfg, 1))
            assert blas.get_blas_threads() == n  # restored after quantizing
    finally:
        blas.set_blas_threads(before)
    for k in states[0]:
        assert states[1][k].tobytes() == states[0][k].tobytes(), k


def test_ranks_take_contiguous_row_blocks_and_gather_joins_them():
    ranks = Ranks(4)
    rows = ranks.rows(344)  # 6 blocks: 2, 2, 1, 1 of them
    assert [(b.start, b.stop) for b in rows][:3] == [(0, 64), (64, 128), (128, 192)] and rows[-1].stop == 344
    x = np.arange(344 * 3).reshape(344, 3)
    np.testing.assert_array_equal(ranks.gather(np.concatenate([x[b] for b in rows]), 344), x)


def shapes(model, cfg=None):
    return {p: m.weight.shape for p, m in model.named_sublayers() if p.startswith("model.layers.")
            and hasattr(m, "weight") and m.weight.ndim == 2}  # fmt: skip


def test_scales_and_zeros_are_placed_as_their_weights():
    plan = ParallelPlan.make("llama", tp=2)
    assert placements(Shard(0), QuantConfig(4, 32)) == dict.fromkeys(("qweight", "scales", "zeros"), Shard(0))
    assert placements(Shard(1), QuantConfig(4, 32)) == dict.fromkeys(("qweight", "scales", "zeros"), Shard(1))
    assert placements(Shard(1), QuantConfig(8, -1))["scales"] == Replicate()  # one scale spans every shard
    model = tiny(intermediate_size=384)  # down_proj: tp=2 shards of 192 input columns, 6 groups of 32
    q = derive(plan, shapes(model), QuantConfig(4, 32, sym=False))
    assert q.mesh == plan.mesh and q.params[-len(plan.params) :] == plan.params
    for name, want in [
        ("model.layers.1.self_attn.q_proj.qweight", Shard(0)),
        ("model.layers.0.self_attn.o_proj.scales", Shard(1)),
        ("model.layers.1.mlp.down_proj.zeros", Shard(1)),
        ("model.layers.0.mlp.up_proj.zeros", Shard(0)),
        ("model.layers.0.input_layernorm.weight", Replicate()),
    ]:
        assert q.tp_placement(name) == want, name
    assert len(q.params) == len(plan.params) + 7 * 3  # one rule per tensor of the 7 linears, all layers
    saved = ParallelPlan.from_json(json.loads(json.dumps(q.to_json())))
    assert saved == q
    sym = derive(plan, shapes(model), QuantConfig(8, -1))
    assert sym.tp_placement("model.layers.0.mlp.down_proj.scales") == Replicate()
    assert not any(g.endswith(".zeros") for g, _ in sym.params)


@pytest.mark.parametrize("cfg", [QuantConfig(4, 32, False, "rtn"), QuantConfig(8, -1, True, "rtn")], ids=str)
def test_each_served_rank_dequantizes_its_shards_to_its_slice_of_the_weight(cfg):
    """Cut every quantized tensor by the derived plan (tp=2): rank r's qweight, scales and zeros,
    read by the format's independent numpy dequantizer, give rank r's region of the whole weight."""
    model = tiny(intermediate_size=384)
    plan = derive(ParallelPlan.make("llama", tp=2), shapes(model), cfg)
    quantize_model(model, cfg, progress=False)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        t = {k: state.get(f"{path}.{k}") for k in ("qweight", "scales", "zeros")}
        whole = read_weight(t["qweight"], t["scales"], t["zeros"], cfg.bits, cfg.group_size)
        weight = plan.tp_placement(f"{path}.weight")
        for r in range(2):

            def mine(k):
                a = t[k]
                return (
                    None
                    if a is None
                    else a[local_region(a.shape, [2], [plan.tp_placement(f"{path}.{k}")], [r])]
                )

            got = read_weight(mine("qweight"), mine("scales"), mine("zeros"), cfg.bits, cfg.group_size)
            np.testing.assert_array_equal(got, whole[local_region(whole.shape, [2], [weight], [r])])


def test_a_group_straddling_two_shards_is_an_error_naming_weight_group_and_shard():
    model = tiny(intermediate_size=384)  # o_proj [128, 128]: tp=2 shards of 64 input columns
    message = (
        r"o_proj.weight \[128, 128\] is row parallel .* tp=2: shards of 64 .* groups of 48 input columns"
    )
    with pytest.raises(QuantError, match=message):
        derive(ParallelPlan.make("llama", tp=2), shapes(model), QuantConfig(4, 48))
    with pytest.raises(QuantError, match=r"shards of 32 .* groups of 64"):
        derive(ParallelPlan.make("llama", tp=4), shapes(model), QuantConfig(4, 64))
    derive(ParallelPlan.make("llama", tp=4), shapes(model), QuantConfig(4, 32))  # 32 | 32: fine
    derive(ParallelPlan.make("llama", tp=4), shapes(model), QuantConfig(8, -1))  # per channel: R scales


def test_nproc_relaunches_the_same_command_under_mpiexec(monkeypatch):
    from llmkit.quant.cli import _without
    from llmkit.train.cli import nproc_command

    argv = ["--model", "runs/x", "--nproc", "2", "--bits", "4", "--hostfile=h", "--quiet"]
    rest = _without(argv, {"--nproc", "--hostfile"})
    assert rest == ["--model", "runs/x", "--bits", "4", "--quiet"]
    monkeypatch.setattr("llmkit.train.trainer.cpu_count", lambda: 2)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/mpiexec")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cmd, env = nproc_command(4, None, ["quantize", *rest])
    assert cmd[0] == "/usr/bin/mpiexec" and "--oversubscribe" in cmd  # 4 ranks on 2 cores
    assert cmd[cmd.index("-n") :] == ["-n", "4", sys.executable, "-m", "llmkit", "quantize", *rest]
    assert env["OMP_NUM_THREADS"] == "1"
