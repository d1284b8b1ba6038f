"""Tokenizer against transformers' AutoTokenizer: a byte-level BPE tokenizer.json made here with the
`tokenizers` library and saved by transformers, and llmkit's own sentencepiece model read by
transformers from the directory llmkit writes (without protobuf); round trips, token bytes, the
files of the static model file, and malformed files."""

from __future__ import annotations

import importlib.abc
import json
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmkit.models.llama.tokenizer import LLAMA3_SPLIT, train_tokenizer
from llmkit.tokenizer import BYTE_ENCODER, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we're testing 12345 tokens.\n",
    "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # indented\n",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, 中文字符, 한국어, emoji 😀🦙👍.\n",
    "Numbers 3.14159 and 2.71828; punctuation!? (parens) [brackets] {braces} — dashes…\n",
]
FRAGMENTS = [
    "hello", "world", "The", " quick", "fox", " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ",
    "123", "2024", "3.14159", "0", "héllo", "naïve", "café", "日本語", "中文字符", "한국어", "ß", "İ",
    "😀", "🦙", "👩‍👩‍👧", "👍🏽", "∑x²", "Ωmega", "can't", "I'm", "WE'LL", "!!", "...", "—", "©",
    "\u00a0", "\u2581", "tab\tbed", "x" * 20, "    def f():", "<|eot_id|>", "<|begin_of_text|>",
    "<s>", "</s>", "<unk>", "<|end_header_id|>", "<", "|", "\x00", "\x7f",
]  # fmt: skip


def strings(n: int, seed: int = 0) -> list[str]:
    """``n`` texts mixing the fragments (unicode, emoji, CJK, whitespace runs, digits, special
    tokens) with and without spaces between them."""
    rng = random.Random(seed)
    out = ["", " ", "\n", *FRAGMENTS, *CORPUS]
    while len(out) < n:
        parts = rng.choices(FRAGMENTS, k=rng.randint(1, 8))
        out.append(rng.choice(["", " ", "\n"]).join(parts))
    return out


TEXTS = strings(600)


class _NoProtobuf(importlib.abc.MetaPathFinder):
    """Refuses to import protobuf, so what transformers does must work without it."""

    def find_spec(self, name, path=None, target=None):
        if name == "google.protobuf" or name.startswith("google.protobuf."):
            raise ImportError("protobuf is blocked in this test")
        return None


@pytest.fixture
def no_protobuf(monkeypatch: pytest.MonkeyPatch):
    for name in [m for m in sys.modules if m.startswith("google.protobuf")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoProtobuf(), *sys.meta_path])


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 3-style byte-level BPE tokenizer trained here, saved by transformers as a real HF dir
    (tokenizer.json, tokenizer_config.json, chat_template.jinja) plus a generation_config.json."""
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
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS * 20, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    fast.chat_template = CHAT
    d = tmp_path_factory.mktemp("bpe")
    fast.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    return d


@pytest.fixture(scope="module")
def spm_dir(builtin_tok, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llmkit's 4096-piece built-in sentencepiece tokenizer, saved by llmkit."""
    d = tmp_path_factory.mktemp("spm")
    builtin_tok.save_pretrained(d)
    return d


