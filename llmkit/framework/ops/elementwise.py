"""Elementwise ops: out[i] = f(in[i], ...) with numpy broadcasting.

Each family constructor (``unary``, ``binary``, ``compare``) supplies the shape and dtype rule, so a
declaration states only the kernel, the gradient and the C expression used by the compiler. C
templates use type-generic math (``<tgmath.h>`` / CUDA overloads) and never fast-math tricks: NaN
and inf must come out as numpy's do.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend as B
from ..dispatch import O
from ..opspec import A, Kind, Meta, OpError, attr, defop, describe, elementwise_meta, optional, same_dtype
from . import spmd as P

# Families. SPMD: any dim shards (broadcast dims stay replicated); ``partial`` says which Partial
# inputs pass through (spmd.elementwise).


def unary(name, kernel, vjp=None, *, c=None, floating=True, out_dtype=None, partial=None, **kw):
    def infer(x, **attrs):
        return elementwise_meta(name, x, floating=floating, out_dtype=out_dtype, numeric=True)

    rule = P.elementwise(partial)
    return defop(name, Kind.ELEMENTWISE, kernel=kernel, infer_meta=infer, vjp=vjp, c=c, spmd=rule, **kw)


def binary(name, kernel, vjp=None, *, c=None, floating=False, partial=None, **kw):
    def infer(a, b, **attrs):
        return elementwise_meta(name, a, b, floating=floating)

    return defop(name, Kind.ELEMENTWISE, inputs=("x", "y"), kernel=kernel, infer_meta=infer, vjp=vjp, c=c,
                 spmd=P.elementwise(partial), **kw)  # fmt: skip


def compare(name, kernel, c):
    def infer(a, b):
        return elementwise_meta(name, a, b, out_dtype=B.DTYPES["bool"])

    return defop(
        name, Kind.ELEMENTWISE, inputs=("x", "y"), kernel=kernel, infer_meta=infer, c=c, spmd=P.elementwise()
    )


def _nan_first(expr: str) -> str:
    """Wrap a C expression so a NaN operand wins, as numpy's maximum/minimum do."""
    return f"(({{0}}!={{0}})?{{0}}:(({{1}}!={{1}})?{{1}}:{expr}))"


# ---- arithmetic ---------------------------------------------------------------------------------

_AC = {"commutative", "associative"}  # +, *, and, or

binary(
    "add",
    lambda xp, a, b: a + b,
    lambda g, out, a, b: (g, g),
    c="({0}+{1})",
    traits=_AC,
    identity=0,
    partial="linear",
)
binary(
    "sub", lambda xp, a, b: a - b, lambda g, out, a, b: (g, -g), c="({0}-{1})", identity=0, partial="linear"
)
binary(
    "mul",
    lambda xp, a, b: a * b,
    lambda g, out, a, b: (g * b, g * a),
    c="({0}*{1})",
    traits=_AC,
    identity=1,
    partial="bilinear",
)
binary(
    "div",
    lambda xp, a, b: a / b,
    lambda g, out, a, b: (g / b, lambda: -(g * out) / b),
    c="({0}/{1})",
    floating=True,
    identity=1,
    partial="first",
)
binary(
    "pow",
    lambda xp, a, b: xp.power(a, b),
    lambda g, out, a, b: (lambda: g * b * a ** (b - 1.0), lambda: g * out * O.log(a)),
    c="pow({0},{1})",
    floating=True,
)
binary(
    "maximum",
    lambda xp, a, b: xp.maximum(a, b),
    lambda g, out, a, b: (O.where(a >= b, g, 0.0), O.where(a >= b, 0.0, g)),
    c=_nan_first("(({0}>={1})?{0}:{1})"),
    traits={"commutative", "associative", "idempotent"},
    partial="max",
)
binary(
    "minimum",
    lambda xp, a, b: xp.minimum(a, b),
    lambda g, out, a, b: (O.where(a <= b, g, 0.0), O.where(a <= b, 0.0, g)),
    c=_nan_first("(({0}<={1})?{0}:{1})"),
    traits={"commutative", "associative", "idempotent"},
    partial="min",
)

