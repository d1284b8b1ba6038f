"""llmkit: train, align and serve Llama models; every job runs the same static program."""

import os as _os
import sys as _sys

# OpenBLAS's idle threads spin for 2**28 cycles (about 0.1 s) after every product by default, on the
# same cores the compiler's kernels run on right after: a compiled training step lost about 15% to
# it here. 2**18 cycles keep them spinning only between back-to-back products. OpenBLAS reads this
# once, when numpy loads it, so it only takes effect when llmkit is imported first (the CLI is); a
# value the user set is kept. See llmkit/framework/blas.py.
if "numpy" not in _sys.modules:
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

__version__ = "0.1.0"
