"""Building C kernels: the system C compiler, a content-addressed disk cache, ctypes loading.

``build({name: source})`` compiles every kernel not yet in the cache, a few per compiler process
(processes run in parallel, one per core), and returns a ctypes function per name (None for one
that failed: its group then runs the reference kernels, with one warning naming it). Kernels are
named by the hash of their source, so the same group in every layer is compiled once, and a
cached kernel is reused by every later run.

Flags keep IEEE semantics: ``-O3 -march=native -fopenmp-simd`` (OpenMP's SIMD pragmas, not its
runtime: kernel threads come from ``par.py``) plus ``-fno-math-errno`` (no errno
writes from sqrt/exp, so they vectorize), ``-fno-trapping-math`` (no FP traps, which are never
enabled anyway) and ``-ffp-contract=off`` (no fused multiply-add: results match numpy's separate
roundings). Never ``-ffast-math``: NaN, inf and signed zeros must behave as in the reference.

Configuration: ``LLMKIT_CC`` names the compiler (``none`` simulates a machine without one; the
default is ``$CC`` or ``cc``); the cache lives in ``$LLMKIT_KERNEL_CACHE``, else
``$LLMKIT_CACHE_DIR/kernels``, else ``~/.cache/llmkit/kernels`` (``set_cache_dir`` overrides).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..executor import FallbackWarning
from ..files import atomic_write, cache_root
from . import par
from .codegen_c import PRELUDE

log = logging.getLogger("llmkit.compiler")

SPIN_NS = 200_000  # how long the thread pool's helpers (par.py) spin between kernels, where they do


def spin_between_kernels() -> None:
    """For processes that only run inference (``llmkit serve``, ``llmkit generate``): the thread
    pool's helpers spin a while after each kernel instead of sleeping at once, so the next kernel
    of a replayed decode step does not wait for them to wake (decode at batch 1 and 8 about
    1.3-1.6x faster here). Training keeps the default: its BLAS calls need the cores spinning
    threads would hold."""
    par.set_spin(SPIN_NS)


CPUS = int(os.environ.get("LLMKIT_CINN_THREADS", 0)) or os.cpu_count() or 1  # threads a kernel may use

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", "-fPIC", "-shared")  # fmt: skip
PER_PROCESS = 12  # kernels per compiler invocation (parallel invocations share the rest)

_cache_dir: Path | None = None
_toolchain: Any = "unset"
_warned: set[str] = set()
_libs: dict[str, ctypes.CDLL] = {}


@dataclass
class Stats:
    """What building cost this process (``LLMKIT_PROFILE=1`` prints it at exit)."""

    compiled: int = 0
    cached: int = 0
    failed: int = 0
    seconds: float = 0.0
    builds: list = field(default_factory=list)  # (kernels compiled, seconds) per build


STATS = Stats()


def warn_once(key: str, message: str, category: type[Warning] = FallbackWarning) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=3)


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Keep compiled kernels (and tuning results) under ``path`` (None: back to the default)."""
    global _cache_dir
    _cache_dir = None if path is None else Path(path)


