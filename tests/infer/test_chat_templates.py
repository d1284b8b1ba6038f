"""Jinja chat templates against transformers' ``apply_chat_template``: rendered text, prompt ids and
the SFT assistant mask, for Llama 2 (sentencepiece), Llama 3 and ChatML (byte-level BPE built here
with the ``tokenizers`` library), and the errors a template can raise."""

from __future__ import annotations

import pytest

from llmkit.infer.chat import LLAMA2_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from llmkit.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# meta-llama/Meta-Llama-3-8B-Instruct's chat_template
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML as Qwen / SmolLM write it (no bos)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# ChatML with the assistant's text marked for training, the way TRL's assistant_only_loss wants it
CHATML_GENERATION = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message.role + '\\n' }}\n"
    "    {%- if message.role == 'assistant' %}\n"
    "        {% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- message.content + '<|im_end|>' }}\n"
    "    {%- endif %}\n"
    "    {{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system+user": [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}],
    "multi-turn": [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": "Once upon a time, a cat sat."},
        {"role": "user", "content": "  And then?  "},
    ],
    "system+multi-turn": [
        SYSTEM,
        {"role": "user", "content": "héllo 漢字 🙂\n\ttabs  and  runs"},
        {"role": "assistant", "content": " Padded reply. "},
        {"role": "user", "content": "Bye"},
    ],
}
# conversations ending with the assistant: what chat SFT trains on
REPLIES = ["Once upon a time, a cat sat.", "The end, 漢字 🙂."]
SFT = {
    "one reply": [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": REPLIES[0]},
    ],
    "system, two replies": [
        SYSTEM,
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": REPLIES[0]},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": REPLIES[1]},
    ],
}

CORPUS = [
    "Once upon a time there was a little cat. The cat sat on the mat, and the dog ran.",
    "What is 2 + 2? Tell me a story. And then? The end. Bye! You are terse. Hi there",
    "héllo 漢字 🙂 tabs and runs of spaces;\n\tnew lines\n\nand digits 0123456789.",
] * 20


