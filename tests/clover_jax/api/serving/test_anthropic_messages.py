"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the real `anthropic`
client, on the real-vocabulary test model (its answers end after a few tokens; its tool-call tags are
single tokens): whole and streamed messages (the same blocks for greedy decoding), thinking, a forced
tool call whose input validates against its schema and the tool_result that answers it, count_tokens
against usage, the API key in `x-api-key`, and every error in Anthropic's shape. The translation of
requests and of deltas into blocks is checked without a server too."""

from __future__ import annotations

import json
import types
import uuid

import anthropic
import httpx
import jsonschema
import pytest

from clover_jax.api.serving.anthropic_messages import ContentBlocks, _stop
from clover_jax.api.serving.anthropic_protocol import ERROR_PREFIX, read_messages
from clover_jax.api.serving.text import StopStrings
from tests.clover_jax.api.serving.conftest import start

QWEN, KEY = "qwen-vocab", "anthropic-test-key"
MAX_BODY = 1 << 16
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer types temperature; Claude Code still sends it
# one short parameter: a forced call is about 20 tokens, two blocks of denoising steps
WEATHER = {"name": "get_weather", "description": "The weather in a city", "cache_control": {"type": "ephemeral"},
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
FORCED = {"model": QWEN, "max_tokens": 32, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
          "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
RAW = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
       "message_stop", "ping")


@pytest.fixture(scope="module")
def server(qwen_vocab_checkpoint):
    server, service = start(qwen_vocab_checkpoint, QWEN, max_running=2, api_key=KEY, max_body_bytes=MAX_BODY)
    with server:
        yield server
    service.engine.close()


def client(server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def post(server, body, path: str = "/v1/messages", headers=None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": KEY} if headers is None else headers,
                      timeout=120)


def check_order(kinds: list[str]) -> None:
    """message_start, then blocks (start, deltas, stop), then message_delta and message_stop."""
    kinds = [kind for kind in kinds if kind != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_block = False
    for kind in kinds[1:-2]:
        if kind == "content_block_start":
            assert not open_block
        else:
            assert open_block and kind in ("content_block_delta", "content_block_stop")
        open_block = kind != "content_block_stop"
    assert not open_block


def prompt_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


# ---------------------------------------------------------------------- through the client
def test_message_parses_as_the_sdk_types(server):
    """A Claude model name, a system prompt of blocks with cache_control, metadata, thinking: a whole
    message that validates as `anthropic.types.Message`, naming the served model, its thinking block
    first (with a signature); count_tokens of the same request is its input_tokens."""
    request = dict(model="claude-haiku-4-5-20251001", messages=[{"role": "user", "content": uuid.uuid4().hex[:8]}],
                   system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                   thinking={"type": "enabled", "budget_tokens": 1024})
    raw = client(server).messages.with_raw_response.create(
        **request, max_tokens=8, metadata={"user_id": "someone"},
        extra_headers={"anthropic-beta": "some-beta-2025-01-01"}, **GREEDY)
    assert raw.http_response.headers["request-id"]
    message = anthropic.types.Message.model_validate(raw.http_response.json())
    assert message.id.startswith("msg_") and message.model == QWEN and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.content[0].type == "thinking" and isinstance(message.content[0].signature, str)
    assert all(block.type == "text" and block.text for block in message.content[1:])
    assert message.usage.output_tokens >= 1 and prompt_tokens(message.usage) > 10
    # a new prompt too short for the prefix cache: count_tokens is usage.input_tokens exactly
    assert not message.usage.cache_read_input_tokens
    assert client(server).messages.count_tokens(**request).input_tokens == message.usage.input_tokens


@pytest.fixture(scope="module")
def forced(server) -> dict:
    """The whole message of FORCED (a forced tool call), shared by the tests that need one."""
    response = post(server, FORCED)
    assert response.status_code == 200, response.text
    return response.json()


def test_stream_is_the_whole_message(server, forced):
    """Greedy: the streamed events of a forced tool call, in Anthropic's order, add up to the whole
    message (its input from input_json_delta pieces; the tool_use id is each message's own)."""
    request = {key: value for key, value in FORCED.items() if key != "temperature"}
    with client(server).messages.stream(**request, **GREEDY) as stream:
        kinds = [event.type for event in stream if event.type in RAW]
        final = stream.get_final_message()
    check_order(kinds)
    assert "content_block_delta" in kinds
    whole = anthropic.types.Message.model_validate(forced)
    shown = lambda message: [block.model_dump(exclude={"id"}) for block in message.content]
    assert shown(final) == shown(whole) and final.content[0].id.startswith("toolu_")
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_tool_use_round_trip(server, forced):
    """tool_choice {"type": "tool"}: one tool_use block whose input validates against input_schema;
    the tool_result answering it (text blocks) is read, and count_tokens counts that prompt as its
    usage does."""
    called = anthropic.types.Message.model_validate(forced)
    assert called.stop_reason == "tool_use"
    (use,) = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": False,
                                           "content": [{"type": "text", "text": "sunny"}]}]}
    follow_up = dict(model=QWEN, messages=[*ASK, {"role": "assistant", "content": called.content}, answer],
                     tools=[WEATHER])
    sdk = client(server)
    replied = sdk.messages.create(max_tokens=4, **follow_up, **GREEDY)
    assert replied.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert sdk.messages.count_tokens(**follow_up).input_tokens == prompt_tokens(replied.usage)