unary(
    "neg",
    lambda xp, x: -x,
    lambda g, out, x: (-g,),
    c="(-{0})",
    floating=False,
    traits={"involution"},
    partial="linear",
)
unary("abs", lambda xp, x: xp.abs(x), lambda g, out, x: (g * O.sign(x),), c="fabs({0})", floating=False)
unary(
    "sign",
    lambda xp, x: xp.sign(x),
    None,
    c="(({0}!={0})?{0}:(({0}>0)-({0}<0)))",
    floating=False,
    doc="sign(x) in {-1, 0, 1}; its derivative is zero almost everywhere, so it stops gradients.",
)
unary("exp", lambda xp, x: xp.exp(x), lambda g, out, x: (g * out,), c="exp({0})")
unary("log", lambda xp, x: xp.log(x), lambda g, out, x: (g / x,), c="log({0})")
unary("sqrt", lambda xp, x: xp.sqrt(x), lambda g, out, x: (g / (out * 2.0),), c="sqrt({0})")
unary(
    "rsqrt", lambda xp, x: 1 / xp.sqrt(x), lambda g, out, x: (g * out * out * out * -0.5,), c="(1/sqrt({0}))"
)
unary("sin", lambda xp, x: xp.sin(x), lambda g, out, x: (g * O.cos(x),), c="sin({0})")
unary("cos", lambda xp, x: xp.cos(x), lambda g, out, x: (-(g * O.sin(x)),), c="cos({0})")
unary("tanh", lambda xp, x: xp.tanh(x), lambda g, out, x: (g * (1.0 - out * out),), c="tanh({0})")
unary(
    "sigmoid",
    lambda xp, x: (0.5 * xp.tanh(0.5 * x) + 0.5).astype(x.dtype, copy=False),  # bfloat16 stays so
    lambda g, out, x: (g * out * (1.0 - out),),
    c="(1/(1+exp(-{0})))",
)
unary(
    "relu",
    lambda xp, x: xp.maximum(x, 0),
    lambda g, out, x: (O.where(out > 0.0, g, 0.0),),
    c="((({0})>0||({0})!=({0}))?({0}):0)",
    floating=False,
)


def _erf_kernel(xp, x):
    if xp is np:
        f = np.frompyfunc(math.erf, 1, 1)  # numpy has no erf; math.erf is exact to float64
        return np.asarray(f(x.astype(np.float64)), dtype=np.float64).astype(x.dtype) if x.size else x.copy()
    from cupyx.scipy.special import erf

    return erf(x)


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
unary("erf", _erf_kernel, lambda g, out, x: (g * O.exp(-(x * x)) * _TWO_OVER_SQRT_PI,), c="erf({0})")


# ---- composite activations (each decomposes into the primitives above) -------------------------


def _silu_kernel(xp, x):
    s = xp.asarray(xp.multiply(x, 0.5))  # x * (0.5 * tanh(0.5 * x) + 0.5), in place from here (0-d: an array)
    xp.tanh(s, out=s)
    s *= 0.5
    s += 0.5
    s *= x
    return s.astype(x.dtype, copy=False)  # python floats lift bfloat16


def _silu_vjp(g, out, x):
    s = O.sigmoid(x)
    return (g * s * (1.0 + x * (1.0 - s)),)


