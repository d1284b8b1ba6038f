"""What ``llmkit serve`` loads is checked, not trusted: the engine's metadata, the programs it runs and
the tokenizer, against each other; a corrupted or malformed file is a FormatError naming the field."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from llmkit.framework import jit
from llmkit.infer import Engine, EngineConfig, SamplingParams

CONFIG = EngineConfig(max_batch=1, compiler="none")


@pytest.fixture
def copied(model_file: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_file, tmp_path / "m.llmkit"))


def rewrite(path: Path, change: Any) -> None:
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_a_corrupted_weights_file_is_refused(copied):
    w = copied / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(jit.FormatError, match="weights.safetensors is corrupted"):
        Engine.from_static(copied, CONFIG)
    rewrite(copied, lambda m: m.update(files={}))
    with pytest.raises(jit.FormatError, match="is not listed"):
        Engine.from_static(copied, CONFIG)


def sha256(f):
    return hashlib.sha256(f.read_bytes()).hexdigest()


def test_a_tokenizer_that_does_not_fit_is_refused(copied):
    (copied / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    digest = hashlib.sha256(b"not a sentencepiece model").hexdigest()
    rewrite(copied, lambda m: m["files"].update({"tokenizer.model": digest}))
    with pytest.raises(jit.FormatError, match="tokenizer.model is not a sentencepiece model"):
        Engine.from_static(copied, CONFIG)
    rewrite(copied, lambda m: [m["files"].pop(n) for n in ("tokenizer.model", "tokenizer.json")])
    with pytest.raises(jit.FormatError, match="no tokenizer.json or tokenizer.model in"):
        Engine.from_static(copied, CONFIG)
    (copied / "tokenizer.json").write_bytes(b'{"model": {"vocab": ')
    rewrite(copied, lambda m: m["files"].update({"tokenizer.json": sha256(copied / "tokenizer.json")}))
    with pytest.raises(jit.FormatError, match=r"tokenizer.json: not valid JSON text"):
        Engine.from_static(copied, CONFIG)


def test_an_old_file_with_only_tokenizer_model_loads(copied):
    """Files written before tokenizer.json was stored hold tokenizer.model alone."""
    want = Engine.from_static(copied, CONFIG).tokenizer
    rewrite(
        copied,
        lambda m: [m["files"].pop(n) for n in list(m["files"]) if n.startswith(("tokenizer_", "special_"))],
    )
    rewrite(copied, lambda m: m["files"].pop("tokenizer.json"))
    got = Engine.from_static(copied, CONFIG).tokenizer
    assert got.kind == "sentencepiece" and got.model_proto == want.model_proto
    assert got.encode("hello world") == want.encode("hello world")


def meta(key: str, value: Any):
    def change(m: dict) -> None:
        *parents, last = key.split(".")
        d = m["metadata"]
        for k in parents:
            d = d[k]
        if value is None:
            del d[last]
        else:
            d[last] = value

    return change


@pytest.mark.parametrize(
    "change, message",
    [
        (meta("engine", None), "not an inference model file"),
        (meta("engine", [1]), "metadata.engine: expected an object, got an array"),
        (meta("engine.num_layers", None), "metadata.engine.num_layers: a required field is missing"),
        (meta("engine.num_layers", 3), r"does not match the prefill program's KV pool"),
        (meta("engine.head_dim", "32"), "metadata.engine.head_dim: expected an integer, got a string"),
        (meta("engine.block_size", -16), "metadata.engine.block_size: must be positive, got -16"),
        (meta("engine.dtype", "bfloat16"), r"does not match the prefill program's KV pool"),
        (
            meta("engine.vocab_size", 4000),
            r"metadata.engine.vocab_size: 4000, but the prefill program's logits",
        ),
        (meta("chat_template", 7), "metadata.chat_template: expected a Jinja template string, got int"),
        (
            meta("chat_template", {"name": "llama-2", "user": "[INST] {x} [/INST]"}),
            r"metadata.chat_template.user: '\[INST\] \{x\} \[/INST\]' is not the Llama 2 format",
        ),
        (meta("generation", {"temperature": -1}), "metadata.generation: temperature must be >= 0"),
        (meta("generation", {"top_k": "5"}), r"metadata.generation.top_k: expected a number"),
        (meta("eos_token_ids", [2, 99999]), "metadata.eos_token_ids: 99999 is not a token id"),
        (meta("model_name", 7), "metadata.model_name: expected a string"),
        (lambda m: m["programs"].pop("decode"), "programs: no 'decode' program"),
    ],
)
def test_each_bad_engine_field_is_named(copied, change, message):
    rewrite(copied, change)
    with pytest.raises(jit.FormatError, match=message):
        Engine.from_static(copied, CONFIG)


def test_random_mutations_of_an_exported_manifest_raise_only_format_errors(copied, mutate_json):
    rng = random.Random(1616)
    original = json.loads((copied / "manifest.json").read_text())
    refused = loaded = 0
    for i in range(60):
        m = copy.deepcopy(original)
        meta = m["metadata"]  # the engine's fields get most of the mutations
        target = [m, meta, meta, meta["engine"], meta["generation"]][i % 5]
        for _ in range(rng.randint(1, 2)):
            mutate_json(target, rng)
        (copied / "manifest.json").write_text(json.dumps(m))
        try:
            engine = Engine.from_static(copied, CONFIG)
        except jit.FormatError:
            refused += 1
            continue
        except Exception as e:
            pytest.fail(f"mutation {i}: {type(e).__name__}: {e}\n{json.dumps(m['metadata'])[:2000]}")
        loaded += 1
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        assert len(engine.generate([[engine.tokenizer.bos_id, 50]], params)[0].token_ids) == 1
    assert refused >= 20 and loaded >= 10, (refused, loaded)


def test_server_start_defers_what_it_may_never_need(model_file: Path) -> None:
    """A fresh server process loads neither jinja2 (with the first chat template rendered) nor,
    where the programs run compiled, the score program (parsed by the first echo, which works)."""
    import subprocess
    import sys

    code = f"""
import sys
from llmkit.framework.jit import model_file as mf
loaded = []
load = mf._load_program
mf._load_program = lambda path, name, *a: loaded.append(name) or load(path, name, *a)
import llmkit.serve.app
from llmkit.infer import SamplingParams
from llmkit.infer.programs import runs_native
from llmkit.serve.server import load_engine, parse_args
engine = load_engine(parse_args([{str(model_file)!r}]))
assert "jinja2" not in sys.modules, "jinja2 was imported at start"
assert loaded == ["prefill", "decode"] + ([] if runs_native(None) else ["score"]), loaded
echo = engine.generate([[1, 5, 7]], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
assert loaded[-1] == "score" and len(echo.prompt_logprobs) == 3, (loaded, echo)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
