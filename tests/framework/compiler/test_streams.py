"""Streaming stores (``schedule.mark_streams``, ``codegen_c``): which stores may bypass the
caches, and that kernels which take that path compute what they compute without it.

Kernels stream only outputs of at least ``STREAM_BYTES`` (half the last-level cache), which the
other tests' shapes never reach; the subprocess tests below set ``LLMKIT_STREAM_BYTES=1``, so that
every marked store streams, and check the results against float64 formulas written here and
against the reference kernels (the whole registry walk of ``test_kernels.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import compiler, jit
from llmkit.framework.compiler import loop_ir as L
from llmkit.framework.compiler.lower import lower
from llmkit.framework.compiler.runtime import kernel_sources

from .conftest import needs_cc

O = lf.ops


def _kernels(fn, specs) -> list[L.Kernel]:
    """The rows-schedule loop IR of every fused group of ``fn`` traced on ``specs``."""
    ts = [lf.zeros(*[3 if isinstance(d, str) else d for d in s], dtype=dt) for s, dt in specs]
    p = jit.to_static(fn, input_spec=[jit.InputSpec(s, d) for s, d in specs], compiler="none")
    fused = compiler.fuse_program(p.get_concrete_program(*ts).program)
    return [kernel_sources(lower(op))[0][3] for op in fused.walk() if op.name == "cinn.fusion"]


def _streamed(k: L.Kernel) -> set[str]:
    return {s.buf for s in L.walk_stmts(k.body) if isinstance(s, L.Store) and s.stream}


def _prefetched(k: L.Kernel) -> list[str]:
    return [repr(ld) for s in L.walk_stmts(k.body) if isinstance(s, L.Loop) for ld in s.prefetch]


def test_an_output_written_once_along_its_rows_streams_and_prefetches_the_next_row():
    (k,) = _kernels(lambda x, w: O.rms_norm(x, w), [(["N", 512], "float32"), ([512], "float32")])
    assert _streamed(k) == {"out0"}
    assert _prefetched(k) == ["in0[(512*i0 + i1 + 512)]"]  # x's next row; w is the same every row


def test_an_output_read_back_as_a_row_buffer_does_not_stream():
    (k,) = _kernels(lambda x: O.softmax(x, axis=-1), [(["N", 512], "float32")])
    assert _streamed(k) == set() and _prefetched(k) == []


def _two_outputs(a, b):
    t = O.tanh(b)
    return O.cast(t, "float64") * a + 1.0, t


def test_flat_elementwise_outputs_stream_without_prefetching():
    (k,) = _kernels(_two_outputs, [(["N"], "float64"), (["N"], "float32")])
    assert _streamed(k) == {"out0", "out1"} and _prefetched(k) == []


def test_short_pieces_of_a_concat_do_not_stream():
    def rotate(x):
        return O.concat([-x[..., 8:], x[..., :8]], axis=-1) * 2.0

    (k,) = _kernels(rotate, [(["N", 16], "float32")])
    assert _streamed(k) == set()  # two loops of 8 floats per row: 32 bytes, not worth a stream


def test_an_epilogue_written_over_its_matmul_product_does_not_stream():
    ks = _kernels(lambda a, b: O.tanh(a @ b) * 3.0, [(["N", 64], "float32"), ([64, 64], "float32")])
    (k,) = [k for k in ks if k.aliased]  # type: ignore[attr-defined]
    assert _streamed(k) == set()


_STREAMED = """
import json, sys
import numpy as np
import llmkit.framework as lf
from llmkit.framework import jit
O = lf.ops
rng = np.random.default_rng(0)
f32 = np.float32
errs = {}

def check(name, fn, arrays, want):
    got = jit.to_static(fn)(*[lf.tensor(a) for a in arrays])
    got = got if isinstance(got, tuple) else (got,)
    errs[name] = max(float(np.max(np.abs(g.numpy() - w)) / max(1.0, float(np.max(np.abs(w)))))
                     for g, w in zip(got, want))

# rows of 1000 floats: every row starts 32 bytes off the last one's alignment; 2 threads, many chunks
x, w = rng.standard_normal((301, 1000)).astype(f32), rng.standard_normal(1000).astype(f32)
x64 = x.astype(np.float64)
check("rms_norm", lambda x, w: O.rms_norm(x, w, eps=1e-6), [x, w],
      [x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w])
# a flat loop with two outputs, float32 and float64 (runs of 1 KiB of the wider one)
a, b = rng.standard_normal(100_003), rng.standard_normal(100_003).astype(f32)
def two_outputs(a, b):
    t = O.tanh(b)
    return O.cast(t, "float64") * a + 1.0, t
t = np.tanh(b.astype(np.float64))
check("two_outputs", two_outputs, [a, b], [t * a + 1.0, t])
# swiglu's backward: two outputs of an odd width, 3 inputs
a, b, g = (rng.standard_normal((97, 517)).astype(f32) for _ in range(3))
def swiglu_bwd(a, b, g):
    s = O.sigmoid(a)
    return g * b * s * (1.0 + a * (1.0 - s)), g * a * s
s = 1 / (1 + np.exp(-a.astype(np.float64)))
check("swiglu_bwd", swiglu_bwd, [a, b, g], [g * b * s * (1 + a * (1 - s)), g * a * s])
print(json.dumps(errs))
"""


def _streaming_env(tmp_path: Path) -> dict:
    return {**os.environ, "LLMKIT_STREAM_BYTES": "1", "LLMKIT_CINN_THREADS": "2", "LLMKIT_CINN_TUNE": "0",
            "LLMKIT_KERNEL_CACHE": str(tmp_path), "LLMKIT_CINN_DUMP": str(tmp_path / "dump")}  # fmt: skip


@needs_cc
def test_streamed_kernels_equal_float64_formulas(tmp_path):
    env = _streaming_env(tmp_path)
    r = subprocess.run(
        [sys.executable, "-c", _STREAMED], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    errs = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(errs) == {"rms_norm", "two_outputs", "swiglu_bwd"} and max(errs.values()) < 1e-5, errs
    sources = [p.read_text() for p in (tmp_path / "dump").iterdir()]
    assert sum("llmkit_stream(&" in s for s in sources) >= 3  # each case took the streaming path


@needs_cc
@pytest.mark.slow
def test_every_generated_kernel_still_equals_the_reference_when_its_outputs_stream(tmp_path):
    env = _streaming_env(tmp_path)
    test = Path(__file__).with_name("test_kernels.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(test)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path(test).parents[3])
    assert r.returncode == 0, r.stdout[-3000:]
    assert np.any(["llmkit_stream(&" in p.read_text() for p in (tmp_path / "dump").iterdir()])
