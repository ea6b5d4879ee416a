"""OpenAI's Responses API (`/v1/responses`) through the real `openai` client, on the real-vocabulary
test model (Qwen's ids and tags, a Qwen-style template with tools; its responses end after a few
tokens): string and item input (Codex's developer messages as one system turn), streaming against
the whole response, a function-tool round trip, text.format under the grammar, the store and
previous_response_id, max_output_tokens, and the refusals; an openai-agents Agent runs to its answer.
The translation and the store are checked alone too."""

from __future__ import annotations

import json
import os
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from clover_jax.api.serving.app import create_app
from clover_jax.api.serving.errors import ApiError
from clover_jax.api.serving.responses_input import chat_messages, read_input, read_responses
from clover_jax.api.serving.responses_store import ResponseStore
from clover_jax.api.serving.server import ServerThread, build_service

QWEN = "qwen-vocab"
FAST = {"mode": "autoregressive"}  # one token per forward: the cheapest mode on CPU
NO_THINKING = {"effort": "none"}
YES_NO = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "weather", "description": "today's weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
CODEX_INPUT = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
               {"type": "message", "role": "developer", "content": "Sandbox: read-only."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def served(qwen_vocab_checkpoint):
    service = build_service(qwen_vocab_checkpoint, name=QWEN, max_running=2)
    app = create_app(service)
    with ServerThread(app) as server:
        yield server, app
    service.engine.close()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def post(served, body: dict) -> httpx.Response:
    return httpx.post(served[0].url + "/v1/responses", json={"model": QWEN, **body}, timeout=60)


def without_ids(item: dict) -> dict:
    """An output item but its id (and the `parsed: None` the stream's parsed items carry)."""
    content = [{k: v for k, v in part.items() if k != "parsed"} for part in item.get("content") or []]
    return {**{k: v for k, v in item.items() if k != "id"}, "content": content}


# ---------------------------------------------------------------------- the translation alone
def test_instructions_and_the_leading_developer_messages_become_one_system_turn():
    items = read_input(CODEX_INPUT + [{"role": "developer", "content": "later"}])
    assert chat_messages(items, "You are Codex.") == [
        {"role": "system", "content": "You are Codex.\n\nBe brief.\n\nSandbox: read-only."},
        {"role": "user", "content": "hi"}, {"role": "user", "content": "later"}]


def test_reasoning_text_and_calls_of_one_turn_become_one_assistant_message():
    items = read_input([
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]}])
    assert chat_messages(items, None) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"}]


def test_fields_that_change_nothing_are_accepted_and_tools_the_server_does_not_run_dropped():
    asked = read_responses({"model": QWEN, "input": "hi", "include": ["reasoning.encrypted_content"],
                            "prompt_cache_key": "k", "client_metadata": {"a": "b"}, "metadata": {"x": "y"},
                            "user": "u", "safety_identifier": "s", "service_tier": "auto", "truncation": "disabled",
                            "store": False, "tools": [{"type": "web_search"}, {"type": "local_shell"},
                                                      {"type": "custom", "name": "apply_patch"}, WEATHER],
                            "reasoning": {"effort": "none", "summary": "auto"}, "text": {"verbosity": "medium"}},
                           lambda _: [])
    assert [tool["function"]["name"] for tool in asked.chat.tools] == ["weather"]
    assert asked.chat.template_kwargs == {"enable_thinking": False} and not asked.store
    assert [tool["name"] for tool in asked.echo["tools"]] == ["weather"]


@pytest.mark.parametrize("field, value, param", [
    ("background", True, "background"), ("conversation", "conv_1", "conversation"),
    ("truncation", "auto", "truncation"), ("top_logprobs", 2, "top_logprobs"), ("typo", 1, "typo"),
    ("max_output_tokens", 0, "max_output_tokens"), ("tool_choice", {"type": "web_search"}, "tool_choice"),
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
    ("text", {"verbosity": "low"}, "text.verbosity"), ("reasoning", {"effort": "huge"}, "reasoning.effort"),
    ("tools", [{"type": "custom", "name": "x"}, {"type": "function", "name": "f", "strict": 1}], "tools[1].strict")])
def test_refusals_name_the_field(field, value, param):
    with pytest.raises(ApiError) as refused:
        read_responses({"model": QWEN, "input": "hi", field: value}, lambda _: [])
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_the_store_keeps_what_its_bound_allows_dropping_the_oldest_first():
    store = ResponseStore(max_bytes=400)  # 195 bytes each
    for index in range(4):
        assert store.put({"id": f"resp_{index}", "text": "x" * 100}, [{"content": "y" * 50}])
    assert list(store.entries) == ["resp_2", "resp_3"] and store.used <= 400
    assert not store.put({"id": "resp_big", "text": "x" * 500}, [])
    with pytest.raises(ApiError) as missing:
        store.items("resp_0")
    assert missing.value.status == 404 and missing.value.param == "previous_response_id"