def cache_dir() -> Path:
    if _cache_dir is not None:
        d = _cache_dir
    elif os.environ.get("LLMKIT_KERNEL_CACHE"):
        d = Path(os.environ["LLMKIT_KERNEL_CACHE"])
    else:
        d = cache_root() / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class Toolchain:
    cc: str
    flags: tuple[str, ...]
    libs: tuple[str, ...]
    ident: str  # compiler version + flags + CPU: part of every kernel's hash


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def toolchain() -> Toolchain | None:
    """The working C toolchain, or None (no compiler, or it cannot build a test kernel)."""
    global _toolchain
    if _toolchain != "unset":
        return _toolchain
    _toolchain = None
    want = os.environ.get("LLMKIT_CC", "")
    if want.lower() in ("none", "0", "off"):
        return None
    cc = (
        shutil.which(want or os.environ.get("CC", "") or "cc") or shutil.which("gcc") or shutil.which("clang")
    )
    if cc is None:
        return None
    # the toolchain that passed the probe with this compiler binary on this CPU, from the cache
    # (`cc --version` and the probe's build cost a fifth of a second at every process start)
    st = os.stat(real := os.path.realpath(cc))
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{platform.machine()}|{_cpu_model()}|{' '.join(FLAGS)}"
    record = cache_dir() / f"toolchain-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    try:
        _toolchain = Toolchain(
            cc, *(tuple(v) if isinstance(v, list) else v for v in json.loads(record.read_text()))
        )
        return _toolchain
    except (OSError, ValueError, TypeError):
        pass
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    base = f"{version.splitlines()[0] if version else cc}|{platform.machine()}|{_cpu_model()}"
    for flags, libs in (((*FLAGS, "-DLLMKIT_MVEC"), ("-lmvec", "-lm")), (FLAGS, ("-lm",))):
        tc = Toolchain(cc, flags, libs, f"{base}|{' '.join(flags)}|{' '.join(libs)}")
        if _probe(tc):
            _toolchain = tc
            with contextlib.suppress(OSError):
                atomic_write(record, json.dumps([tc.flags, tc.libs, tc.ident]))
            return tc
    return None


_PROBE = """
void probe(void **bufs, const int64_t *sizes, int64_t nthreads) {
  const float *x = (const float *)bufs[0]; float *y = (float *)bufs[1];
  (void)nthreads;
  #pragma omp simd
  for (int64_t i = 0; i < sizes[0]; i++) y[i] = exp(x[i]) + log(x[i]) + tanh(x[i]) + pow(x[i], x[i]);
}
"""


def _probe(tc: Toolchain) -> bool:
    try:
        lib = _compile_and_load(tc, {"probe": _PROBE})
        fn = lib["probe"]
        import numpy as np

        x = np.full(16, 0.5, np.float32)
        y = np.zeros(16, np.float32)
        bufs = (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data)
        fn(bufs, (ctypes.c_int64 * 1)(16), 1)
        return abs(float(y[0]) - (np.exp(0.5) + np.log(0.5) + np.tanh(0.5) + 0.5**0.5)) < 1e-5
    except Exception as e:  # any failure means "this toolchain does not work here"
        log.info("cinn: toolchain probe failed: %s", e)
        return False


def kernel_name(source: str, tc: Toolchain | None = None) -> str:
    """``k_<hash>`` of a kernel source whose function is named ``KERNEL`` (the caller renames it),
    compiled after ``PRELUDE`` with the toolchain's flags."""
    tc = tc or toolchain()
    h = hashlib.sha256(((tc.ident if tc else "") + "\n" + PRELUDE + source).encode()).hexdigest()
    return "k_" + h[:20]


def build(sources: dict[str, str]) -> dict[str, Any]:
    """``{name: C function source}`` -> ``{name: ctypes function or None}`` (see the module docstring)."""
    tc = toolchain()
    if tc is None:
        return dict.fromkeys(sources)
    d = cache_dir()
    _load_pool(tc, d)
    out: dict[str, Any] = {}
    missing = {}
    for name, src in sources.items():
        so = d / f"{name}.so"
        if so.exists():
            try:
                out[name] = _symbol(so, name)
                STATS.cached += 1
                continue
            except (OSError, AttributeError):
                pass
        missing[name] = src
    if missing:
        t0 = time.perf_counter()
        names = list(missing)
        chunks = [names[i : i + PER_PROCESS] for i in range(0, len(names), PER_PROCESS)]
        results = _run_parallel(tc, [{n: missing[n] for n in c} for c in chunks])
        for chunk, ok in zip(chunks, results):
            if ok:
                continue
            for n in chunk:  # find the kernel(s) that broke the batch
                if not _run_parallel(tc, [{n: missing[n]}])[0]:
                    STATS.failed += 1
                    err = _last_error.get(n, "")
                    warn_once(
                        f"kernel:{n}",
                        f"cinn: kernel {n} failed to compile; its group runs the reference "
                        f"kernels.\n{err[:2000]}",
                    )
        for n in names:
            so = d / f"{n}.so"
            try:
                out[n] = _symbol(so, n) if so.exists() else None
            except (OSError, AttributeError) as e:  # built, but will not load (the pool failed to)
                out[n] = None
                msg = f"cinn: kernel {n} does not load ({e}); its group runs the reference kernels."
                warn_once(f"kernel:{n}", msg)
        dt = time.perf_counter() - t0
        done = sum(1 for n in names if out[n] is not None)
        STATS.compiled += done
        STATS.seconds += dt
        STATS.builds.append((done, dt))
        log.info("cinn: compiled %d kernels in %.2f s (cache %s)", done, dt, d)
    return out


