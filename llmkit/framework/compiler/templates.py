"""Kernel templates: ops the compiler emits one whole kernel for instead of decomposing them.

Fusing primitives cannot turn attention into a flash-attention loop nest (the online softmax
rescales partial products inside the key loop), so for such ops the compiler has a C template
(``attention.py``). An op with a template that applies to it is left whole by ``decompose``,
becomes a ``cinn.fusion`` group of its own in ``fuse``, and ``runtime`` builds and calls the
rendered kernel; where the template does not apply (a mask, bfloat16) the op is decomposed and
fused as usual, and on GPU arrays the group runs the op's reference kernel.
"""

from __future__ import annotations

from ..ir import Operation
from . import attention

TEMPLATES = {t.op: t for t in (attention.FORWARD, attention.BACKWARD)}


def template_for(op: Operation) -> attention.Attention | None:
    """The template that compiles ``op``, or None."""
    spec = op.opdef.spec
    t = TEMPLATES.get(spec.name) if spec is not None else None
    return t if t is not None and t.applies(op) else None
