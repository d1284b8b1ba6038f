"""A static program compiled once is found compiled by later loads (the compiled-program cache),
computes the same numbers as the float64 formula, and any change to the framework's code, an
unreadable entry or a kernel missing from the cache is a miss (compiled again)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.framework import compiler, jit
from llmkit.framework.compiler import program_cache

from .conftest import needs_cc

pytestmark = needs_cc


class MLP(lf.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = lf.nn.Linear(5, 7), lf.nn.Linear(7, 3)

    def forward(self, x):
        return self.b(lf.nn.functional.silu(self.a(x)) * 2.0)


def _reference(m: MLP, x: np.ndarray) -> np.ndarray:
    def lin(layer, v):
        return v @ layer.weight.numpy().astype(np.float64).T + layer.bias.numpy().astype(np.float64)

    h = lin(m.a, x.astype(np.float64))
    return lin(m.b, h / (1 + np.exp(-h)) * 2.0)


@pytest.fixture
def saved(tmp_path):
    lf.seed(5)
    m = MLP()
    path = jit.save(m, tmp_path / "m.llmkit", input_spec=[jit.InputSpec(["N", 5], "float32")])
    return path, m


def _no_fusion(*_):
    raise AssertionError("fused again: the compiled program was not found in the cache")


def test_a_second_load_finds_the_program_compiled(saved, monkeypatch):
    path, m = saved
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    first = jit.load(path, compiler="cinn")
    assert not first.programs["forward"]._compiled
    y1 = first(x)
    monkeypatch.setattr(compiler, "fuse_program", _no_fusion)
    second = jit.load(path, compiler="cinn")
    assert second.programs["forward"]._compiled
    y2 = second(x)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(y2, _reference(m, x), rtol=1e-5, atol=1e-5)
    assert any(op.name == "cinn.fusion" for op in second.programs["forward"].program.walk())


@pytest.mark.parametrize("spoil", ["code", "entry", "kernel"])
def test_a_stale_or_broken_entry_is_a_miss(saved, monkeypatch, spoil, kernel_cache):
    path, m = saved
    x = np.ones((2, 5), np.float32)
    jit.load(path, compiler="cinn")(x)
    text = (path / "forward.pir").read_text()
    entry = program_cache._entry(text)
    assert entry.exists()
    if spoil == "code":  # another llmkit: another key
        monkeypatch.setattr(program_cache, "_code_digest", lambda: "another version")
    elif spoil == "entry":
        entry.write_text(entry.read_text()[:100])
    else:
        names = [n for g in json.loads(entry.read_text())["groups"] if g for _, n in g["kernels"]]
        (kernel_cache / f"{names[0]}.so").unlink()
    again = jit.load(path, compiler="cinn")
    assert not again.programs["forward"]._compiled
    np.testing.assert_allclose(again(x), _reference(m, x), rtol=1e-5, atol=1e-5)


def test_the_probed_toolchain_is_recorded_for_the_next_process(monkeypatch):
    from llmkit.framework.compiler import build

    monkeypatch.setattr(build, "_toolchain", "unset")  # as a fresh process: probes, records
    first = build.toolchain()
    monkeypatch.setattr(build, "_toolchain", "unset")  # the next fresh process

    def no_compiler_run(*a, **k):
        raise AssertionError("ran the compiler again: the toolchain record was not used")

    monkeypatch.setattr(build.subprocess, "run", no_compiler_run)
    assert build.toolchain() == first
    monkeypatch.setattr(build, "_toolchain", "unset")
    monkeypatch.setattr(build, "_cpu_model", lambda: "another CPU")  # another machine: probed again
    with pytest.raises(AssertionError, match="ran the compiler again"):
        build.toolchain()
