"""Fuzz /v1/chat/completions (the completions fuzz lives in test_errors.py): never a 5xx, always a message."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "k3-tiny"

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                     st.text(max_size=12))
_content = st.one_of(_scalars, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                               "text": _scalars}), max_size=2))
_message = st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]),
                           st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "wizard"]), _content),
                           max_size=4)
_body = st.dictionaries(
    st.sampled_from(["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                     "stop", "stream", "stream_options", "n", "tools", "logprobs", "top_logprobs", "extra"]),
    st.one_of(_scalars, st.just(MODEL), st.lists(_message, max_size=3), st.just({"include_usage": True})),
    max_size=8)


@pytest.fixture(scope="module")
def chat_server(tiny_engine, make_server):
    s = make_server(tiny_engine, max_prompt_tokens=64, max_tokens_limit=3)  # valid requests stay tiny
    yield s
    assert httpx.get(f"{s.url}/health").status_code == 200
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    s.wait_idle()
    s.close()


@given(_body)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_chat_never_5xx(chat_server, body):
    body.setdefault("model", MODEL)
    # json.dumps writes NaN/Infinity literals, as a careless client would
    r = httpx.post(f"{chat_server.url}/v1/chat/completions", content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"], (body, r.text)
