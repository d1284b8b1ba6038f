"""Hand-written C kernels (``OpSpec.native``) and whole-function replays (``compiler/native/``).

Each kernel is checked against a numpy float64 formula written here (or in ``test_op_table.py``'s
independent references), on sizes that exercise its vector blocks and scalar tails; replays are
checked bitwise against the op-by-op run of the same native executor, over calls whose inputs
change, and for the ways a call must fall back to the op-by-op run.
"""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest
from test_op_table import (
    _codes,
    _dequant_ref,
    _paged_attention_ref,
    _paged_write_ref,
    _sdpa_grad_ref,
    _sdpa_lse_ref,
)  # tests/framework is on sys.path

from llmkit.framework import ir
from llmkit.framework.compiler import available
from llmkit.framework.compiler.native import NativeOp, build_c
from llmkit.framework.executor import Executor
from llmkit.framework.opspec import Meta, OpError, table

pytestmark = pytest.mark.skipif(not available(), reason="no working C compiler")


def native(name: str, *arrays, **attrs) -> NativeOp:
    """``name``'s kernel (one rendered for ``arrays`` and ``attrs`` where its source depends on them)."""
    spec = table()[name]
    src = spec.native.source
    return NativeOp(
        spec, build_c(src(*[Meta(a.shape, a.dtype) for a in arrays], **attrs) if callable(src) else src)
    )


def applies(name: str, *arrays, **attrs) -> bool:
    return table()[name].native.applies(*[Meta(a.shape, a.dtype) for a in arrays], **attrs)


# ---- kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n", [(1, 256, 200), (3, 100, 70), (5, 7, 9), (2, 8, 64), (1, 1, 1)])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_rows1_matches_float64(m, k, n, transposed, bias):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n) if transposed else (n, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    args = (x, w, b) if bias else (x, w)
    assert applies("tiled_linear", *args, rows=1, transposed=transposed)
    got = native("tiled_linear")(np, *args, rows=1, transposed=transposed)
    w64 = w.astype(np.float64) if transposed else w.astype(np.float64).T
    want = x.astype(np.float64) @ w64 + (b if bias else 0)
    assert got.dtype == np.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(k))


