"""Structured outputs through the real `openai` client: `response_format` JSON on the real-vocabulary
test model (Qwen's 248k ids) in every mode, greedy and sampled; tool calls under the grammar of the
parameter form on the bundled model (named, required, auto with a strict tool, streamed) and on the
real vocabulary (whose tags are single tokens); every output that ends with "stop" validates with
`jsonschema`, and one cut by max_tokens is a prefix the grammar accepts. The grammar itself is
walked at random over both vocabularies (any text it allows is one the parser reads as arguments that
validate), and the refusals are 400s naming the field, before any compute."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import numpy as np
import openai
import pytest

import clover_jax
from clover_jax.api.serving.responses import ChoiceText, Message
from clover_jax.api.serving.structured import Tags, tags_of, tool_constraint
from clover_jax.text.tokenizer import Tokenizer
from decoding.constraints.matcher import grammar_text
from decoding.constraints.spec import Constraint
from decoding.constraints.vocabulary import llguidance_tokenizer
from tests.clover_jax.api.serving.conftest import start

QWEN, TINY = "qwen-vocab", "tiny-clover"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
YES_NO = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}  # few tokens: a real-vocabulary denoising step costs ~0.3 s on CPU
# scalar parameters: what the bundled vocabulary (letters, digits, a few signs; no braces) can write
SORT = {"type": "function", "function": {"name": "sort", "strict": True, "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "order": {"enum": ["up", "down"]}, "note": {"type": ["string", "null"],
                                                                                  "maxLength": 3}},
    "required": ["n", "order"], "additionalProperties": False}}}
STOP = {"type": "function", "function": {"name": "halt", "parameters": {"type": "object", "properties": {
    "why": {"type": "string", "pattern": "^[a-z]{1,4}$"}}, "required": ["why"]}}}
# an object and a union: what the real vocabulary writes
LOCATE = {"type": "function", "function": {"name": "locate", "strict": True, "parameters": {
    "type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
                                          "required": ["x"], "additionalProperties": False}},
    "properties": {"at": {"$ref": "#/$defs/point"}, "tag": {"anyOf": [{"type": "string", "maxLength": 4},
                                                                       {"type": "integer", "maximum": 3}]},
                   "ok": {"type": "boolean"}},
    "required": ["at", "ok"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (SORT, STOP, LOCATE)}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def validated_calls(choice) -> list[tuple[str, dict]]:
    """A choice's tool calls, each one's arguments validated against its tool's schema."""
    calls = []
    for call in choice.message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.fixture(scope="module")
def qwen_server(qwen_vocab_checkpoint):
    server, service = start(qwen_vocab_checkpoint, QWEN, max_running=2)
    with server:
        yield server, service
    service.engine.close()


def vocabulary(path: str, vocab_size: int, eos: tuple[int, ...]):
    """(Tokenizer, llguidance tokenizer, end-of-sequence ids) of a checkpoint."""
    return Tokenizer.from_pretrained(path), llguidance_tokenizer(os.path.join(path, "tokenizer.json"), vocab_size,
                                                                 eos), eos


def prefix_accepted(path: str, vocab_size: int, constraint: Constraint, text: str) -> bool:
    """Whether `constraint`'s grammar takes `text` as a prefix (the grammar reads bytes: any tokenization will do)."""
    import llguidance

    _, lexicon, _ = vocabulary(path, vocab_size, (0,))
    matcher = llguidance.LLMatcher(lexicon, grammar_text(constraint), log_level=0)
    ids = lexicon.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids)


