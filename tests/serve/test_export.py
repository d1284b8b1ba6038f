"""``llmkit export``: the static model file, and the export -> serve round trip of logits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.cli import main as cli_main
from llmkit.framework import jit
from llmkit.framework.compiler import available
from llmkit.infer import Engine, EngineConfig, SamplingParams
from llmkit.infer.chat import LLAMA2_CHAT_TEMPLATE
from llmkit.models.llama.checkpoint import derived_path


def test_manifest_programs_weights_and_metadata(model_file, trained):
    model, _ = trained
    m = json.loads((model_file / "manifest.json").read_text())
    assert set(m["programs"]) == {"prefill", "decode", "score"}
    tokenizer = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    pirs = {"prefill.pir", "decode.pir", "score.pir"}
    assert set(m["files"]) == {*pirs, "weights.safetensors", *tokenizer}
    assert all(len(v) == 64 for v in m["files"].values())  # sha256 of every part
    meta = m["metadata"]
    assert meta["model_name"] == "tiny" and meta["engine"]["block_size"] == 16
    assert meta["engine"]["max_model_len"] == 512 and meta["eos_token_ids"] == [2]
    assert meta["chat_template"] == LLAMA2_CHAT_TEMPLATE and meta["config"]["hidden_size"] == 128
    dec = m["programs"]["decode"]
    assert [i["name"] for i in dec["inputs"]][-1] == "pool"
    # linear weights in the layout the programs read: 16-column panels [out/16, in, 16] where the
    # programs are compiled and out_features is a multiple of 16, else [in, out]
    packed = "P16" if available() else "T"
    assert f"model.layers.0.self_attn.q_proj.weight.{packed}" in dec["weights"]
    assert dec["weights"] == [w for w in dec["weights"] if w in m["programs"]["prefill"]["weights"]]
    sm = jit.load(model_file)
    down = model.model.layers[1].mlp.down_proj.weight.numpy()  # [128, 344]
    want = down.T if packed == "T" else np.stack([down[16 * j : 16 * j + 16].T for j in range(8)])
    np.testing.assert_array_equal(sm.weights[f"model.layers.1.mlp.down_proj.weight.{packed}"], want)
    gate = model.model.layers[1].mlp.gate_proj.weight.numpy()  # out_features 344: always [in, out]
    np.testing.assert_array_equal(sm.weights["model.layers.1.mlp.gate_proj.weight.T"], gate.T)


def test_round_trip_logits_equal_the_training_models(model_file, trained):
    model, _ = trained
    served = Engine.from_static(model_file, EngineConfig(max_batch=4))
    live = Engine.from_model(model, config=EngineConfig(max_batch=4))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4096, n).tolist() for n in (7, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=20)
    a, b = served.generate(prompts, params), live.generate(prompts, params)
    for p, x, y in zip(prompts, a, b):
        # the same program on the same weights: bit for bit
        assert x.token_ids == y.token_ids
        assert [c.top for c in x.logprobs] == [c.top for c in y.logprobs]
        # and the training model's own logits (eager forward over prompt + generated tokens)
        with lf.no_grad():
            logits = model(lf.tensor(np.array([p + x.token_ids]))).logits.numpy()[0].astype(np.float64)
        for k, c in enumerate(x.logprobs):
            row = logits[len(p) - 1 + k]
            ref = row - row.max() - np.log(np.exp(row - row.max()).sum())
            assert [t for t, _ in c.top[:3]] == list(np.argsort(-ref, kind="stable")[:3])
            np.testing.assert_allclose(
                [lp for _, lp in c.top], ref[[t for t, _ in c.top]], rtol=1e-5, atol=1e-5
            )


def test_the_served_score_program_scores_as_the_live_model_and_an_older_file_refuses_echo(
    model_file, trained, tmp_path
):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 4096, n).tolist() for n in (9, 30)]
    score = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)
    served = Engine.from_static(model_file, EngineConfig(max_batch=4)).generate(prompts, score)
    live = Engine.from_model(trained[0], config=EngineConfig(max_batch=4)).generate(prompts, score)
    assert [len(c.prompt_logprobs) for c in served] == [9, 30]
    for a, b in zip(served, live):  # the same program on the same weights: bit for bit
        assert [(c.token_id, c.logprob, c.top) for c in a.prompt_logprobs[1:]] == [
            (c.token_id, c.logprob, c.top) for c in b.prompt_logprobs[1:]
        ]
    # a file written before the score program existed: everything but scoring still runs
    old = tmp_path / "old.llmkit"
    shutil.copytree(model_file, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["programs"]["score"], m["files"]["score.pir"]
    (old / "manifest.json").write_text(json.dumps(m))
    (old / "score.pir").unlink()
    eng = Engine.from_static(old, EngineConfig(max_batch=4))
    assert not eng.runner.can_score
    assert eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))[0].token_ids
    with pytest.raises(ValueError, match="^prompt_logprobs: this model file has no score program"):
        eng.add_request(prompts[0], score)


def test_a_file_with_packed_weights_runs_the_reference_kernels_on_unpacked_ones(model_file, trained):
    """Served without the C kernel (compiler="none"), panel-packed weights are unpacked once at load:
    the programs then equal the live model's reference-kernel programs bit for bit."""
    model, _ = trained
    served = Engine.from_static(model_file, EngineConfig(max_batch=4, compiler="none"))
    live = Engine.from_model(model, config=EngineConfig(max_batch=4, compiler="none"))
    for fn in jit.load(model_file, compiler="none").programs.values():
        packed = "panel = 16" in str(fn.program)
        assert packed == available()  # the file itself keeps the panels (exported where cc works)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 4096, n).tolist() for n in (5, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=5)
    a, b = served.generate(prompts, params), live.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert [c.top for c in x.logprobs] == [c.top for c in y.logprobs]


