"""to_static: tracing, guards, symbolic dims, the executor, program autodiff, recompute, model files."""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import tracemalloc
import weakref

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import ir, jit, optim
from llmkit.framework.executor import ExecutionError
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM

SEQ = jit.InputSpec(["B", "S"], "int64")


def tiny(**kw):
    return LlamaConfig.from_preset("tiny", **{"vocab_size": 128, "num_hidden_layers": 2, **kw})


class Logits(lf.nn.Layer):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def test_forward_logits_equal_eager_exactly():
    lf.seed(0)
    model = LlamaForCausalLM(tiny())
    f = jit.to_static(Logits(model), input_spec=[SEQ], compiler="none")  # bit-exact: unfused
    ids = np.random.default_rng(0).integers(0, 128, (2, 9))
    np.testing.assert_array_equal(f(lf.tensor(ids)).numpy(), model(lf.tensor(ids)).logits.numpy())


def test_one_trace_serves_every_batch_and_length():
    lf.seed(1)
    model = LlamaForCausalLM(tiny(max_position_embeddings=512, num_hidden_layers=1))
    f = jit.to_static(Logits(model), input_spec=[SEQ], compiler="none")  # bit-exact: unfused
    rng = np.random.default_rng(1)
    for b, s in [(1, 1), (8, 512), (3, 17), (1, 512), (8, 1), (5, 100)]:
        ids = rng.integers(0, 128, (b, s))
        out = f(lf.tensor(ids))
        assert out.shape == (b, s, 128)
        if s <= 17:
            np.testing.assert_array_equal(out.numpy(), model(lf.tensor(ids)).logits.numpy())
    assert f.trace_count == 1
    assert "i64[B, S]" in str(f.program)


@pytest.mark.parametrize("compiler", ["none", None])
def test_a_calls_outputs_are_freed_as_soon_as_the_caller_drops_them(compiler):
    """Nothing of a call outlives it but what it returns, with the cyclic GC off: a call that kept
    its outputs until the next collection made every call of a large function page-fault a fresh
    output buffer (rms_norm on [2048, 4096] at 10x its compiled time)."""
    f = jit.to_static(lambda x: {"a": (x * 2.0, [x + 1.0]), "n": 3}, compiler=compiler)
    x = lf.ones(64, 8)
    f(x)
    gc.disable()
    try:
        out = f(x)
        assert out["n"] == 3
        arrays = [weakref.ref(t._data) for t in (out["a"][0], out["a"][1][0])]
        del out
        assert [r() for r in arrays] == [None, None]
    finally:
        gc.enable()


def test_without_input_spec_shapes_are_guards():
    f = jit.to_static(lambda x: x * 2.0)
    f(lf.zeros(2, 3))
    f(lf.zeros(2, 3))
    assert f.trace_count == 1
    f(lf.zeros(4, 3))
    assert f.trace_count == 2


def test_python_values_are_guards_and_unrolled():
    def f(x, n):
        for _ in range(n):
            x = x + 1.0
        return x

    g = jit.to_static(f)
    assert g(lf.zeros(2), 3).tolist() == [3.0, 3.0]
    assert g(lf.zeros(2), 3).tolist() == [3.0, 3.0]
    assert g(lf.zeros(2), 5).tolist() == [5.0, 5.0]
    assert g.trace_count == 2
    assert sum(1 for op in g.program.walk() if op.name == "llm.add") == 5


def test_branching_on_a_tensor_value_names_the_users_line():
    def f(x):
        if x.sum() > 0:  # the offending line
            return x
        return -x

    g = jit.to_static(f)
    with pytest.raises(jit.TraceError, match=r"test_jit.py:\d+ .*ops.where"):
        g(lf.ones(3))
    with pytest.raises(jit.TraceError, match="Tensor.numpy"):
        jit.to_static(lambda x: lf.tensor(x.numpy()))(lf.ones(2))


def test_input_spec_mismatch_is_a_clear_error():
    f = jit.to_static(lambda x: x + 1, input_spec=[jit.InputSpec(["B", 4], "float32")])
    with pytest.raises(TypeError, match=r"argument 0 does not match its InputSpec \['B', 4\] float32"):
        f(lf.zeros(2, 5))