def test_structured_output_as_server_sent_events(server):
    """Each event is an `event: NAME` line and a `data: JSON` line of that type, in Anthropic's order
    (?beta=true and anthropic-version accepted); under output_config.format json_schema the text is
    JSON under the schema (the response_format grammar)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"model": QWEN, "max_tokens": 16, "messages": ASK, "temperature": 0, "stream": True,
            "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers=headers,
                      timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        frames = [frame for frame in response.read().decode().split("\n\n") if frame]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    check_order([event["type"] for event in events])
    assert events[-2]["delta"]["stop_reason"] == "end_turn" and events[-2]["usage"]["output_tokens"] >= 1
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------------- keys and errors
def test_api_key_in_x_api_key_or_bearer(server):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(server, "wrong").messages.count_tokens(model=QWEN, messages=ASK)
    assert caught.value.status_code == 401 and caught.value.body["error"]["type"] == "authentication_error"
    missing = post(server, {"model": QWEN, "messages": ASK}, "/v1/messages/count_tokens", headers={})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    bearer = post(server, {"model": QWEN, "messages": ASK}, "/v1/messages/count_tokens",
                  headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    # the OpenAI paths take x-api-key too, and keep their own error shape
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(server.url + "/v1/models").json()["error"]["code"] == "invalid_api_key"


REFUSALS = [
    ({"model": QWEN, "messages": ASK}, "max_tokens"),
    ({"model": QWEN, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages[0].content[0].type"),
    ({"model": QWEN, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"model": QWEN, "max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "messages[1]"),
    ({"model": QWEN, "max_tokens": 4, "messages": ASK, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nowhere"}}, "tool_choice.name"),
    ({"model": QWEN, "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web"}]},
     "tools[0].type"),
    ({"model": QWEN, "max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"model": QWEN, "max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"model": QWEN, "max_tokens": 4, "messages": ASK, "mcp_servers": [{"type": "url", "url": "x", "name": "m"}]},
     "mcp_servers"),
    ({"model": QWEN, "max_tokens": 4, "messages": ASK, "frequency": 1}, "frequency"),
]


@pytest.mark.parametrize("body, field", REFUSALS, ids=[field for _, field in REFUSALS])
def test_refusals_are_anthropic_errors(server, body, field):
    response = post(server, body)
    assert response.status_code == 400
    error = anthropic.types.ErrorResponse.model_validate(response.json())
    assert error.error.type == "invalid_request_error" and field in error.error.message
    assert error.request_id == response.headers["x-request-id"]


def test_body_limits_and_sdk_errors(server):
    too_big = post(server, {"model": QWEN, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * MAX_BODY}]})
    assert too_big.status_code == 413 and too_big.json()["type"] == "error"
    bad_json = httpx.post(server.url + "/v1/messages", content=b"{", headers={"x-api-key": KEY})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(server).messages.create(model=QWEN, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert caught.value.type == "invalid_request_error" and "document" in caught.value.api_message


# ---------------------------------------------------------------------- without a server
def test_request_translation():
    """Blocks become the chat pipeline's messages: tool results tool messages (is_error marked),
    thinking reasoning_content, tool_use tool_calls; cache_control and redacted thinking are dropped."""
    cached = {"cache_control": {"type": "ephemeral"}}
    body = {"model": "claude-opus-4-1", "max_tokens": 9, "system": [{"type": "text", "text": "S", **cached}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a", **cached}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}, **cached}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": True},
                    {"type": "text", "text": "and?"}]}],
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"], "top_k": 5, "metadata": {"user_id": "u"}, "service_tier": "auto"}
    asked = read_messages(body, "served")
    chat = asked.chat
    assert asked.model == "claude-opus-4-1" and chat.model == "served"
    assert chat.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": ERROR_PREFIX + "boom"},
        {"role": "user", "content": "and?"}]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather",
                                                            "description": WEATHER["description"],
                                                            "parameters": WEATHER["input_schema"]}}]
    assert (chat.forced, chat.parallel_tool_calls, chat.strict) == ("required", False, [False])
    assert chat.template_kwargs == {"enable_thinking": False}  # thinking left out: none, as Anthropic's default
    assert (chat.sampling.max_tokens, chat.sampling.stop, chat.sampling.top_k) == (9, ["END"], 5)
    none = read_messages({**body, "tool_choice": {"type": "none"}, "thinking": {"type": "adaptive"}}, "served").chat
    assert none.tools is None and none.forced is None and none.template_kwargs == {"enable_thinking": True}
    counted = read_messages({"model": "m", "messages": ASK}, "served", counting=True).chat
    assert counted.sampling.max_tokens is None


def test_deltas_become_blocks_and_events():
    """Thinking, then text, then two tool calls: four blocks, each started, filled and stopped in
    turn; the blocks are what the events add up to."""
    blocks = ContentBlocks()
    events = blocks.add([{"reasoning_content": "think"}, {"content": "Hi"}, {"content": " there"}])
    events += blocks.add([{"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                                           "function": {"name": "f", "arguments": ""}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]},
                          {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                          {"tool_calls": [{"index": 1, "id": "call_def", "type": "function",
                                           "function": {"name": "g", "arguments": "{}"}}]}])
    events += blocks.close()
    assert blocks.finished() == [{"type": "thinking", "thinking": "think", "signature": ""},
                                 {"type": "text", "text": "Hi there"},
                                 {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"a": 1}},
                                 {"type": "tool_use", "id": "toolu_def", "name": "g", "input": {}}]
    check_order(["message_start", *(name for name, _ in events), "message_delta", "message_stop"])
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["thinking_delta", "signature_delta", "text_delta", "text_delta",
                                           "input_json_delta", "input_json_delta", "input_json_delta"]
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts[2] == {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {}}


def test_stop_sequence_is_named():
    stops = StopStrings(["END", "STOP"])
    assert stops.push("one STOP two END") == "one " and stops.found == "STOP"
    text = types.SimpleNamespace(stopped=True, stops=stops)
    assert _stop("stop", text) == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert _stop("length", types.SimpleNamespace(stopped=False)) == {"stop_reason": "max_tokens",
                                                                    "stop_sequence": None}
