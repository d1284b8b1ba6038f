"""Tensor creation, metadata, operators, indexing and conversion."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import OpError


def test_tensor_from_python_data_picks_dtypes():
    assert lf.tensor([1.0, 2.0]).dtype == np.float32
    assert lf.tensor([1, 2]).dtype == np.int64
    assert lf.tensor([True, False]).dtype == np.bool_
    assert lf.tensor([1, 2], dtype="float64").dtype == np.float64
    assert lf.tensor(np.arange(3, dtype=np.int32)).dtype == np.int32
    assert lf.tensor([1.0], dtype="bfloat16").dtype == lf.bfloat16


def test_tensor_copies_its_input():
    a = np.zeros(3, np.float32)
    t = lf.tensor(a)
    a[0] = 5
    assert t.numpy()[0] == 0


def test_metadata_and_values():
    t = lf.randn(2, 3, 4)
    assert t.shape == (2, 3, 4) and t.ndim == 3 and t.size == 24 and t.device == "cpu"
    assert lf.tensor(3.5).item() == 3.5
    assert lf.tensor([[1, 2]]).tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="1"):
        lf.tensor([1.0, 2.0]).item()


def test_operators_with_scalars_keep_the_tensor_dtype():
    x = lf.tensor([1.0, 2.0, 4.0])
    np.testing.assert_allclose((2 - x).numpy(), [1, 0, -2])
    np.testing.assert_allclose((1 / x).numpy(), [1, 0.5, 0.25])
    np.testing.assert_allclose((x**2).numpy(), [1, 4, 16])
    np.testing.assert_allclose((2.0**x).numpy(), [2, 4, 16])
    assert (x * 3).dtype == np.float32
    assert (x > 1.5).dtype == np.bool_
    assert (np.float64(2.0) * x).dtype == np.float32


def test_int_tensor_with_fractional_float_is_an_error():
    with pytest.raises(OpError, match="mul: cannot combine a int64 tensor with the float 0.5"):
        lf.tensor([1, 2]) * 0.5


def test_mixed_dtypes_are_rejected():
    with pytest.raises(OpError, match=r"add: dtype mismatch \(\[2\] float32, \[2\] float64\)"):
        lf.tensor([1.0, 2.0]) + lf.tensor([1.0, 2.0], dtype="float64")


def test_broadcast_mismatch_names_op_and_shapes():
    with pytest.raises(OpError, match=r"add: shapes cannot be broadcast.*\[2, 3\] float32, \[4\] float32"):
        lf.zeros(2, 3) + lf.zeros(4)


def test_matmul_mismatch_names_shapes():
    with pytest.raises(
        OpError, match=r"matmul: inner dims differ \(3 vs 4\).*\[2, 3\] float32, \[4, 5\] float32"
    ):
        lf.zeros(2, 3) @ lf.zeros(4, 5)


def test_unknown_and_invalid_attributes():
    x = lf.zeros(2, 3)
    with pytest.raises(OpError, match="softmax: unknown attribute 'dim'.*attributes are: axis"):
        lf.ops.softmax(x, dim=1)
    with pytest.raises(OpError, match="softmax: attribute 'axis' expects an integer, got 'a'"):
        lf.ops.softmax(x, axis="a")
    with pytest.raises(OpError, match="dropout: attribute 'p'=1.5 is invalid: must be in"):
        lf.ops.dropout(x, p=1.5)
    with pytest.raises(OpError, match="unknown op 'sofmax' \\(did you mean 'softmax'\\?\\)"):
        lf.ops.get("sofmax")
    with pytest.raises(OpError, match="softmax: axis 5 is out of range"):
        lf.ops.softmax(x, axis=5)


def test_wrong_input_dtype():
    with pytest.raises(OpError, match="exp: expects floating tensors, got \\[2\\] int64"):
        lf.ops.exp(lf.tensor([1, 2]))
    with pytest.raises(OpError, match="embedding: indices must be an integer tensor"):
        lf.ops.embedding(lf.zeros(2), lf.zeros(4, 3))
    with pytest.raises(OpError, match="where: condition must be bool"):
        lf.ops.where(lf.zeros(2), lf.zeros(2), lf.zeros(2))


def test_positional_attributes_and_keyword_inputs():
    x = lf.randn(2, 3)
    np.testing.assert_allclose(lf.ops.softmax(x, 0).numpy(), lf.ops.softmax(x, axis=0).numpy())
    q = lf.randn(1, 2, 3, 4)
    a = lf.ops.scaled_dot_product_attention(q, q, q, None, True)
    b = lf.ops.scaled_dot_product_attention(q=q, k=q, v=q, is_causal=True)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(OpError, match="got attribute 'axis' twice"):
        lf.ops.softmax(x, 0, axis=1)


def test_method_per_op_and_conveniences():
    x = lf.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert x.sum().item() == 10
    np.testing.assert_allclose(x.mean(axis=0).numpy(), [2, 3])
    assert (
        x.reshape(4).shape == (4,) and x.reshape(1, -1).shape == (1, 4) and x.reshape((4, 1)).shape == (4, 1)
    )
    np.testing.assert_allclose(x.T.numpy(), [[1, 3], [2, 4]])
    assert lf.randn(2, 3, 4).transpose(0, 2).shape == (4, 3, 2)
    assert lf.randn(2, 3, 4).mT.shape == (2, 4, 3)
    assert lf.randn(2, 3, 4).flatten(1).shape == (2, 12)
    assert [c.shape for c in lf.randn(4, 2).chunk(2)] == [(2, 2), (2, 2)]
    assert x.exp().dtype == np.float32


@pytest.mark.parametrize(
    "index",
    [
        0,
        -1,
        (1, 2),
        slice(1, 3),
        (slice(None), slice(0, 4, 2)),
        (Ellipsis, 1),
        (None, 1),
        (1, None, slice(2)),
        [2, 0, 2],
        (slice(None), [1, 3]),
        (0, [1, 1], None),
        np.array([[0, 1], [2, 0]]),
        (Ellipsis, None),
        (slice(None, None, 3), 2),
    ],
)
def test_indexing_matches_numpy(index):
    a = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    np.testing.assert_array_equal(lf.tensor(a)[index].numpy(), a[index])


def test_indexing_gradient_scatters_back():
    x = lf.tensor(np.arange(12.0).reshape(3, 4), dtype="float64", requires_grad=True)
    (x[1:, ::2].sum() + x[[0, 0], 3].sum()).backward()
    want = np.zeros((3, 4))
    want[1:, ::2] = 1
    want[0, 3] = 2
    np.testing.assert_array_equal(x.grad.numpy(), want)


def test_bad_indices():
    x = lf.zeros(2, 3)
    with pytest.raises(IndexError, match="boolean mask"):
        x[lf.tensor([True, False])]
    with pytest.raises(IndexError, match="out of bounds"):
        x[5]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(TypeError, match="immutable"):
        x[0] = 1


def test_astype_to_and_detach():
    x = lf.tensor([1.5, 2.5], requires_grad=True)
    y = x.astype("float64")
    assert y.dtype == np.float64 and y.requires_grad
    assert x.to("float16").dtype == np.float16
    d = x.detach()
    assert not d.requires_grad and d._data is x._data
    assert x.to("cpu") is x
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        lf.set_device("tpu")


def test_gpu_device_error_is_clear_without_cupy():
    if lf.backend.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="device 'gpu'"):
        lf.zeros(2, device="gpu")


@pytest.mark.gpu
def test_gpu_ops_take_scalars_and_host_arrays_along():
    if not lf.backend.gpu_available():
        pytest.skip("no cupy or no CUDA device")
    x = lf.tensor([1.0, -2.0, 3.0], device="gpu", requires_grad=True)
    y = lf.ops.where(x > 0, x, 0.5) * 2.0 + lf.tensor(1.0)  # a Python scalar and a 0-d CPU tensor
    assert y.device == "gpu"
    np.testing.assert_array_equal(y.numpy(), [3.0, 2.0, 7.0])
    y.sum().backward()
    assert x.grad.device == "gpu"
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 0.0, 2.0])
    z = x.detach() + lf.tensor([1.0, 2.0, 3.0])  # a CPU array moves to the GPU, as in JAX
    assert z.device == "gpu"
    np.testing.assert_array_equal(z.numpy(), [2.0, 0.0, 6.0])
    lf.set_device("gpu")
    try:
        assert lf.ops.arange(0, 4).device == "gpu"  # an op without inputs: the current device
    finally:
        lf.set_device("cpu")


def test_bool_of_tensor():
    assert bool(lf.tensor(1.0))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(lf.tensor([1.0, 2.0]))


def test_set_value_checks_shape_and_dtype():
    p = lf.Parameter(np.zeros(3, np.float32))
    p.set_value(lf.ones(3))
    assert p.numpy().tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match=r"set_value: expected \[3\] float32, got \[4\]"):
        p.set_value(lf.ones(4))


def test_seeded_randomness_is_reproducible():
    lf.seed(123)
    a = lf.randn(5).numpy()
    lf.seed(123)
    b = lf.randn(5).numpy()
    np.testing.assert_array_equal(a, b)
    state = lf.backend.get_rng_state()
    c = lf.rand(3).numpy()
    lf.backend.set_rng_state(state)
    np.testing.assert_array_equal(lf.rand(3).numpy(), c)


def test_repr():
    assert repr(lf.tensor([1.0, 2.0])) == "Tensor([1., 2.], dtype=float32)"
    assert "requires_grad=True" in repr(lf.tensor([1.0], requires_grad=True))


def test_shape_rules_reject_what_kernels_cannot_run():
    with pytest.raises(OpError, match="rotary_embedding: cos/sin must broadcast"):
        lf.ops.rotary_embedding(lf.zeros(3, 4), lf.zeros(3, 4), lf.zeros(1, 2, 3, 4))
    for op in (lf.ops.softmax, lf.ops.log_softmax):
        with pytest.raises(OpError, match="axis -1 is empty"):
            op(lf.zeros(2, 0))
    with pytest.raises(OpError, match="max: cannot reduce an empty axis"):
        lf.ops.max(lf.zeros(2, 0), axis=1)
    with pytest.raises(OpError, match="argmax: cannot take the argmax of an empty axis"):
        lf.ops.argmax(lf.zeros(0))
    assert lf.ops.sum(lf.zeros(2, 0), axis=1).tolist() == [0.0, 0.0]
    assert lf.ops.get("full").bind({"shape": [1], "value": 0})["dtype"] == np.dtype("float32")