def test_captured_state_is_read_at_every_call():
    w = lf.Parameter(np.ones(3, np.float32))
    f = jit.to_static(lambda x: x * w)
    assert f(lf.ones(3)).tolist() == [1, 1, 1]
    w.set_value(lf.full([3], 2.0))
    assert f(lf.ones(3)).tolist() == [2, 2, 2]
    assert f.trace_count == 1


@pytest.mark.parametrize("compiler", ["none", None])
def test_a_traced_dropout_draws_a_new_mask_at_every_call(compiler):
    """The program's ``run_seed`` input is drawn from the generator before each run, so a traced
    dropout draws a new mask at every call (its seed alone, fixed at tracing, repeated one mask),
    each call's gradient uses that call's mask, and ``lf.seed`` repeats the whole sequence (tracing,
    at the first call, draws nothing: a resumed run draws what it would have)."""
    w = lf.Parameter(np.ones((8, 16), np.float32))

    def step():
        y = lf.nn.functional.dropout(w, 0.5)
        (g,) = lf.grad((y * y).sum(), [w])  # 2 * mask² / (1 - p)² = 2 * y * mask / (1 - p)
        return y, g

    f = jit.to_static(step, compiler=compiler)
    lf.seed(3)
    runs = [tuple(t.numpy() for t in f()) for _ in range(3)]
    for y, g in runs:
        assert set(np.unique(y)) == {0.0, 2.0}
        np.testing.assert_array_equal(g, 2 * y * y)
    assert not np.array_equal(runs[0][0], runs[1][0]) and not np.array_equal(runs[1][0], runs[2][0])
    lf.seed(3)
    for y, _ in runs:
        np.testing.assert_array_equal(f()[0].numpy(), y)
    assert f.trace_count == 1


def _train_pair(steps, static, recompute=False):
    lf.seed(0)
    model = LlamaForCausalLM(tiny())
    if recompute:
        for layer in model.model.layers:
            layer.recompute()
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)

    def step(x, y):
        loss = model.loss(x, y)
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    run = jit.to_static(step, input_spec=[SEQ, SEQ], compiler="none") if static else step
    losses = []
    for _ in range(steps):
        x = rng.integers(0, 128, (4, 16))
        losses.append(run(lf.tensor(x), lf.tensor(x)).item())  # learnable: predict the visible token
    return losses, model, run


@pytest.mark.slow
def test_fifty_training_steps_agree_with_eager():
    eager, m1, _ = _train_pair(50, static=False)
    static, m2, run = _train_pair(50, static=True)
    assert run.trace_count == 1
    np.testing.assert_allclose(static, eager, rtol=1e-5)
    assert eager[-1] < eager[0] - 0.3
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_gradients_of_every_parameter_agree_with_eager():
    """The compiled program's gradients and eager's, each against the same model's in float64.
    The two float32 paths sum in different orders (fused kernels, the CPU's SIMD width), so they
    are compared with the truth, not each other: an element's float32 error is a few ulps of the
    largest terms summed into it (sums of up to 344 terms here, ~n*eps*max|term| at worst, far less
    as the roundings cancel), so the bound is 64 float32 eps of the tensor's largest gradient,
    several times the error seen (<= 10 eps); a wrong gradient misses by orders of magnitude."""
    lf.seed(3)
    model = LlamaForCausalLM(tiny())
    params = model.parameters()
    ids = lf.tensor(np.random.default_rng(3).integers(0, 128, (2, 8)))
    m64 = copy.deepcopy(model).to("float64")
    truth = [g.numpy() for g in lf.grad(m64.loss(ids, ids), m64.parameters())]
    eager = lf.grad(model.loss(ids, ids), params)
    g = jit.to_static(lambda x: lf.grad(model.loss(x, x), params), input_spec=[SEQ])
    for (name, _), t, e, s in zip(model.named_parameters(), truth, eager, g(ids), strict=True):
        assert t.dtype == np.float64 and e.numpy().dtype == s.numpy().dtype == np.float32
        tol = 64 * np.finfo(np.float32).eps * np.abs(t).max()
        np.testing.assert_allclose(e.numpy(), t, rtol=0, atol=tol, err_msg=f"eager {name}")
        np.testing.assert_allclose(s.numpy(), t, rtol=0, atol=tol, err_msg=f"static {name}")


