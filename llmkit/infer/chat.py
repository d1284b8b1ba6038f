"""Chat templates: a list of messages -> prompt token ids, with the model's Jinja ``chat_template``.

A template is the Jinja source the ecosystem ships (``tokenizer_config.json``'s ``chat_template``
or transformers 5's ``chat_template.jinja``), rendered exactly as transformers'
``apply_chat_template`` renders it: a sandboxed ``jinja2`` environment with ``trim_blocks`` and
``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter that
does not escape HTML, ``{% generation %}`` blocks, and the variables ``messages``,
``add_generation_prompt``, ``tools``, ``documents`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``). The text is then tokenized as
transformers' ``tokenize=True`` path does: special tokens written in it become their ids, and no
bos is added (a template writes ``bos_token`` itself).

A model without a template gets :data:`LLAMA2_CHAT_TEMPLATE`, the one Meta's Llama 2 chat
tokenizer ships. The static model file stores the source string (``metadata.chat_template``);
files from older llmkit versions stored a small dict for that same Llama 2 format, which
:meth:`ChatTemplate.from_metadata` still reads.

Supervised fine-tuning trains on the assistant's tokens only: :meth:`ChatTemplate.render_conversation`
takes them from the template's ``{% generation %}`` blocks when it has them, else from the
difference between the conversation rendered up to each assistant message with and without it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json "chat_template": an optional system message
# folded into the first user turn; <s>[INST] user [/INST] assistant </s> per turn.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# The dict older llmkit files hold for the Llama 2 format above (its fields and their only values).
_LEGACY_LLAMA2 = {
    "name": "llama-2",
    "user": "[INST] {content} [/INST]",
    "assistant": " {content} ",
    "system": "<<SYS>>\n{content}\n<</SYS>>\n\n",
    "bos_each_turn": True,
}
_SPECIAL_TOKENS = ("bos", "eos", "unk", "pad")  # the <name>_token variables a template sees
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that does not compile (one line)."""


