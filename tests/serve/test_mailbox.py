"""Outputs in batches: the engine thread wakes the event loop once per step (every item, in order),
and a stream writes the events it has ready in one body message."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmkit.serve.serving import _Mailbox


def test_a_burst_of_outputs_wakes_the_loop_once_and_arrives_in_order():
    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        box = _Mailbox(loop)
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            nonlocal wakeups
            wakeups += 1
            return real(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        a: asyncio.Queue = asyncio.Queue()
        b: asyncio.Queue = asyncio.Queue()

        def engine_step() -> None:  # 64 outputs of one step, while the loop is busy
            for i in range(32):
                box.post(a, i)
                box.post(b, -i)

        t = threading.Thread(target=engine_step)
        t.start()
        t.join()  # the loop is blocked here: nothing delivered yet
        assert a.empty() and b.empty()
        got_a = [await a.get() for _ in range(32)]
        got_b = [await b.get() for _ in range(32)]
        box.post(a, "later")  # after a delivery, the next post schedules another
        assert await a.get() == "later"
        return got_a, got_b, wakeups

    got_a, got_b, wakeups = asyncio.run(main())
    assert got_a == list(range(32)) and got_b == [-i for i in range(32)]
    assert wakeups == 2


class _FakeRunner:
    """Just enough of an EngineThread for Serving: submit records the callbacks."""

    alive = True

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.callbacks: list = []
        self.aborted: list[str] = []
        self.engine = SimpleNamespace(
            tokenizer=SimpleNamespace(token_text=str),
            model_name="m",
            max_model_len=64,
            spec=SimpleNamespace(vocab_size=100),
            encode=lambda prompt: [int(t) for t in prompt],  # token-id prompts, as given
            generation_defaults={},
            stats=lambda: {"waiting": 0},
        )

    def submit(self, prompt, params, callback, seed=None) -> str:
        self.callbacks.append(callback)
        return f"r{len(self.callbacks)}"

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def _output(i: int, text: str, finished: bool = False):
    from llmkit.infer import RequestOutput

    reason = "length" if finished else None
    return RequestOutput("r1", [i], text, None, finished, reason, 3, i + 1, 0)


def test_stream_events_that_are_ready_together_go_out_in_one_write():
    """A stream sends one body message per batch of ready events: tokens queued while the loop was
    busy, and the last token (with its finish_reason) with the usage chunk and [DONE]."""
    import json

    from llmkit.serve.protocol import CompletionRequest
    from llmkit.serve.serving import Serving

    async def main() -> list[str]:
        runner = _FakeRunner()
        serving = Serving(runner)  # type: ignore[arg-type]
        req = CompletionRequest(
            model="m", prompt=[1, 2, 3], max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        gen = await serving.completions(req, disconnected=None)  # type: ignore[arg-type]
        (post,) = runner.callbacks
        post(_output(0, "a"))
        post(_output(1, "b"))  # two tokens ready before the stream first runs
        writes = [await gen.__anext__()]
        post(_output(2, "c"))
        writes.append(await gen.__anext__())
        post(_output(3, "d", finished=True))
        writes.append(await gen.__anext__())
        assert [w async for w in gen] == []
        return writes

    writes = asyncio.run(main())
    events = [[e for e in w.split("\n\n") if e] for w in writes]
    assert [len(e) for e in events] == [2, 1, 3]  # a+b | c | d with its finish_reason, usage, [DONE]
    chunks = [json.loads(e[6:]) for w in events for e in w if e != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "abcd"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and events[-1][-1] == "data: [DONE]"


_TEXTS = ["", "a", " word", 'quote " and \\ back', "line\nbreak\ttab", "é ü 中文 🙂", "\x00\x01 nul", "</s>"]


def test_token_events_from_templates_are_the_whole_events_bytes():
    """A token's event is its choice's template around the JSON of its text: byte for byte what
    serializing the whole event gives, for any text (escapes, non-ASCII, a NUL like the template's
    hole), any choice index, with and without the usage field, and when the head holds the hole."""
    import json

    from llmkit.serve.serving import _Events

    for rid in ["cmpl-1", "cmpl-\x00"]:  # the second cannot be templated (falls back, same bytes)
        head = {"id": rid, "object": "text_completion", "created": 5, "model": "m"}

        def event(i: int, text: str) -> dict:
            return {**head, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}

        for extra in ({}, {"usage": None}):
            ev = _Events(event, extra)
            for i in (0, 3):
                for text in _TEXTS:
                    got = ev.token(i, text)
                    whole = {**event(i, text), **extra}
                    assert got == f"data: {json.dumps(whole, separators=(',', ':'))}\n\n"
                    assert json.loads(got[6:]) == whole and got.endswith("}\n\n")


def _logprobs_reference(tokens, text_of, offset):
    """OpenAI's legacy completions logprobs, one dict per token (the shape the server answers)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in tokens:
        text = text_of(c.token_id)
        top = None
        if c.logprob is not None:
            top = {}
            for t, lp in c.top:  # most likely first: a text two tokens share keeps the likelier
                top.setdefault(text_of(t), lp)
            top.setdefault(text, c.logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(c.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_completion_logprobs_json_is_the_dict_per_token_answer(k):
    """The echo body's logprobs, written from the score program's arrays and the generated
    TokenChoices, parse to the per-token dicts: texts two ids share (the likelier kept), the chosen
    token in its top, offsets, numbers to the last bit, a prompt's first token null, -inf."""
    import json

    import numpy as np

    from llmkit.infer.sampling import PromptLogprobs, TokenChoice
    from llmkit.serve.protocol import TokenJSON, completion_logprobs_json

    rng = np.random.default_rng(k)
    words = ["a", " b", "é", '"q"', "\\", "\n", "😀", ""]
    text_of = lambda t: words[t % len(words)]  # ids 0 and 8 share a text
    n, g = 40, 3
    ids = rng.integers(0, 16, n).tolist()
    lps = rng.normal(-5, 3, n - 1)
    top_ids = rng.integers(0, 16, (n - 1, k))
    top_lps = -np.sort(-rng.normal(-3, 2, (n - 1, k)), axis=1)
    if k:
        top_ids[::7, 0] = ids[1::7]  # sometimes the chosen token is the most likely ...
        top_ids[::5, 0] = ids[1::5]  # ... and, as the score program gives it, with its own logprob
        top_lps[::5, 0] = lps[::5]
    gen = [
        TokenChoice(int(t), float(v), [(int(a), float(b)) for a, b in zip(ti, tv)])
        for t, v, ti, tv in zip(rng.integers(0, 16, g), rng.normal(-2, 1, g), top_ids[:g], top_lps[:g])
    ]
    if k:
        gen[-1].top[-1] = (gen[-1].top[-1][0], -np.inf)
    prompt = PromptLogprobs(ids, lps, top_ids, top_lps)
    got = json.loads(completion_logprobs_json(TokenJSON(text_of), gen, prompt, offset=0))
    want = _logprobs_reference([TokenChoice(ids[0]), *prompt[1:], *gen], text_of, 0)
    assert got == want
    got = json.loads(completion_logprobs_json(TokenJSON(text_of), gen, offset=7))
    assert got == _logprobs_reference(gen, text_of, 7)
