"""Fuzzed parser: random and mutated text never raises anything but ``ir.ParseError``.

Whatever the parser accepts must also print and read back to the same text. Set
PIR_FUZZ_EXAMPLES (default 200 per test) to fuzz longer.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmkit.framework import ir

from .gen import random_program

FUZZ = settings(
    max_examples=int(os.environ.get("PIR_FUZZ_EXAMPLES", 200)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

SEEDS = [
    p.read_text().partition("// CHECK:\n")[0]
    for p in sorted((Path(__file__).parent / "golden").glob("*.pir"))
]
SEEDS += [str(random_program(random.Random(s), 8)) for s in range(5)]

TOKENS = [
    "module",
    "func",
    "@main",
    "@f",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    "<",
    ">",
    ",",
    ":",
    "=",
    "->",
    "-",
    "+",
    "*",
    "%x",
    "%0",
    "%1",
    "f32",
    "i64",
    "bool",
    "bf16",
    "S",
    "B",
    "0",
    "1",
    "2",
    "-1",
    "1.5",
    "1e-06",
    "nan",
    "inf",
    "true",
    "false",
    "none",
    "return",
    "llm.add",
    "llm.exp",
    "llm.reshape",
    "llm.split",
    "llm.full",
    "cinn.fusion",
    "cinn.yield",
    "builtin.constant",
    "dist.send",
    "dense",
    "dense_resource",
    "resources",
    "attributes",
    "r0",
    "#shard",
    '"s"',
    '"\\n"',
    "0x00",
    "^bb0",
    "shape",
    "value",
    "axis",
    "sections",
    "// c\n",
    "\n",
]


def check(text: str) -> None:
    try:
        p = ir.parse(text)
    except ir.ParseError:
        return
    printed = str(p)
    assert str(ir.parse(printed)) == printed


@FUZZ
@given(
    st.text(
        alphabet=st.sampled_from(list('%@^#{}[]()<>,:=-+*.0123456789xSBfi_"\\ \n') + ["é", "\t"]),
        max_size=120,
    )
)
def test_random_characters(text):
    check(text)


@FUZZ
@given(st.text(max_size=80))
def test_random_unicode(text):
    check(text)


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_random_token_sequences(tokens):
    check(" ".join(tokens))


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=40), st.sampled_from(SEEDS), st.integers(0, 10**6))
def test_random_tokens_inside_a_valid_program(tokens, seed_text, where):
    i = where % (len(seed_text) + 1)
    check(seed_text[:i] + " ".join(tokens) + seed_text[i:])


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        n = len(text)
        i = draw(st.integers(0, n))
        j = draw(st.integers(i, min(n, i + 12)))
        kind = draw(st.sampled_from(["delete", "duplicate", "replace", "swap"]))
        if kind == "delete":
            text = text[:i] + text[j:]
        elif kind == "duplicate":
            text = text[:j] + text[i:j] + text[j:]
        elif kind == "replace":
            text = text[:i] + draw(st.sampled_from(TOKENS + list("{}[]()<>,:=%-0"))) + text[j:]
        else:
            k = draw(st.integers(0, n))
            a, b = sorted((i, k))
            text = text[:a] + text[j:] + text[a:i] if b == i else text[:i] + text[j:k] + text[i:j] + text[k:]
    return text


@FUZZ
@given(mutated())
def test_mutated_programs(text):
    check(text)


def test_parse_rejects_non_text():
    for bad in (None, b"module {}", 3):
        try:
            ir.parse(bad)  # type: ignore[arg-type]
        except ir.ParseError:
            continue
        raise AssertionError(f"parse accepted {bad!r}")
