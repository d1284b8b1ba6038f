"""CINN: automatic operator fusion and kernel generation for static programs.

The pipeline, one named stage per file::

    merge       the products of one input, forward and backward -> one GEMM each  merge_gemms.py
    decompose   composite ops -> primitives (the op table's ``decompose``)        decompose.py
    fuse        primitives -> ``cinn.fusion`` groups, by each op's ``kind``         fuse.py
    lower       a group -> expressions over its loop domain                         lower.py
    schedule    -> a loop-IR kernel (coalesced loops, threads, SIMD, tiles)       loop_schedule.py, loop_ir.py
    codegen     -> C (parallel loops on the pool, par.py) or CUDA                   codegen_c.py, cuda.py
    build       -> shared library, cached by content hash, loaded with ctypes       build.py
    tune        -> the fastest schedule per kernel and shape class, kept on disk    tune.py
    run         the executor calls each group's kernel                              runtime.py

Hand-written kernels (``native/``: the engine's ops, embeddings, flash attention) are declared on
their ops' specs there and run in place of the reference kernels (``native/run.py``); ops whose
kernel applies are not decomposed. Products of matrices run in blocks of rows, each one
single-threaded BLAS call, on threads of their own (``native/products.py``, ``blas.matmul_rows``);
every other kernel's threads come from the pool in ``par.py``.

``compile_program(program)`` runs it all (``jit.to_static(..., compiler="cinn")`` does it for
you); ``fuse_program(program)`` stops after grouping (what the golden tests print);
``kernels(program)`` gives each group's loop IR for reading. Without a C compiler everything
runs the reference kernels and says so once; so does a kernel that fails to compile or load, or a
group that cannot be lowered (a ``FallbackWarning``, which the test suite makes an error).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from ..ir import Pass, PassManager, Program, register_pass
from ..ir.passes.cse import cse_block
from . import build, native  # noqa: F401  (native: the hand-written kernels, and their executor hooks)
from .attention_lse import AttentionLse
from .build import STATS, FallbackWarning, cache_dir, set_cache_dir
from .decompose import Decompose
from .fuse import Fuse
from .loop_ir import Kernel
from .lower import LowerError, lower
from .merge_gemms import MergeGemms
from .runtime import NO_CC, compile_fusions, kernel_sources

__all__ = [
    "STATS",
    "CinnFuse",
    "FallbackWarning",
    "Kernel",
    "LowerError",
    "available",
    "cache_dir",
    "compile_fusions",
    "compile_program",
    "fuse_program",
    "kernels",
    "lower",
    "set_cache_dir",
    "unavailable",
]


def available() -> bool:
    """True when a working C compiler was found (``LLMKIT_CC=none`` pretends there is none)."""
    return build.toolchain() is not None


@register_pass
@dataclass
class CinnFuse(Pass):
    """``cinn-fuse``: pair attention forwards with their backwards (``attention-lse``), merge the
    products of a shared input (``merge-gemms``), decompose, CSE, DCE, then group into
    ``cinn.fusion`` ops (groups named after the composite op they came from)."""

    name = "cinn-fuse"

    def apply(self, program: Program) -> None:
        dec, fuse = Decompose(), Fuse()
        fuse.origins = dec.origins
        PassManager([AttentionLse(), MergeGemms(), dec, "cse", "dce", fuse], verify=False).run(program)
        for op in program.walk():  # copies pulled into a group more than once: merge them, inside
            if op.name == "cinn.fusion":  # the group only (reusing outer values would unfuse them)
                cse_block(op.regions[0].blocks[0], {})


def fuse_program(program: Program) -> Program:
    """A copy of ``program`` decomposed, cleaned up (CSE, DCE) and grouped into ``cinn.fusion`` ops."""
    p = program.clone()
    PassManager([CinnFuse()]).run(p)
    return p


def compile_program(program: Program, key: str | None = None) -> Program:
    """The program the executor should run: fused, with every group's kernel built.

    ``key`` (the program's text, as a static model file holds it): the result is looked up in and
    stored into the cache of compiled programs (``program_cache``). Without a C compiler it returns
    ``program`` itself (the reference kernels run it), with one warning per process.
    """
    if not available():
        build.warn_once("no-cc", NO_CC)
        return program
    from . import program_cache

    cached = None if key is None else program_cache.load(key)
    if cached is not None:
        return cached
    p = fuse_program(program)
    compile_fusions(p)
    if key is not None:
        program_cache.store(key, p)
    return p


def kernels(program: Program) -> list[Kernel]:
    """The loop-IR kernel (first candidate schedule) of each fusion group, in program order."""
    out = []
    for op in program.walk():
        if op.name == "cinn.fusion":
            try:
                out.append(kernel_sources(lower(op))[0][3])
            except LowerError:
                continue
    return out


@contextlib.contextmanager
def unavailable() -> Iterator[None]:
    """Pretend there is no C compiler (tests of the fallback): warnings are fresh inside."""
    saved, saved_warned = build._toolchain, set(build._warned)
    build._toolchain = None
    build._warned.clear()
    try:
        yield
    finally:
        build._toolchain = saved
        build._warned.clear()
        build._warned.update(saved_warned)
