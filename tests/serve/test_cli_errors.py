"""``llmkit export``, ``serve`` and ``generate`` given missing or wrong files: each exits 2 with one
line on stderr naming what was wrong (no traceback), in-process through ``llmkit.cli.main``."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from llmkit.cli import main as cli_main


def edit(base: str, name: str, data: bytes | None, checksum: bool = False) -> Callable[..., Path]:
    """A copy of the model directory ("hf") or the model file ("static") with ``name`` replaced by
    ``data`` (None: deleted; ``name`` may then be several names joined by "+"), its manifest
    checksum updated when ``checksum``."""

    def make(tmp: Path, hf: Path, static: Path) -> Path:
        d = Path(shutil.copytree(hf if base == "hf" else static, tmp / base))
        if data is None:
            for n in name.split("+"):
                (d / n).unlink()
        else:
            (d / name).write_bytes(data(d / name) if callable(data) else data)
        if checksum:
            m = json.loads((d / "manifest.json").read_text())
            m["files"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
            (d / "manifest.json").write_text(json.dumps(m))
        return d

    return make


def empty(tmp: Path, hf: Path, static: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def truncated(f: Path) -> bytes:
    return f.read_bytes()[: f.stat().st_size // 2]


def flipped(f: Path) -> bytes:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    return bytes(data)


def manifest(change: Callable[[dict], object]) -> Callable[[Path], bytes]:
    def data(f: Path) -> bytes:
        m = json.loads(f.read_text())
        change(m)
        return json.dumps(m).encode()

    return data


def config_with(**changes) -> Callable[[Path], bytes]:
    def data(f: Path) -> bytes:
        return json.dumps({**json.loads(f.read_text()), **changes}).encode()

    return data


# Each case: (tmp_path, the model directory, the model file) -> the path to pass; what stderr must say.
HF_BAD = {
    "missing": (lambda t, h, s: t / "nope", "model directory"),
    "empty dir": (empty, "no model config"),
    "a file": (lambda t, h, s: h / "config.json", "is a file, not a model directory"),
    "the model file": (lambda t, h, s: s, "is a static model file (written by `llmkit export`)"),
    "no weights": (edit("hf", "model.safetensors", None), "no model.safetensors"),
    "truncated weights": (edit("hf", "model.safetensors", truncated), "model.safetensors"),
    "config not JSON": (edit("hf", "config.json", b'{"hidden_size": '), "config.json: invalid JSON"),
    "config not UTF-8": (edit("hf", "config.json", b'{"\xff": 1}'), "config.json: invalid JSON"),
    "config a list": (edit("hf", "config.json", b"[1, 2]"), "config.json: expected a JSON object"),
    "bad hidden_size": (edit("hf", "config.json", config_with(hidden_size=-1)), "hidden_size must be"),
    "wrong model_type": (edit("hf", "config.json", config_with(model_type="gpt2")), "model_type is 'gpt2'"),
    "config vs weights": (edit("hf", "config.json", config_with(num_hidden_layers=3)), "does not match"),
    "no tokenizer": (
        edit("hf", "tokenizer.model+tokenizer.json", None),
        "no tokenizer.model or tokenizer.json in",
    ),
    "bad tokenizer": (edit("hf", "tokenizer.model", b"garbage"), "is not a sentencepiece model"),
}
EXPORT_BAD = {
    "a run directory": (
        lambda t, h, s: h.parents[2],  # <run>/checkpoints/step-N/model -> <run>
        "is a run directory: give one of its checkpoints' model directories",
    ),
    "generation config not JSON": (
        edit("hf", "generation_config.json", b"{"),
        "generation_config.json: not valid",
    ),
    "generation config a list": (edit("hf", "generation_config.json", b"[]"), "expected a JSON object"),
    "temperature a string": (
        edit("hf", "generation_config.json", b'{"temperature": "hot"}'),
        "temperature: expected a number, got 'hot'",
    ),
    "negative temperature": (
        edit("hf", "generation_config.json", b'{"temperature": -1}'),
        "temperature must be >= 0",
    ),
}
SERVE_BAD = {
    "missing": (lambda t, h, s: t / "nope", "not a static model directory (no manifest.json)"),
    "a file": (lambda t, h, s: s / "manifest.json", "not a static model directory"),
    "the model directory": (lambda t, h, s: h, "a model directory (config.json), not a static model file"),
    "no manifest": (edit("static", "manifest.json", None), "not a static model directory"),
    "manifest not JSON": (edit("static", "manifest.json", b"{"), "not valid JSON"),
    "manifest not UTF-8": (edit("static", "manifest.json", b'{"\xff": 1}'), "not valid JSON"),
    "files empty": (edit("static", "manifest.json", manifest(lambda m: m.update(files={}))), "is not listed"),
    "a file outside": (
        edit("static", "manifest.json", manifest(lambda m: m["files"].update({"../x": "0" * 64}))),
        "is not the plain name of a file",
    ),
    "no format_version": (
        edit("static", "manifest.json", manifest(lambda m: m.pop("format_version"))),
        "format_version: a required field is missing",
    ),
    "negative format_version": (
        edit("static", "manifest.json", manifest(lambda m: m.update(format_version=-1))),
        "format_version: must be at least 1",
    ),
    "programs a list": (
        edit("static", "manifest.json", manifest(lambda m: m.update(programs=[]))),
        "programs: expected an object, got an array",
    ),
    "no engine metadata": (
        edit("static", "manifest.json", manifest(lambda m: m["metadata"].pop("engine"))),
        "not an inference model file",
    ),
    "corrupted weights": (edit("static", "weights.safetensors", flipped), "weights.safetensors is corrupted"),
    "truncated weights": (
        edit("static", "weights.safetensors", truncated, checksum=True),
        "weights unreadable",
    ),
    "no weights": (
        edit("static", "weights.safetensors", None),
        "'weights.safetensors' listed in the manifest is missing",
    ),
    "prefill not UTF-8": (
        edit("static", "prefill.pir", b"\xff\xfe", checksum=True),
        "prefill.pir is not UTF-8 text",
    ),
    "prefill garbage": (edit("static", "prefill.pir", b"builtin.module {", checksum=True), "does not parse"),
    "bad tokenizer": (
        edit("static", "tokenizer.model", b"garbage", checksum=True),
        "tokenizer.model is not a sentencepiece model",
    ),
}
CASES = [
    *[("export", k, f, m) for k, (f, m) in {**HF_BAD, **EXPORT_BAD}.items()],
    *[("generate", k, f, m) for k, (f, m) in HF_BAD.items()],
    *[("serve", k, f, m) for k, (f, m) in SERVE_BAD.items()],
]


@pytest.mark.parametrize("command, case, setup, message", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_missing_or_wrong_files_exit_2_with_one_line(
    command, case, setup, message, trained, model_file, tmp_path, monkeypatch, capsys
):
    import llmkit.serve.server as server

    # serve sets up the process for inference before loading: keep this test process as it is
    monkeypatch.setattr(server, "spin_between_kernels", lambda: False)
    monkeypatch.setattr(server, "set_blas_threads", lambda n: True)
    path = setup(tmp_path, trained[1], model_file)
    argv = {
        "export": ["export", "--model", str(path), "--out", str(tmp_path / "out.llmkit")],
        "generate": ["generate", "--model", str(path), "--prompt", "Once", "--max-new-tokens", "2"],
        "serve": ["serve", str(path), "--host", "256.0.0.1"],  # a file that loads cannot bind: no hang
    }[command]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmkit {command}: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "out.llmkit").exists()


@pytest.mark.parametrize(
    "out, message",
    [
        ("notes", "exists and is not a static model file; refusing to replace it"),
        ("notes/m", "is a file, not a dir"),
    ],
)
def test_export_refuses_an_out_path_it_cannot_write(out, message, trained, tmp_path, capsys):
    (tmp_path / "notes").write_text("keep me")
    assert cli_main(["export", "--model", str(trained[1]), "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert (tmp_path / "notes").read_text() == "keep me"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-memory", "2GB"], "--kv-memory must be a positive size such as 512MiB or 2GiB, got '2GB'"),
        (["--kv-memory", "0MiB"], "--kv-memory must be a positive size"),
        (["--kv-memory", "-1"], "--kv-memory must be a positive size"),
        (["--kv-memory", "1MiB", "--num-blocks", "4"], "give --num-blocks or --kv-memory, not both"),
    ],
)
def test_serve_rejects_a_bad_kv_memory(flags, message, model_file, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", str(model_file), *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_serve_kv_memory_units_and_a_cap_below_one_block(model_file, tmp_path, monkeypatch, capsys):
    import llmkit.serve.server as server

    sizes = {"3000": 3000, "1.5KiB": 1536, "2 MiB": 2 << 20, "1g": 1 << 30, ".5K": 512}
    for text, size in sizes.items():
        assert server.parse_args([str(model_file), "--kv-memory", text]).kv_memory == size
    monkeypatch.setattr(server, "spin_between_kernels", lambda: False)
    monkeypatch.setattr(server, "set_blas_threads", lambda n: True)
    spec = json.loads((model_file / "manifest.json").read_text())["metadata"]["engine"]
    block = spec["num_layers"] * 2 * spec["num_kv_heads"] * spec["block_size"] * spec["head_dim"] * 4
    engine = server.load_engine(
        server.parse_args([str(model_file), "--kv-memory", str(5 * block + 7), "--compiler", "none"])
    )
    assert engine.blocks.num_blocks == 5 and engine.runner.pool.nbytes == 5 * block
    assert cli_main(["serve", str(model_file), "--kv-memory", str(block - 1), "--host", "256.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-memory, kv_memory_bytes) must hold at least one KV block" in err
    assert f"({block} bytes), got {block - 1} bytes" in err, err
