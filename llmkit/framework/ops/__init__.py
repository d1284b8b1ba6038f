"""The op table and its public functions.

``ops.<name>(...)`` exists for every op in the table: positional arguments fill the op's tensor
inputs in order, then its attributes; keywords work for both. ``ops.table()`` lists the specs.
Variadic ops (``concat``, ``stack``) take a sequence of tensors first, as numpy does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from . import collective, contraction, elementwise, movement, neural, paged, reduce  # noqa: F401  (they register ops)
from .spec import REQUIRED, A, Kind, Meta, OpError, OpSpec, attr, defop, get, table

_PUBLIC: dict[str, Callable[..., Any]] = {}


def public(spec: OpSpec) -> Callable[..., Any]:
    """The user-facing function of an op (made once, cached)."""
    fn = _PUBLIC.get(spec.name)
    if fn is None:
        fn = _make_public(spec)
        _PUBLIC[spec.name] = fn
    return fn


def _make_public(spec: OpSpec) -> Callable[..., Any]:
    from ..dispatch import apply

    names = spec.input_names
    attr_names = tuple(a.name for a in spec.attrs)
    n_in = 1 if spec.variadic else len(names)

    def fn(*args: Any, **kw: Any) -> Any:
        if len(args) > n_in:
            extra = args[n_in:]
            if len(extra) > len(attr_names):
                raise OpError(f"{spec.name}: too many positional arguments ({len(args)})")
            for k, v in zip(attr_names, extra):
                if k in kw:
                    raise OpError(f"{spec.name}: got attribute {k!r} twice")
                kw[k] = v
            args = args[:n_in]
        inputs = list(args)
        if len(inputs) < n_in:
            for nm in names[len(inputs) :]:
                if nm in kw:
                    inputs.append(kw.pop(nm))
                else:
                    inputs.append(None)
        if spec.variadic:
            xs = inputs[0]
            if xs is None or not isinstance(xs, (list, tuple)):
                raise OpError(f"{spec.name}: expects a list of tensors as its first argument")
            return apply(spec, *xs, **kw)
        return apply(spec, *inputs, **kw)

    params = []
    if spec.variadic:
        params.append(inspect.Parameter(names[0], inspect.Parameter.POSITIONAL_OR_KEYWORD))
    else:
        for raw, nm in zip(spec.inputs, names):
            default = None if raw.endswith("?") else inspect.Parameter.empty
            params.append(inspect.Parameter(nm, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    for a in spec.attrs:
        default = inspect.Parameter.empty if a.default is REQUIRED else a.default
        params.append(inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = spec.name
    fn.__doc__ = (
        f"{spec.doc}\n\nop {spec.name!r} ({spec.kind})" if spec.doc else f"op {spec.name!r} ({spec.kind})"
    )
    fn.spec = spec  # type: ignore[attr-defined]
    return fn


def __getattr__(name: str) -> Callable[..., Any]:
    spec = table().get(name)
    if spec is None:
        raise AttributeError(f"module 'llmkit.framework.ops' has no op {name!r}")
    return public(spec)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(table()))


__all__ = ["REQUIRED", "A", "Kind", "Meta", "OpError", "OpSpec", "attr", "defop", "get", "public", "table"]
