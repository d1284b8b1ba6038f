"""Symbolic dimension arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmkit.framework import symbolic as sym


def test_canonical_forms():
    assert sym.canonical("S + T") == "S+T"
    assert sym.canonical("T+S") == "S+T"
    assert sym.canonical("2*(S+1)") == "2*S+2"
    assert sym.canonical("S-S") == 0
    assert sym.canonical("B*S//S") == "B"
    assert sym.mul("B", "S") == sym.mul("S", "B") == "B*S"
    assert sym.add("S", 1) == "S+1" and sym.sub("S+1", 1) == "S"
    assert sym.div("4*B*S", "S") == "4*B"


def test_errors():
    with pytest.raises(sym.DimError, match="exactly"):
        sym.div("S+1", "S")
    with pytest.raises(sym.DimError, match="bad symbolic dim"):
        sym.canonical("S$")
    with pytest.raises(sym.DimError, match="not bound"):
        sym.evaluate("S", {})


def test_bind_and_evaluate():
    env: dict[str, int] = {}
    assert sym.bind("B", 2, env) and sym.bind("S", 5, env)
    assert sym.bind("B*S", 10, env) and not sym.bind("B*S", 11, env)
    assert not sym.bind("B", 3, env)
    assert sym.evaluate("2*S+B", env) == 12


@given(st.integers(1, 50), st.integers(1, 50), st.integers(-5, 5))
def test_arithmetic_agrees_with_integers(s, t, c):
    env = {"S": s, "T": t}
    e = sym.add(sym.mul(sym.add("S", c), "T"), sym.sub("T", "S"))
    assert sym.evaluate(e, env) == (s + c) * t + (t - s)
