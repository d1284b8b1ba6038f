"""Eager autograd: accumulation, broadcasting, no_grad, functional grad, freeing the tape."""

from __future__ import annotations

import numpy as np
import pytest

import llmkit.framework as lf


def t64(a, grad=True):
    return lf.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def test_grad_accumulates_over_uses_and_calls():
    x = t64([1.0, 2.0])
    (x * x + x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 5.0])
    (x * 2.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [5.0, 7.0])


def test_broadcast_gradients_are_summed_back():
    a = t64(np.ones((3, 1)))
    b = t64(np.ones(4))
    (a * b).sum().backward()
    assert a.grad.shape == (3, 1) and b.grad.shape == (4,)
    np.testing.assert_allclose(a.grad.numpy(), np.full((3, 1), 4.0))
    np.testing.assert_allclose(b.grad.numpy(), np.full(4, 3.0))


def test_no_grad_records_nothing():
    x = t64([1.0])
    with lf.no_grad():
        y = x * 2
    assert not y.requires_grad and y._node is None

    @lf.no_grad()
    def f(v):
        return v * 3

    assert not f(x).requires_grad
    assert lf.is_grad_enabled()


def test_functional_grad_leaves_dot_grad_alone_and_handles_non_leaves():
    x = t64([1.0, 2.0, 3.0])
    h = x * x
    y = (h * 3.0).sum()
    gx, gh = lf.grad(y, [x, h])
    np.testing.assert_allclose(gx.numpy(), [6.0, 12.0, 18.0])
    np.testing.assert_allclose(gh.numpy(), [3.0, 3.0, 3.0])
    assert x.grad is None


def test_unused_input():
    x, z = t64([1.0]), t64([2.0])
    with pytest.raises(RuntimeError, match="input 1 was not used"):
        lf.grad((x * 2).sum(), [x, z])
    gx, gz = lf.grad((x * 2).sum(), [x, z], allow_unused=True)
    assert gz is None and gx.item() == 2.0


def test_second_backward_through_freed_graph_is_a_clear_error():
    x = t64([1.0])
    y = (x.exp() * 2).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="a second time.*retain_graph=True"):
        y.backward()


def test_retain_graph_allows_two_passes():
    x = t64([1.0])
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    assert x.grad.item() == 4.0


def test_tape_is_freed_after_backward():
    x = t64(np.ones(4))
    y = x.exp()
    z = y.sum()
    z.backward()
    assert y._node.freed and y._node.inputs == ()


def test_higher_order_with_create_graph():
    x = t64([2.0])
    y = (x * x * x).sum()
    (g,) = lf.grad(y, [x], create_graph=True)
    (g2,) = lf.grad(g.sum(), [x])
    np.testing.assert_allclose(g.numpy(), [12.0])
    np.testing.assert_allclose(g2.numpy(), [12.0])


def test_non_scalar_backward_needs_grad():
    x = t64([1.0, 2.0])
    with pytest.raises(RuntimeError, match="only for scalar outputs"):
        (x * 2).backward()
    (x * 2).backward(lf.tensor(np.array([1.0, 10.0])))
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 20.0])


def test_backward_of_constant_is_a_clear_error():
    with pytest.raises(RuntimeError, match="does not require grad"):
        lf.tensor([1.0]).sum().backward()


def test_integer_outputs_do_not_require_grad():
    x = t64([[1.0, 3.0, 2.0]])
    vals, idx = lf.ops.topk(x, 2)
    assert vals.requires_grad and not idx.requires_grad
    assert not lf.ops.argmax(x).requires_grad


def test_stop_gradient_alias():
    x = lf.tensor([1.0])
    assert x.stop_gradient
    x.stop_gradient = False
    assert x.requires_grad


def test_chain_through_many_ops_matches_finite_differences():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3))
    xv = rng.standard_normal((2, 4))

    def f(x):
        h = lf.ops.silu(x @ lf.tensor(w))
        return (lf.ops.log_softmax(h, axis=-1) * h).sum()

    x = t64(xv)
    f(x).backward()
    eps = 1e-6
    num = np.zeros_like(xv)
    for i in np.ndindex(*xv.shape):
        p, m = xv.copy(), xv.copy()
        p[i] += eps
        m[i] -= eps
        num[i] = (f(t64(p, False)).item() - f(t64(m, False)).item()) / (2 * eps)
    np.testing.assert_allclose(x.grad.numpy(), num, rtol=1e-6, atol=1e-8)