def test_recompute_same_gradients_lower_peak_memory():
    def run(recompute):
        lf.seed(4)
        model = LlamaForCausalLM(tiny(num_hidden_layers=3))
        for layer in model.model.layers:
            layer.recompute(recompute)
        params = model.parameters()
        f = jit.to_static(lambda x: lf.grad(model.loss(x, x), params), input_spec=[SEQ], compiler="none")
        ids = lf.tensor(np.random.default_rng(4).integers(0, 128, (8, 64)))
        f(ids)  # trace and warm up outside the measurement
        tracemalloc.start()
        grads = f(ids)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return [g.numpy() for g in grads], peak, f.program

    g0, peak0, p0 = run(False)
    g1, peak1, p1 = run(True)
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(a, b)
    assert peak1 < 0.8 * peak0, (peak0, peak1)
    assert p1.num_ops() > p0.num_ops()  # the forward is in the program twice


def test_static_step_peak_memory_below_eager():
    lf.seed(5)
    cfg = LlamaConfig.from_preset("bench", num_hidden_layers=2)
    ids = lf.tensor(np.random.default_rng(5).integers(0, cfg.vocab_size, (4, 128)))

    def peak(fn):
        fn()
        tracemalloc.start()
        fn()
        p = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return p

    model = LlamaForCausalLM(cfg)
    params = model.parameters()

    def eager():
        model.loss(ids, ids).backward()
        for p in params:
            p.grad = None

    static_fn = jit.to_static(lambda x: lf.grad(model.loss(x, x), params), input_spec=[SEQ])
    assert peak(lambda: static_fn(ids)) < peak(eager)


def test_append_backward_on_parsed_program():
    p = ir.parse("""module {
  func @main(%x: f64[3, 4], %w: f64[4, 2]) -> (f64[]) {
    %h = llm.matmul(%x, %w) : f64[3, 2]
    %t = llm.tanh(%h) : f64[3, 2]
    %m = llm.mul(%t, %h) : f64[3, 2]
    %s = llm.sum(%m) : f64[]
    builtin.return(%s)
  }
}""")
    f = p.function()
    jit.append_backward(p, f.outputs[0], [f.args[0], f.args[1]])
    p.verify()
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    _, dx, dw = ir.interpret(p, x, w)
    h = x @ w
    dh = (1 - np.tanh(h) ** 2) * h + np.tanh(h)  # d/dh sum(tanh(h) * h)
    np.testing.assert_allclose(dx, dh @ w.T, rtol=1e-12)
    np.testing.assert_allclose(dw, x.T @ dh, rtol=1e-12)
    # h is used twice (tanh and mul): its gradient contributions are summed
    assert sum(1 for op in f.body if op.name == "llm.add") >= 1


def test_executor_rejects_bad_inputs():
    f = jit.to_static(lambda x: x + 1, input_spec=[jit.InputSpec(["B", 4], "float32")])
    f(lf.zeros(2, 4))
    ex = f._last.executor
    with pytest.raises(ExecutionError, match=r"input %arg0 must be f32\[B, 4\]"):
        ex.run([np.zeros((2, 5), np.float32)])


def test_executor_checks_new_inputs_after_a_bound_call():
    """bind reuses the binding of shapes it checked before and skips inputs passed last time: a new
    input with those shapes is still checked (dtype, static shape), with the same error."""
    spec = [jit.InputSpec(["B", 4], "float32"), jit.InputSpec([4], "float32")]
    f = jit.to_static(lambda x, w: x + w, input_spec=spec)
    x, w = np.ones((2, 4), np.float32), np.arange(4, dtype=np.float32)
    f(lf.tensor(x), lf.tensor(w))
    ex = f._last.executor
    assert ex.bind([x, w]) == {"B": 2} and ex.bind([x, w]) == {"B": 2}  # the second from the memo
    np.testing.assert_array_equal(ex.run([x, w])[0], x + w)
    w[:] = 7  # written in place: the same array, its new values
    np.testing.assert_array_equal(ex.run([x, w])[0], x + 7)
    with pytest.raises(
        ExecutionError, match=r"input %arg1 must be f32\[4\], got shape \[5\] float32 \(B=2\)"
    ):
        ex.run([x, np.zeros(5, np.float32)])
    with pytest.raises(ExecutionError, match=r"input %arg0 must be f32\[B, 4\], got shape \[2, 4\] float64"):
        ex.run([np.ones((2, 4)), w])
    assert ex.bind([np.ones((3, 4), np.float32), w]) == {"B": 3}