@dataclass(frozen=True)
class ChatTemplate:
    """One Jinja chat template (``source``); see the module docstring."""

    source: str = LLAMA2_CHAT_TEMPLATE

    @classmethod
    def of(cls, tokenizer: Any) -> ChatTemplate:
        """The tokenizer's ``chat_template``, or the Llama 2 default when it has none."""
        source = getattr(tokenizer, "chat_template", None)
        return cls(source) if source else cls()

    @classmethod
    def from_metadata(cls, value: Any, where: str = "metadata.chat_template") -> ChatTemplate:
        """The template a static model file stores: a Jinja string, or an older file's dict."""
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping) and all(_LEGACY_LLAMA2.get(k, v) == v for k, v in value.items()):
            return cls()  # an older file: its dict spelled out the Llama 2 format, now the default
        if isinstance(value, Mapping):
            bad = next(k for k, v in value.items() if _LEGACY_LLAMA2.get(k, v) != v)
            raise ChatTemplateError(
                f"{where}.{bad}: {value[bad]!r} is not the Llama 2 format, the only one an older llmkit "
                "wrote as a dict; re-export the model from a directory whose tokenizer_config.json has a "
                "Jinja chat_template"
            )
        raise ChatTemplateError(f"{where}: expected a Jinja template string, got {type(value).__name__}")

    def to_metadata(self) -> str:
        return self.source

    def check(self) -> ChatTemplate:
        """``self``, once its source compiles (else :class:`ChatTemplateError` naming the line)."""
        _compile(self.source)
        return self

    @property
    def has_generation_blocks(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}`` blocks."""
        return bool(_GENERATION_TAG.search(self.source))

    # ---- rendering --------------------------------------------------------------------------------
    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The template's text for ``messages`` (as ``apply_chat_template(..., tokenize=False)``).

        ``special_tokens`` maps variable names (``bos_token``, ...) to the tokens' strings;
        ``variables`` are passed to the template as well and override them.
        """
        if not messages:
            raise ChatTemplateError("messages: the conversation is empty; give at least one message")
        return self._render(messages, add_generation_prompt, special_tokens, tools, documents, variables)[0]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        *,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> list[int]:
        """Prompt ids for ``messages``: the rendered text tokenized with special tokens parsed and no
        bos added (``apply_chat_template(..., tokenize=True)``). By default it ends with the
        template's generation prompt, so the model writes the next assistant message."""
        text = self.render_text(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=special_tokens(tokenizer),
            **variables,
        )
        return tokenizer.encode(text, add_bos=False)

    def render_conversation(
        self, messages: Sequence[Mapping[str, Any]], tokenizer: Any, **variables: Any
    ) -> tuple[list[int], list[bool]]:
        """Ids of a whole conversation (no generation prompt), and for each id whether the assistant
        wrote it: what supervised fine-tuning trains on.

        The assistant's text is what the template's ``{% generation %}`` blocks render, or, for a
        template without them, for each assistant message the text the conversation gains between
        being rendered up to it with a generation prompt and rendered including it (for Llama 2:
        ``" reply </s>"``). A token is the assistant's when it lies in that text; where a token
        straddles a boundary, tokenizing the text up to the boundary decides.
        """
        if not messages:
            raise ChatTemplateError("messages: the conversation is empty; give at least one message")
        msgs = _checked(messages)
        specials = special_tokens(tokenizer)
        text, spans = self._render(msgs, False, specials, None, None, variables, track=True)
        if not self.has_generation_blocks:
            spans = []
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                before = self._render(msgs[:i], True, specials, None, None, variables)[0]
                upto = self._render(msgs[: i + 1], False, specials, None, None, variables)[0]
                if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
                    raise ChatTemplateError(
                        f"messages[{i}]: the chat template does not render the conversation up to this "
                        "assistant message as the start of the whole one, so its tokens cannot be told "
                        "apart; mark the assistant's text with {% generation %} ... {% endgeneration %}"
                    )
                spans.append((len(before), len(upto)))
        ids = tokenizer.encode(text, add_bos=False)
        mask = [False] * len(ids)
        for start, end in spans:
            for k in range(_token_at(text, start, ids, tokenizer), _token_at(text, end, ids, tokenizer)):
                mask[k] = True
        return ids, mask

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        specials: Mapping[str, str] | None,
        tools: Any,
        documents: Any,
        variables: Mapping[str, Any],
        track: bool = False,
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, the character spans of its ``{% generation %}`` blocks when ``track``)."""
        from . import jinja_env

        template = _compile(self.source)
        context = {
            "messages": _checked(messages),
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": add_generation_prompt,
            **dict(specials or {}),
            **_plain(dict(variables)),
        }
        try:
            if not track:
                return template.render(**context), []
            blocks: list[str] = []
            with jinja_env.tracking(blocks) as spans:
                for block in template.generate(**context):
                    blocks.append(block)
            return "".join(blocks), spans
        except jinja_env.jinja2.TemplateError as e:  # raise_exception, undefined names, sandbox violations
            raise ChatTemplateError(_one_line(f"chat template: {e.message or type(e).__name__}")) from None
        except Exception as e:  # a template is code from the model author: any error in it is its error
            raise ChatTemplateError(_one_line(f"chat template: {type(e).__name__}: {e}")) from None


def special_tokens(tokenizer: Any) -> dict[str, str]:
    """The special-token variables transformers gives a template (its ``special_tokens_map``):
    ``bos_token``, ``eos_token``, ``unk_token`` and ``pad_token``, those the tokenizer has."""
    out = {}
    for name in _SPECIAL_TOKENS:
        token = getattr(tokenizer, f"{name}_token", None)
        if token is None:
            token_id = getattr(tokenizer, f"{name}_id", None)
            if token_id is not None and token_id >= 0:
                token = tokenizer.id_to_piece(token_id)
        if token is not None:
            out[f"{name}_token"] = token
    return out


def _token_at(text: str, pos: int, ids: list[int], tokenizer: Any) -> int:
    """The index of the first token of ``ids`` (the tokens of ``text``) not in ``text[:pos]``: how
    many of them tokenizing ``text[:pos]`` alone reproduces."""
    if pos >= len(text):
        return len(ids)
    head = tokenizer.encode(text[:pos], add_bos=False) if pos > 0 else []
    n = 0
    for a, b in zip(head, ids, strict=False):
        if a != b:
            break
        n += 1
    return n


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as plain dicts without None values (transformers drops them: templates test for
    missing keys), each with a string role."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages: expected a list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}]: expected an object with a role, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f'messages[{i}]: has no "role" (a string such as "user")')
        out.append({k: _plain(v) for k, v in m.items() if v is not None})
    return out


def _plain(value: Any) -> Any:
    """JSON-like data rebuilt from plain types, so the sandbox sees no objects with methods of their own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for base in (bool, str, int, float):  # subclasses (enums, ...) carry methods: keep the base value
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if callable(getattr(value, "item", None)):  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _compile(source: str) -> Any:
    """The compiled template (jinja2 loads with the first one: a server answering completions never
    renders one)."""
    from . import jinja_env

    try:
        return jinja_env.compile_template(source)
    except jinja_env.jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(_one_line(f"chat template: line {e.lineno}: {e.message}")) from None
