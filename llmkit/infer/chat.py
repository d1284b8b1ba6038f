"""Chat templates: a list of messages -> prompt token ids, from data stored in the static model file.

A template is a small dict (no code, no Jinja), so a model file can carry it and the server needs
nothing else. The default is Llama 2's format::

    <s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST]

where ``<s>``/``</s>`` are the bos/eos *token ids* (never text a user could type), the system
message goes into the first user turn, and the prompt ends after the last ``[/INST]`` so the model
writes the assistant's reply. Fields of a template:

``user``       text of a user turn, ``{content}`` replaced (default ``"[INST] {content} [/INST]"``)
``assistant``  text of an earlier assistant turn (default ``" {content} "``), followed by eos
``system``     prefix for the first user message (default ``"<<SYS>>\\n{content}\\n<</SYS>>\\n\\n"``)
``bos_each_turn``  a bos token opens every user turn (default true)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


class ChatTemplateError(ValueError):
    """Messages the template cannot render (the message names the offending message)."""


@dataclass(frozen=True)
class ChatTemplate:
    name: str = "llama-2"
    user: str = "[INST] {content} [/INST]"
    assistant: str = " {content} "
    system: str = "<<SYS>>\n{content}\n<</SYS>>\n\n"
    bos_each_turn: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ChatTemplate:
        return cls(**{k: v for k, v in (d or {}).items() if k in cls.__dataclass_fields__})

    def render(self, messages: Sequence[Mapping[str, str]], tokenizer: Any) -> list[int]:
        """Prompt ids for ``messages`` ({"role", "content"}; roles system/developer, user, assistant).

        After an optional leading system message, turns alternate user / assistant and end with a
        user turn (the model writes the next assistant turn).
        """
        return [t for ids, _ in self._pieces(messages, tokenizer, "user") for t in ids]

    def render_conversation(
        self, messages: Sequence[Mapping[str, str]], tokenizer: Any
    ) -> tuple[list[int], list[bool]]:
        """Ids of a whole conversation ending with an assistant turn, and for each id whether it is
        the assistant's (its reply's tokens and the eos after it): what supervised fine-tuning
        trains on. Rendered exactly as :meth:`render` renders the earlier turns of a prompt."""
        ids: list[int] = []
        mask: list[bool] = []
        for piece, assistant in self._pieces(messages, tokenizer, "assistant"):
            ids += piece
            mask += [assistant] * len(piece)
        return ids, mask

    def _pieces(
        self, messages: Sequence[Mapping[str, str]], tokenizer: Any, last: str
    ) -> list[tuple[list[int], bool]]:
        """The rendering as (ids, written by the assistant) pieces; the last message's role must be
        ``last``."""
        msgs = list(messages)
        system = None
        if msgs and msgs[0]["role"] in ("system", "developer"):
            system = msgs.pop(0)["content"]
        if not msgs:
            raise ChatTemplateError("messages: need at least one user message")
        for i, m in enumerate(msgs):
            want = "user" if i % 2 == 0 else "assistant"
            if m["role"] != want:
                raise ChatTemplateError(
                    f"messages[{i + (system is not None)}]: expected "
                    f"{'an' if want == 'assistant' else 'a'} {want} message (after an optional system "
                    f"message, user and assistant turns alternate), got role {m['role']!r}"
                )
        if msgs[-1]["role"] != last:
            raise ChatTemplateError(f"messages: the last message must be from the {last}")
        pieces: list[tuple[list[int], bool]] = []
        for i in range(0, len(msgs), 2):
            user = msgs[i]["content"]
            if i == 0 and system is not None:
                user = self.system.format(content=system) + user
            bos = [tokenizer.bos_id] if self.bos_each_turn or i == 0 else []
            pieces.append((bos + tokenizer.encode(self.user.format(content=user), add_bos=False), False))
            if i + 1 < len(msgs):
                reply = tokenizer.encode(self.assistant.format(content=msgs[i + 1]["content"]), add_bos=False)
                pieces.append((reply + [tokenizer.eos_id], True))
        return pieces
