"""int8 KV cache (``EngineConfig(kv_dtype="int8")``): rows quantized as stored, against float64
formulas written here; batch invariance kept; static files retyped at load."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmkit.framework.compiler import available
from llmkit.framework.ops.paged import dequantize_kv, quantize_kv
from llmkit.framework.opspec import OpError, table
from llmkit.infer import Engine, EngineConfig, SamplingParams
from llmkit.infer.engine import EngineConfigError

from .conftest import tiny_model
from .test_engine import prompts_of, signature

SEEDED = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=10, ignore_eos=True, logprobs=3)
COMPILERS = ["none", pytest.param("cinn", marks=pytest.mark.skipif(not available(), reason="no C compiler"))]


def q8_ref(x):
    """float64: s = max|x| / 127 per row, q = x / s rounded to nearest; (codes, scales)."""
    x = np.asarray(x, np.float64)
    s = np.abs(x).max(axis=-1, keepdims=True) / 127
    return np.round(x / np.where(s > 0, s, 1)), s


def test_quantize_rows_match_the_float64_formula():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 3, 19)) * rng.uniform(1e-3, 50, (5, 3, 1))).astype(np.float32)
    x[1, 2] = 0  # a zero row: scale 0, codes 0
    rows = quantize_kv(np, x)
    assert rows.dtype == np.int8 and rows.shape == (5, 3, 23)
    codes, s = q8_ref(x)
    got_s = np.ascontiguousarray(rows[..., 19:]).view(np.float32)
    np.testing.assert_allclose(got_s, s, rtol=1e-7)
    # codes equal the float64 formula's but at (float32-rounding) near-ties
    tie = np.abs(np.abs(x / np.where(s > 0, s, 1)) % 1 - 0.5) < 1e-4
    assert np.array_equal(rows[..., :19][~tie], codes[~tie])
    assert np.abs(rows[..., :19]).max() == 127 and not rows[1, 2].any()
    back = dequantize_kv(np, rows)
    assert back.dtype == np.float32
    assert np.all(np.abs(back - x) <= s * (0.5 + 1e-6))  # half a step at most


def attention64(q, keys, values, kv_len, starts, lens, scale):
    """float64 causal attention of q [B, Hq, S, D] (token-major segments) over keys/values [seg][T, Hk, D]."""
    hq, s = q.shape[1], q.shape[2]
    out = np.zeros(q.shape)
    for i, (t, st, m) in enumerate(zip(kv_len, starts, lens)):
        hk = keys[i].shape[1]
        for j in range(m):
            row, col = divmod(st + j, s)
            pos = t - m + j
            for h in range(hq):
                k, v = keys[i][: pos + 1, h // (hq // hk)], values[i][: pos + 1, h // (hq // hk)]
                sc = k @ q[row, h, col].astype(np.float64) * scale
                w = np.exp(sc - sc.max())
                out[row, h, col] = w @ v / w.sum()
    return out


@pytest.mark.parametrize("kernel", COMPILERS)
@pytest.mark.parametrize("d,bs,hq,hk", [(19, 4, 6, 2), (32, 16, 4, 2), (64, 16, 8, 1), (8, 4, 3, 3)])
def test_int8_pool_write_and_attention_match_float64(kernel, d, bs, hq, hk):
    """Write keys/values of three sequences (1 token; across block boundaries) into an int8 pool,
    then attend: decode form and prefill segments, against dequantized K/V in float64."""
    from llmkit.framework.compiler.native import NativeOp, build_c

    spec = {n: table()[n] for n in ("paged_kv_write", "paged_attention")}
    c = kernel == "cinn"
    op = {n: NativeOp(s, build_c(s.native.source)) if c else s.kernel for n, s in spec.items()}
    rng = np.random.default_rng(d + bs)
    nb, lens = 8, [1, bs + 3, 2 * bs + 1]
    tables = np.array([[5, 0, 0], [2, 7, 0], [1, 4, 6]], np.int64)
    pool = np.zeros((2, 2, nb, bs, hk, d + 4), np.int8)
    kv = [rng.standard_normal((2, hk, t, d)).astype(np.float32) * 3 for t in lens]
    for i, t in enumerate(lens):
        slots = np.array([tables[i, p // bs] * bs + p % bs for p in range(t)], np.int64)
        pool = op["paged_kv_write"](np, pool, kv[i][0:1], kv[i][1:2], slots, layer=1, inplace=True)
    assert pool.dtype == np.int8
    keys, values = [], []
    for i, t in enumerate(lens):  # what was stored, decoded by the float64 formula
        pos = [(tables[i, p // bs], p % bs) for p in range(t)]
        for j, out in ((0, keys), (1, values)):
            rows = np.stack([pool[1, j, blk, off] for blk, off in pos])  # (T, Hk, D + 4)
            codes, s = q8_ref(kv[i][j].transpose(1, 0, 2))  # (T, Hk, D)
            assert np.abs(rows[..., :d].astype(np.int64) - codes).max() <= 1  # ties aside
            stored = np.ascontiguousarray(rows[..., d:]).view(np.float32).astype(np.float64)
            np.testing.assert_allclose(stored, s, rtol=1e-7)
            out.append(rows[..., :d].astype(np.float64) * stored)
    scale = 1 / math.sqrt(d)
    q = rng.standard_normal((3, hq, 1, d)).astype(np.float32)
    got = op["paged_attention"](np, q, pool, tables, np.array(lens, np.int64), layer=1)
    want = attention64(q, keys, values, lens, range(3), [1] * 3, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    qp = rng.standard_normal((1, hq, 1 + 4 + lens[2], d)).astype(np.float32)  # segments: 1, 4 (a chunk), all
    i64 = lambda *v: np.array(v, np.int64)
    args = (qp, pool, tables, i64(*lens), i64(0, 1, 5), i64(1, 4, lens[2]))
    got = op["paged_attention"](np, *args, layer=1)
    want = attention64(qp, keys, values, lens, [0, 1, 5], [1, 4, lens[2]], scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_int8_pool_rejects_other_inputs_and_gradients():
    pool = np.zeros((1, 2, 2, 4, 1, 12), np.int8)
    k = np.ones((1, 1, 1, 8), np.float64)
    with pytest.raises(OpError, match="int8 pool stores and attends float32"):
        table()["paged_kv_write"].infer_meta(pool, k, k, np.zeros(1, np.int64))
    with pytest.raises(OpError, match="head dim"):
        table()["paged_attention"].infer_meta(
            np.ones((1, 2, 1, 12), np.float32), pool, np.zeros((1, 2), np.int64), np.ones(1, np.int64)
        )


@pytest.mark.parametrize("compiler", COMPILERS)
def test_int8_kv_keeps_batch_invariance_and_stays_close_to_float_kv(model, compiler):
    """The same request alone, in a batch of 6, and after a prefix hit: the same tokens and logprobs,
    bit for bit; its logprobs near the float32 cache's."""
    eng = Engine.from_model(model, config=EngineConfig(max_batch=8, compiler=compiler, kv_dtype="int8"))
    assert eng.runner.pool.dtype == np.int8 and eng.runner.pool.shape[-1] == model.config.head_dim + 4
    target = prompts_of([37], seed=5)[0]
    alone = signature(eng.generate([target], SEEDED)[0])
    eng.reset_prefix_cache()
    others = prompts_of([3, 18, 50, 9, 33], seed=6)
    batch = eng.generate([target, *others], [SEEDED] + [SEEDED.replace(seed=k) for k in range(5)])
    assert signature(batch[0]) == alone
    eng.reset_prefix_cache()
    eng.generate([target[:32] + [5]], SEEDED)
    hit = eng.generate([target], SEEDED)[0]
    assert hit.num_cached_tokens == 32 and signature(hit) == alone
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    ref = Engine.from_model(model, config=EngineConfig(max_batch=8, compiler=compiler))
    a, b = (e.generate([target], greedy)[0].logprobs[0] for e in (eng, ref))
    assert a.token_id == b.token_id
    assert max(abs(x[1] - y[1]) for x, y in zip(a.top, b.top)) < 0.02


