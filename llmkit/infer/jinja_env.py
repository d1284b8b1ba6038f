"""The sandboxed Jinja environment chat templates render in, as transformers'
``chat_template_utils._cached_compile_jinja_template`` makes it (see ``chat``): imported with the
first template compiled (``chat._compile``), so a process that renders none (a server answering
completions) never loads jinja2."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPANS: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("chat_spans", default=None)


class _Generation(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: renders its body, and while :func:`tracking`
    is active records the body's character span in the output."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_span", []), [], [], body).set_lineno(lineno)

    def _span(self, caller: Any) -> str:
        text = caller()
        tracked = _SPANS.get()
        if tracked is not None:
            blocks, spans = tracked
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


@contextmanager
def tracking(blocks: list[str]) -> Iterator[list[tuple[int, int]]]:
    spans: list[tuple[int, int]] = []
    token = _SPANS.set((blocks, spans))
    try:
        yield spans
    finally:
        _SPANS.reset(token)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot store the underscore name {name!r}")


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace, dict=_dict
    )
    return env.from_string(source)  # (TemplateSyntaxError: chat._compile says it in one line)