def walk(words, constraint: Constraint, rng, steps: int = 160) -> tuple[list[int], bool]:
    """A random path through the grammar (short tokens, an end wherever allowed half the time):
    the tokens and whether the answer ended."""
    import llguidance

    tokenizer, lexicon, eos = words
    matcher = llguidance.LLMatcher(lexicon, grammar_text(constraint), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids: list[int] = []
    for _ in range(steps):
        allowed = np.nonzero(np.frombuffer(matcher.compute_logit_bias(), np.uint8) == 200)[0]
        ends = [t for t in allowed if t in eos]
        texts = [t for t in allowed if t not in eos]
        if ends and (not texts or rng.random() < 0.5):
            return ids, True
        short = [t for t in texts if len(tokenizer.decode([int(t)])) <= 2] or texts
        ids.append(int(rng.choice(short)))
        assert matcher.consume_token(ids[-1]), matcher.get_error()
    return ids, False


def parsed(tokenizer, tools, ids: list[int]) -> dict:
    text = ChoiceText(tokenizer, [], reasoning=False, tools=tools)
    message = Message()
    message.add(text.push(ids) + text.finish())
    return message.as_openai()


# ---------------------------------------------------------------------- the grammar alone
def test_the_tags_are_written_as_single_tokens_where_the_vocabulary_has_them(qwen_vocab_checkpoint):
    qwen = Tokenizer.from_pretrained(qwen_vocab_checkpoint)
    assert tags_of(qwen) == Tags(f"<[{qwen.token_to_id('<tool_call>')}]>", f"<[{qwen.token_to_id('</tool_call>')}]>")
    assert tags_of(Tokenizer.from_pretrained(clover_jax.bundled_model_path())) == Tags('"<tool_call>"',
                                                                                       '"</tool_call>"')


@pytest.mark.parametrize("model", ["bundled", "qwen"])
def test_every_text_the_tool_grammar_allows_parses_to_arguments_that_validate(model, qwen_vocab_checkpoint):
    if model == "bundled":
        path, vocab_size, eos, tools = str(clover_jax.bundled_model_path()), 128, (2, 0), [SORT, STOP]
    else:
        path, vocab_size, eos, tools = qwen_vocab_checkpoint, 248_320, (248_046, 248_044), [LOCATE, STOP]
    words = vocabulary(path, vocab_size, eos)
    rng = np.random.default_rng(0)
    ended = 0
    choices = [(tools[0]["function"]["name"], True), ("required", True), ("required", False), (None, True)]
    for choice, parallel in choices if model == "bundled" else choices[1:3]:  # a real-vocabulary mask: ~10 ms
        constraint = tool_constraint(tools, choice, parallel, [True, False], tags_of(words[0]))
        for _ in range(6 if model == "bundled" else 3):
            ids, end = walk(words, constraint, rng)
            message = parsed(words[0], tools, ids)
            calls = message.get("tool_calls") or []
            if end:  # (a walk cut short may hold a call that has not written its required parameters yet)
                for call in calls:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
                ended += 1
                assert calls or choice is None, words[0].decode(ids)
                assert len(calls) <= 1 or parallel and choice == "required"
                assert choice is None or message["content"] is None
    assert ended >= (16 if model == "bundled" else 4)


# ---------------------------------------------------------------------- response_format
@pytest.mark.parametrize("mode, temperature, schema", [
    ("diffusion", 0, YES_NO), ("autoregressive", 0, ANSWER), ("autoregressive", 1.0, ANSWER),
    ("self_speculative", 0, YES_NO)])
def test_a_json_schema_response_validates_in_every_mode(qwen_server, mode, temperature, schema):
    server, _ = qwen_server
    response = client(server).chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "is it sunny?"}], max_tokens=24, temperature=temperature,
        seed=1, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                        "strict": True}},
        extra_body={"mode": mode, **NO_THINKING})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_a_json_object_cut_by_max_tokens_is_a_prefix_the_grammar_accepts(qwen_server, qwen_vocab_checkpoint):
    server, _ = qwen_server
    response = client(server).chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "hi"}], max_tokens=6, response_format={"type": "json_object"},
        extra_body={"mode": "autoregressive", **NO_THINKING})
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")
        assert prefix_accepted(qwen_vocab_checkpoint, 248_320, Constraint.json_object(), choice.message.content)


