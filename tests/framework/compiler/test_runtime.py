"""The compiler at run time: to_static integration, dynamic shapes, the disk cache, the tuner,
fallbacks (no C compiler, a kernel that does not compile), profiling, the CUDA rendering."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import compiler, jit
from llmkit.framework.compiler import runtime, tune

from .conftest import needs_cc

O = lf.ops
ROWS = jit.InputSpec(["N", "H"], "float32")


def norm_softmax(x, w):
    return O.softmax(O.rms_norm(x, w) * 2.0, axis=-1)


def _xw(n=5, h=24, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, h)).astype(np.float32), rng.standard_normal(h).astype(np.float32)


@needs_cc
def test_to_static_compiles_and_one_kernel_serves_every_size():
    f = jit.to_static(norm_softmax, input_spec=[ROWS, jit.InputSpec(["H"], "float32")], compiler="cinn")
    ref = jit.to_static(norm_softmax, input_spec=[ROWS, jit.InputSpec(["H"], "float32")], compiler="none")
    for n, h in [(1, 1), (3, 7), (64, 130), (2, 1)]:
        x, w = _xw(n, h)
        np.testing.assert_allclose(
            f(lf.tensor(x), lf.tensor(w)).numpy(),
            ref(lf.tensor(x), lf.tensor(w)).numpy(),
            rtol=2e-5,
            atol=1e-7,
        )
    assert f.trace_count == 1
    ex = f._last.executor
    assert any(s.name == "cinn.fusion[rms_norm+softmax]" for s in ex.steps)


@needs_cc
def test_default_compiler_is_cinn_where_a_c_compiler_exists():
    from llmkit.framework.jit.compile import default_compiler

    assert default_compiler() == "cinn"
    f = jit.to_static(norm_softmax)
    x, w = _xw()
    f(lf.tensor(x), lf.tensor(w))
    assert [s.name for s in f._last.executor.steps] == ["cinn.fusion[rms_norm+softmax]"]


@needs_cc
def test_kernels_are_cached_by_content_on_disk(kernel_cache):
    p = (
        jit.to_static(lambda x: O.exp(x) * 3.0 - x, compiler="none")
        .get_concrete_program(lf.ones(3, 5))
        .program
    )
    before = compiler.STATS.compiled, compiler.STATS.cached
    compiler.compile_program(p)
    compiled = compiler.STATS.compiled - before[0]
    compiler.compile_program(p)  # the same kernels again: from the cache, nothing compiled
    assert compiler.STATS.compiled - before[0] == compiled
    assert compiler.STATS.cached > before[1]
    assert list(kernel_cache.glob("k_*.so")) and list(kernel_cache.glob("lib_*.so"))


@needs_cc
def test_tuner_times_candidates_once_and_keeps_the_winner(kernel_cache):
    def colsum(g, y):
        return (g * y).sum(axis=0)

    spec = jit.InputSpec(["N", 512], "float32")
    f = jit.to_static(colsum, input_spec=[spec, spec], compiler="cinn")
    rng = np.random.default_rng(0)
    g, y = (rng.standard_normal((300, 512)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(f(lf.tensor(g), lf.tensor(y)).numpy(), (g * y).sum(0), rtol=1e-4, atol=1e-4)
    data = json.loads((kernel_cache / "tune.json").read_text())
    assert any(k.endswith(f"|{tune.shape_class([300])}|{runtime.CPUS}") for k in data), data
    n = len(data)
    f(lf.tensor(g[:290]), lf.tensor(y[:290]))  # same shape class: no new decision
    assert len(json.loads((kernel_cache / "tune.json").read_text())) == n


def test_tuner_decisions_saved_by_many_threads_at_once_are_all_kept(kernel_cache):
    """Sim ranks are threads of one process that tune the same kernels at once: every save lands
    (no writer's temporary file taken by another, no decision lost to a concurrent rewrite)."""
    import threading

    keys = [f"test-threads|{i}" for i in range(16)]
    errors: list[BaseException] = []

    def save(key: str) -> None:
        try:
            tune._save(key, (1, 2))
        except BaseException as e:  # pragma: no cover - the failure this test is for
            errors.append(e)

    threads = [threading.Thread(target=save, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    data = json.loads((kernel_cache / "tune.json").read_text())
    assert all(data[k] == [1, 2] for k in keys)
    assert not list(kernel_cache.glob("*.tmp"))


def test_without_a_compiler_everything_runs_and_says_so_once():
    x, w = _xw()
    want = jit.to_static(norm_softmax, compiler="none")(lf.tensor(x), lf.tensor(w)).numpy()
    with compiler.unavailable(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not compiler.available()
        f = jit.to_static(norm_softmax, compiler="cinn")
        g = jit.to_static(lambda x: O.exp(x) + 1.0, compiler="cinn")
        np.testing.assert_array_equal(f(lf.tensor(x), lf.tensor(w)).numpy(), want)
        g(lf.tensor(x))
        # a program fused elsewhere: its groups run their ops with the reference kernels
        fused = compiler.fuse_program(f._last.program)
        from llmkit.framework.executor import Executor

        np.testing.assert_array_equal(Executor(fused).run([x, w])[0], want)
        assert jit.to_static(norm_softmax)._trace  # the default quietly runs unfused
    said = [c for c in caught if "no working C compiler" in str(c.message)]
    assert len(said) == 1, [str(c.message) for c in caught]


@needs_cc
def test_llmkit_cc_none_simulates_no_compiler():
    code = (
        "import warnings, numpy as np, llmkit.framework as lf\nfrom llmkit.framework import jit, compiler\n"
        "warnings.simplefilter('always')\nassert not compiler.available()\n"
        "f = jit.to_static(lambda x: lf.ops.softmax(x), compiler='cinn')\n"
        "print(f(lf.ones(2, 3)).numpy().sum())\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "LLMKIT_CC": "none"}
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2.0" and r.stderr.count("no working C compiler") == 1


@needs_cc
def test_a_kernel_that_fails_to_compile_runs_the_reference(monkeypatch):
    real = runtime.render_c

    def broken(k):
        src = real(k)
        return src.replace("{", "{ this is not C;", 1) if "[exp" in str(k) or "exp" in k.label else src

    monkeypatch.setattr(runtime, "render_c", broken)

    def fn(x, y):
        return O.exp(x) * 7.0, O.rms_norm(y, x[0] * 0.0 + 1.0)

    f = jit.to_static(fn, compiler="none")
    x, y = _xw(4, 9)[0], _xw(4, 9, seed=1)[0]
    p = f.get_concrete_program(lf.tensor(x), lf.tensor(y)).program
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = compiler.compile_program(p)
    said = [c for c in caught if "failed to compile" in str(c.message)]
    assert len(said) == 1
    from llmkit.framework.executor import Executor

    got = Executor(fused).run([x, y])
    want = Executor(p).run([x, y])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    names = [s.name for s in Executor(fused).steps]
    assert "cinn.fusion[rms_norm]" in names and "cinn.fusion[exp_mul] unfused" in names, names


@needs_cc
def test_profile_lists_fused_kernels_with_their_time(tmp_path):
    code = (
        "import numpy as np, llmkit.framework as lf\nfrom llmkit.framework import jit\n"
        "f = jit.to_static(lambda x, w: lf.ops.softmax(lf.ops.rms_norm(x, w)), compiler='cinn')\n"
        "f(lf.ones(4, 8), lf.ones(8)); f(lf.ones(4, 8), lf.ones(8))\n"
    )
    env = {**os.environ, "LLMKIT_PROFILE": "1", "LLMKIT_KERNEL_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"cinn\.fusion\[rms_norm\+softmax\]\s+2\s+\d", r.stdout), r.stdout
    assert re.search(r"cinn: \d+ kernels compiled in [\d.]+ s", r.stderr), r.stderr


_SPIN_PROBE = """
import json, os, sys
import numpy as np
from llmkit.framework.compiler import build, par
if sys.argv[1] == "after-kernel":
    import llmkit.framework as lf
    from llmkit.framework import jit
    f = jit.to_static(lambda x: lf.ops.exp(x) + 1.0, input_spec=[jit.InputSpec(["N"], "float32")])
    f(lf.tensor(np.ones(3, np.float32)))  # loads a kernel, and with it the pool
before = par._spin_ns
build.spin_between_kernels()
env = [os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")]
print(json.dumps([*env, before, par._spin_ns == build.SPIN_NS]))
"""


@needs_cc
def test_inference_processes_spin_between_kernels_whenever_they_say_so(kernel_cache):
    def probe(when: str, **env: str) -> list:
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        base["LLMKIT_KERNEL_CACHE"] = str(kernel_cache)
        r = subprocess.run(
            [sys.executable, "-c", _SPIN_PROBE, when], env={**base, **env}, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    # the pool's helpers (which sleep at once by default) spin from then on, before or after the
    # first kernel; OpenMP's settings are the user's own (no kernel uses its runtime)
    assert probe("before") == [None, None, 0, True]
    assert probe("after-kernel") == [None, None, 0, True]
    assert probe("after-kernel", OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", None, 0, True]


def test_fallbacks_fail_the_tests_that_meet_them():
    # pyproject.toml makes the warning an error: a test of a compiled path cannot pass on fallbacks
    with pytest.raises(compiler.FallbackWarning):
        warnings.warn("cinn: a group runs the reference kernels", compiler.FallbackWarning, stacklevel=1)


@needs_cc
def test_a_group_that_cannot_be_lowered_says_so(monkeypatch):
    from llmkit.framework.compiler import build

    def refuse(op, *a, **k):
        raise compiler.LowerError("no rule for this group")

    monkeypatch.setattr(runtime, "lower", refuse)
    monkeypatch.setattr(build, "_warned", set())
    x, w = _xw()
    f = jit.to_static(norm_softmax, compiler="cinn")
    with pytest.raises(compiler.FallbackWarning, match=r"rms_norm\+softmax runs the reference kernels"):
        f(lf.tensor(x), lf.tensor(w))


@needs_cc
def test_a_kernel_that_fails_to_compile_fails_a_compiled_test(monkeypatch):
    from llmkit.framework.compiler import build

    real = runtime.render_c
    monkeypatch.setattr(runtime, "render_c", lambda k: real(k).replace("{", "{ not C;", 1))
    monkeypatch.setattr(build, "_warned", set())
    f = jit.to_static(lambda x: O.tanh(x) * 5.0 - 2.0, compiler="cinn")
    with pytest.raises(compiler.FallbackWarning, match="failed to compile"):
        f(lf.ones(3, 4))


_THREADS_PROBE = """
import ctypes, json, resource, sys, tempfile, time, warnings
warnings.simplefilter("always")
if sys.argv[1] == "openmp-first":
    ctypes.CDLL("libgomp.so.1")  # as a library imported before llmkit (torch) does
import numpy as np
import pytest
import llmkit.framework as lf
from llmkit.framework import jit
from llmkit.framework.compiler import par
f = jit.to_static(lambda x: lf.ops.exp(x) + 1.0, input_spec=[jit.InputSpec(["N"], "float32")])
if sys.argv[2] == "jit.load":
    f = jit.load(jit.save(f, tempfile.mkdtemp() + "/m"))
x = np.ones(1 << 20, np.float32)
f(x)  # the first compiled call: loads the kernels and the pool
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
idle = 0.0
loops = par.counts()[0]
for _ in range(5):  # CPU time between kernels: what idle kernel threads burn
    f(x)
    t = cpu()
    time.sleep(0.04)
    idle += cpu() - t
with open("/proc/self/maps") as fh:
    gomp = any("libgomp" in line for line in fh)
loops = par.counts()[0] - loops
print(json.dumps({"idle_cpu_s": idle, "pool_spin_ns": par._spin_ns, "pool_loops": loops, "libgomp": gomp}))
"""


@needs_cc
@pytest.mark.slow
@pytest.mark.parametrize("way", ["to_static", "jit.load"])
def test_kernel_threads_sleep_between_kernels_in_a_fresh_process(way, tmp_path):
    """The threading actually in effect after the first compiled call (every kernel on two threads:
    untuned), whatever was imported first: the kernels' loops run on the pool, whose helpers sleep
    between kernels, and no OpenMP runtime (nor its wait policy) is involved."""

    def probe(order: str, **env: str) -> tuple[dict, str]:
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        base.update(LLMKIT_KERNEL_CACHE=str(tmp_path), LLMKIT_CINN_TUNE="0", LLMKIT_CINN_THREADS="2", **env)
        r = subprocess.run(
            [sys.executable, "-c", _THREADS_PROBE, order, way], env=base, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr

    got, said = probe("llmkit-first")
    assert got["pool_loops"] == 5 and not got["libgomp"], got  # one parallel loop per call
    assert got["pool_spin_ns"] == 0 and got["idle_cpu_s"] < 0.01, got  # spinning: ~5 ms per gap here
    assert "Warning" not in said, said
    # OpenMP loaded first, told to spin (torch's own runtime, say): nothing of ours runs on it
    got, said = probe("openmp-first", OMP_WAIT_POLICY="ACTIVE")
    assert got["pool_loops"] == 5 and got["libgomp"], got
    assert got["idle_cpu_s"] < 0.01 and "Warning" not in said, (got, said)
