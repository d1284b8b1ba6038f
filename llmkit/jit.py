"""``import llmkit.jit as jit``: the public name of ``llmkit.framework.jit`` (the same objects).

``jit.to_static`` / ``jit.InputSpec`` trace functions and layers into static programs,
``jit.save`` / ``jit.load`` write and run the static model file; see ``docs/architecture.md``.
"""

from llmkit.framework.jit import *  # noqa: F403
from llmkit.framework.jit import __all__  # noqa: F401