def test_a_static_file_serves_an_int8_cache_as_its_model_does(tmp_path, tok):
    from llmkit.serve.export import export_model

    model = tiny_model(seed=3)
    path = export_model(model, tok, tmp_path / "m.llmkit", model_name="m")
    config = EngineConfig(max_batch=4, kv_dtype="int8")
    served = Engine.from_static(path, config)
    assert (
        served.runner.pool.dtype == np.int8
        and served.spec.block_bytes * 4 > Engine.from_static(path, EngineConfig(max_batch=4)).spec.block_bytes
    )  # int8 rows (and their scales) in a quarter of the bytes, or a little more
    prompts = prompts_of([6, 21], seed=9)
    live = [signature(o) for o in Engine.from_model(model, config=config).generate(prompts, SEEDED)]
    assert [signature(o) for o in served.generate(prompts, SEEDED)] == live
    again = Engine.from_static(path, config)  # the retyped programs as compiled and cached
    assert [signature(o) for o in again.generate(prompts, SEEDED)] == live
    # the score program, parsed and retyped at its first use, scores as the model's does
    scored = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3)

    def scores(engine):
        outs = engine.generate(prompts, scored)
        return [[x and (x.token_id, x.logprob, tuple(x.top)) for x in o.prompt_logprobs] for o in outs]

    assert scores(again) == scores(Engine.from_model(model, config=config))
    with pytest.raises(EngineConfigError, match="kv_dtype.*float32.*int8, got 'int4'"):
        Engine.from_static(path, EngineConfig(kv_dtype="int4"))
