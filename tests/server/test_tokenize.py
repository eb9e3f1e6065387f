"""``/tokenize`` and ``/detokenize`` on a real server: the ids a completion would be given, a round
trip back to the text, and a 400 naming the field for each bad body."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def c(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with shared_server.client() as client:
        yield client


def _ok(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_chat_messages_count_as_the_chat_completion_counts_them(c: httpx.Client) -> None:
    out = _ok(c, "/tokenize", {"model": "default", "messages": MESSAGES, "return_token_strs": True})
    chat = _ok(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert out["count"] == len(out["tokens"]) == chat["usage"]["prompt_tokens"]
    assert out["max_model_len"] == c.get("/get_model_info").json()["context_length"]
    assert len(out["token_strs"]) == out["count"] and all(isinstance(s, str) for s in out["token_strs"])
    no_opener = _ok(c, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert out["tokens"][: no_opener["count"]] == no_opener["tokens"] and no_opener["count"] < out["count"]


def test_a_prompt_round_trips_and_counts_as_a_completion_does(c: httpx.Client) -> None:
    text = "The quick brown fox, 42 times: déjà vu!"
    out = _ok(c, "/tokenize", {"prompt": text})
    assert out["token_strs"] is None
    comp = _ok(c, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
    assert out["count"] == comp["usage"]["prompt_tokens"]
    assert _ok(c, "/detokenize", {"tokens": out["tokens"]})["prompt"] == text
    # the ids a completion takes as its prompt give the same answer as the text
    by_ids = _ok(c, "/v1/completions", {"prompt": out["tokens"], "max_tokens": 4, "temperature": 0})
    by_text = _ok(c, "/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0})
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt", "invalid_request"),
        ("/tokenize", {}, "prompt", "invalid_request"),
        ("/tokenize", {"prompt": 5}, "prompt", "invalid_value"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "invalid_request"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message", "unsupported"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools", "unsupported"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs", "invalid_value"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus", "unknown_parameter"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens", "invalid_value"),
        ("/detokenize", {"tokens": [10**9]}, "tokens", "invalid_value"),
        ("/detokenize", {"tokens": "hi"}, "tokens", "invalid_value"),
        ("/detokenize", {}, "tokens", "missing_required_parameter"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(c: httpx.Client, path: str, body: dict[str, Any], param: str,
                                               code: str) -> None:
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err


def test_an_unknown_model_is_a_404(c: httpx.Client) -> None:
    r = c.post("/tokenize", json={"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
