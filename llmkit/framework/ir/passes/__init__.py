"""The standard passes, registered by name.

=================  ==============================================================================
``dce``            dead code elimination: erase pure ops whose results are unused
``cse``            common subexpression elimination: merge equal pure ops (commutative-aware)
``fold-constants`` evaluate ops whose inputs are all constants with the op-table kernels
``canonicalize``   local simplifications (x*1, x+0, transpose∘transpose, reshape∘reshape...)
``simplify-shapes`` bind/substitute symbolic dims, re-infer types, fold shape-only ops
``fuse-patterns``  DRR fusion rules: matmul+add -> linear, silu(a)*b -> swiglu
``quantize-linear`` DRR rules: linear / tiled_linear of a dequantized weight -> quant_linear
=================  ==============================================================================
"""

from __future__ import annotations

from .canonicalize import Canonicalize
from .cse import CSE
from .dce import DCE
from .fold import FoldConstants
from .fuse_patterns import FusePatterns
from .quantize import QuantizeLinear
from .shapes import SimplifyShapes

__all__ = ["CSE", "DCE", "Canonicalize", "FoldConstants", "FusePatterns", "QuantizeLinear", "SimplifyShapes"]
