"""A Llama 3-style Hugging Face directory, made here with transformers (random weights, llama3 RoPE
scaling, GQA, tied or untied embeddings, a byte-level BPE tokenizer.json with Llama 3's special
tokens and its real chat template, saved by ``save_pretrained`` as transformers 5 writes it), through
every job as a user runs them: ``llmkit generate``, ``llmkit train`` (the checkpoint is a complete HF
directory transformers reads back), ``llmkit rlhf`` (chat-message prompts rendered with the
template), ``llmkit quantize --bits 8``, ``llmkit export`` and ``llmkit serve`` with the openai
client. Every number is checked against transformers on the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llmkit.framework as lf
from llmkit.models.llama import LlamaForCausalLM
from llmkit.models.llama.tokenizer import LLAMA3_SPLIT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS, EOS, EOT = 0, 1, 4  # the specials' ids, in the order above
# meta-llama/Meta-Llama-3-8B-Instruct's chat_template
LLAMA3_CHAT = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we're testing tokens.\n",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]\n",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 😀🦙.\n",
    "Some words without that letter: a cat, a dog, a big old ship, what a world.\n",
]
VOCAB = 400
LLAMA3_ROPE = {  # original_max_position_embeddings small, so short prompts span all three bands
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say héllo to the 日本 fox 😀"},
]


def llmkit(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``python -m llmkit ARGS`` as a user runs it; fails the test with its output on an error."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    done = subprocess.run(
        [sys.executable, "-m", "llmkit", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def tokenizer_object() -> transformers.PreTrainedTokenizerFast:
    """Llama 3's tokenizer in miniature: byte-level BPE with its split regex and specials, a BOS
    post-processor, bos/eos as Llama 3 Instruct names them, its chat template."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    fast.chat_template = LLAMA3_CHAT
    return fast


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The directory, made once per embedding kind: ``{"tied": DIR, "untied": DIR}``."""
    fast = tokenizer_object()
    assert fast.convert_tokens_to_ids(SPECIALS) == [BOS, EOS, 2, 3, EOT]
    out = {}
    for kind in ("tied", "untied"):
        torch.manual_seed(0 if kind == "tied" else 1)
        cfg = transformers.LlamaConfig(
            vocab_size=len(fast),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # GQA
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA3_ROPE),
            tie_word_embeddings=kind == "tied",
            bos_token_id=BOS,
            eos_token_id=[EOS, EOT],
        )
        hf = transformers.LlamaForCausalLM(cfg).float()
        with torch.no_grad():  # HF inits norms to 1: random, so a misplaced norm would show
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        d = tmp_path_factory.mktemp(f"llama3-{kind}")
        hf.save_pretrained(d)
        fast.save_pretrained(d)
        assert (d / "chat_template.jinja").is_file() and (d / "tokenizer.json").is_file()
        gen = json.loads((d / "generation_config.json").read_text())
        assert gen["eos_token_id"] == [EOS, EOT]
        out[kind] = d
    return out


def chat_ids(
    fast: transformers.PreTrainedTokenizerBase, messages: list[dict], generation: bool = True
) -> list[int]:
    """transformers' ``apply_chat_template`` prompt ids."""
    out = fast.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=generation
    )
    return list(out["input_ids"])