def test_bpe_ids_equal_transformers(bpe_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(bpe_dir)
    hf = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    assert tok.kind == "bpe" and len(TEXTS) >= 500
    want = [hf(t, add_special_tokens=False).input_ids for t in TEXTS]
    assert [tok.encode(t, add_bos=False) for t in TEXTS] == want
    assert tok.encode_batch(TEXTS) == [[tok.bos_id, *w] for w in want]
    assert [hf(t).input_ids for t in TEXTS] == tok.encode_batch(
        TEXTS
    )  # add_bos_token: from the post-processor
    assert tok.encode("a<|eot_id|>b", add_bos=False)[1] == tok.token_to_id("<|eot_id|>") == 2
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (0, 1, [1, 2], None)
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == ("<|begin_of_text|>", "<|end_of_text|>", True)
    assert tok.chat_template == CHAT == hf.chat_template  # from chat_template.jinja
    assert tok.vocab_size == len(hf)


def test_sentencepiece_dir_is_read_by_transformers_without_protobuf(
    spm_dir: Path, builtin_tok, no_protobuf
) -> None:
    with pytest.raises(ImportError):
        import google.protobuf  # noqa: F401
    files = sorted(p.name for p in spm_dir.iterdir())
    assert files == ["special_tokens_map.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(spm_dir)
    tok = Tokenizer.from_pretrained(spm_dir)
    assert tok.kind == "sentencepiece" and tok.sha256 == builtin_tok.sha256
    want = [hf(t, add_special_tokens=False).input_ids for t in TEXTS]
    assert [builtin_tok.encode(t, add_bos=False) for t in TEXTS] == want
    assert [hf(t).input_ids for t in TEXTS] == builtin_tok.encode_batch(TEXTS)  # Llama adds bos
    assert builtin_tok.encode("<s>x</s>", add_bos=False)[::2] == [1, 2]  # special tokens in text
    assert (hf.bos_token_id, hf.eos_token_id, hf.unk_token_id) == (1, 2, 0)
    plain = [t for t in TEXTS if not any(s in t for s in ("<s>", "</s>", "<unk>", "\u2581"))]
    assert [hf.decode(builtin_tok.encode(t), skip_special_tokens=True) for t in plain] == plain


@pytest.fixture(scope="module")
def converted(builtin_tok):
    return tokenizers.Tokenizer.from_str(builtin_tok.files()["tokenizer.json"].decode())


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40))
def test_sentencepiece_equals_its_tokenizer_json(builtin_tok, converted, text: str) -> None:
    """sentencepiece itself against the tokenizers BPE written for it (no transformers between)."""
    assert converted.encode(text, add_special_tokens=False).ids == builtin_tok.encode(text, add_bos=False)


SPM_VARIANTS = {  # sentencepiece settings beside llmkit's, each converted to tokenizer.json
    "llama2": {"add_dummy_prefix": True},  # Meta's Llama 1/2 tokenizers
    "sentencepiece_defaults": {  # nmt_nfkc (a precompiled charsmap), extra whitespace removed
        "normalization_rule_name": None,
        "remove_extra_whitespaces": None,
        "add_dummy_prefix": None,
    },
    "unigram": {"model_type": "unigram"},
}


