"""Every test run writes its caches (tokenizers, packed tokens, compiled kernels) under a temporary
directory removed at exit, never into the user's ~/.cache."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

_root = tempfile.mkdtemp(prefix="llmkit-tests-")
atexit.register(shutil.rmtree, _root, ignore_errors=True)
os.environ.setdefault("LLMKIT_CACHE_DIR", os.path.join(_root, "cache"))
os.environ.setdefault("LLMKIT_KERNEL_CACHE", os.path.join(_root, "kernels"))
