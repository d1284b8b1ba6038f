"""Fixtures for server tests: a tiny model directory, its exported model file, real uvicorn servers.

Servers run as subprocesses (``python -m llmkit.cli serve ...``) on free ports of 127.0.0.1 and are
driven over HTTP with the official ``openai`` client; one server is shared by a whole module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import llmkit.framework as lf
from llmkit.cli import main as cli_main
from llmkit.models.llama import LlamaConfig, LlamaForCausalLM
from llmkit.models.llama.tokenizer import LlamaTokenizer

API_KEY = "sk-test-llmkit"


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, tok: LlamaTokenizer) -> tuple[LlamaForCausalLM, Path]:
    """A tiny random Llama saved as the trainer saves checkpoints (HF layout + tokenizer.model)."""
    lf.seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_preset("tiny", vocab_size=4096, num_hidden_layers=2))
    model.eval()
    d = tmp_path_factory.mktemp("run") / "checkpoints" / "step-00000004" / "model"
    model.save_pretrained(str(d))
    tok.save_pretrained(d)
    return model, d


@pytest.fixture(scope="session")
def model_file(trained: tuple[LlamaForCausalLM, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "tiny.llmkit"
    assert cli_main(["export", "--model", str(trained[1]), "--out", str(out), "--name", "tiny"]) == 0
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    api_key: str | None
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(model_file: Path, log: Path, *args: str, api_key: str | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llmkit.cli", "serve", str(model_file), "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    f = open(log, "w")  # noqa: SIM115  (the child writes it for its lifetime)
    proc = subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    server = Server(proc, f"http://127.0.0.1:{port}", api_key, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server did not come up:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(model_file: Path, tmp_path_factory: pytest.TempPathFactory):
    """One server per test module: API key set, 8 requests per batch."""
    s = start_server(
        model_file, tmp_path_factory.mktemp("srv") / "server.log", "--max-batch", "8", api_key=API_KEY
    )
    yield s
    assert s.stop() == 0, s.log.read_text()


def write_hf_model(d: Path, tok: LlamaTokenizer, seed: int = 0) -> Any:
    """A tiny random ``transformers.LlamaForCausalLM`` saved as a Hugging Face directory that both
    transformers and llmkit read: ``config.json``, ``model.safetensors`` (transformers' own), and
    the built-in tokenizer's files as llmkit writes them (``tokenizer.model``, ``tokenizer.json``,
    ``tokenizer_config.json``, ...: ``AutoTokenizer`` reads them). Returns the transformers model
    (eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,  # peakier distributions than 0.02: choices differ, ranks are clear
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return model


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory, tok: LlamaTokenizer) -> tuple[Any, Path]:
    """(transformers model, its directory): see :func:`write_hf_model`."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf") / "hf-tiny"
    return write_hf_model(d, tok), d


@pytest.fixture(scope="session")
def hf_model_file(hf_model: tuple[Any, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The transformers-made model exported by ``llmkit export``."""
    out = tmp_path_factory.mktemp("export") / "hf-tiny.llmkit"
    assert cli_main(["export", "--model", str(hf_model[1]), "--out", str(out), "--name", "hf-tiny"]) == 0
    return out