def hf_model(d: Path) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def hf_greedy(d: Path, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (stopping at generation_config's eos ids)."""
    with torch.no_grad():
        out = hf_model(d).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def hf_logits(d: Path, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(d)(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_logits_equal_transformers(dirs: dict[str, Path], kind: str) -> None:
    from llmkit.tokenizer import Tokenizer

    d = dirs[kind]
    tok = Tokenizer.from_pretrained(d)
    ids = tok.encode(PROMPT + " " + MESSAGES[1]["content"] * 3)
    assert (
        ids
        == transformers.AutoTokenizer.from_pretrained(d)(PROMPT + " " + MESSAGES[1]["content"] * 3)[
            "input_ids"
        ]
    )
    assert len(ids) > LLAMA3_ROPE["original_max_position_embeddings"]
    model = LlamaForCausalLM.from_pretrained(str(d))
    assert model.config.tie_word_embeddings == (kind == "tied")
    ours = model(lf.tensor(np.array([ids]))).logits.numpy()[0]
    np.testing.assert_allclose(ours, hf_logits(d, ids), atol=1e-4, rtol=0)


def stops_at(d: Path, out: Path, ids: list[int], stop: int) -> Path:
    """``d``'s weights with ``lm_head``'s row of token ``stop`` made a little larger than that of the
    third token greedy decoding of ``ids`` picks: the model then ends its reply with ``stop``
    within three tokens, in transformers as anywhere else."""
    hf = hf_model(d)
    third = hf_greedy(d, ids, 3)[2]
    with torch.no_grad():
        w = hf.lm_head.weight
        w[stop] = 1.05 * w[third]
    hf.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(d).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_generate_cli_equals_transformers(dirs: dict[str, Path], kind: str) -> None:
    d, n = dirs[kind], 12
    fast = transformers.AutoTokenizer.from_pretrained(d)
    ids = fast(PROMPT)["input_ids"]
    want = hf_greedy(d, ids, n)
    out = llmkit(
        "generate", "--model", str(d), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(n)
    )
    assert out.stdout.rstrip("\n") == PROMPT + fast.decode(want, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["engine", "eager"])
def test_generate_stops_at_every_eos_of_generation_config(
    dirs: dict[str, Path], tmp_path: Path, mode: str
) -> None:
    """Llama 3 Instruct's tokenizer names <|eot_id|> its eos; <|end_of_text|> stops generation only
    through generation_config.json's eos list, as in transformers."""
    fast = transformers.AutoTokenizer.from_pretrained(dirs["untied"])
    assert fast.eos_token == "<|eot_id|>"
    ids = fast(PROMPT)["input_ids"]
    d = stops_at(dirs["untied"], tmp_path / "hf", ids, EOS)
    reply = hf_greedy(d, ids, 12)
    assert reply[-1] == EOS and len(reply) <= 3, reply
    args = ["--model", str(d), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "12"]
    out = llmkit("generate", *args, *(["--eager"] if mode == "eager" else []))
    assert out.stdout.rstrip("\n") == PROMPT + fast.decode(reply, skip_special_tokens=True)


def newest_checkpoint(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1] / "model"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_train_from_the_dir_writes_a_complete_hf_dir(
    dirs: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    d = dirs[kind]
    text = tmp_path / "corpus.txt"
    text.write_text("".join(CORPUS) * 30, encoding="utf-8")
    run, cfg = tmp_path / "run", tmp_path / "hf.yaml"
    # the docs' config for a Hugging Face directory (docs/train.md): weights and tokenizer from it
    cfg.write_text(
        f"model:\n  init_from: {d}\ntokenizer:\n  path: {d}\ndata:\n  sources: [{text}]\n"
        f"  cache_dir: {tmp_path / 'cache'}\nout_dir: {run}\n",
        encoding="utf-8",
    )
    llmkit(
        "train",
        str(cfg),
        "train.steps=2",
        "train.batch_size=2",
        "train.seq_len=32",
        "train.eval_every=0",
        "train.log_every=1",
        "train.save_every=0",
        "lr_schedule.warmup_steps=0",
        "optim.lr=1e-2",
        "--quiet",
    )
    ckpt = newest_checkpoint(run)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):  # fmt: skip
        assert (ckpt / name).is_file(), name
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] == (kind == "tied")
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == [EOS, EOT]
    # transformers reads it back: the same ids, the same chat prompt, llmkit's logits
    theirs, fast = (
        transformers.AutoTokenizer.from_pretrained(ckpt),
        transformers.AutoTokenizer.from_pretrained(d),
    )
    for s in CORPUS + [PROMPT]:
        assert theirs(s)["input_ids"] == fast(s)["input_ids"]
    assert chat_ids(theirs, MESSAGES) == chat_ids(fast, MESSAGES)
    ids = fast(PROMPT + " " + CORPUS[2])["input_ids"]
    ours = LlamaForCausalLM.from_pretrained(str(ckpt))(lf.tensor(np.array([ids]))).logits.numpy()[0]
    np.testing.assert_allclose(ours, hf_logits(ckpt, ids), atol=1e-4, rtol=0)
    # and training moved the weights
    assert not np.allclose(hf_logits(ckpt, ids), hf_logits(d, ids), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_rlhf_from_the_dir_renders_chat_prompts_with_its_template(
    dirs: dict[str, Path], kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmkit.cli import main as cli_main
    from llmkit.rlhf.rollout import Rollouts

    d = dirs[kind]
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": MESSAGES}, {"prompt": [MESSAGES[1]]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    seen: list[list[int]] = []
    encode = Rollouts.encode
    monkeypatch.setattr(Rollouts, "encode", lambda self, p: seen.append(encode(self, p)) or seen[-1])
    run = tmp_path / "rlhf"
    args = [f"model.init_from={d}", f"data.prompts={prompts}", f"out_dir={run}", "train.steps=2"]
    args += ["train.save_every=0", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=6"]
    args += ["rollout.max_batch=4", "lr_schedule.warmup_steps=0"]
    assert cli_main(["rlhf", str(ROOT / "configs" / "rlhf-tiny.yaml"), *args, "--quiet"]) == 0
    fast = transformers.AutoTokenizer.from_pretrained(d)
    want = [chat_ids(fast, r["prompt"]) for r in rows]
    assert seen and all(ids in want for ids in seen) and {tuple(w) for w in want} == {tuple(s) for s in seen}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward_mean" in r] == [1, 2]
    policy = newest_checkpoint(run)
    assert json.loads((policy / "config.json").read_text())["tie_word_embeddings"] == (kind == "tied")
    assert chat_ids(transformers.AutoTokenizer.from_pretrained(policy), MESSAGES, False) == chat_ids(
        fast, MESSAGES, False
    )
    ids = fast(PROMPT)["input_ids"]
    ours = LlamaForCausalLM.from_pretrained(str(policy))(lf.tensor(np.array([ids]))).logits.numpy()[0]
    np.testing.assert_allclose(ours, hf_logits(policy, ids), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_quantize_int8_reports_transformers_perplexity(
    dirs: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    from llmkit.quant.evaluate import eval_tokens, windows
    from llmkit.tokenizer import Tokenizer

    d, out, seq = dirs[kind], tmp_path / "int8", 32
    calib = tmp_path / "calib.txt"
    calib.write_text("".join(CORPUS) * 10, encoding="utf-8")
    args = ["--model", str(d), "--bits", "8", "--calib", str(calib), "--calib-samples", "4"]
    args += ["--seq-len", str(seq), "--eval-tokens", "256", "--out", str(out), "--quiet"]
    done = llmkit("quantize", *args, LLMKIT_CACHE_DIR=str(tmp_path / "cache"))
    report = json.loads((out / "quant_report.json").read_text())
    ppl = report["perplexity"]
    assert f"{ppl['float']:.3f}" in done.stdout and f"{ppl['quant']:.3f}" in done.stdout, done.stdout
    assert report["linears"] == 14 and abs(ppl["quant"] / ppl["float"] - 1) < 0.01
    # the float side's perplexity is transformers' on the same windows (float64 log-softmax)
    ids = windows(eval_tokens(Tokenizer.from_pretrained(d), cache_dir=tmp_path / "cache"), seq, 256)
    assert report["eval"]["tokens"] == ids.shape[0] * seq
    with torch.no_grad():
        logits = hf_model(d)(torch.tensor(ids[:, :-1])).logits.double()
    nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[:, 1:])[..., None]).mean()
    assert ppl["float"] == pytest.approx(float(torch.exp(nll)), rel=1e-5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == 8 and cfg["rope_scaling"]["rope_type"] == "llama3"
    fast = transformers.AutoTokenizer.from_pretrained(d)  # the tokenizer and its template came along
    assert chat_ids(transformers.AutoTokenizer.from_pretrained(out), MESSAGES) == chat_ids(fast, MESSAGES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_export_and_serve_equal_transformers(dirs: dict[str, Path], kind: str, tmp_path: Path) -> None:
    import openai
    from serve.conftest import start_server  # tests/ is on sys.path (pytest rootdir)

    fast = transformers.AutoTokenizer.from_pretrained(dirs[kind])
    chat = chat_ids(fast, MESSAGES)
    d = stops_at(dirs[kind], tmp_path / "hf", chat, EOT)
    reply = hf_greedy(d, chat, 16)  # generation_config's eos list [<|end_of_text|>, <|eot_id|>]
    assert reply[-1] == EOT and len(reply) <= 3, reply
    model_file = tmp_path / "llama3.llmkit"
    llmkit("export", "--model", str(d), "--out", str(model_file), "--name", "llama3")
    server = start_server(model_file, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        # a string prompt gets the tokenizer's BOS (add_bos_token), as transformers' encode does
        ids = fast(PROMPT)["input_ids"]
        want = hf_greedy(d, ids, 12)
        done = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=12, temperature=0)
        assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == len(want)
        assert done.choices[0].text == fast.decode(want, skip_special_tokens=True)
        # the chat prompt is apply_chat_template's ids, and the reply stops at <|eot_id|>
        said = client.chat.completions.create(model="llama3", messages=MESSAGES, max_tokens=16, temperature=0)
        assert said.usage.prompt_tokens == len(chat)
        assert said.choices[0].finish_reason == "stop" and said.usage.completion_tokens == len(reply)
        assert said.choices[0].message.content == fast.decode(reply[:-1])
        # the same ids given as a token-id prompt: the same reply, and echo gives them back
        scored = client.completions.create(
            model="llama3", prompt=chat, max_tokens=16, temperature=0, echo=True, logprobs=0
        )
        assert scored.usage.prompt_tokens == len(chat) and scored.choices[0].finish_reason == "stop"
        lp = scored.choices[0].logprobs
        assert len(lp.tokens) == len(chat) + len(reply) and lp.token_logprobs[0] is None
        # echoed token texts: each token alone, special tokens left out as the text leaves them
        assert lp.tokens[: len(chat)] == [fast.decode([i], skip_special_tokens=True) for i in chat]
        assert scored.choices[0].text == fast.decode(chat + reply, skip_special_tokens=True)
        # each echoed log-prob is transformers' log_softmax of that prompt token
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(d)(torch.tensor([chat])).logits[0].double(), -1)
        want_lp = [float(logp[i, t]) for i, t in enumerate(chat[1:])]
        np.testing.assert_allclose(lp.token_logprobs[1 : len(chat)], want_lp, atol=1e-4, rtol=0)
    finally:
        assert server.stop() == 0, server.log.read_text()
