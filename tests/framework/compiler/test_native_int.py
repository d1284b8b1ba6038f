"""``quant_linear`` with int8 activations (``act_bits=8``): every instruction-set path of its C kernel
and the op's reference kernel against a float64 formula written here from docs/quantize.md.

The formula: per row of x and weight group, ``d = max|x| / 127`` and codes ``rint(x / d)`` in float32
(as the format says), the integer product of the codes with ``q - zero`` exactly in int64, and the
output the sum over groups of ``d * scale * idot`` in float64. Paths are forced with ``set_int_isa``
(the kernel never runs one the CPU lacks, so each is tested where this CPU has it).
"""

from __future__ import annotations

import numpy as np
import pytest

from llmkit.framework.compiler import available
from llmkit.framework.compiler.native import NativeOp, build_c
from llmkit.framework.compiler.native.quant_int import (
    INT_ISAS,
    IsaError,
    cpu_int_isas,
    f16c_code,
    int_isa_code,
    set_f16c,
    set_int_isa,
)
from llmkit.framework.ops.quant import float_scales, half_scales, pack_qweight, unpack_qweight
from llmkit.framework.opspec import table

pytestmark = pytest.mark.skipif(not available(), reason="no working C compiler")

# (bits, out, in, group, asym): inputs not a multiple of 32, groups of 6 / 48 (not a multiple of 32),
# 32 (two at a time on AVX-512), 64 / 128 / 160 (wide; 4 bits: units of 128 columns), -1 (one group,
# per output channel)
CASES = [
    (8, 33, 100, -1, False),
    (8, 17, 256, 64, False),
    (8, 5, 70, 32, False),
    (4, 17, 96, 32, True),
    (4, 9, 70, 6, False),
    (4, 40, 256, 128, False),
    (4, 5, 144, 48, True),
    (4, 3, 98, -1, True),
    (4, 16, 64, 32, False),
    (4, 28, 64, 32, False),  # a last panel of 12 outputs: a vector and a part
    (4, 7, 200, -1, True),  # a 128-column unit, then 64, then 8 columns in C
    (4, 5, 320, 160, False),  # per group: a unit of 128, then 32
]


@pytest.fixture(scope="module")
def op() -> NativeOp:
    spec = table()["quant_linear"]
    return NativeOp(spec, build_c(spec.native.source))


@pytest.fixture(params=[i for i in INT_ISAS if i in cpu_int_isas()])
def isa(request):
    set_int_isa(request.param)
    yield request.param
    set_int_isa(None)


