"""The CUDA backend: the same loop IR as CUDA C.

Without a GPU the generated CUDA is still checked: it is compiled as C++ by the host compiler
against a one-thread emulation of the CUDA built-ins (one block of one thread, so every
grid-/block-stride loop walks all iterations and a block reduction is the thread's own value) and
its results are compared with the reference. That catches everything but the real parallel
reduction, which the GPU test below covers where a GPU exists (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import compiler, ir, jit
from llmkit.framework.compiler.cuda import render_cuda
from llmkit.framework.compiler.loop_schedule import build
from llmkit.framework.compiler.lower import lower

from .harness import assert_same

O = lf.ops

EMULATION = r"""#include <cmath>
#include <cstring>
#include <cstdint>
#undef INFINITY
#undef NAN
#undef INT64_C
#undef INT64_MIN
#undef INT64_MAX
#undef INT32_MIN
#undef INT32_MAX
#undef INT16_MIN
#undef INT16_MAX
#undef INT8_MIN
#undef INT8_MAX
#undef UINT8_MAX
using std::exp; using std::log; using std::sqrt; using std::tanh; using std::erf; using std::pow;
using std::sin; using std::cos; using std::fabs;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
struct Dim3 { unsigned x; };
static Dim3 threadIdx = {0}, blockIdx = {0}, blockDim = {1}, gridDim = {1};
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
"""

CASES = {
    "rms_norm": (lambda x, w: O.rms_norm(x, w), [(["N", 24], "float32"), ([24], "float32")]),
    "softmax": (lambda x: O.softmax(x * 2.0, axis=-1), [(["N", 37], "float32")]),
    "column_sum": (lambda g, y: (g * y).sum(axis=0), [(["N", 16], "float64"), (["N", 16], "float64")]),
    "rotary": (
        lambda x, c, s: x * c + O.concat([-x[..., 4:], x[..., :4]], axis=-1) * s,
        [(["N", 2, 8], "float32"), ([2, 8], "float32"), ([2, 8], "float32")],
    ),
    "max_and_mean": (lambda x: (O.max(x, axis=-1), O.mean(x)), [(["N", 9], "float32")]),
}


def _program(fn, specs):
    ins = [jit.InputSpec(s, d) for s, d in specs]
    ts = [lf.zeros(*[2 if isinstance(n, str) else n for n in s], dtype=d) for s, d in specs]
    return jit.to_static(fn, input_spec=ins, compiler="none").get_concrete_program(*ts).program


def _emulated(kernel, tmp_path):
    src = render_cuda(kernel).split("\n", 2)[2]  # drop the typedefs: <cstdint> has them
    # one thread per block: a block reduction is the thread's own value
    src = re.sub(
        r"template <class T, class F> __device__ T block_reduce\(T v, F op\) \{.*?\n\}\n",
        "template <class T, class F> T block_reduce(T v, F op) { (void)op; return v; }\n",
        src,
        flags=re.S,
    )
    c = tmp_path / f"{kernel.name}.cpp"
    c.write_text(EMULATION + src)
    so = tmp_path / f"{kernel.name}.so"
    r = subprocess.run(
        ["g++", "-O1", "-shared", "-fPIC", "-std=c++17", str(c), "-o", str(so)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return getattr(ctypes.CDLL(str(so)), kernel.name)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler to emulate CUDA with")
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_source_compiles_and_computes_the_reference(name, tmp_path):
    fn, specs = CASES[name]
    p = _program(fn, specs)
    fused = compiler.fuse_program(p)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal([5 if isinstance(n, str) else n for n in s]).astype(d) for s, d in specs]
    env = {"N": 5}
    vals = dict(zip(fused.function().args, arrays))
    for op in fused.function().body:
        if op.name == "builtin.return":
            break
        if op.name != "cinn.fusion":  # an op left outside groups: its reference kernel
            spec = op.opdef.spec
            attrs = {k: (a.evaluate(env) if a.symbolic else a.value) for k, a in op.attributes.items()}
            res = spec.kernel(np, *[vals[v] for v in op.operands], **attrs)
            for r, o in zip(op.results, res if spec.multi_output else (res,)):
                vals[r] = np.asarray(o)
            continue
        low = lower(op)
        k = build(low, f"k_{name}_{len(vals)}", "rows")
        kern = _emulated(k, tmp_path)
        ins = [np.ascontiguousarray(vals[v]) for v in op.operands]
        sizes = {s: ins[i].shape[a] for s, (i, a) in zip(low.sizes, low.size_sources)}
        outs = [
            np.empty([sizes.get(d, d) if isinstance(d, str) else d for d in shape], dt)
            for _, dt, shape in low.outputs
        ]
        args = [ctypes.c_void_p(a.ctypes.data) for a in ins + outs] + [
            ctypes.c_int64(sizes[s]) for s in low.sizes
        ]
        kern(*args)
        for r, o in zip(op.results, outs):
            vals[r] = o
    got = [vals[v] for v in fused.function().return_op.operands]
    from llmkit.framework.executor import Executor

    want = Executor(p).run(arrays)
    assert_same(got, want, arrays[0].dtype, name)


@pytest.mark.gpu
def test_cuda_kernels_equal_the_reference_on_a_gpu():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    from llmkit.framework.compiler.runtime import FusedKernel
    from llmkit.framework.executor import Executor

    for name, (fn, specs) in sorted(CASES.items()):
        p = _program(fn, specs)
        fused = compiler.compile_program(p)
        ex = Executor(fused)
        rng = np.random.default_rng(0)
        for n in (1, 5, 300):
            arrays = [
                rng.standard_normal([n if isinstance(d, str) else d for d in s]).astype(t) for s, t in specs
            ]
            outs = ex.run([cp.asarray(a) for a in arrays])
            assert all(isinstance(o, cp.ndarray) for o in outs), f"{name}: a result came back on the host"
            want = Executor(p).run(arrays)
            assert_same([cp.asnumpy(o) for o in outs], want, arrays[0].dtype, f"{name} n={n} on the GPU")
        groups = [st.fn for st in ex.steps if isinstance(st.fn, FusedKernel)]
        assert groups and all(g.cuda is not None for g in groups), f"{name}: a group ran without CUDA"


def test_cuda_launch_covers_rows_or_elements():
    from llmkit.framework.compiler.cuda import launch_shape

    text = """module {
      func @main(%x: f32[N, 64]) -> (f32[N, 64], f32[N, 64]) {
        %a = llm.softmax(%x) : f32[N, 64]
        %b = llm.exp(%x) : f32[N, 64]
        return %a, %b
      }
    }"""
    fused = compiler.fuse_program(ir.parse(text))
    shapes = [
        launch_shape(build(lower(op), "k", "rows"), {"N": 1000})
        for op in fused.walk()
        if op.name == "cinn.fusion"
    ]
    assert (1000, 256) in shapes  # a block per row of the softmax