def test_saved_bytes_counts_the_tape_activations_once():
    from llmkit.framework.autograd import saved_bytes

    x = lf.tensor(np.ones((4, 8)))  # a leaf: the batch
    w = lf.Parameter(np.ones((8, 3)))  # a leaf: a weight
    h = x @ w  # (4, 3) float64, kept as tanh's input
    t = h.tanh()  # (4, 3), kept as tanh's output and sum's input
    loss = t.sum()
    assert saved_bytes([loss]) == 2 * 4 * 3 * 8 + 8  # h, t, and the loss's own scalar
    ckpt = lf.autograd.checkpoint(lambda a: (a @ w).tanh(), x, params=[w]).sum()
    assert saved_bytes([ckpt]) == 4 * 3 * 8 + 8  # the segment keeps its output only


def test_grad_mode_is_per_thread_and_on_by_default():
    import threading

    seen = {}

    def other():
        x = lf.tensor(np.ones(2, np.float32), requires_grad=True)
        seen["enabled"] = lf.is_grad_enabled()
        seen["recorded"] = (x * 2.0).requires_grad
        with lf.no_grad():
            seen["inner"] = (x * 2.0).requires_grad

    with lf.no_grad():  # this thread's setting does not reach a thread started inside
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert not (lf.tensor(np.ones(2), requires_grad=True) * 2.0).requires_grad
    assert seen == {"enabled": True, "recorded": True, "inner": False}
    assert lf.is_grad_enabled()


def test_a_validated_signature_does_not_hide_errors_of_others():
    x, y = lf.tensor(np.ones(3, np.float32)), lf.tensor(np.ones(3, np.float32))
    for _ in range(2):  # the second call finds (shapes, dtypes) already validated
        np.testing.assert_allclose((x + y).numpy(), 2.0)
        with pytest.raises(
            lf.ops.OpError, match=r"add: shapes cannot be broadcast.*\[3\] float32, \[2\] float32"
        ):
            x + lf.tensor(np.ones(2, np.float32))
        with pytest.raises(lf.ops.OpError, match="dtype mismatch"):
            x + lf.tensor(np.ones(3, np.float64))
        with pytest.raises(lf.ops.OpError, match="softmax: axis 1 is out of range"):
            lf.ops.softmax(x, axis=1)
        np.testing.assert_allclose(lf.ops.softmax(x, axis=0).numpy(), 1 / 3, rtol=1e-6)


def test_cached_calls_and_views_still_check_and_record():
    """A repeat call (cached: attributes as given, index and shape) still rejects what differs, and
    the no-gradient views (x[i], .T, reshape) equal numpy's while with a gradient they record."""
    m = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    x = lf.tensor(m)
    for _ in range(2):
        np.testing.assert_array_equal(x[1].numpy(), m[1])
        np.testing.assert_array_equal(x[1:, None, ::2].numpy(), m[1:, None, ::2])
        np.testing.assert_array_equal(x.T.numpy(), m.T)
        np.testing.assert_array_equal(x.reshape(2, -1).numpy(), m.reshape(2, -1))
        assert x[1, 2].shape == ()
        with pytest.raises(IndexError, match="index 3 is out of bounds for axis 0 with size 3"):
            x[3]
        with pytest.raises(IndexError, match="slice steps must be positive"):
            x[::-1]
        with pytest.raises(lf.ops.OpError, match=r"reshape: cannot reshape \[3, 4\] float32 into \[5, -1\]"):
            x.reshape(5, -1)
        with pytest.raises(lf.ops.OpError, match="sum: attribute 'keepdim' expects a bool"):
            lf.ops.sum(x, axis=0, keepdim=1)
        assert lf.ops.sum(x, axis=0, keepdim=True).shape == (1, 4)
    w = lf.tensor(m, requires_grad=True)
    (w[1] * 3.0 + w.T.sum(axis=1) + w.reshape(12)[:4].sum()).sum().backward()
    want = np.ones((3, 4))  # each element once in .T's row sums
    want[1] += 3.0
    want[0] += 4.0  # reshape(12)[:4] is row 0, its sum added to 4 entries
    np.testing.assert_array_equal(w.grad.numpy(), want)
