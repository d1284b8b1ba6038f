"""Host memory behaviour that matters for speed.

glibc returns freed blocks above its mmap threshold straight to the OS; a training step that
frees and re-allocates the same activations every step then pays page faults for all of them again
(about 8 ms per 32 MiB on a 2-core machine). Raising the mmap and trim thresholds keeps freed
memory in the heap for the next allocation. This is process-wide and applied once, by the executor
(and by benchmarks that compare against it, so both sides run under the same allocator settings).
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 32) -> bool:
    """Ask glibc to keep freed blocks up to ``mmap_threshold`` bytes in the heap; False if not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        # the process's own symbols (libc among them): find_library("c") runs `ldconfig -p`
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, 2**31 - 1))) and bool(
        mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1))
    )
    _done = ok
    return ok
