"""The README's whole pipeline on a small budget: ``llmkit train configs/tiny.yaml``, ``llmkit rlhf
configs/rlhf-tiny.yaml``, ``llmkit quantize --model runs/rlhf-tiny --bits 4``, ``llmkit export
--model runs/rlhf-tiny-int4``, ``llmkit serve runs/rlhf-tiny-int4.llmkit``, run as the README runs
them (the shipped configs, default paths, from a fresh directory) with overrides that shrink the
model and the steps, and a check at every hand-off:

- the RLHF policy's weights at step 0 are the trained checkpoint's (read back with safetensors);
- the quantized model is the RLHF policy's: every weight GPTQ quantizes first (column 0 of each
  linear, before any error is moved onto it) lies within half a scale step of the policy's, read
  through the published format (docs/quantize.md), and RLHF moved some of them further than that
  from the trained weights;
- the exported file runs the quantized codes (``quant_linear``), the server answers from it, and the
  served completion equals the engine's on that file for the same prompt and seed.

With ``nproc=2`` training runs data parallel over two MPI processes (``parallel.dp=2 --nproc 2``) and
quantization shares GPTQ's rows between two (``--nproc 2``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from serve.conftest import start_server  # tests/ is on sys.path (pytest rootdir)

from llmkit.cli import main as cli_main
from llmkit.infer import Engine, SamplingParams
from llmkit.rlhf.trainer import PolicyTrainer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TRAIN_STEPS, RLHF_STEPS = 20, 3
TRAIN = [
    "model.num_hidden_layers=2",  # configs/tiny.yaml's width: the kernels other tests compiled
    f"train.steps={TRAIN_STEPS}",
    "train.batch_size=4",
    "train.seq_len=32",
    "train.eval_every=10",
    "train.eval_steps=2",
    "train.log_every=5",
    "train.save_every=0",
    "lr_schedule.warmup_steps=2",
]
# a large learning rate, so that three steps move weights by more than int4's half step
RLHF = [
    f"train.steps={RLHF_STEPS}",
    "train.save_every=0",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_tokens=8",
    "rollout.max_batch=8",
    "optim.lr=1e-2",
    "lr_schedule.warmup_steps=0",
]
QUANTIZE = ["--bits", "4", "--calib-samples", "8", "--eval-tokens", "2048", "--quiet"]
PROMPT, SEED = "The value", 3


def weights(run: Path, step: int) -> dict[str, np.ndarray]:
    """A checkpoint's model weights: ``model.safetensors``, or the pieces ranks wrote, each at its
    offset (``llmkit.pieces`` metadata: the tensor's shape and the piece's start, docs/parallel.md)."""
    d = run / "checkpoints" / f"step-{step:08d}" / "model"
    if (d / "model.safetensors").is_file():
        return load_file(d / "model.safetensors")
    out: dict[str, np.ndarray] = {}
    for f in sorted(d.glob("rank-*.safetensors")):
        with safe_open(f, "np") as pieces:
            for name, at in json.loads(pieces.metadata()["llmkit.pieces"]).items():
                piece = pieces.get_tensor(name)
                whole = out.setdefault(name, np.full(at["shape"], np.nan, piece.dtype))
                whole[tuple(slice(a, a + n) for a, n in zip(at["start"], piece.shape))] = piece
    assert out and not any(np.isnan(w).any() for w in out.values()), d
    return out


def dequantize(t: dict[str, np.ndarray], name: str, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 weights of linear ``name`` as docs/quantize.md defines them: float64
    ``(W [out, in], scale of each weight [out, in])``."""
    q, s = t[name + ".qweight"], t[name + ".scales"].astype(np.float64)
    q = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1)  # column 2j low nibble, 2j+1 high
    cols = np.arange(q.shape[1]) // group
    return (q.astype(np.int64) - 8) * s[:, cols], s[:, cols]