@pytest.mark.parametrize("variant", sorted(SPM_VARIANTS))
def test_other_sentencepiece_models_convert_exactly(variant: str) -> None:
    import io

    import sentencepiece as spm

    from llmkit.models.llama.tokenizer import TRAINER_SETTINGS

    settings = {k: v for k, v in {**TRAINER_SETTINGS, **SPM_VARIANTS[variant]}.items() if v is not None}
    model = io.BytesIO()
    lines = [line for text in CORPUS * 30 for line in text.split("\n") if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=360, **settings
    )
    tok = Tokenizer(model.getvalue())
    converted = tokenizers.Tokenizer.from_str(tok.files()["tokenizer.json"].decode())
    got = [e.ids for e in converted.encode_batch(TEXTS, add_special_tokens=False)]
    assert got == tok.encode_batch(TEXTS, add_bos=False)  # sentencepiece itself, segment by segment


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_decode_and_token_bytes_round_trip(kind: str, bpe_dir: Path, spm_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(bpe_dir if kind == "bpe" else spm_dir)
    specials = ("<|", "<s>", "</s>", "<unk>") if kind == "spm" else ("<|",)
    for text in TEXTS:
        ids = tok.encode(text, add_bos=True, add_eos=True)
        if kind == "bpe" or "\u2581" not in text:  # sentencepiece reads "▁" as a space
            assert tok.decode(ids, skip_special=False) == tok.bos_token + text + tok.eos_token
        if not any(s in text for s in specials):
            assert (
                b"".join(tok.token_bytes(i) for i in ids)
                == text.replace("\u2581", " " if kind == "spm" else "\u2581").encode()
            )
            if kind == "bpe" or "\u2581" not in text:
                assert tok.decode(ids) == text
    multi = "日本語 😀 👩‍👩‍👧 ß"
    ids = tok.encode(multi, add_bos=False)
    assert any(len(tok.token_bytes(i)) and not _utf8(tok.token_bytes(i)) for i in ids) or kind == "bpe"
    assert b"".join(tok.token_bytes(i) for i in ids) == multi.encode()


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_byte_level_token_bytes_use_gpt2s_byte_map(bpe_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(bpe_dir)
    emoji = "😀".encode()
    ids = tok.encode("😀", add_bos=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == emoji
    # each token's piece is its bytes written with GPT-2's map, read independently of llmkit here
    for i in ids:
        assert tok.id_to_piece(i) == "".join(BYTE_ENCODER[b] for b in tok.token_bytes(i))
    assert tok.token_bytes(tok.eos_id) == b"" and tok.is_control(tok.eos_id)
    assert tok.token_text(ids[0]) in ("\ufffd", "😀")


@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_from_files_of_files_is_the_same_tokenizer(
    kind: str, bpe_dir: Path, spm_dir: Path, tmp_path: Path
) -> None:
    tok = Tokenizer.from_pretrained(bpe_dir if kind == "bpe" else spm_dir)
    again = Tokenizer.from_files(tok.files())
    assert again.files() == tok.files() and again.sha256 == tok.sha256
    for a in (
        "kind",
        "vocab_size",
        "bos_id",
        "eos_id",
        "eos_ids",
        "pad_id",
        "unk_id",
        "bos_token",
        "eos_token",
    ):
        assert getattr(again, a) == getattr(tok, a), a
    assert (again.add_bos_token, again.chat_template, again.model_proto) == (
        tok.add_bos_token,
        tok.chat_template,
        tok.model_proto,
    )
    assert again.encode_batch(TEXTS[:100]) == tok.encode_batch(TEXTS[:100])
    tok.save_pretrained(tmp_path)
    saved = Tokenizer.from_pretrained(tmp_path)
    assert saved.sha256 == tok.sha256 and saved.eos_ids == tok.eos_ids
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)  # llmkit's own files read back by transformers
    assert [hf(t).input_ids for t in TEXTS[:100]] == tok.encode_batch(TEXTS[:100])
    assert hf.chat_template == tok.chat_template


def test_chat_templates_as_configs_hold_them(spm_dir: Path, tmp_path: Path) -> None:
    cfg = json.loads((spm_dir / "tokenizer_config.json").read_text())
    for name in ("tokenizer.model", "tokenizer.json"):
        (tmp_path / name).write_bytes((spm_dir / name).read_bytes())
    write = lambda c: (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **c}))
    write({"chat_template": "{{ messages }}"})
    assert Tokenizer.from_pretrained(tmp_path).chat_template == "{{ messages }}"
    write({"chat_template": [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]})
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_templates == {"default": "A", "tool_use": "B"} and tok.chat_template == "A"
    assert Tokenizer.from_files(tok.files()).chat_templates == tok.chat_templates
    (tmp_path / "chat_template.jinja").write_text("C")  # transformers 5's file wins over the config
    assert Tokenizer.from_pretrained(tmp_path).chat_template == "C"
    write({"bos_token": {"content": "</s>", "__type": "AddedToken"}, "add_bos_token": False})
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.bos_id, tok.add_bos_token) == (2, False)


def _broken(d: Path, name: str, data: bytes, tmp: Path) -> Path:
    out = tmp / "broken"
    out.mkdir(exist_ok=True)
    for f in d.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / name).write_bytes(data)
    return out


