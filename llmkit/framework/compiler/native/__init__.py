"""Hand-written C kernels: the one home of every kernel the compiler does not generate.

Each family module holds the C source of some ops and attaches it to their specs with
:func:`native_kernel` (``attach.py``; ``OpSpec.native``: source, size arguments, when it
applies). ``run`` builds them (``build.py``: the system C compiler, the kernel cache) and runs
them in place of the reference kernels in compiled programs, where a function made only of C
kernels is replayed in one C call; their threads come from the pool in ``par.py``.

==============  ==============================================================================
``attach``      ``native_kernel``: a family module attaches its kernel to an op's spec
``run``         NativeOp (one op's kernel, called like its reference kernel), Replay(s); both
                registered with the executor
``simd``        vector helpers the kernels share (AVX2 + FMA, else GCC vectors)
``linear``      ``tiled_linear``, ``tiled_linear_swiglu``: the engine's batch-invariant products;
                ``tiled_linear_logprobs``: the score program's LM head and log-probs, fused
``paged``       ``paged_attention``, ``paged_kv_write``: the engine's KV cache
``quant``       ``quant_linear``: products with int8 / int4 weights, dequantized in the loop
``quant_int``   ``quant_linear`` with int8 activations: integer dot products, the ISA picked at run time
``gather``      ``index_select``, ``index_add``: embedding rows and their gradient
``attention``   flash attention forward and backward (``scaled_dot_product_attention*``)
``pyext``       the eager fast path: a CPython extension (dispatch's cached calls, ``Tensor._wrap``,
                exact C twins of the softmax, silu and cross_entropy reference kernels)
==============  ==============================================================================

A new kernel: a module here with its C source (one function with the compiler's kernel signature,
every name it defines starting with ``KERNEL_FN``), ``sizes`` and ``applies``, one
``native_kernel(...)`` call per op, the module imported below, and a test against a float64
formula in ``tests/framework/compiler/test_native.py``.
"""

from __future__ import annotations

from . import attention, gather, linear, paged, quant  # noqa: F401  (they attach their kernels)
from .attach import native_kernel
from .run import NativeOp, Replays, build_c, native_of

__all__ = ["NativeOp", "Replays", "build_c", "native_kernel", "native_of"]