@pytest.mark.parametrize("transposed", [True, False])
def test_tiled_linear_rows_are_independent_bitwise(transposed):
    """Batch invariance: a row's result is the same bits whatever rows come with it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 200) if transposed else (200, 96)).astype(np.float32)
    xs = rng.standard_normal((8, 96)).astype(np.float32)
    op = native("tiled_linear")
    together = op(np, xs, w, rows=1, transposed=transposed)
    for i in range(8):
        alone = op(np, xs[i : i + 1], w, rows=1, transposed=transposed)
        assert np.array_equal(alone[0], together[i])
    assert np.array_equal(op(np, xs[3:6], w, rows=1, transposed=transposed), together[3:6])


@pytest.mark.parametrize("transposed", [True, False])
def test_tiled_linear_threads_do_not_change_a_bit(monkeypatch, transposed):
    import llmkit.framework.compiler.native.run as native_mod

    rng = np.random.default_rng(5)
    for m in (8, 40):  # the decode path and the packed one
        x = rng.standard_normal((m, 200)).astype(np.float32)
        w = rng.standard_normal((200, 700) if transposed else (700, 200)).astype(np.float32)
        got = {}
        for n in (1, 2, 3):
            monkeypatch.setattr(native_mod, "_threads", lambda n=n: n)
            got[n] = native("tiled_linear")(np, x, w, rows=1, transposed=transposed)
        assert np.array_equal(got[1], got[2]) and np.array_equal(got[1], got[3])


def test_the_engines_ops_declare_it_and_have_their_kernels():
    """The inference engine's ops say so in their spec (trait ``inference``, no Tensor method), and
    each comes with its hand-written kernel from compiler/native/."""
    import llmkit.framework as lf

    engine = sorted(n for n, s in table().items() if "inference" in s.traits)
    assert engine == [
        "paged_attention",
        "paged_kv_write",
        "quant_linear",
        "quant_linears",
        "tiled_linear",
        "tiled_linear_logprobs",
        "tiled_linear_swiglu",
    ]
    for name in engine:
        assert table()[name].native is not None and "internal" in table()[name].traits
        assert not hasattr(lf.Tensor, name)


def test_tiled_linear_native_for_any_tile_size_float32_only():
    x, w = np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32)
    assert applies("tiled_linear", x, w, rows=1)
    assert applies("tiled_linear", x, w, rows=8)  # prefill tiles: every row is computed alone anyway
    assert not applies("tiled_linear", x.astype(np.float64), w.astype(np.float64), rows=1)


@pytest.mark.parametrize("m", [16, 17, 40])
@pytest.mark.parametrize("k,n", [(1, 9), (63, 24), (64, 8), (130, 70), (200, 200), (0, 16)])
def test_tiled_linear_packed_path_matches_float64_and_the_one_row_bits(m, k, n):
    """From 16 rows the kernel packs W for a GEMM micro-kernel: same values, same bits per row."""
    rng = np.random.default_rng(m + 7 * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    op = native("tiled_linear")
    got = op(np, x, w, b, rows=8, transposed=True)
    want = x.astype(np.float64) @ w.astype(np.float64) + b
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(max(k, 1)))
    for i in (0, m // 2, m - 1):  # the decode path (one row) gives the same bits
        assert np.array_equal(op(np, x[i : i + 1], w, b, rows=1, transposed=True)[0], got[i])


def _panels(w_in_out: np.ndarray) -> np.ndarray:
    """[in, out] -> [out / 16, in, 16], written out here: p[j, k, c] = w[k, 16 j + c]."""
    k, n = w_in_out.shape
    out = np.empty((n // 16, k, 16), w_in_out.dtype)
    for j in range(n // 16):
        out[j] = w_in_out[:, 16 * j : 16 * j + 16]
    return out


@pytest.mark.parametrize("m", [1, 2, 6, 8, 15, 16, 40, 400])
@pytest.mark.parametrize("k,n", [(1, 16), (63, 32), (200, 208), (256, 688), (700, 48), (0, 16)])
def test_tiled_linear_panels_match_float64_and_the_other_layouts_bits(m, k, n):
    """Weights packed in 16-column panels: the same values, and the same bits as [in, out] and as
    each row alone (every output is the same k-ordered chain of FMAs in every path: panels taken
    whole, and from 2^18 floats of x (m 400, k 700) in chunks of k)."""
    from llmkit.framework.ops.paged import pack_panels

    rng = np.random.default_rng(m + 3 * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    p = _panels(w)
    np.testing.assert_array_equal(pack_panels(w), p)
    assert applies("tiled_linear", x, p, b, rows=1, panel=16)
    op = native("tiled_linear")
    got = op(np, x, p, b, rows=1, panel=16)
    want = x.astype(np.float64) @ w.astype(np.float64) + b
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(max(k, 1)))
    assert np.array_equal(got, op(np, x, w, b, rows=1, transposed=True))
    for i in (0, m - 1):
        assert np.array_equal(op(np, x[i : i + 1], p, b, rows=1, panel=16)[0], got[i])


def test_tiled_linear_panels_threads_do_not_change_a_bit(monkeypatch):
    import llmkit.framework.compiler.native.run as native_mod

    rng = np.random.default_rng(9)
    w = _panels(rng.standard_normal((200, 704)).astype(np.float32))
    for m in (8, 40):
        x = rng.standard_normal((m, 200)).astype(np.float32)
        got = {}
        for n in (1, 2, 3):
            monkeypatch.setattr(native_mod, "_threads", lambda n=n: n)
            got[n] = native("tiled_linear")(np, x, w, rows=1, panel=16)
        assert np.array_equal(got[1], got[2]) and np.array_equal(got[1], got[3])


def test_tiled_linear_panel_shapes_and_width_are_checked():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(OpError, match=r"panel=16 weight must be \[out/16, in, 16\]"):
        table()["tiled_linear"].infer_meta(Meta(x.shape, x.dtype), Meta((2, 4, 8), x.dtype), panel=16)
    with pytest.raises(OpError, match=r"inner dims differ \(4 vs 5"):
        table()["tiled_linear"].infer_meta(Meta(x.shape, x.dtype), Meta((2, 5, 16), x.dtype), panel=16)
    with pytest.raises(OpError, match="'panel'=8 is invalid: must be 0 or 16"):
        table()["tiled_linear"].bind({"panel": 8})
    tls = table()["tiled_linear_swiglu"]
    with pytest.raises(OpError, match="the gate and up weights must have one shape and dtype"):
        tls.infer_meta(Meta(x.shape, x.dtype), Meta((2, 4, 16), x.dtype), Meta((3, 4, 16), x.dtype), panel=16)
    with pytest.raises(OpError, match=r"tiled_linear_swiglu: a panel=16 weight must be \[out/16, in, 16\]"):
        tls.infer_meta(Meta(x.shape, x.dtype), Meta((2, 4, 8), x.dtype), Meta((2, 4, 8), x.dtype), panel=16)


@pytest.mark.parametrize("m", [1, 5, 8, 16, 33])
@pytest.mark.parametrize("k,n", [(1, 16), (64, 80), (256, 688), (0, 32)])
def test_tiled_linear_swiglu_matches_float64_and_rows_are_independent(m, k, n):
    """The engine's fused MLP: silu(x Wg) * (x Wu) with panel weights, against float64; a row's bits
    do not depend on the other rows, and its products are tiled_linear's (same chain, same bits)."""
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wg, wu = (rng.standard_normal((k, n)).astype(np.float32) / 8 for _ in range(2))
    pg, pu = _panels(wg), _panels(wu)
    assert applies("tiled_linear_swiglu", x, pg, pu, rows=1, panel=16)
    assert not applies("tiled_linear_swiglu", x, wg, wu, rows=1, transposed=True)  # panels only
    op = native("tiled_linear_swiglu")
    got = op(np, x, pg, pu, rows=1, panel=16)
    a, b = x.astype(np.float64) @ wg, x.astype(np.float64) @ wu
    np.testing.assert_allclose(got, a / (1 + np.exp(-a)) * b, rtol=1e-5, atol=1e-5 * math.sqrt(max(k, 1)))
    for i in (0, m - 1):
        assert np.array_equal(op(np, x[i : i + 1], pg, pu, rows=1, panel=16)[0], got[i])
    ga = native("tiled_linear")(np, x, pg, rows=1, panel=16)  # the products, as tiled_linear computes them
    gb = native("tiled_linear")(np, x, pu, rows=1, panel=16)
    np.testing.assert_allclose(got, ga / (1 + np.exp(-ga.astype(np.float64))) * gb, rtol=2e-6, atol=1e-7)


