"""The server against OpenAI's published API description, on one server of the bundled model.

Responses: every chat and completion response, streamed chunks included, in every decoding mode,
validates against the response schemas of OpenAI's OpenAPI description (`openai_api/`, cut from
it by `scripts/vendor_openai_schemas.py` at the commit it names; fields the schemas do not
list, such as `reasoning_content`, are allowed, as the schemas allow them).

Requests: any JSON body sent to `/v1/chat/completions` or `/v1/completions` is answered — 200
with a response, or a 4xx with an OpenAI error body — never a 5xx, and the engine is left with
nothing running. Bodies are drawn from the fields the endpoints read, each given a value of any
JSON type (or a plausible one), plus unknown fields and arbitrary JSON, so that most bodies are
refused at one field and some are valid and decode."""

from __future__ import annotations

import copy
import json
import os

import httpx
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

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


HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def schemas() -> dict:
    with open(os.path.join(HERE, "openai_api", "response_schemas.json")) as handle:
        return json.load(handle)


def validate(schemas: dict, name: str, instance: dict) -> None:
    components = copy.deepcopy(schemas["components"])
    # The description gives completion stream chunks the completion response's shape, whose
    # finish_reason is never null; OpenAI's own streams (and the `openai` SDK's types) send null in
    # every chunk but a choice's last. That one difference is allowed, nothing else.
    chunk = copy.deepcopy(components["schemas"]["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    components["schemas"]["CompletionStreamChunk"] = chunk
    # With echo, the prompt's first token has no log-probability (nothing precedes it): OpenAI's own
    # legacy completions and vLLM send null there, the description says "number". That one null is
    # allowed (token_logprobs[0], top_logprobs[0]); every other entry must be what the schema says.
    if name in ("CreateCompletionResponse", "CompletionStreamChunk") and instance.get("choices"):
        instance = copy.deepcopy(instance)
        for choice in instance["choices"]:
            logprobs = choice.get("logprobs")
            if logprobs and logprobs.get("token_logprobs") and logprobs["token_logprobs"][0] is None:
                logprobs["token_logprobs"][0] = 0.0
                logprobs["top_logprobs"][0] = {}
    document = {"$ref": f"#/components/schemas/{name}", "components": components}
    jsonschema.Draft202012Validator(document).validate(instance)


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-1]
    return [json.loads(line) for line in lines[:-1]]


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
    response = httpx.post(thread.url + path, content=json.dumps(body).encode(), timeout=600,
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
    assert httpx.post(thread.url + "/v1/chat/completions", json=body, timeout=600).status_code == 200


CONFORMANCE = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 3 1 2"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 9 4"}], "mode": "autoregressive",
                              "stop": ["9"], "seed": 3, "temperature": 0.7}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 5 0 5"}], "mode": "self_speculative",
                              "max_tokens": 2}),
    ("/v1/completions", {"prompt": ["sort 3 1", "sort 2 2 1"]}),
    ("/v1/completions", {"prompt": "sort 8 7", "mode": "autoregressive", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 2 1"}], "n": 2, "seed": 1,
                              "temperature": 0.5, "store": True, "metadata": {"k": "v"}}),
]
WITH_LOGPROBS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 3 1 2"}], "logprobs": True,
                              "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 3 1 2"}], "logprobs": True,
                              "mode": "autoregressive", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort 6 2"}], "logprobs": True,
                              "top_logprobs": 1, "mode": "self_speculative", "n": 2, "stop": ["6"]}),
    ("/v1/completions", {"prompt": ["sort 8 7", "sort 1"], "logprobs": 2, "echo": True, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "sort 5 3 4", "logprobs": 0, "mode": "autoregressive", "stop": ["4"]}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, change", CONFORMANCE)
def test_responses_and_stream_chunks_validate_against_openais_schemas(server, schemas, path, change, stream):
    thread, _ = server
    body = {"model": "tiny-clover", "max_tokens": 12, **change, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(thread.url + path, json=body, timeout=600)
    assert response.status_code == 200, response.text
    chat = path == "/v1/chat/completions"
    if not stream:
        validate(schemas, "CreateChatCompletionResponse" if chat else "CreateCompletionResponse", response.json())
        return
    chunks = _events(response)
    for chunk in chunks:
        validate(schemas, "CreateChatCompletionStreamResponse" if chat else "CompletionStreamChunk", chunk)
    assert chunks[-1]["usage"]["total_tokens"] > 0


def _figures(choice: dict, chat: bool) -> list:
    """A choice's log-probabilities as one list of per-token rows."""
    if choice["logprobs"] is None:
        return []
    if chat:
        return choice["logprobs"]["content"]
    columns = [choice["logprobs"][key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")]
    return [list(row) for row in zip(*columns, strict=True)]


def _split(figures) -> tuple:
    """(the figures with every float as 0.0, the floats in order): compared apart, the floats to 1e-6."""
    if isinstance(figures, float):
        return 0.0, [figures]
    if isinstance(figures, dict):
        parts = {key: _split(value) for key, value in figures.items()}
        return {key: part[0] for key, part in parts.items()}, [x for part in parts.values() for x in part[1]]
    if isinstance(figures, list):
        parts = [_split(value) for value in figures]
        return [part[0] for part in parts], [x for part in parts for x in part[1]]
    return figures, []


@pytest.mark.parametrize("path, change", WITH_LOGPROBS)
def test_responses_with_logprobs_validate_against_openais_schemas(server, schemas, path, change):
    """Whole and streamed: every body and chunk validates, and each choice's chunks' figures put
    together are its whole response's (greedy: the same tokens; the same figures, to the float
    rounding between causal scoring passes of different padded lengths)."""
    thread, _ = server
    body = {"model": "tiny-clover", "max_tokens": 12, **change}
    response = httpx.post(thread.url + path, json=body, timeout=600)
    assert response.status_code == 200, response.text
    chat = path == "/v1/chat/completions"
    whole = response.json()
    validate(schemas, "CreateChatCompletionResponse" if chat else "CreateCompletionResponse", whole)
    assert all(choice["logprobs"] for choice in whole["choices"])
    stream = httpx.post(thread.url + path, json={**body, "stream": True}, timeout=600)
    assert stream.status_code == 200, stream.text
    streamed = {index: [] for index in range(len(whole["choices"]))}
    for chunk in _events(stream):
        validate(schemas, "CreateChatCompletionStreamResponse" if chat else "CompletionStreamChunk", chunk)
        for choice in chunk["choices"]:
            streamed[choice["index"]] += _figures(choice, chat)
    for choice in whole["choices"]:
        (shape, values), (expected_shape, expected) = _split(streamed[choice["index"]]), _split(_figures(choice, chat))
        assert shape == expected_shape and len(shape) > 0
        np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-6)


def test_a_response_without_refusal_is_refused_by_the_schema(schemas):
    """The check can fail: OpenAI's schema requires `message.refusal`, which the server once omitted."""
    thread_free = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop", "logprobs": None, "message": {"role": "assistant", "content": "1"}}]}
    with pytest.raises(jsonschema.ValidationError, match="'refusal' is a required property"):
        validate(schemas, "CreateChatCompletionResponse", thread_free)


def test_usage_is_the_rendered_prompt_plus_the_generated_tokens(server):
    """prompt_tokens: the tokens of the prompt as rendered by the chat template (or of each prompt of
    a completion); completion_tokens: those `generate` returns for it; total: their sum."""
    from decoding import generate

    thread, service = server
    messages = [{"role": "system", "content": "sort"}, {"role": "user", "content": "sort 4 2 9"}]
    ids = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    [tokens] = generate(service.model, [ids], max_new_tokens=12).sequences
    chat = httpx.post(thread.url + "/v1/chat/completions", timeout=600,
                      json={"model": "tiny-clover", "max_tokens": 12, "messages": messages}).json()
    # prompt_tokens_details: what the prefix cache held of the prompt (test_server.py checks the figure)
    assert chat.pop("usage") | {"prompt_tokens_details": None} == {
        "prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens),
        "prompt_tokens_details": None}
    prompts = ["sort 3 1", "sort 7 7 0"]
    encoded = [service.tokenizer.encode(prompt) for prompt in prompts]
    outputs = generate(service.model, encoded, max_new_tokens=6).sequences
    completion = httpx.post(thread.url + "/v1/completions", timeout=600,
                            json={"model": "tiny-clover", "max_tokens": 6, "prompt": prompts}).json()
    prompt_tokens, completion_tokens = sum(map(len, encoded)), sum(map(len, outputs))
    assert completion["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None}