@pytest.mark.parametrize(
    "nproc",
    [
        1,
        pytest.param(
            2,
            marks=[
                pytest.mark.mpi,
                pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (dist extra)"),
            ],
        ),
    ],
)
def test_train_rlhf_quantize_export_serve(nproc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's relative default paths: runs/...
    parallel = ["parallel.dp=2", "--nproc", "2"] if nproc == 2 else []  # --nproc execs mpiexec
    cmd = [sys.executable, "-m", "llmkit", "train", str(ROOT / "configs" / "tiny.yaml"), *TRAIN, *parallel]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    train = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=300, env=env)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert train.stdout.count(f"done: step {TRAIN_STEPS}") == 1
    trained = weights(Path("runs/tiny"), TRAIN_STEPS)

    # RLHF starts from the trained model: its parameters when step 0 begins
    at_step0: dict[str, np.ndarray] = {}
    step = PolicyTrainer.train_step

    def spy(self):
        if self.step == 0:
            at_step0.update((n, p.numpy().copy()) for n, p in self.model.named_parameters())
        return step(self)

    monkeypatch.setattr(PolicyTrainer, "train_step", spy)
    assert cli_main(["rlhf", str(ROOT / "configs" / "rlhf-tiny.yaml"), *RLHF, "--quiet"]) == 0
    assert set(at_step0) == set(trained)
    for name, w in trained.items():
        np.testing.assert_array_equal(at_step0[name], w, err_msg=name)
    policy = weights(Path("runs/rlhf-tiny"), RLHF_STEPS)
    rows = [json.loads(line) for line in Path("runs/rlhf-tiny/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, RLHF_STEPS + 1))

    # the quantized model is the RLHF policy's (GPTQ's first column of each linear is rounded as is)
    quantize = ["quantize", "--model", "runs/rlhf-tiny", *QUANTIZE]
    if nproc == 2:  # two MPI processes share GPTQ's rows (--nproc execs mpiexec: a subprocess here)
        q = subprocess.run(
            [sys.executable, "-m", "llmkit", *quantize, "--nproc", "2"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    else:
        assert cli_main(quantize) == 0
    quant = Path("runs/rlhf-tiny-int4")
    qc = json.loads((quant / "config.json").read_text())["quantization_config"]
    assert (qc["bits"], qc["sym"], qc["method"]) == (4, True, "gptq")
    report = json.loads((quant / "quant_report.json").read_text())
    assert report["linears"] == 14 and report["perplexity"]["quant"] < 1.1 * report["perplexity"]["float"]
    codes = load_file(quant / "model.safetensors")
    linears = sorted(k.removesuffix(".qweight") for k in codes if k.endswith(".qweight"))
    assert len(linears) == 14
    moved = 0
    for name in linears:
        w, scale = dequantize(codes, name, qc["group_size"])
        half = scale[:, 0] / 2 * (1 + 1e-6)
        assert np.all(np.abs(w[:, 0] - policy[name + ".weight"][:, 0]) <= half), name
        moved += int(np.sum(np.abs(w[:, 0] - trained[name + ".weight"][:, 0]) > half))
    assert moved > 0  # RLHF moved them: these codes do not round from the trained weights

    # export to the default path, serve it, and one completion over HTTP equals the engine's
    assert cli_main(["export", "--model", str(quant)]) == 0
    model_file = Path("runs/rlhf-tiny-int4.llmkit")
    assert (model_file / "decode.pir").read_text().count("llm.quant_linear(") == 14
    server = start_server(model_file.resolve(), tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["rlhf-tiny-int4"]
        served = client.completions.create(
            model="rlhf-tiny-int4", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=SEED
        )
    finally:
        assert server.stop() == 0, server.log.read_text()
    engine = Engine.from_static(model_file)
    local = engine.generate([PROMPT], SamplingParams(temperature=0.8, max_tokens=12, seed=SEED))[0]
    assert served.choices[0].text == local.text and local.token_ids
