"""The chat template a static model file carries, as the server uses it: prompt ids equal to
transformers' ``apply_chat_template``, a template that fails is a 400 naming the problem (never a
500) and the server stays healthy, older files with the dict form still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from llmkit.infer import Engine, EngineConfig
from llmkit.infer.chat import LLAMA2_CHAT_TEMPLATE, ChatTemplate

from .conftest import API_KEY, start_server

CONFIG = EngineConfig(max_batch=1, compiler="none")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


def with_template(model_file: Path, out: Path, template: object) -> Path:
    path = Path(shutil.copytree(model_file, out))
    m = json.loads((path / "manifest.json").read_text())
    m["metadata"]["chat_template"] = template
    (path / "manifest.json").write_text(json.dumps(m))
    return path


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, headers=server.headers(), json=body, timeout=60)


@pytest.fixture(scope="module")
def broken(model_file, tmp_path_factory):
    """A server whose model file's template does not compile (a Jinja syntax error on line 2)."""
    d = tmp_path_factory.mktemp("broken")
    path = with_template(model_file, d / "m.llmkit", "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    s = start_server(path, d / "server.log", api_key=API_KEY)
    yield s
    assert s.stop() == 0, s.log.read_text()


def test_chat_prompt_ids_equal_apply_chat_template(server, trained):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(trained[1])  # the model directory
    want = hf.apply_chat_template(
        MESSAGES,
        chat_template=LLAMA2_CHAT_TEMPLATE,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=True,
    )["input_ids"]
    r = post(server, "/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_raise_exception_in_the_template_is_a_400(server):
    body = {"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2}
    r = post(server, "/chat/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages"
    assert (
        err["message"] == "chat template: Conversation roles must alternate user/assistant/user/assistant/..."
    )
    ok = post(server, "/chat/completions", {**body, "messages": MESSAGES})
    assert ok.status_code == 200


def test_a_template_that_does_not_compile_is_a_400_and_the_server_stays_healthy(broken):
    for _ in range(2):
        r = post(broken, "/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["message"].startswith("chat template: line 2: ")
        assert "\n" not in err["message"]
    r = post(broken, "/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    health = httpx.get(broken.url + "/health", headers=broken.headers())
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_an_older_file_with_the_dict_template_loads_as_llama2(model_file, tmp_path):
    old = {
        "name": "llama-2",
        "user": "[INST] {content} [/INST]",
        "assistant": " {content} ",
        "system": "<<SYS>>\n{content}\n<</SYS>>\n\n",
        "bos_each_turn": True,
    }
    engine = Engine.from_static(with_template(model_file, tmp_path / "old.llmkit", old), CONFIG)
    assert engine.chat_template == ChatTemplate()
    ids = engine.chat_template.render(MESSAGES, engine.tokenizer)
    tok = engine.tokenizer
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode(
        "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nSay hi. [/INST]", add_bos=False
    )