# ---------------------------------------------------------------------- tool calls
def test_a_required_call_on_the_real_vocabulary_writes_its_single_token_tags(qwen_server):
    server, _ = qwen_server
    response = client(server).chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "where am i?"}], max_tokens=48, tools=[LOCATE, STOP],
        tool_choice="required", parallel_tool_calls=False, extra_body={"mode": "autoregressive"})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(validated_calls(choice)) == 1
    assert not (choice.message.model_extra or {}).get("reasoning_content")  # a forced call closes thinking


def test_auto_with_a_strict_tool_leaves_the_thinking_free_and_keeps_calls_valid(qwen_server):
    server, _ = qwen_server
    response = client(server).chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": "where am i?"}], max_tokens=32, tools=[LOCATE],
        extra_body={"mode": "autoregressive"})  # the prompt opens <think>: the grammar follows </think>
    choice = response.choices[0]
    assert (choice.message.model_extra or {}).get("reasoning_content")
    validated_calls(choice)
    if choice.finish_reason == "stop":
        assert "<tool_call>" not in choice.message.content


@pytest.mark.parametrize("mode", ["diffusion", "autoregressive"])
def test_a_named_tool_choice_is_one_valid_call_of_that_tool(bundled_server, mode):
    server, _ = bundled_server
    request = dict(model=TINY, messages=[{"role": "user", "content": "sort 3 1 2"}], max_tokens=160,
                   tools=[SORT, STOP], tool_choice={"type": "function", "function": {"name": "sort"}},
                   extra_body={"mode": mode})
    whole = client(server).chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    [(name, arguments)] = validated_calls(whole)
    assert name == "sort"
    if mode == "diffusion":  # the stream's deltas put together are the whole response
        with client(server).chat.completions.stream(**request) as events:
            streamed = events.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert validated_calls(streamed) == [(name, arguments)]


def test_required_calls_any_tool_and_auto_keeps_a_strict_tool_valid(bundled_server):
    server, service = bundled_server
    messages = [{"role": "user", "content": "sort 2 1"}]
    required = client(server).chat.completions.create(model=TINY, messages=messages, max_tokens=160,
                                                      tools=[SORT, STOP], tool_choice="required", temperature=1.0,
                                                      seed=3, extra_body={"mode": "autoregressive"}).choices[0]
    assert required.finish_reason == "tool_calls" and 1 <= len(validated_calls(required))
    auto = client(server).chat.completions.create(model=TINY, messages=messages, max_tokens=128,
                                                  tools=[SORT, STOP]).choices[0]
    validated_calls(auto)
    if auto.finish_reason == "stop":
        assert "<tool_call>" not in (auto.message.content or "")
    plain = client(server).chat.completions.create(model=TINY, messages=messages, max_tokens=128).choices[0]
    assert auto.message.content == plain.message.content  # the unconstrained answer holds no call: unchanged


# ---------------------------------------------------------------------- refusals
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}
REFUSED = [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": ANSWER}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": ANSWER}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {**SCHEMA_FORMAT, "json_schema": {**SCHEMA_FORMAT["json_schema"], "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "json_object", "json_schema": {}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "string", "pattern": "(?=lookahead)"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"minimum": "x"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "date"}}}}}]},
     "tools[0].function.parameters.properties.a"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f>", "strict": True}}]}, "tools[0].function.name"),
    ({"tools": [SORT, SORT]}, "tools[1].function.name"),
]


@pytest.mark.parametrize("change, param", REFUSED)
def test_malformed_formats_and_schemas_are_400s_naming_the_field_before_compute(bundled_server, change, param):
    server, service = bundled_server
    body = {"model": TINY, "messages": [{"role": "user", "content": "sort 3 1"}], "max_tokens": 4, **change}
    steps = service.engine.steps
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    assert service.engine.steps == steps


def test_a_non_strict_tool_the_grammar_cannot_express_is_called_with_any_parameters(bundled_server):
    server, _ = bundled_server
    loose = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "date"}}, "minProperties": 1}}}
    choice = client(server).chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "sort 3 1"}], max_tokens=40, tools=[loose],
        tool_choice="required", extra_body={"mode": "autoregressive"}).choices[0]
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "f"