def weights(rng, bits, out, n_in, group, asym):
    """Codes [out, in] (int64), the stored tensors, and per-column scale and zero."""
    groups = 1 if group == -1 else -(-n_in // group)
    if bits == 8:
        q = rng.integers(-127, 128, (out, n_in))
        stored = [q.astype(np.int8)]
    else:
        q = rng.integers(0, 16, (out, n_in))
        stored = [(q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)]
    scales = rng.uniform(0.01, 0.1, (out, groups)).astype(np.float32)
    zeros = rng.integers(0, 16, (out, groups)).astype(np.uint8) if asym else None
    stored += [scales] + ([zeros] if asym else [])
    col = np.arange(n_in) // (n_in if group == -1 else group)
    zero = 0 if bits == 8 else (8 if zeros is None else zeros.astype(np.int64)[:, col])
    return q - zero, stored, col


def reference(x, qz, scales, col):
    """float64 output, the tolerance its float32 evaluation may differ by, and the integer products."""
    m = x.shape[0]
    groups = col.max() + 1
    y = np.zeros((m, qz.shape[0]))
    bound = np.zeros_like(y)
    for gi in range(groups):
        cols = col == gi
        xg = x[:, cols].astype(np.float32)
        d = (np.abs(xg).max(axis=1) / np.float32(127)).astype(np.float32)  # float32, as the format
        codes = np.where(d[:, None] > 0, np.rint(xg / np.where(d > 0, d, 1)[:, None]), 0).astype(np.int64)
        idot = codes @ qz[:, cols].T  # exact
        c = d.astype(np.float64)[:, None] * scales[:, gi].astype(np.float64)[None, :]
        y += c * idot
        bound += np.abs(c) * (np.abs(codes) @ np.abs(qz[:, cols]).T)
    return y, (groups + 12) * 2.0**-24 * bound


@pytest.mark.parametrize("m", [1, 8, 14, 15, 33])  # AVX2 4 bits: blocks of 4 rows, then 2, 3 or 1
@pytest.mark.parametrize("bits,out,n_in,group,asym", CASES)
def test_every_path_matches_float64_and_rows_are_independent_bitwise(
    op, isa, m, bits, out, n_in, group, asym
):
    rng = np.random.default_rng(out * 7 + n_in + m)
    qz, w, col = weights(rng, bits, out, n_in, group, asym)
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    x[0, : min(5, n_in)] = 0.0
    if m > 1:
        x[1] = 0.0  # a zero row: d = 0, codes 0
    attrs = {"bits": bits, "group_size": group, "act_bits": 8}
    y = op(np, x, *w, **attrs)
    want, tol = reference(x, qz, w[1], col)
    assert y.dtype == np.float32 and y.shape == (m, out)
    assert np.all(np.abs(y - want) <= tol + 1e-30), np.abs(y - want).max()
    for rows in (slice(0, 1), slice(m - 1, m), slice(0, m // 2 + 1)):  # any batch: the same bits
        assert np.array_equal(op(np, np.ascontiguousarray(x[rows]), *w, **attrs), y[rows])


@pytest.mark.parametrize("bits,out,n_in,group,asym", CASES)
def test_the_integer_product_is_exact(op, isa, bits, out, n_in, group, asym):
    """Integer x whose every group reaches 127 (so d = 1 and the codes are x) and unit scales: the
    output is the integer product itself, on every path."""
    rng = np.random.default_rng(n_in)
    qz, w, col = weights(rng, bits, out, n_in, group, asym)
    w[1][:] = 1.0
    x = rng.integers(-127, 128, (33, n_in)).astype(np.float32)
    for gi in range(col.max() + 1):
        x[:, np.flatnonzero(col == gi)[0]] = 127.0
    y = op(np, x, *w, bits=bits, group_size=group, act_bits=8)
    assert np.array_equal(y.astype(np.int64), x.astype(np.int64) @ qz.T)


@pytest.mark.parametrize("group", [32, 64, -1])
def test_the_integer_product_is_exact_at_the_extremes(op, isa, group):
    """Codes 15 against activations +-127 in long runs (the largest partial sums any path keeps in
    narrow integers, as AVX2's int16 pair sums): the product is still the exact one."""
    rng = np.random.default_rng(5)
    _, w, _ = weights(rng, 4, 24, 256, group, False)
    w[0][:] = 0xFF  # every code 15
    w[0][3, :64] = 0x00  # a row of code 0 (15 - 8 against 0 - 8)
    w[1][:] = 1.0
    qz = np.where(np.arange(24)[:, None] == 3, np.where(np.arange(256) < 128, -8, 7), 7)
    x = np.full((5, 256), 127.0, np.float32)
    x[1] = -127.0
    x[2, ::2] = -127.0
    x[3, 100:] = -127.0
    y = op(np, x, *w, bits=4, group_size=group, act_bits=8)
    assert np.array_equal(y.astype(np.int64), x.astype(np.int64) @ qz.T)


@pytest.mark.parametrize("bits,out,n_in,group,asym", CASES[:6])
def test_the_reference_kernel_is_the_same_arithmetic(bits, out, n_in, group, asym):
    """The op's numpy kernel (eager mode, programs without a compiler) against the formula."""
    rng = np.random.default_rng(3 + n_in)
    qz, w, col = weights(rng, bits, out, n_in, group, asym)
    x = rng.standard_normal((7, n_in)).astype(np.float32)
    y = table()["quant_linear"].kernel(np, x, *w, bits=bits, group_size=group, act_bits=8)
    want, tol = reference(x, qz, w[1], col)
    assert np.all(np.abs(y - want) <= tol + 1e-30)


def test_activation_error_is_within_half_a_step_of_the_float_product():
    """Against the float32 dequantized product: each activation moves by at most d / 2, so an
    output by at most sum over groups of d / 2 * sum |W| over the group (docs/quantize.md)."""
    rng = np.random.default_rng(11)
    for bits, group in ((8, -1), (4, 32), (4, 128)):
        qz, w, col = weights(rng, bits, 64, 256, group, False)
        wf = qz * w[1].astype(np.float64)[:, col]
        x = rng.standard_normal((9, 256)).astype(np.float32) * rng.uniform(0.1, 10, 256).astype(np.float32)
        y = table()["quant_linear"].kernel(np, x, *w, bits=bits, group_size=group, act_bits=8)
        err = np.abs(y - x.astype(np.float64) @ wf.T)
        bound = np.zeros_like(err)
        for gi in range(col.max() + 1):
            d = np.abs(x[:, col == gi]).max(axis=1).astype(np.float64) / 127
            bound += d[:, None] / 2 * np.abs(wf[:, col == gi]).sum(axis=1)[None, :]
        assert np.all(err <= bound * (1 + 1e-5) + 1e-6)


def test_paths_are_chosen_by_name_and_bad_names_are_errors(monkeypatch):
    assert cpu_int_isas()[0] == "c"
    monkeypatch.setenv("LLMKIT_INT_ISA", "avx2")
    assert int_isa_code() == INT_ISAS.index("avx2")
    set_int_isa("c")
    assert int_isa_code() == 0  # the function wins over the variable
    set_int_isa(None)
    monkeypatch.setenv("LLMKIT_INT_ISA", "auto")
    assert int_isa_code() == -1
    monkeypatch.setenv("LLMKIT_INT_ISA", "sse9")
    with pytest.raises(IsaError, match="LLMKIT_INT_ISA must be auto or one of c, avx2"):
        int_isa_code()
    with pytest.raises(IsaError, match="got 'amx'"):
        set_int_isa("amx")


def test_the_environment_variable_forces_a_path_and_every_path_gives_the_same_bits(op, monkeypatch):
    """LLMKIT_INT_ISA=c gives what set_int_isa('c') gives; and since every path computes each output
    as the same sequence (the exact integer product of a group, then one fused multiply-add per group
    in order), the portable path and the widest one agree bit for bit, at any number of rows."""
    rng = np.random.default_rng(2)
    for bits, group, asym in ((4, 128, False), (4, 32, True), (8, -1, False), (8, 48, False)):
        _, w, _ = weights(rng, bits, 70, 576, group, asym)
        x = rng.standard_normal((37, 576)).astype(np.float32)
        monkeypatch.setenv("LLMKIT_INT_ISA", "c")
        c_env = op(np, x, *w, bits=bits, group_size=group, act_bits=8)
        set_int_isa("c")
        c_fn = op(np, x, *w, bits=bits, group_size=group, act_bits=8)
        set_int_isa(None)
        assert np.array_equal(c_env, c_fn)
        for name in cpu_int_isas()[1:]:
            monkeypatch.setenv("LLMKIT_INT_ISA", name)
            assert np.array_equal(op(np, x, *w, bits=bits, group_size=group, act_bits=8), c_env), name
            assert np.array_equal(op(np, x[5:6], *w, bits=bits, group_size=group, act_bits=8), c_env[5:6])


@pytest.mark.parametrize("bits,out,n_in,group,asym", CASES)
def test_the_dequantize_kernel_is_the_format_exactly(bits, out, n_in, group, asym):
    """``dequantize``'s C kernel (a quantized embedding's rows in replayed programs): (q - zero) *
    scale, one float32 rounding of an exact float64 product, so equal to it rounded."""
    spec = table()["dequantize"]
    dq = NativeOp(spec, build_c(spec.native.source))
    rng = np.random.default_rng(n_in + 1)
    qz, w, col = weights(rng, bits, out, n_in, group, asym)
    got = dq(np, *w, bits=bits, group_size=group)
    want = (qz * w[1].astype(np.float64)[:, col]).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("bits,out,n_in,group,asym", CASES)
def test_packed_weights_give_the_same_bits_and_unpack_to_the_codes(op, isa, bits, out, n_in, group, asym):
    """``pack_qweight``'s panels (what the engine hands the kernel) against the row-major codes: the
    same output bits (the kernel packs those itself), the reference kernel the same, and unpacking
    gives the codes back; 512 rows (a prefill) as well as one."""
    rng = np.random.default_rng(out + 3 * n_in)
    qz, w, col = weights(rng, bits, out, n_in, group, asym)
    packed = pack_qweight(w[0], bits, group)
    assert packed.shape[0] == -(-out // 16) and packed.dtype == np.uint8
    assert np.array_equal(unpack_qweight(np, packed, out, n_in, bits, group), w[0])
    for m in (1, 512):
        x = rng.standard_normal((m, n_in)).astype(np.float32)
        attrs = {"bits": bits, "group_size": group, "act_bits": 8}
        y = op(np, x, *w, **attrs)
        assert np.array_equal(op(np, x, packed, *w[1:], packed=1, **attrs), y)
        if m == 1:
            ref = table()["quant_linear"].kernel(np, x, packed, *w[1:], packed=1, **attrs)
            assert np.array_equal(ref, table()["quant_linear"].kernel(np, x, *w, **attrs))
        want, tol = reference(x, qz, w[1], col)
        assert np.all(np.abs(y - want) <= tol + 1e-30)


@pytest.fixture(params=["f16c", "plain C"])
def f16c(request):
    set_f16c(request.param == "f16c")
    yield request.param
    set_f16c(None)


def half_weights(rng, bits, out, n_in, group, asym):
    """``weights`` with scales that are float16 numbers, a subnormal and a large one among them."""
    qz, w, col = weights(rng, bits, out, n_in, group, asym)
    s = w[1].astype(np.float16)
    s[0, 0], s[-1, -1] = np.float16(3e-6), np.float16(1000.0)  # float16 subnormal (2^-24 steps), 2^9..
    w[1] = s.astype(np.float32)
    return qz, w, col


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("bits,out,n_in,group,asym", CASES)
def test_float16_scales_match_float64_and_give_the_float32_scales_bits(
    op, isa, f16c, m, bits, out, n_in, group, asym
):
    """``packed=2`` (panels and float16 scales), on every path with and without F16C: the formula,
    the bits of the same scales in float32 (the widening is exact), and rows independent."""
    rng = np.random.default_rng(out + n_in + m)
    qz, w, col = half_weights(rng, bits, out, n_in, group, asym)
    half = half_scales(w[1])
    assert half.dtype == np.float16 and half.shape == w[1].shape
    assert np.array_equal(float_scales(np, half), w[1])
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    attrs = {"bits": bits, "group_size": group, "act_bits": 8}
    packed = pack_qweight(w[0], bits, group)
    y = op(np, x, packed, half, *w[2:], packed=2, **attrs)
    want, tol = reference(x, qz, w[1], col)
    assert y.dtype == np.float32 and y.shape == (m, out)
    assert np.all(np.abs(y - want) <= tol + 1e-30), np.abs(y - want).max()
    assert np.array_equal(y, op(np, x, packed, *w[1:], packed=1, **attrs))
    assert np.array_equal(op(np, x[-1:], packed, half, *w[2:], packed=2, **attrs), y[-1:])
    ref = table()["quant_linear"].kernel(np, x, packed, half, *w[2:], packed=2, **attrs)
    assert np.all(np.abs(ref - want) <= tol + 1e-30)


@pytest.mark.parametrize("bits,asym", [(4, False), (4, True), (8, False)])
def test_one_row_split_over_the_threads_matches_float64_and_the_same_row_in_a_batch(op, isa, bits, asym):
    """A decode row with work for every thread (each takes one run of panels): 300 outputs (a last
    panel of 12), 520 inputs (16 groups of 32, then 8 columns), the engine's panels and float16
    scales: the formula, and the bits of that row computed in a batch of 33."""
    rng = np.random.default_rng(31)
    qz, w, col = half_weights(rng, bits, 300, 520, 32, asym)
    x = rng.standard_normal((33, 520)).astype(np.float32)
    attrs = {"bits": bits, "group_size": 32, "act_bits": 8}
    packed, half = pack_qweight(w[0], bits, 32), half_scales(w[1])
    y = op(np, x[5:6], packed, half, *w[2:], packed=2, **attrs)
    want, tol = reference(x[5:6], qz, w[1], col)
    assert np.all(np.abs(y - want) <= tol + 1e-30), np.abs(y - want).max()
    assert np.array_equal(y, op(np, x, packed, half, *w[2:], packed=2, **attrs)[5:6])


def test_float16_scales_are_stored_panel_by_panel_in_lane_order():
    """``half_scales``' layout, written out: for each panel of 16 outputs (the last of what is left),
    group by group, the scale of each of its outputs."""
    s = (np.arange(37 * 3).reshape(37, 3) + 1).astype(np.float32)  # float16 numbers
    want = [s[p + lane, gi] for p in (0, 16, 32) for gi in range(3) for lane in range(min(16, 37 - p))]
    half = half_scales(s)
    assert half.shape == (37, 3) and half.reshape(-1).tolist() == want


def test_float16_scales_must_be_float16_numbers_and_packed_2_takes_only_them(op):
    from llmkit.framework.opspec import OpError

    with pytest.raises(OpError, match="packed=2 needs scales that are float16 numbers; quantize with"):
        half_scales(np.array([[0.1]], np.float32))
    _, w, _ = weights(np.random.default_rng(0), 4, 16, 64, 32, False)
    x = np.zeros((1, 64), np.float32)
    packed = pack_qweight(w[0], 4, 32)
    with pytest.raises(OpError, match="packed=2 takes float16 scales and float32 x"):
        table()["quant_linear"].infer_meta(x, packed, w[1], bits=4, group_size=32, act_bits=8, packed=2)


def test_f16c_is_switched_off_by_name(monkeypatch):
    monkeypatch.setenv("LLMKIT_F16C", "off")
    assert f16c_code() == 0
    set_f16c(True)
    assert f16c_code() == 1  # the function wins over the variable
    set_f16c(None)
    monkeypatch.setenv("LLMKIT_F16C", "auto")
    assert f16c_code() == 1
    monkeypatch.setenv("LLMKIT_F16C", "no")
    with pytest.raises(IsaError, match="LLMKIT_F16C must be auto or off, got 'no'"):
        f16c_code()


@pytest.fixture(scope="module")
def grouped() -> NativeOp:
    spec = table()["quant_linears"]
    return NativeOp(spec, build_c(spec.native.source))


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize(
    "bits,group,asym,packed", [(8, -1, False, 1), (8, 32, False, 2), (4, 32, False, 2), (4, 128, True, 1)]
)
def test_weights_of_one_x_in_one_call_give_each_weights_own_bits(
    op, grouped, isa, m, bits, group, asym, packed
):
    """``quant_linears``: one x against three weights (200, 37 and 300 outputs: partial last panels,
    and the threads' runs of panels crossing from one weight into the next) in one call: each
    output the bits of that weight's own ``quant_linear``, the float64 formula, rows independent;
    the reference kernel the formula too."""
    rng = np.random.default_rng(m + bits + group)
    x = rng.standard_normal((m, 256)).astype(np.float32)
    attrs = {"bits": bits, "group_size": group, "act_bits": 8, "packed": packed}
    inputs, alone, want = [x], [], []
    for out in (200, 37, 300):
        qz, w, col = half_weights(rng, bits, out, 256, group, asym)
        stored = [pack_qweight(w[0], bits, group), half_scales(w[1]) if packed == 2 else w[1], *w[2:]]
        inputs += stored
        alone.append(op(np, x, *stored, **attrs))
        want.append(reference(x, qz, w[1], col))
    ys = grouped(np, *inputs, zeros=asym, **attrs)
    ref = table()["quant_linears"].kernel(np, *inputs, zeros=asym, **attrs)
    last = grouped(np, x[-1:], *inputs[1:], zeros=asym, **attrs)
    for y, y1, (f64, tol), r, row in zip(ys, alone, want, ref, last, strict=True):
        assert y.shape == y1.shape and np.array_equal(y, y1)
        assert np.all(np.abs(y - f64) <= tol + 1e-30) and np.all(np.abs(r - f64) <= tol + 1e-30)
        assert np.array_equal(row, y[-1:])


def test_quant_linears_name_what_is_wrong():
    from llmkit.framework.opspec import OpError

    spec = table()["quant_linears"]
    _, w, _ = weights(np.random.default_rng(0), 4, 16, 64, 32, False)
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(OpError, match=r"takes x, then \(qweight, scales, zeros\) per weight; got 3"):
        spec.infer_meta(x, *w, bits=4, group_size=32, zeros=True)
    with pytest.raises(OpError, match=r"weight 1: quant_linear: scales must be \[out, ceil"):
        spec.infer_meta(x, *w, w[0], w[1][:, :1], bits=4, group_size=32)