# ---------------------------------------------------------------------- through the openai client
def test_a_string_input_makes_a_response_that_validates(served, client):
    raw = post(served, {"input": "hi", "max_output_tokens": 12, "extra": None} | {"temperature": 0})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "extra"  # (unknown fields are refused)
    raw = post(served, {"input": "hi", "max_output_tokens": 12, "temperature": 0, "store": True, **FAST})
    response = Response.model_validate(raw.json())
    assert response.id.startswith("resp_") and response.object == "response" and response.model == QWEN
    assert response.status in ("completed", "incomplete") and response.output
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens > usage.input_tokens
    assert 0 <= usage.output_tokens_details.reasoning_tokens <= usage.output_tokens
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_codex_items_render_as_the_chat_request_with_one_system_turn(served, client):
    response = client.responses.create(model=QWEN, instructions="You are Codex.", input=CODEX_INPUT,
                                       max_output_tokens=1, store=False, reasoning=NO_THINKING, extra_body=FAST)
    chat = client.chat.completions.create(
        model=QWEN, max_tokens=1, extra_body={**FAST, "chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "system", "content": "You are Codex.\n\nBe brief.\n\nSandbox: read-only."},
                  {"role": "user", "content": "hi"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)  # store: false


def test_the_stream_says_what_the_whole_response_says(client):
    asked = dict(model=QWEN, input="hi", max_output_tokens=12, temperature=0, store=False, extra_body=FAST)
    whole = client.responses.create(**asked)
    with client.responses.stream(**asked) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{whole.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(whole.output)
    strip = lambda output: [without_ids(item.model_dump()) for item in output]
    assert strip(streamed.output) == strip(whole.output)
    assert streamed.usage == whole.usage
    texts = [event for event in events if event.type == "response.output_text.delta"]
    assert "".join(event.delta for event in texts) == whole.output_text


def test_a_forced_call_then_its_output_through_previous_response_id(client):
    with client.responses.stream(model=QWEN, input="weather in Oslo?", tools=[WEATHER], max_output_tokens=40,
                                 tool_choice={"type": "function", "name": "weather"}, extra_body=FAST) as stream:
        kinds = [event.type for event in stream]
        called = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    calls = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed" and len(calls) == 1 and calls[0].name == "weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answer = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"}]
    followed = client.responses.create(model=QWEN, previous_response_id=called.id, input=answer, tools=[WEATHER],
                                       max_output_tokens=1, store=False, reasoning=NO_THINKING, extra_body=FAST)
    assert followed.previous_response_id == called.id
    whole = client.responses.create(
        model=QWEN, tools=[WEATHER], max_output_tokens=1, store=False, reasoning=NO_THINKING, extra_body=FAST,
        input=[{"role": "user", "content": "weather in Oslo?"}] + [item.model_dump() for item in called.output] +
        answer)
    assert followed.usage.input_tokens == whole.usage.input_tokens > called.usage.input_tokens + 5


@pytest.fixture(scope="module")
def openai_schemas() -> dict:
    """OpenAI's published schemas of the response object and of each stream event, by event type
    (`openai_api/`, cut from OpenAI's OpenAPI description by `scripts/vendor_openai_schemas.py`)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "openai_api", "response_schemas.json")) as f:
        components = json.load(f)["components"]
    events = {}
    for reference in components["schemas"]["ResponseStreamEvent"]["anyOf"]:
        name = reference["$ref"].rsplit("/", 1)[1]
        events |= {kind: name for kind in components["schemas"][name]["properties"]["type"]["enum"]}
    return {"components": components, "events": events}


def conforms(schemas: dict, name: str, instance: dict) -> None:
    document = {"$ref": f"#/components/schemas/{name}", "components": schemas["components"]}
    jsonschema.Draft202012Validator(document).validate(instance)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_and_events_validate_against_openais_schemas(served, openai_schemas, stream):
    """A forced call (reasoning, function_call and message items) and a response cut short, whole
    and streamed, raw from the wire: every event against its type's schema, every response object
    against `Response`, the stored one too."""
    called = {"input": "weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 40, "temperature": 0,
              "tool_choice": {"type": "function", "name": "weather"}, "store": True, **FAST}
    cut = {"input": "sunny?", "max_output_tokens": 2, "store": False, "user": "u1", "instructions": "Be brief.", **FAST,
           "text": {"format": {"type": "json_schema", "name": "answer", "schema": YES_NO}}}
    for body in (called, cut):
        raw = post(served, {**body, "stream": stream})
        assert raw.status_code == 200, raw.text
        if not stream:
            final = raw.json()
        else:
            events = [json.loads(line[len("data: "):]) for line in raw.text.splitlines() if line.startswith("data: ")]
            for event in events:
                conforms(openai_schemas, openai_schemas["events"][event["type"]], event)
            final = events[-1]["response"]
        conforms(openai_schemas, "Response", final)
        assert final["status"] == ("completed" if body is called else "incomplete")
        if body is called:
            assert [item["type"] for item in final["output"]][-1] == "function_call"
            stored = httpx.get(served[0].url + "/v1/responses/" + final["id"], timeout=60)
            conforms(openai_schemas, "Response", stored.json())


def test_text_format_json_schema_is_decoded_under_the_grammar(client):
    response = client.responses.create(
        model=QWEN, input="sunny?", max_output_tokens=24, store=False, reasoning=NO_THINKING, extra_body=FAST,
        text={"format": {"type": "json_schema", "name": "answer", "schema": YES_NO, "strict": True}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), YES_NO)


def test_max_output_tokens_cuts_the_response_as_incomplete(client):
    response = client.responses.create(
        model=QWEN, input="sunny?", max_output_tokens=2, store=False, reasoning=NO_THINKING, extra_body=FAST,
        text={"format": {"type": "json_schema", "name": "answer", "schema": YES_NO}})
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[-1].status == "incomplete"


def test_an_unknown_previous_response_is_a_404_and_a_refused_field_a_400(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=QWEN, input="hi", previous_response_id="resp_nope")
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=QWEN, input="hi", background=True)
    assert refused.value.body["param"] == "background"
    email = {"type": "object", "properties": {"to": {"type": "string", "format": "email"}}, "required": ["to"]}
    with pytest.raises(openai.BadRequestError) as inexpressible:  # refused by the chat side, before any compute
        client.responses.create(model=QWEN, input="hi",
                                tools=[{"type": "web_search"}, {**WEATHER, "parameters": email}])
    assert inexpressible.value.body["param"].startswith("tools[1].parameters"), inexpressible.value.body


def test_get_and_delete_of_a_stored_response_are_counted_under_their_own_endpoint(served, client):
    """One label for every response id (`/v1/responses/{id}`), not "other"."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict:
        text = httpx.get(served[0].url + "/metrics").text
        return {(s.labels["endpoint"], s.labels["status"]): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "clover_requests_total"}

    stored = client.responses.create(model=QWEN, input="hi", max_output_tokens=1, reasoning=NO_THINKING,
                                     extra_body=FAST)
    url = f"{served[0].url}/v1/responses/{stored.id}"
    before = counts()
    statuses = [httpx.get(url).status_code, httpx.delete(url).status_code, httpx.get(url).status_code]
    after = counts()
    assert statuses == [200, 200, 404]
    added = {key: after[key] - before.get(key, 0) for key in after
             if after[key] != before.get(key, 0) and key[0] != "/metrics"}  # (the first scrape is counted)
    assert added == {("/v1/responses/{id}", "200"): 2, ("/v1/responses/{id}", "404"): 1}


def test_an_agent_calls_its_tool_and_answers(served):
    agents = pytest.importorskip("agents")
    from openai.types.shared import Reasoning

    agents.set_tracing_disabled(True)  # (tracing would export to OpenAI)
    calls = []

    @agents.function_tool
    def weather(city: Literal["Oslo", "Rome"]) -> str:
        """Today's weather in a city."""
        calls.append(city)
        return "rain"

    model = agents.OpenAIResponsesModel(model=QWEN, openai_client=openai.AsyncOpenAI(
        base_url=served[0].url + "/v1", api_key="unused", max_retries=0))
    # the first turn must call (the random model would not); the agent then lets the model answer
    settings = agents.ModelSettings(tool_choice="required", max_tokens=32, reasoning=Reasoning(effort="none"),
                                    extra_body=FAST)
    agent = agents.Agent(name="forecaster", instructions="Answer briefly.", tools=[weather], model=model,
                         model_settings=settings)
    result = agents.Runner.run_sync(agent, "weather in Oslo?", max_turns=3)
    assert calls in (["Oslo"], ["Rome"]) and isinstance(result.final_output, str)