def _config_with(d: Path, **changes) -> bytes:
    return json.dumps({**json.loads((d / "tokenizer_config.json").read_text()), **changes}).encode()


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("tokenizer.json", b'{"model": {"vocab": ', r"tokenizer.json: not valid JSON text"),
        ("tokenizer.json", b"[1, 2]", r"tokenizer.json: expected a JSON object, got list"),
        ("tokenizer.json", b'{"version": "1.0"}', r'tokenizer.json: no "model" with a "vocab"'),
        ("tokenizer.json", b'{"model": {"type": "BPE", "vocab": 5}}', r"json: invalid type.*\(tokenizers\)"),
        (
            "tokenizer.json",
            b'{"model": {"type": "Nope", "vocab": {}}}',
            r"tokenizer.json: model.type 'Nope' is not one of BPE, Unigram",
        ),
        ("tokenizer_config.json", b"{", r"tokenizer_config.json: not valid JSON text"),
        ("tokenizer_config.json", b'"x"', r"tokenizer_config.json: expected a JSON object, got str"),
        (
            "tokenizer_config.json",
            {"bos_token": 5},
            r"tokenizer_config.json: bos_token: expected a token string",
        ),
        (
            "tokenizer_config.json",
            {"eos_token": "<nope>"},
            r"tokenizer_config.json: eos_token '<nope>' is not in",
        ),
        ("tokenizer_config.json", {"add_bos_token": "yes"}, r"add_bos_token: expected true or false"),
        ("tokenizer_config.json", {"chat_template": 5}, r"chat_template: expected a string or a list"),
        ("tokenizer_config.json", {"chat_template": [{"name": "x"}]}, r"chat_template\[0\]: expected"),
        (
            "tokenizer_config.json",
            {"added_tokens_decoder": {"1": {"content": "<zz>"}}},
            r"added_tokens_decoder.1",
        ),
        (
            "generation_config.json",
            b'{"eos_token_id": "x"}',
            r"generation_config.json: eos_token_id: expected",
        ),
        ("generation_config.json", b'{"eos_token_id": [99999]}', r"eos_token_id 99999 is out of range"),
        ("special_tokens_map.json", b"{", r"special_tokens_map.json: not valid JSON text"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 25 else None,
)
@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_malformed_files_are_named(kind, name, data, message, bpe_dir, spm_dir, tmp_path) -> None:
    d = bpe_dir if kind == "bpe" else spm_dir
    if isinstance(data, dict):
        data = _config_with(d, **data)
    with pytest.raises(TokenizerError, match=message) as e:
        Tokenizer.from_pretrained(_broken(d, name, data, tmp_path))
    assert str(tmp_path / "broken" / name) in str(e.value)


def test_a_trained_bpe_tokenizer_is_read_by_transformers(tmp_path: Path) -> None:
    """llmkit tokenizer train --kind bpe: Llama 3's byte-level BPE, the same files each time."""
    tok = train_tokenizer(CORPUS * 10, 400, tmp_path / "a", kind="bpe")
    assert train_tokenizer(CORPUS * 10, 400, tmp_path / "b", kind="bpe").files() == tok.files()
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos_token) == ("bpe", 400, 0, 1, True)
    assert [hf(t).input_ids for t in TEXTS] == tok.encode_batch(TEXTS)
    plain = [t for t in TEXTS if "<|" not in t]
    assert [tok.decode(tok.encode(t)) for t in plain] == plain  # byte-level: every text comes back
    assert [b"".join(map(tok.token_bytes, tok.encode(t))) for t in plain] == [t.encode() for t in plain]


def test_user_defined_pieces_are_found() -> None:
    """user_defined_ids reads the pieces' types from the proto; the pieces asked for as
    user_defined_symbols are the reference (sentencepiece's own ids of them)."""
    import io

    import sentencepiece as spm

    from llmkit.tokenizer_convert import user_defined_ids

    symbols = ["<tool>", "<x\u00e9>", "[[sep]]"]
    model = io.BytesIO()
    lines = [line for text in CORPUS * 30 for line in text.split("\n") if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=100, user_defined_symbols=symbols
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert user_defined_ids(model.getvalue()) == sorted(sp.piece_to_id(s) for s in symbols)