def bpe_tokenizer(special: list[str], bos: str | None, eos: str, template: str):
    """A byte-level BPE tokenizer (Llama 3 style) as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token=bos, eos_token=eos, chat_template=template
    )


@pytest.fixture(scope="module")
def tokenizers_(tok, tmp_path_factory) -> dict[str, tuple[object, Tokenizer]]:
    """For each template, (transformers' tokenizer, llmkit's Tokenizer) of one HF directory,
    built once for the module: Llama 2 is llmkit's sentencepiece tokenizer as it saves itself (no
    template: the Llama 2 default applies), Llama 3 and ChatML are byte-level BPE tokenizers saved
    by transformers with their template in tokenizer_config.json."""
    llama3 = bpe_tokenizer(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        LLAMA3,
    )
    chatml = bpe_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML)
    out = {}
    for name, saver in (("llama2", tok), ("llama3", llama3), ("chatml", chatml)):
        d = tmp_path_factory.mktemp(name)
        saver.save_pretrained(d)
        # the class AutoTokenizer picks for these directories (tokenizer_config.json's tokenizer_class),
        # named here so that the test does not import torch through transformers' auto classes
        hf = transformers.PreTrainedTokenizerFast.from_pretrained(d)
        out[name] = (hf, Tokenizer.from_pretrained(d))
    return out


@pytest.fixture(scope="module")
def hf_tokenizers(tokenizers_) -> dict[str, object]:
    return {name: hf for name, (hf, _) in tokenizers_.items()}


TEMPLATES = {"llama2": LLAMA2_CHAT_TEMPLATE, "llama3": LLAMA3, "chatml": CHATML}


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", [*CONVERSATIONS, *SFT])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendered_text_equals_apply_chat_template(hf_tokenizers, name, conversation, generation_prompt):
    hf = hf_tokenizers[name]
    msgs = {**CONVERSATIONS, **SFT}[conversation]
    want = hf.apply_chat_template(
        msgs, chat_template=TEMPLATES[name], tokenize=False, add_generation_prompt=generation_prompt
    )
    got = ChatTemplate(TEMPLATES[name]).render_text(
        msgs, add_generation_prompt=generation_prompt, special_tokens=hf.special_tokens_map
    )
    assert got == want


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", [*CONVERSATIONS, *SFT])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_prompt_ids_equal_apply_chat_template(tokenizers_, name, conversation, generation_prompt):
    hf, ours = tokenizers_[name]
    msgs = {**CONVERSATIONS, **SFT}[conversation]
    want = hf.apply_chat_template(
        msgs,
        chat_template=TEMPLATES[name],
        tokenize=True,
        return_dict=True,
        add_generation_prompt=generation_prompt,
    )["input_ids"]
    template = ChatTemplate.of(ours)  # the tokenizer's own template; Llama 2's: the default
    assert template.source == TEMPLATES[name]
    assert template.render(msgs, ours, add_generation_prompt=generation_prompt) == want


# what each template writes for an assistant reply (the SFT targets), in the text
REPLY_TEXT = {
    "llama2": lambda r: " " + r.strip() + " </s>",
    "llama3": lambda r: r.strip() + "<|eot_id|>",
    "chatml": lambda r: r + "<|im_end|>\n",
}


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", SFT)
def test_sft_mask_marks_exactly_the_assistant_replies(tokenizers_, name, conversation):
    """Against the text: the replies found in transformers' rendering, transformers' own token
    offsets; a token is a target when it lies in a reply's text."""
    hf, ours = tokenizers_[name]
    msgs = SFT[conversation]
    ids, mask = ChatTemplate.of(ours).render_conversation(msgs, ours)
    text = hf.apply_chat_template(msgs, chat_template=TEMPLATES[name], tokenize=False)
    want_ids = hf.apply_chat_template(msgs, chat_template=TEMPLATES[name], tokenize=True, return_dict=True)
    assert ids == want_ids["input_ids"]
    spans, pos = [], 0
    for m in msgs:
        if m["role"] == "assistant":
            piece = REPLY_TEXT[name](m["content"])
            pos = text.index(piece, pos)
            spans.append((pos, pos + len(piece)))
            pos += len(piece)
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(ids)
    want = [any(s <= a and b <= e for s, e in spans) for a, b in offsets]
    assert mask == want
    assert sum(mask) > 0 and not all(mask)


def test_chat_sft_data_is_rendered_by_the_tokenizers_template(tokenizers_, tmp_path):
    import json

    from llmkit.train.data import load_token_data

    _, ours = tokenizers_["llama3"]
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": m}) + "\n" for m in SFT.values()))
    data = load_token_data([str(f)], ours, 0.0, tmp_path / "cache")
    stream, targets = list(data.tokens), list(data.mask.astype(bool))
    for msgs in SFT.values():
        ids, mask = ChatTemplate(LLAMA3).render_conversation(msgs, ours)
        at = next(i for i in range(len(stream)) if stream[i : i + len(ids)] == ids)
        assert targets[at : at + len(ids)] == mask
    assert len(stream) == sum(len(ChatTemplate(LLAMA3).render_conversation(m, ours)[0]) for m in SFT.values())


def test_sft_mask_from_generation_blocks_equals_transformers(tokenizers_):
    hf, ours = tokenizers_["chatml"]
    for msgs in SFT.values():
        out = hf.apply_chat_template(
            msgs,
            chat_template=CHATML_GENERATION,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        template = ChatTemplate(CHATML_GENERATION)
        assert template.has_generation_blocks
        ids, mask = template.render_conversation(msgs, ours)
        assert ids == list(out["input_ids"]) and [int(m) for m in mask] == list(out["assistant_masks"])
        assert sum(mask) > 0


def test_sft_needs_a_template_that_renders_prefixes_or_marks_generation(tokenizers_):
    _, ours = tokenizers_["chatml"]
    ends = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} END{% endif %}\n{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match=r"messages\[2\]: .* \{% generation %\}"):
        ChatTemplate(ends).render_conversation(SFT["system, two replies"], ours)