def test_profile_lists_op_types(tmp_path):
    code = (
        "import numpy as np, llmkit.framework as lf\nfrom llmkit.framework import jit\n"
        "f = jit.to_static(lambda x: lf.ops.softmax(x * 2.0), compiler='none')\nf(lf.ones(4, 4))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "LLMKIT_PROFILE": "1"},
        check=True,
    ).stdout
    assert "LLMKIT_PROFILE" in out and "llm.softmax" in out and "llm.mul" in out


# ---- the static model file ----------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    lf.seed(6)
    model = LlamaForCausalLM(tiny())
    path = jit.save(Logits(model), tmp_path / "m.llmkit", input_spec=[SEQ], metadata={"note": "hi"})
    return path, model


def test_example_inputs_trace_the_saved_program(tmp_path):
    lf.seed(6)
    model = LlamaForCausalLM(tiny())
    ids = np.random.default_rng(3).integers(0, 128, (2, 5))
    path = jit.save(Logits(model), tmp_path / "m.llmkit", example_inputs=[ids])
    m = json.loads((path / "manifest.json").read_text())
    assert m["programs"]["forward"]["inputs"] == [{"name": "arg0", "shape": [2, 5], "dtype": "int64"}]
    loaded = jit.load(path, compiler="none")
    np.testing.assert_array_equal(loaded(ids), model(lf.tensor(ids)).logits.numpy())
    with pytest.raises(ValueError, match="pass input_spec or example_inputs"):
        jit.save(Logits(model), tmp_path / "n.llmkit")


def test_load_in_a_fresh_process_without_model_code(saved, tmp_path):
    path, model = saved
    ids = np.random.default_rng(7).integers(0, 128, (2, 6))
    np.save(tmp_path / "ids.npy", ids)
    code = f"""
import sys, numpy as np
import llmkit.framework.jit as jit
m = jit.load({str(path)!r}, compiler="none")
np.save({str(tmp_path / "out.npy")!r}, m(np.load({str(tmp_path / "ids.npy")!r})))
assert not any(k.startswith("llmkit.models") for k in sys.modules), [k for k in sys.modules if "models" in k]
print(m.metadata["note"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hi"
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), model(lf.tensor(ids)).logits.numpy())


def test_manifest_lists_specs_and_checksums(saved):
    path, _ = saved
    m = json.loads((path / "manifest.json").read_text())
    assert m["format"] == "llmkit.static" and m["format_version"] == jit.FORMAT_VERSION
    assert m["programs"]["forward"]["inputs"] == [{"name": "arg0", "shape": ["B", "S"], "dtype": "int64"}]
    assert "model.model.embed_tokens.weight" in m["programs"]["forward"]["weights"]
    assert set(m["files"]) == {"forward.pir", "weights.safetensors"}


def test_corrupted_truncated_and_future_files(saved):
    path, _ = saved
    w = path / "weights.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:-10])
    with pytest.raises(jit.FormatError, match="weights.safetensors is corrupted"):
        jit.load(path)
    w.write_bytes(data)
    (path / "forward.pir").write_text((path / "forward.pir").read_text().replace("llm.add", "llm.sub", 1))
    with pytest.raises(jit.FormatError, match="forward.pir is corrupted"):
        jit.load(path)
    m = json.loads((path / "manifest.json").read_text())
    m["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(jit.FormatError, match=f"format version 99.*reads up to version {jit.FORMAT_VERSION}"):
        jit.load(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(jit.FormatError, match="not valid JSON"):
        jit.load(path)


def test_not_a_model_directory(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(jit.FormatError, match="not a static model directory"):
        jit.load(tmp_path)


def test_saving_a_training_step_is_refused(tmp_path):
    w = lf.Parameter(np.ones(2, np.float32))

    def step(x):
        w.set_value(w + x)
        return w

    f = jit.to_static(step)
    f(lf.ones(2))
    with pytest.raises(ValueError, match="updates captured state"):
        jit.save(f, tmp_path / "m")


def test_llmkit_jit_is_the_public_name_of_framework_jit():
    import llmkit.jit as public

    assert public.__all__ == jit.__all__ and "to_static" in public.__all__
    for name in jit.__all__:
        assert getattr(public, name) is getattr(jit, name), name
    f = public.to_static(lambda x: x * 2.0 + 1.0, input_spec=[public.InputSpec(["N"], "float32")])
    np.testing.assert_array_equal(f(lf.tensor(np.arange(3, dtype=np.float32))).numpy(), [1.0, 3.0, 5.0])
