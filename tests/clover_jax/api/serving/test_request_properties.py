"""Generated request bodies against a running server: any JSON body sent to `/v1/chat/completions`
or `/v1/completions` is answered — 200 with a response, or a 4xx with an OpenAI error body — never
a 5xx, and the engine is left with nothing running. Bodies are drawn from the fields the endpoints
read, each given a value of any JSON type (or a plausible one), plus unknown fields and arbitrary
JSON, so that most bodies are refused at one field and some are valid and decode."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import clover_jax
from tests.clover_jax.api.serving.conftest import start

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats()
                    | st.text(max_size=6), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
SORT = st.lists(st.integers(0, 9), min_size=1, max_size=5).map(lambda digits: "sort " + " ".join(map(str, digits)))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | JSON},
                                optional={"content": SORT | JSON, "name": JSON, "tool_calls": JSON,
                                          "tool_call_id": JSON, "reasoning_content": JSON})
PLAUSIBLE = {
    "model": st.just("tiny-clover") | JSON,
    "max_tokens": st.integers(1, 12) | JSON, "max_completion_tokens": st.integers(1, 12) | JSON,
    "temperature": st.floats(0, 2) | JSON, "top_p": st.floats(0, 1) | JSON, "top_k": st.integers(-1, 8) | JSON,
    "seed": st.integers(0, 2**31) | JSON, "stop": st.lists(st.text(max_size=3), max_size=2) | JSON,
    "stream": st.booleans() | JSON, "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "mode": st.sampled_from(["diffusion", "autoregressive", "self_speculative"]) | JSON,
    "threshold": st.floats(0, 1) | JSON, "block_size": st.sampled_from([4, 8, 16]) | JSON,
    "schedule": st.sampled_from(["threshold", "fixed_k"]) | JSON, "schedule_params": JSON,
    "presence_penalty": st.floats(-2, 2) | JSON, "frequency_penalty": JSON, "repetition_penalty": JSON,
    "tools": JSON, "tool_choice": st.sampled_from(["auto", "none"]) | JSON, "n": st.just(1) | JSON,
    "user": JSON, "logprobs": JSON, "echo": JSON, "suffix": JSON,
}
# model and max_tokens are always sent (mostly valid, so that the other fields are what is tested);
# "max_completion_tokens" and the fields below may replace them with anything.
OPTIONAL = {key: value for key, value in PLAUSIBLE.items() if key not in ("model", "max_tokens")}
CHAT = st.fixed_dictionaries({"model": st.just("tiny-clover"), "messages": st.lists(MESSAGE, max_size=3) | JSON,
                              "max_tokens": st.integers(1, 12)},
                             optional={**OPTIONAL, "unknown_field": JSON})
COMPLETION = st.fixed_dictionaries({"model": st.just("tiny-clover"), "max_tokens": st.integers(1, 12),
                                    "prompt": SORT | st.lists(SORT, max_size=3) | st.lists(st.integers(-2, 200),
                                                                                          max_size=6) | JSON},
                                   optional={**OPTIONAL, "unknown_field": JSON})
BODY = st.one_of(st.tuples(st.just("/v1/chat/completions"), CHAT), st.tuples(st.just("/v1/completions"), COMPLETION),
                 st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), JSON))


@pytest.fixture(scope="module")
def server():
    server, service = start(clover_jax.bundled_model_path(), "tiny-clover", max_running=4)
    with server:
        yield server, service
    service.engine.close()


@SETTINGS
@given(request=BODY)
def test_any_json_body_gets_a_response_or_an_openai_error_never_a_server_error(server, request):
    thread, _ = server
    path, body = request
    # json.dumps writes NaN and Infinity as JavaScript does, which some clients send too
    response = httpx.post(thread.url + path, content=json.dumps(body).encode(), timeout=120,
                          headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    event(f"status {response.status_code}")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif not response.headers["content-type"].startswith("text/event-stream"):
        assert response.json()["choices"], response.text


def test_the_engine_is_left_idle_and_serving(server):
    """After the generated bodies above (this test runs after them, in file order)."""
    thread, _ = server
    assert httpx.get(thread.url + "/health").json()["running"] == 0
    body = {"model": "tiny-clover", "max_tokens": 8, "messages": [{"role": "user", "content": "sort 3 1"}]}
    assert httpx.post(thread.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