def test_the_default_is_llama2_and_templates_come_from_the_tokenizer():
    class Tok:
        chat_template = CHATML

    assert ChatTemplate().source == LLAMA2_CHAT_TEMPLATE == ChatTemplate.of(object()).source
    assert ChatTemplate.of(Tok()).source == CHATML


def test_environment_matches_transformers(hf_tokenizers):
    """tojson without HTML escaping, strftime_now, namespace, loop controls, tools and documents
    defined as none, extra variables passed through, special tokens as variables."""
    src = (
        "{{ messages | tojson }}|{{ tools is none }}|{{ documents is none }}"
        "|{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}|{{ bos_token }}{{ eos_token }}|{{ extra }}\n"
        "  {% if true %}\n    trimmed\n  {% endif %}\n"
    )
    hf = hf_tokenizers["llama3"]
    msgs = [{"role": "user", "content": '<b>é & "q"</b>', "name": None}, {"role": "user", "content": "x"}]
    want = hf.apply_chat_template(msgs, chat_template=src, tokenize=False, extra="E")
    assert ChatTemplate(src).render_text(msgs, special_tokens=hf.special_tokens_map, extra="E") == want


# ---- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source, msgs, match",
    [
        ("{% if %}", [{"role": "user", "content": "x"}], r"^chat template: line 1: Expected an expression"),
        ("a\n{% for m in messages %}\n{{ m.content }", [{"role": "user", "content": "x"}], "line 3"),
        (
            LLAMA2_CHAT_TEMPLATE,
            [{"role": "assistant", "content": "x"}],
            r"^chat template: Conversation roles must alternate user/assistant",
        ),
        ("{{ raise_exception('no\nsystem\nmessages') }}", [SYSTEM], r"^chat template: no system messages$"),
        ("{{ messages[0].content.upper(1, 2) }}", [SYSTEM], r"^chat template: TypeError: "),
        (
            "{{ messages.__class__.__mro__ }}",
            [SYSTEM],
            r"^chat template: .*__class__.*unsafe",
        ),
        ("{{ namespace(_x=1) }}", [SYSTEM], "underscore name '_x'"),
        (CHATML, [SYSTEM, {"content": "x"}], r'^messages\[1\]: has no "role"'),
        (CHATML, [SYSTEM, "hi"], r"^messages\[1\]: expected an object with a role, got str"),
        (CHATML, [], "the conversation is empty"),
    ],
)
def test_a_template_that_fails_is_one_line_naming_the_problem(source, msgs, match):
    with pytest.raises(ChatTemplateError, match=match) as e:
        ChatTemplate(source).render_text(msgs, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert "\n" not in str(e.value)


def test_check_compiles_the_source():
    assert ChatTemplate(CHATML).check() == ChatTemplate(CHATML)
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatTemplate("{{ x").check()


def test_model_file_metadata_old_dicts_keep_loading():
    old = {
        "name": "llama-2",
        "user": "[INST] {content} [/INST]",
        "assistant": " {content} ",
        "system": "<<SYS>>\n{content}\n<</SYS>>\n\n",
        "bos_each_turn": True,
    }
    assert (
        ChatTemplate.from_metadata(old) == ChatTemplate() == ChatTemplate.from_metadata({"name": "llama-2"})
    )
    assert ChatTemplate.from_metadata(CHATML) == ChatTemplate(CHATML)
    assert ChatTemplate.from_metadata(ChatTemplate(CHATML).to_metadata()).source == CHATML
    with pytest.raises(
        ChatTemplateError, match=r"metadata.chat_template.user: '\{content\}' is not the Llama 2"
    ):
        ChatTemplate.from_metadata({**old, "user": "{content}"})
    with pytest.raises(
        ChatTemplateError, match="metadata.chat_template: expected a Jinja template string, got int"
    ):
        ChatTemplate.from_metadata(7)