def test_tiled_linear_swiglu_threads_do_not_change_a_bit(monkeypatch):
    import llmkit.framework.compiler.native.run as native_mod

    rng = np.random.default_rng(11)
    pg, pu = (_panels(rng.standard_normal((200, 704)).astype(np.float32) / 8) for _ in range(2))
    for m in (8, 40):
        x = rng.standard_normal((m, 200)).astype(np.float32)
        got = {}
        for n in (1, 2, 3):
            monkeypatch.setattr(native_mod, "_threads", lambda n=n: n)
            got[n] = native("tiled_linear_swiglu")(np, x, pg, pu, rows=1, panel=16)
        assert np.array_equal(got[1], got[2]) and np.array_equal(got[1], got[3])


@pytest.mark.parametrize("d", [3, 8, 19, 32, 64, 128])
@pytest.mark.parametrize("bs,hq,hk", [(4, 4, 2), (16, 4, 2), (16, 20, 4), (16, 3, 3), (8, 6, 2)])
def test_paged_attention_decode_matches_float64(d, bs, hq, hk):
    # blocks of 8 and 16 positions take the eight-scores-at-a-time path (with tails: 9, 12 and 1
    # keys; 41 with bs 16), 20 query heads sum their softmax in two groups, g 2 and 3 pair heads
    rng = np.random.default_rng(d)
    b, nb, layers = 3, 6, 2
    q = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
    pool = rng.standard_normal((layers, 2, nb, bs, hk, d)).astype(np.float32)
    tables = np.array([[5, 1, 0], [2, 3, 4], [0, 0, 0]], np.int64)
    kv_len = np.array([9, 12 if bs < 16 else 41, 1], np.int64)
    assert applies("paged_attention", q, pool, tables, kv_len, layer=1)
    got = native("paged_attention")(np, q, pool, tables, kv_len, layer=1)
    want = _paged_attention_ref(q.astype(np.float64), pool.astype(np.float64), tables, kv_len, layer=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize(
    "b,hq,hk,s,t,d,dv,causal",
    [(1, 4, 2, 77, 77, 5, 12, True), (2, 3, 1, 40, 150, 5, 12, True), (1, 2, 2, 33, 70, 5, 12, False)]
    + [(2, 4, 2, 70, 90, 16, 24, True)],  # head dims of whole vectors: k and v transposed 8 x 8 at a time
)
def test_flash_attention_over_many_tiles_matches_float64(dt, b, hq, hk, s, t, d, dv, causal):
    """The flash kernels (forward with its log-sum-exp, backward with and without it) over several
    query and key tiles, register-tile edges and padded head dims, q/k/v/g as transposed views."""
    rng = np.random.default_rng(s * t + d)
    q, k, v, g = (rng.standard_normal((b, n, h, e)).astype(dt).transpose(0, 2, 1, 3)
                  for n, h, e in ((s, hq, d), (t, hk, d), (t, hk, dv), (s, hq, dv)))  # fmt: skip
    out, lse = native("scaled_dot_product_attention_lse", q, k, v, is_causal=causal)(
        np, q, k, v, is_causal=causal
    )
    want_out, want_lse = _sdpa_lse_ref(*(x.astype(np.float64) for x in (q, k, v)), is_causal=causal)
    want = _sdpa_grad_ref(*(x.astype(np.float64) for x in (g, want_out, q, k, v)), is_causal=causal)
    ins = (g, out, lse, q, k, v)
    got = native("scaled_dot_product_attention_lse_grad", *ins, is_causal=causal)(np, *ins, is_causal=causal)
    ins = (g, out, q, k, v)
    got2 = native("scaled_dot_product_attention_grad", *ins, is_causal=causal)(np, *ins, is_causal=causal)
    tol = dict(rtol=1e-4, atol=1e-5) if dt == np.float32 else dict(rtol=1e-10, atol=1e-11)
    for x, w in zip((out, lse, *got, *got2), (want_out, want_lse, *want, *want)):
        assert x.dtype == dt
        np.testing.assert_allclose(x, w, **tol)


def test_paged_attention_threads_and_batch_do_not_change_a_bit(monkeypatch):
    import llmkit.framework.compiler.native.run as native_mod

    rng = np.random.default_rng(7)
    b, hq, hk, d, nb, bs = 4, 8, 2, 32, 64, 16
    q = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
    pool = rng.standard_normal((1, 2, nb, bs, hk, d)).astype(np.float32)
    tables = rng.permutation(nb)[: b * 16].reshape(b, 16).astype(np.int64)
    kv_len = np.array([250, 7, 129, 200], np.int64)  # enough work for threads
    got = {}
    for n in (1, 2):
        monkeypatch.setattr(native_mod, "_threads", lambda n=n: n)
        got[n] = native("paged_attention")(np, q, pool, tables, kv_len)
    assert np.array_equal(got[1], got[2])
    alone = native("paged_attention")(np, q[2:3], pool, tables[2:3], kv_len[2:3])
    assert np.array_equal(alone[0], got[1][2])


def test_paged_attention_native_rejects_bad_lengths_with_the_ops_error():
    q = np.zeros((1, 2, 1, 4), np.float32)
    pool = np.zeros((1, 2, 2, 4, 1, 4), np.float32)
    with pytest.raises(OpError, match="paged_attention"):
        native("paged_attention")(np, q, pool, np.array([[0, 1]]), np.array([9]))  # 9 > 2 blocks of 4


@pytest.mark.parametrize("d", [8, 32, 19])
def test_paged_attention_prefill_segments_match_float64(d):
    """Prefill form: segments of one flattened row, one a chunk after cached keys, tokens in no
    segment (zeros), causal within a segment (bottom-right aligned)."""
    rng = np.random.default_rng(d + 1)
    hq, hk, nb, bs = 4, 2, 8, 4
    q = rng.standard_normal((1, hq, 11, d)).astype(np.float32)
    pool = rng.standard_normal((2, 2, nb, bs, hk, d)).astype(np.float32)
    tables = np.array([[5, 1, 0], [2, 3, 4], [7, 6, 0]], np.int64)
    kv_len = np.array([4, 10, 3], np.int64)
    q_start, q_len = np.array([0, 4, 8], np.int64), np.array([4, 3, 2], np.int64)  # token 10: none
    args = (q, pool, tables, kv_len, q_start, q_len)
    assert applies("paged_attention", *args, layer=1)
    got = native("paged_attention")(np, *args, layer=1)
    want = _paged_attention_ref(
        q.astype(np.float64), pool.astype(np.float64), tables, kv_len, q_start, q_len, layer=1
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not got[0, :, 7].any() and not got[0, :, 10].any()  # tokens in no segment


def test_paged_attention_a_token_has_the_same_bits_however_it_is_segmented():
    """Batch invariance of prefill: token j of a prompt gets the same bits prefilled whole, in
    chunks after its cached prefix, next to other sequences, or as a decode step."""
    rng = np.random.default_rng(3)
    hq, hk, d, nb, bs = 8, 4, 32, 16, 16
    pool = rng.standard_normal((1, 2, nb, bs, hk, d)).astype(np.float32)
    table = np.array([[3, 9, 4]], np.int64)
    q = rng.standard_normal((1, hq, 40, d)).astype(np.float32)
    op = native("paged_attention")
    i64 = lambda *v: np.array(v, np.int64)
    whole = op(np, q, pool, table, i64(40), i64(0), i64(40))
    chunk = op(np, q[:, :, 25:], pool, table, i64(40), i64(0), i64(15))  # after 25 cached keys
    assert np.array_equal(chunk, whole[:, :, 25:])
    other = rng.standard_normal((1, hq, 7, d)).astype(np.float32)
    both = op(
        np,
        np.concatenate([other, q], 2),
        pool,
        np.concatenate([[[1, 2, 0]], table]),
        i64(7, 40),
        i64(0, 7),
        i64(7, 40),
    )
    assert np.array_equal(both[:, :, 7:], whole)
    step = op(np, q[:, :, 39:].transpose(2, 1, 0, 3), pool, table, i64(40))  # decode form, one token
    assert np.array_equal(step[:, :, 0], whole[0, :, 39][None])


@pytest.mark.parametrize(
    "starts,lens,kv,match",
    [
        ([0, 1], [2, 2], [2, 2], "overlaps an earlier one"),
        ([0, 3], [3, 3], [3, 2], "q_len <= kv_len"),
        ([0, 2], [2, 2], [2, 2], "lie within one row"),
    ],
)
def test_paged_attention_prefill_bad_segments_raise_the_ops_error(starts, lens, kv, match):
    q = np.zeros((2, 2, 3, 4), np.float32)
    pool = np.zeros((1, 2, 4, 4, 1, 4), np.float32)
    args = (q, pool, np.zeros((2, 1), np.int64), np.array(kv), np.array(starts), np.array(lens))
    with pytest.raises(OpError, match=match):
        native("paged_attention")(np, *args)
    with pytest.raises(OpError, match=match):  # the reference kernel says the same
        table()["paged_attention"].kernel(np, *args)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_paged_kv_write_matches_reference(dtype):
    rng = np.random.default_rng(1)
    pool = rng.standard_normal((2, 2, 3, 2, 2, 4)).astype(dtype)
    k, v = rng.standard_normal((2, 1, 2, 4, 4)).astype(dtype)
    slots = np.array([4, -1, 0, 5], np.int64)
    got = native("paged_kv_write")(np, pool, k, v, slots, layer=1)
    np.testing.assert_array_equal(got, _paged_write_ref(pool, k, v, slots, layer=1))
    assert got is not pool  # not in place unless asked
    same = native("paged_kv_write")(np, pool, k, v, slots, layer=1, inplace=True)
    assert same is pool
    np.testing.assert_array_equal(pool, got)


def test_paged_kv_write_rejects_a_slot_outside_the_pool_before_writing():
    pool = np.zeros((1, 2, 2, 2, 1, 2), np.float32)
    before = pool.copy()
    k = np.ones((1, 1, 2, 2), np.float32)
    with pytest.raises(OpError, match="paged_kv_write"):
        native("paged_kv_write")(np, pool, k, k, np.array([1, 4], np.int64), inplace=True)
    np.testing.assert_array_equal(pool, before)


def test_index_select_rows_any_dtype_and_negative_indices():
    rng = np.random.default_rng(2)
    for x in (rng.standard_normal((7, 5)), rng.integers(0, 9, (7, 3, 2)), rng.random((7,)) > 0.5):
        idx = np.array([0, 6, -1, 3, 3], np.int64)
        assert applies("index_select", x, idx)
        np.testing.assert_array_equal(native("index_select")(np, x, idx), x[[0, 6, 6, 3, 3]])
    with pytest.raises(IndexError, match="out of bounds"):  # the reference kernel's own error
        native("index_select")(np, np.zeros((3, 2)), np.array([3], np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_index_add_accumulates_repeats_in_order_as_numpy_add_at(dtype):
    """The embedding's gradient: rows added at their indices, repeats accumulating in index order,
    so the bits are numpy's add.at's (written out here as a loop)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, 3, 5)).astype(dtype)
    idx = np.array([2, 8, -1, 2, 0, 2, 5], np.int64)
    src = rng.standard_normal((7, 3, 5)).astype(dtype)
    assert applies("index_add", x, idx, src)
    want = x.copy()
    for i, r in enumerate(idx):
        want[r] = want[r] + src[i]
    got = native("index_add")(np, x, idx, src)
    assert got.dtype == dtype and np.array_equal(got, want)
    assert not np.array_equal(x, want)  # x itself is left alone
    assert not applies("index_add", x.astype(np.int64), idx, src.astype(np.int64))
    assert not applies("index_add", x, idx, src, axis=1)
    with pytest.raises(IndexError):  # the reference kernel's own error
        native("index_add")(np, x, np.array([9], np.int64), src[:1])


QUANT = [  # bits, out, in, group_size, asymmetric: vector blocks, remainders, tails, short last groups
    (4, 40, 344, 128, False),
    (4, 33, 96, 32, True),
    (4, 9, 70, 6, True),
    (4, 5, 22, -1, False),
    (4, 17, 256, 64, False),
    (8, 17, 100, -1, False),
    (8, 9, 70, 16, False),
    (8, 24, 96, 32, False),
]


def _quantized(rng, bits, out, n_in, group, asym):
    _, qweight = _codes(rng, out, n_in, bits)
    groups = 1 if group == -1 else -(-n_in // group)
    scales = rng.uniform(0.01, 0.1, (out, groups)).astype(np.float32)
    zeros = rng.integers(0, 16, (out, groups)).astype(np.uint8) if asym else None
    return [a for a in (qweight, scales, zeros) if a is not None]


# the kernel's paths by instruction set: as built here, and with the wider sets hidden from its
# code (after the intrinsics header, which would define them again)
ISAS = {"native": "", "avx2": "#undef __AVX512F__\n", "generic": "#undef __AVX512F__\n#undef __AVX2__\n"}


def quant_native(isa: str) -> NativeOp:
    spec = table()["quant_linear"]
    head = "#include <immintrin.h>\n"
    source = spec.native.source.replace(head, head + ISAS[isa], 1) if ISAS[isa] else spec.native.source
    return NativeOp(spec, build_c(source))


@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("bits,out,n_in,group,asym", QUANT)
def test_quant_linear_matches_float64_and_rows_are_independent_bitwise(bits, out, n_in, group, asym, isa):
    rng = np.random.default_rng(out + n_in)
    w = _quantized(rng, bits, out, n_in, group, asym)
    attrs = {"bits": bits, "group_size": group}
    wf = _dequant_ref(*w, **attrs)  # float64, read from the format in test_op_table
    op = quant_native(isa)
    x = rng.standard_normal((13, n_in)).astype(np.float32)
    y = op(np, x, *w, **attrs)
    scale = np.abs(x.astype(np.float64)) @ np.abs(wf).T
    np.testing.assert_allclose(y, x.astype(np.float64) @ wf.T, rtol=0, atol=1e-6 * scale.max())
    for rows in (slice(0, 1), slice(4, 5), slice(2, 4), slice(3, 11)):  # any batch: the same bits
        assert np.array_equal(op(np, np.ascontiguousarray(x[rows]), *w, **attrs), y[rows])


def test_quant_linear_threads_do_not_change_a_bit(monkeypatch):
    import llmkit.framework.compiler.native.run as native_mod

    rng = np.random.default_rng(5)
    for bits, asym in ((4, True), (8, False)):
        w = _quantized(rng, bits, 300, 256, 64, asym)
        x = rng.standard_normal((4, 256)).astype(np.float32)
        got = []
        for n in (1, 2, 3):
            monkeypatch.setattr(native_mod, "_threads", lambda n=n: n)
            got.append(native("quant_linear")(np, x, *w, bits=bits, group_size=64))
        assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], got[2])


def test_quant_linear_native_takes_float32_and_whole_bytes_per_group():
    x, q, s = np.zeros((2, 12), np.float32), np.zeros((3, 6), np.uint8), np.zeros((3, 2), np.float32)
    assert applies("quant_linear", x, q, s, bits=4, group_size=6, rows=1)
    assert not applies("quant_linear", x, q, np.zeros((3, 3), np.float32), bits=4, group_size=5)  # odd groups
    assert not applies("quant_linear", x.astype(np.float64), q, s.astype(np.float64), bits=4, group_size=6)


# ---- replays ------------------------------------------------------------------------------------


def _decode_like() -> ir.Program:
    """A function of only native kernels, fused groups and views: gather, two one-row products."""
    return ir.parse(
        """
module {
  func @main(%ids: i64[B], %emb: f32[50, 24], %w1: f32[24, 40], %w2: f32[16, 40])
      -> (f32[B, 1, 16], f32[B, 40]) {
    %0 = llm.index_select(%emb, %ids) : f32[B, 24]
    %1 = llm.tiled_linear(%0, %w1) {rows = 1, transposed = true} : f32[B, 40]
    %2 = llm.silu(%1) : f32[B, 40]
    %3 = llm.reshape(%2) {shape = [B, 1, 40]} : f32[B, 1, 40]
    %4 = llm.tiled_linear(%3, %w2) {rows = 1} : f32[B, 1, 16]
    return %4, %2
  }
}
"""
    )


def _compiled(p: ir.Program) -> ir.Program:
    from llmkit.framework.jit.compile import prepare

    return prepare(p, "cinn")


def _inputs(rng, b):
    return [
        rng.integers(0, 50, b).astype(np.int64),
        rng.standard_normal((50, 24)).astype(np.float32),
        rng.standard_normal((24, 40)).astype(np.float32),
        rng.standard_normal((16, 40)).astype(np.float32),
    ]


def test_replay_equals_op_by_op_bitwise_across_calls():
    p = _compiled(_decode_like())
    replayed = Executor(p, native=True)
    stepwise = Executor(p, native=True)
    stepwise._replays = None  # the same kernels, one Python call per op
    rng = np.random.default_rng(0)
    for b in (1, 3, 1, 8, 3):
        ins = _inputs(rng, b)
        want = stepwise.run(ins)
        gc.collect()  # the plan's own buffers must outlive the planning call
        got = replayed.run(ins)
        for g, w in zip(got, want):
            assert g.shape == w.shape and np.array_equal(g, w)
        if b == 8:
            arena_at_8 = replayed._replays._arena.nbytes
    plans = replayed._replays.plans
    assert sum(v is not None for v in plans.values()) == 3  # one plan per batch size
    # their intermediates share one arena, grown for the largest plan (batch 8) and no more
    assert replayed._replays._arena.nbytes == arena_at_8 > 0


@pytest.mark.parametrize("seed", range(5))
def test_packed_intermediates_never_share_memory_while_both_live(seed):
    from llmkit.framework.compiler.native.run import _pack

    rng = np.random.default_rng(seed)
    bufs = []
    for b in range(60):
        first = int(rng.integers(0, 40))
        bufs.append((b, [first, first + int(rng.integers(0, 8))], int(rng.integers(1, 5000))))
    off = _pack(bufs)
    for b, (f, l_), n in bufs:
        assert off[b] % 64 == 0
        for c, (g, m), k in bufs:
            if c != b and f <= m and g <= l_:  # both live at some step
                assert off[b] + n <= off[c] or off[c] + k <= off[b], (b, c)
    # reuse: far less than one buffer after another
    assert max(off[b] + n for b, _, n in bufs) < sum(n for _, _, n in bufs) / 2


def test_replay_copies_a_transpose_that_is_not_a_view_and_equals_numpy():
    """A movement op whose result is a strided view (a transpose, as prefill's attention heads)
    becomes a C copy step in the replay; the function is replayed, with numpy's values."""
    p = _compiled(
        ir.parse(
            """
module {
  func @main(%x: f32[N, 3, 5], %w: f32[5, 16]) -> (f32[3, N, 5], f32[3, N, 16]) {
    %0 = llm.silu(%x) : f32[N, 3, 5]
    %1 = llm.transpose(%0) {perm = [1, 0, 2]} : f32[3, N, 5]
    %2 = llm.tiled_linear(%1, %w) {rows = 1, transposed = true} : f32[3, N, 16]
    return %1, %2
  }
}
"""
        )
    )
    ex = Executor(p, native=True)
    rng = np.random.default_rng(4)
    for n in (4, 1, 7):
        x = rng.standard_normal((n, 3, 5)).astype(np.float32)
        w = rng.standard_normal((5, 16)).astype(np.float32)
        t, y = ex.run([x, w])
        silu = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))
        np.testing.assert_allclose(t, silu.transpose(1, 0, 2), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(y, silu.transpose(1, 0, 2) @ w, rtol=1e-5, atol=1e-5)
    assert [v is not None for v in ex._replays.plans.values()] == [True] * 3  # all three replayed


def test_replay_outputs_are_fresh_arrays_each_call():
    p = _compiled(_decode_like())
    ex = Executor(p, native=True)
    ins = _inputs(np.random.default_rng(1), 2)
    first = [o.copy() for o in ex.run(ins)]
    kept = ex.run(ins)
    ins2 = _inputs(np.random.default_rng(2), 2)
    ex.run(ins2)
    for a, b in zip(kept, first):  # a later call did not overwrite what an earlier one returned
        assert np.array_equal(a, b)


def test_replay_follows_new_input_arrays_and_strided_inputs_fall_back():
    p = _compiled(_decode_like())
    ex = Executor(p, native=True)
    ref = Executor(p)
    rng = np.random.default_rng(3)
    ins = _inputs(rng, 4)
    ex.run(ins)
    ins[1] = rng.standard_normal((50, 24)).astype(np.float32)  # new weights, same shapes
    np.testing.assert_allclose(ex.run(ins)[0], ref.run(ins)[0], rtol=1e-5, atol=1e-5)
    ins[2] = np.asfortranarray(ins[2])  # not contiguous: runs op by op, same values
    np.testing.assert_allclose(ex.run(ins)[0], ref.run(ins)[0], rtol=1e-5, atol=1e-5)


def test_replay_kernel_rejecting_its_inputs_raises_the_ops_error():
    p = _compiled(_decode_like())
    ex = Executor(p, native=True)
    ins = _inputs(np.random.default_rng(4), 2)
    ex.run(ins)
    ins[0] = np.array([0, 50], np.int64)  # out of range of the 50-row table
    with pytest.raises(Exception, match="index_select"):
        ex.run(ins)
    ins[0] = np.array([0, 49], np.int64)
    assert ex.run(ins)[0].shape == (2, 1, 16)  # and the executor still works


def test_a_function_with_a_blas_matmul_is_not_replayed_but_runs():
    p = _compiled(
        ir.parse(
            """
module {
  func @main(%x: f32[B, 8], %w: f32[8, 8]) -> (f32[B, 8]) {
    %0 = llm.matmul(%x, %w) : f32[B, 8]
    %1 = llm.exp(%0) : f32[B, 8]
    return %1
  }
}
"""
        )
    )
    ex = Executor(p, native=True)
    x, w = np.ones((2, 8), np.float32), np.eye(8, dtype=np.float32)
    np.testing.assert_allclose(ex.run([x, w])[0], np.exp(x))
    assert list(ex._replays.plans.values()) == [None]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_last_axis_equals_a_stable_sort_with_ties_infinities_and_nans(dtype):
    rng = np.random.default_rng(4)
    rows = [
        rng.standard_normal(50),
        rng.integers(-2, 3, 50).astype(np.float64),  # many ties: the lower index first
        np.array([-np.inf, 1.0, -np.inf, -0.0, 0.0, np.nan, 1.0, np.nan]),
        np.array([np.nan, np.nan, 3.0, np.nan, -np.inf, np.nan, np.nan, np.nan]),  # NaNs fill, in order
    ]
    for x in rows:
        for k in (1, 3, min(8, x.size)):
            x2 = np.stack([x, x[::-1]]).astype(dtype)
            assert applies("topk", x2, k=k)
            vals, idx = native("topk")(np, x2, k=k)
            want = np.argsort(-x2, axis=-1, kind="stable")[:, :k]  # the float64 reference's order
            np.testing.assert_array_equal(idx, want)
            np.testing.assert_array_equal(vals, np.take_along_axis(x2, want, -1))
    assert not applies("topk", np.zeros((2, 4)), k=2, largest=False)  # smallest: reference kernel
    assert not applies("topk", np.zeros((4, 2)), k=2, axis=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_last_axis_on_score_sized_rows_equals_a_stable_sort(dtype):
    # [64, 4096]: the threaded path over rows and the skipped blocks of 16 (the K-th rising late,
    # ties of the K-th inside and across blocks, a NaN in an otherwise skippable block, a short tail)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((64, 4099)).astype(dtype)
    x[1] = np.arange(4099)  # ascending: every block beats the K-th
    x[2] = rng.integers(-3, 4, 4099)  # ties everywhere
    x[3, 4000] = np.nan
    x[4, :] = -np.inf
    x[4, 4098] = 0.0
    for k in (1, 5):
        assert applies("topk", x, k=k)
        vals, idx = native("topk")(np, x, k=k)
        want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(vals, np.take_along_axis(x, want, -1))


def test_gather_last_axis_any_dtype_and_negative_indices():
    rng = np.random.default_rng(5)
    for x in (rng.standard_normal((4, 9)), rng.integers(0, 9, (2, 3, 5)), rng.random((3, 6)) > 0.5):
        idx = rng.integers(-x.shape[-1], x.shape[-1], (*x.shape[:-1], 4))
        assert applies("gather", x, idx, axis=-1)
        np.testing.assert_array_equal(native("gather")(np, x, idx, axis=-1), np.take_along_axis(x, idx, -1))
    assert not applies("gather", np.zeros((3, 4)), np.zeros((1, 4), np.int64), axis=0)
    with pytest.raises(IndexError, match="out of bounds"):  # the reference kernel's own error
        native("gather")(np, np.zeros((2, 3)), np.array([[0], [3]], np.int64), axis=-1)


def _logprobs64(z: np.ndarray, targets: np.ndarray, k: int):
    """The score program's numbers from logits z, in float64 (the formula written out): z[t] - lse
    and the k largest (first index wins ties, NaNs last) - lse, with lse's shift 0 where the max is
    not finite."""
    z = z.astype(np.float64)
    m = z.max(1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    lse = np.log(np.exp(z - m).sum(1, keepdims=True)) + m
    ids = np.argsort(-z, axis=-1, kind="stable")[:, :k]
    with np.errstate(invalid="ignore"):  # inf - inf
        return z[np.arange(len(z)), targets] - lse[:, 0], np.take_along_axis(z, ids, 1) - lse, ids


@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("k,n,panel", [(64, 4144, 16), (33, 700, 0), (16, 16, 16), (5, 3, 0)])
def test_tiled_linear_logprobs_matches_float64_and_rows_are_independent(m, k, n, panel):
    """The score program's fused head: its logits are tiled_linear's bits, its logprobs and top-k
    those of a float64 log-softmax of them, and no row's results depend on the other rows."""
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / 4).astype(np.float32)
    wl = _panels(np.ascontiguousarray(w.T)) if panel else w
    targets = rng.integers(-n, n, m)
    rows = np.array([m - 1, 0, -1])
    kk = min(5, n)
    args = (x, wl, targets, rows)
    assert applies("tiled_linear_logprobs", *args, k=kk, panel=panel)
    assert not applies("tiled_linear_logprobs", x, np.ascontiguousarray(w.T), targets, rows, transposed=True)
    op = native("tiled_linear_logprobs")
    logits, target_lp, top_lp, top_ids = op(np, *args, k=kk, panel=panel)
    z = native("tiled_linear")(np, x, wl, panel=panel)
    assert np.array_equal(logits, z[rows])
    want = _logprobs64(z, targets % n, kk)  # exp in float32 (about 1e-7 a term), sums in float64
    np.testing.assert_allclose(target_lp, want[0], rtol=0, atol=2e-7)
    np.testing.assert_allclose(top_lp, want[1], rtol=0, atol=2e-7)
    np.testing.assert_array_equal(top_ids, want[2])
    z64 = x.astype(np.float64) @ w.astype(np.float64).T  # and against the float64 product
    np.testing.assert_allclose(target_lp, _logprobs64(z64, targets % n, kk)[0], rtol=1e-5, atol=1e-5)
    for i in (0, m - 1):
        alone = op(np, x[i : i + 1], wl, targets[i : i + 1], np.array([0]), k=kk, panel=panel)
        assert np.array_equal(alone[0][0], z[i]) and alone[1][0] == target_lp[i]
        assert np.array_equal(alone[2][0], top_lp[i]) and np.array_equal(alone[3][0], top_ids[i])


def test_tiled_linear_logprobs_ties_infinities_nans_and_threads(monkeypatch):
    import llmkit.framework.compiler.native.run as native_mod

    rng = np.random.default_rng(12)
    n = 700  # three column blocks, the last one short
    special = [
        rng.integers(-2, 3, n).astype(np.float32),  # ties everywhere, across blocks
        np.where(rng.random(n) < 0.5, -np.inf, rng.standard_normal(n)).astype(np.float32),
        np.concatenate([np.full(300, -np.inf), rng.standard_normal(n - 300) - 800]).astype(
            np.float32
        ),  # exp(800): inf
        np.where(np.arange(n) == 450, np.nan, rng.standard_normal(n)).astype(np.float32),
        np.where(np.arange(n) == 3, np.inf, rng.standard_normal(n)).astype(np.float32),
    ]
    op = native("tiled_linear_logprobs")
    for zrow in special:  # x = [[1]] and w = z as a column: the logits are z exactly
        x, w = np.ones((1, 1), np.float32), zrow[:, None].copy()
        for t in (0, 450, n - 1):
            got = op(np, x, w, np.array([t]), np.array([0]), k=5)
            want = _logprobs64(zrow[None], np.array([t]), 5)
            np.testing.assert_array_equal(got[0][0], zrow)
            np.testing.assert_allclose(got[1], want[0], rtol=0, atol=2e-7)
            np.testing.assert_allclose(got[2], want[1], rtol=0, atol=2e-7)
            np.testing.assert_array_equal(got[3], want[2])
    wl = _panels((rng.standard_normal((48, 4096)) / 4).astype(np.float32))
    x = rng.standard_normal((40, 48)).astype(np.float32)
    args = (x, wl, rng.integers(0, 4096, 40), np.array([5, 39]))
    got = {}
    for nt in (1, 2, 3):
        monkeypatch.setattr(native_mod, "_threads", lambda nt=nt: nt)
        got[nt] = op(np, *args, k=5, panel=16)
    for nt in (2, 3):
        assert all(np.array_equal(a, b) for a, b in zip(got[1], got[nt]))


def test_tiled_linear_logprobs_names_bad_inputs():
    meta = table()["tiled_linear_logprobs"].infer_meta
    x, w, i3, r = (
        Meta((3, 4), np.float32),
        Meta((6, 4), np.float32),
        Meta((3,), np.int64),
        Meta((1,), np.int64),
    )
    with pytest.raises(OpError, match=r"x must be \[N, in_features\]"):
        meta(Meta((1, 3, 4), np.float32), w, i3, r)
    with pytest.raises(OpError, match="targets must have one id per row of x"):
        meta(x, w, Meta((2,), np.int64), r)
    with pytest.raises(OpError, match="targets must be a 1-D integer tensor"):
        meta(x, w, Meta((3,), np.float32), r)
    with pytest.raises(OpError, match="k=7 is out of range for 6 output features"):
        meta(x, w, i3, r, k=7)
    op, x1, w1 = native("tiled_linear_logprobs"), np.ones((3, 4), np.float32), np.ones((6, 4), np.float32)
    # the kernel refuses before writing; the reference kernel's error names the index
    with pytest.raises(IndexError, match="index 6 is out of bounds for axis 1 with size 6"):
        op(np, x1, w1, np.array([0, 6, 1]), np.array([0]), k=2)
    with pytest.raises(IndexError, match="index 3 is out of bounds"):  # a logit row past the rows
        op(np, x1, w1, np.array([0, 5, 1]), np.array([3]), k=2)