_last_error: dict[str, str] = {}


def _compile(tc: Toolchain, source: str, so: Path, libs: tuple[str, ...] = ()) -> str | None:
    """Compile ``source`` into the shared library ``so`` (written whole, then renamed into place:
    a reader never sees half a library); the compiler's output if it failed, else None."""
    fd, c_path = tempfile.mkstemp(suffix=".c", dir=so.parent)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    tmp = so.with_name(f"{so.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")  # threads build too
    try:
        cmd = [tc.cc, *tc.flags, c_path, "-o", str(tmp), *tc.libs, *libs]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(c_path)
    if r.returncode != 0:
        return r.stderr or r.stdout
    os.replace(tmp, so)
    return None


def _load_pool(tc: Toolchain, d: Path) -> None:
    """The kernels' thread pool (``par.py``), built once per toolchain into the cache and
    loaded before any kernel: kernels bind to its symbols (without it, they run their loops on
    the calling thread, and one warning says so)."""
    if par.loaded():
        return
    so = d / f"par_{hashlib.sha256((tc.ident + par.SOURCE).encode()).hexdigest()[:20]}.so"
    err = None if so.exists() else _compile(tc, par.SOURCE, so, ("-lpthread",))
    if err is not None:
        warn_once(
            "par",
            f"cinn: the kernels' thread pool failed to compile; kernels run on one thread.\n{err[:2000]}",
        )
        return
    par.attach(so)


def _run_parallel(tc: Toolchain, batches: list[dict[str, str]]) -> list[bool]:
    """Compile each batch into one shared library, linked from ``<name>.so`` for each kernel."""
    d = cache_dir()

    def one(batch: dict[str, str]) -> bool:
        src = PRELUDE + "\n".join(batch.values())
        lib = d / f"lib_{hashlib.sha256((tc.ident + src).encode()).hexdigest()[:20]}.so"
        err = _compile(tc, src, lib)
        if err is not None:
            for n in batch:
                _last_error[n] = err
            return False
        for n in batch:
            tmp_link = d / f"{n}.{os.getpid()}.{threading.get_ident()}.tmp.so"
            if tmp_link.is_symlink() or tmp_link.exists():
                tmp_link.unlink()
            os.symlink(lib.name, tmp_link)
            os.replace(tmp_link, d / f"{n}.so")
        return True

    if len(batches) == 1:
        return [one(batches[0])]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(one, batches))


def _symbol(so: Path, name: str) -> Any:
    real = os.path.realpath(so)
    lib = _libs.get(real)
    if lib is None:
        lib = _libs[real] = ctypes.CDLL(real)
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    fn.restype = None
    return fn


def _compile_and_load(tc: Toolchain, sources: dict[str, str]) -> dict[str, Any]:
    """Compile outside the cache (the toolchain probe)."""
    with tempfile.TemporaryDirectory() as tmp:
        c = Path(tmp) / "k.c"
        so = Path(tmp) / "k.so"
        c.write_text(PRELUDE + "\n".join(sources.values()))
        r = subprocess.run(
            [tc.cc, *tc.flags, str(c), "-o", str(so), *tc.libs], capture_output=True, text=True, timeout=120
        )
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        lib = ctypes.CDLL(str(so))
        _libs[str(so)] = lib  # keep it loaded
        out = {}
        for n in sources:
            fn = getattr(lib, n)
            fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
            fn.restype = None
            out[n] = fn
        return out