unary("silu", _silu_kernel, _silu_vjp, decompose=lambda x: x * O.sigmoid(x), doc="x * sigmoid(x)")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_kernel(xp, x, approximate="none"):
    if approximate == "tanh":
        out = 0.5 * x * (1.0 + xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    else:
        out = 0.5 * x * (1.0 + _erf_kernel(xp, x * _INV_SQRT2))
    return out.astype(x.dtype, copy=False)  # python floats lift bfloat16 to float32


def _gelu_decompose(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + O.tanh((x + 0.044715 * x * x * x) * _SQRT_2_OVER_PI))
    return 0.5 * x * (1.0 + O.erf(x * _INV_SQRT2))


def _gelu_vjp(g, out, x, approximate="none"):
    if approximate == "tanh":
        t = O.tanh((x + 0.044715 * x * x * x) * _SQRT_2_OVER_PI)
        dt = (1.0 - t * t) * (1.0 + 0.134145 * x * x) * _SQRT_2_OVER_PI
        return (g * (0.5 * (1.0 + t) + 0.5 * x * dt),)
    return (g * (0.5 * (1.0 + O.erf(x * _INV_SQRT2)) + x * O.exp(x * x * -0.5) * _INV_SQRT_2PI),)


unary(
    "gelu",
    _gelu_kernel,
    _gelu_vjp,
    decompose=_gelu_decompose,
    attrs=[
        attr(
            "approximate", A.STR, "none", lambda v: None if v in ("none", "tanh") else "use 'none' or 'tanh'"
        )
    ],
    doc="Gaussian error linear unit; approximate='tanh' is the tanh approximation.",
)


def _swiglu_vjp(g, out, a, b):
    s = O.sigmoid(a)
    return (g * b * s * (1.0 + a * (1.0 - s)), g * a * s)


binary(
    "swiglu",
    lambda xp, a, b: _silu_kernel(xp, a) * b,
    _swiglu_vjp,
    floating=True,
    decompose=lambda a, b: O.silu(a) * b,
    doc="silu(x) * y: the gated MLP activation of Llama.",
)

# ---- comparisons and logic (no gradients) -------------------------------------------------------

compare("equal", lambda xp, a, b: a == b, "({0}=={1})")
compare("not_equal", lambda xp, a, b: a != b, "({0}!={1})")
compare("less", lambda xp, a, b: a < b, "({0}<{1})")
compare("less_equal", lambda xp, a, b: a <= b, "({0}<={1})")
compare("greater", lambda xp, a, b: a > b, "({0}>{1})")
compare("greater_equal", lambda xp, a, b: a >= b, "({0}>={1})")


def logical(name, inputs, kernel, c, **kw):
    """An op on bool tensors (numpy broadcasting), giving bool."""

    def infer(*xs):
        for x in xs:
            if x.dtype != B.DTYPES["bool"]:
                raise OpError(f"{name}: expects bool tensors, got {describe(x)}")
        return elementwise_meta(name, *xs)

    return defop(
        name,
        Kind.ELEMENTWISE,
        inputs=inputs,
        kernel=kernel,
        infer_meta=infer,
        c=c,
        spmd=P.elementwise(),
        **kw,
    )


logical("logical_and", ("x", "y"), lambda xp, a, b: a & b, "({0}&&{1})", traits=_AC)
logical("logical_or", ("x", "y"), lambda xp, a, b: a | b, "({0}||{1})", traits=_AC)
logical("logical_not", ("x",), lambda xp, x: ~x, "(!{0})")


def _where_meta(cond, x, y):
    if cond.dtype != B.DTYPES["bool"]:
        raise OpError(f"where: condition must be bool, got {describe(cond)}")
    dt = same_dtype("where", x, y)
    return Meta(elementwise_meta("where", cond, Meta(x.shape, "bool"), Meta(y.shape, "bool")).shape, dt)


defop(
    "where",
    Kind.ELEMENTWISE,
    inputs=("condition", "x", "y"),
    kernel=lambda xp, c, a, b: xp.where(c, a, b),
    infer_meta=_where_meta,
    nondiff={0},
    c="({0}?{1}:{2})",
    vjp=lambda g, out, c, a, b: (None, O.where(c, g, 0.0), O.where(c, 0.0, g)),
    spmd=P.elementwise("linear", inputs=(1, 2)),  # linear in the branches, never in the condition
)


# ---- dtype conversion and constants -------------------------------------------------------------


def _cast_vjp(g, out, x, dtype):
    return (O.cast(g, x.dtype) if B.is_floating(x.dtype) else None,)


defop(
    "cast",
    Kind.ELEMENTWISE,
    attrs=[attr("dtype", A.DTYPE)],
    kernel=lambda xp, x, dtype: x.astype(dtype, copy=False),
    infer_meta=lambda x, dtype: Meta(x.shape, dtype),
    vjp=_cast_vjp,
    c="(({ctype}){0})",
    traits={"same_type_noop"},
    spmd=P.elementwise(),  # a Partial sum is reduced first: sum(cast(x_r)) is not cast(sum(x_r))
)


def _like_meta(x, dtype=None):
    return Meta(x.shape, x.dtype if dtype is None else dtype)


def _like(name, value):
    defop(
        name,
        Kind.ELEMENTWISE,
        attrs=[attr("dtype", optional(A.DTYPE), None)],
        infer_meta=_like_meta,
        kernel=lambda xp, x, dtype=None: xp.full(x.shape, value, x.dtype if dtype is None else dtype),
        c=str(value),
        splat=lambda x, dtype=None: value,
        spmd=P.Rule(P.like_input, doc="the input's layout"),
        doc=f"A tensor of {value}s shaped like x; gradients stop here.",
    )


_like("zeros_like", 0)
_like("ones_like", 1)


def _full_meta(shape, value, dtype):
    return Meta(shape, dtype)


def _full_kernel(xp, shape, value, dtype):
    return xp.full(shape, value, dtype)


defop(
    "full",
    Kind.ELEMENTWISE,
    inputs=(),
    attrs=[attr("shape", A.SHAPE), attr("value", A.FLOAT), attr("dtype", A.DTYPE, "float32")],
    kernel=_full_kernel,
    infer_meta=_full_meta,
    c="{value}",
    traits={"constant_like"},
    splat=lambda shape, value, dtype: value,
    spmd=P.Rule(lambda ctx: P.dim_map(ctx, []), shape_attr="shape", doc="no inputs: replicated"),
    doc="A tensor of one value; the shape may hold symbolic dims.",
)