def test_unpacking_rewrites_the_programs_and_their_weights(model_file, trained):
    from llmkit.infer.programs import unpack_panel_weights

    model, _ = trained
    sm = jit.load(model_file, compiler="none")
    n = unpack_panel_weights(sm.programs.values())
    assert n == (2 * 5 + 1 if available() else 0)  # q, k, v, o, down per layer + lm_head (gate, up: 344)
    for name, fn in sm.programs.items():
        assert "panel = 16" not in str(fn.program), name
    dec = sm.programs["decode"]
    i = dec.entry["weights"].index(f"model.layers.1.mlp.down_proj.weight.{'P16' if available() else 'T'}")
    np.testing.assert_array_equal(dec.weights[i], model.model.layers[1].mlp.down_proj.weight.numpy().T)


def test_the_file_runs_in_a_process_without_model_code(model_file, tmp_path):
    code = f"""
import sys
from llmkit.infer import Engine, SamplingParams
e = Engine.from_static({str(model_file)!r})
out = e.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))[0]
assert not [m for m in sys.modules if m.startswith("llmkit.models")]
print(len(out.token_ids))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "4"


def test_bfloat16_export_runs(trained, tmp_path):
    out = tmp_path / "bf16.llmkit"
    assert cli_main(["export", "--model", str(trained[1]), "--out", str(out), "--dtype", "bfloat16"]) == 0
    e = Engine.from_static(out, EngineConfig(max_batch=2))
    assert e.spec.dtype == "bfloat16" and e.runner.pool.dtype.name == "bfloat16"
    got = e.generate([[1, 50, 60]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(got.token_ids) == 3


def test_export_refuses_to_replace_other_directories(trained, tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert cli_main(["export", "--model", str(trained[1]), "--out", str(precious)]) == 2
    assert "refusing to replace it" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"
    assert cli_main(["export", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2


def test_out_defaults_to_the_model_directory_or_its_run_with_llmkit_appended(trained, tmp_path, capsys):
    assert derived_path(Path("runs/tiny/checkpoints/step-00000600/model"), ".llmkit") == Path(
        "runs/tiny.llmkit"
    )
    assert derived_path(Path("runs/tiny-int4"), ".llmkit") == Path("runs/tiny-int4.llmkit")
    model = shutil.copytree(trained[1], tmp_path / "mine")
    assert cli_main(["export", "--model", str(model)]) == 0
    assert (tmp_path / "mine.llmkit" / "manifest.json").is_file()
    assert f"wrote {tmp_path / 'mine.llmkit'} " in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--help"]])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", *argv])
    assert e.value.code == 0 and "--max-queue" in capsys.readouterr().out
