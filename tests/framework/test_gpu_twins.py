"""The GPU paths and their CPU twins: the same test on numpy and (marked ``gpu``) on cupy.

Where the GPU code lives and what checks it (the op table's twins are in ``test_op_table.py``,
the engine's in ``tests/infer/test_engine.py``, the trainer's (a run, its checkpoint and resume)
in ``tests/train/test_trainer.py``, compiled training on both devices in
``compiler/test_training.py``, the CUDA source emulated on the host in ``compiler/test_cuda.py``):

- fused groups through ``to_static(f)(x)``: C kernels on the CPU, their CUDA rendering on the GPU,
  each against a float64 numpy formula written here, every group running its device's kernel;
- the executor's report of a GPU step computed on the host (a ``FallbackWarning``, an error in
  the suite), checked here on the CPU with a stand-in array module;
- the ``nccl`` backend (cupy + NCCL, bootstrapped over MPI) over a world of one GPU, in a process
  of its own (a process chooses its backend once): GPU only, it has no CPU twin beyond its parent
  class ``mpi``, whose collectives ``distributed/`` tests run on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import compiler, executor, jit
from llmkit.framework.compiler import FallbackWarning
from llmkit.framework.compiler.runtime import FusedKernel

O = lf.ops
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rotate_half(x, xp):
    h = x.shape[-1] // 2
    return xp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _lk_rope(x, c, s):
    h = x.shape[-1] // 2
    return x * c + O.concat([-x[..., h:], x[..., :h]], axis=-1) * s


def _f64_ce_grad(x, y):
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p / len(y)


def _f64_ce(x, y):
    m = x.max(-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(-1)) + m[:, 0]
    return np.mean(lse - x[np.arange(len(y)), y])


# name -> (llmkit function, float64 formula, input arrays (rng -> list), differentiated inputs)
FUSED = {
    "rms_norm": (
        lambda x, w: O.rms_norm(x, w, eps=1e-6),
        lambda x, w: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w,
        lambda rng: [rng.standard_normal((37, 64)), rng.standard_normal(64)],
    ),
    "softmax": (
        lambda x: O.softmax(x, axis=-1),
        lambda x: (
            np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
        ),
        lambda rng: [rng.standard_normal((3, 29, 50)) * 3],
    ),
    "swiglu": (
        O.swiglu,
        lambda a, b: a / (1 + np.exp(-a)) * b,
        lambda rng: [rng.standard_normal((41, 96)), rng.standard_normal((41, 96))],
    ),
    "rotary": (
        _lk_rope,
        lambda x, c, s: x * c + _rotate_half(x, np) * s,
        lambda rng: [
            rng.standard_normal((2, 4, 19, 16)),
            rng.standard_normal((19, 16)),
            rng.standard_normal((19, 16)),
        ],
    ),
    "cross_entropy": (
        lambda x, y: O.cross_entropy(x, y),
        _f64_ce,
        lambda rng: [rng.standard_normal((33, 300)), rng.integers(0, 300, 33)],
    ),
    "cross_entropy_grad": (
        lambda x, y: lf.grad(O.cross_entropy(x, y), [x])[0],
        _f64_ce_grad,
        lambda rng: [rng.standard_normal((33, 300)), rng.integers(0, 300, 33)],
    ),
}


@pytest.mark.skipif(not compiler.available(), reason="no working C compiler on this machine")
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_group_through_to_static_equals_float64(name, device, assert_on_device):
    """``to_static(f, compiler="cinn")(x)`` on the device's arrays: every fused group runs its
    compiled kernel (C on the CPU, the CUDA rendering on the GPU, none left to the reference
    kernels), the outputs stay on the device and match the float64 formula."""
    fn, ref, make = FUSED[name]
    arrays = make(np.random.default_rng(len(name)))
    arrays = [a.astype(np.float32) if a.dtype == np.float64 else a for a in arrays]
    ts = [lf.tensor(a, dtype=a.dtype, device=device, requires_grad=name.endswith("_grad") and i == 0)
          for i, a in enumerate(arrays)]  # fmt: skip
    run = jit.to_static(fn, input_spec=[jit.InputSpec(a.shape, a.dtype) for a in arrays], compiler="cinn")
    out = run(*ts)
    assert_on_device(out)
    want = ref(*[a.astype(np.float64) if a.dtype == np.float32 else a for a in arrays])
    np.testing.assert_allclose(out.numpy().astype(np.float64), want, rtol=2e-5, atol=2e-6, err_msg=name)
    steps = run._last.executor.steps
    kernels = [st.fn for st in steps if isinstance(st.fn, FusedKernel)]
    assert kernels, f"{name}: no fused group got a kernel ({[st.name for st in steps]})"
    assert not any(st.name == "cinn.fusion" for st in steps)  # a group left to the reference kernels
    if device == "gpu":
        assert all(k.cuda is not None for k in kernels), f"{name}: a group ran without its CUDA kernel"


def test_a_host_array_in_a_gpu_program_is_a_fallback_warning():
    """The executor's check that fails the GPU twins when a kernel computes on the host: a step
    of a program on another array module that returns a numpy array is reported once per step
    (``FallbackWarning``, an error in this suite) and its result moved to that module."""
    moved = []
    gpu = types.SimpleNamespace(
        __name__="stand_in_gpu", asarray=lambda a: moved.append(a) or ("on device", a)
    )
    host = np.ones(3)
    with pytest.warns(FallbackWarning, match=r"llm\.twin_step: its kernel returned a host \(numpy\) array"):
        assert executor._device_array(gpu, host, "llm.twin_step") == ("on device", host)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        executor._device_array(gpu, host, "llm.twin_step")  # said once per step
        executor._device_array(gpu, "a device array", "llm.other_step")  # not a host array: no warning
        assert executor._device_array(np, 2.0, "llm.scalar") == 2.0  # numpy programs: as before
    assert moved == [host, host, "a device array"]


NCCL_WORLD_OF_ONE = r"""
import sys
import numpy as np
import cupy as cp
from llmkit.framework.distributed import comm

b = comm.init("nccl", timeout=60)
assert (b.name, b.rank, b.world_size) == ("nccl", 0, 1), (b.name, b.rank, b.world_size)
x = cp.asarray(np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32))
g = (0,)
for op in ("sum", "avg", "max"):
    out = b.all_reduce(g, {0: x}, op)[0]
    assert isinstance(out, cp.ndarray) and out.data.ptr != x.data.ptr, op
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(x), err_msg=op)
for name, out in (
    ("all_gather", b.all_gather(g, {0: x}, 1, [6])[0]),
    ("all_to_all", b.all_to_all(g, {0: x}, 0, [5], 1, [6])[0]),
    ("reduce_scatter", b.reduce_scatter(g, {0: x}, 0, [5])[0]),
):
    assert isinstance(out, cp.ndarray), name
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(x), err_msg=name)
big = cp.arange(1 << 22, dtype=cp.float32)
np.testing.assert_array_equal(cp.asnumpy(b.all_reduce(g, {0: big}, "sum")[0]), cp.asnumpy(big))
print("nccl world of 1: ok")
"""


@pytest.mark.gpu
def test_nccl_backend_over_a_world_of_one_gpu():
    """The nccl backend's collectives on one GPU (NCCL communicator of one rank, bootstrapped
    over MPI as a singleton): each result a fresh cupy array equal to the input."""
    if not lf.backend.gpu_available():
        pytest.skip("nccl: cupy found no CUDA device")
    probe = "from cupy.cuda import nccl; from mpi4py import MPI"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    if r.returncode:
        pytest.skip(
            f"nccl: cupy's NCCL or mpi4py's MPI cannot load here: {r.stderr.strip().splitlines()[-1:]}"
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(
        [sys.executable, "-c", NCCL_WORLD_OF_ONE], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0 and "nccl world of 1: ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
