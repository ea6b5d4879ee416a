"""Reasoning and tool-call parsing, stop strings and incremental detokenizing, on hand-written text in
the Qwen3.5/3.6 format, fed whole and cut at every boundary: the streamed deltas always put together
the message the whole text gives, and that message is the one written by hand here."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from clover_jax.api.serving.responses import ChoiceText, Message
from clover_jax.api.serving.text import IncrementalDecoder, StopStrings
from clover_jax.api.serving.tool_calls import typed_value

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "options": {"type": "object"}, "hours": {"type": ["array", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
]

XML_CALLS = """<think>
The user wants the weather, then a file.
</think>

Let me look that up.

<tool_call>
<function=get_weather>
<parameter=city>
San Francisco, CA
</parameter>
<parameter=days>
3
</parameter>
<parameter=metric>
true
</parameter>
<parameter=ratio>
0.5
</parameter>
<parameter=options>
{"hourly": false, "fields": ["temp", "wind"]}
</parameter>
<parameter=hours>
null
</parameter>
</function>
</tool_call>
<tool_call>
<function=write_file>
<parameter=path>
/tmp/a.py
</parameter>
<parameter=content>
def f():
    return 1 < 2

</parameter>
<parameter=unknown>
42
</parameter>
</function>
</tool_call>"""

# (text, whether the prompt opened <think>, tools, the message: content, reasoning, [(name, arguments)])
CASES = [
    ("<think>\n5 digits\n</think>\n\n1 1 3 4 5", False, None, ("1 1 3 4 5", "5 digits", [])),
    (XML_CALLS, False, TOOLS, ("Let me look that up.", "The user wants the weather, then a file.", [
        ("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True, "ratio": 0.5,
                         "options": {"hourly": False, "fields": ["temp", "wind"]}, "hours": None}),
        ("write_file", {"path": "/tmp/a.py", "content": "def f():\n    return 1 < 2\n", "unknown": "42"})])),
    # the prompt opened <think>; the JSON form; text after the calls
    ("I need Paris first.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
     "\"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"write_file\", \"arguments\": {}}\n</tool_call>\n\nDone.",
     True, TOOLS,
     ("Done.", "I need Paris first.", [("get_weather", {"city": "Paris", "days": 2}), ("write_file", {})])),
    # no reasoning, text that only looks like tags, and a call still open when the answer ends
    ("a <b> c < d <tool_cal x\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n", False,
     TOOLS, ("a <b> c < d <tool_cal x", None, [("get_weather", {"city": "Rome"})])),
    # broken JSON in a call is text; tools not given: tags are plain text
    ("<tool_call>\n{\"name\": oops}\n</tool_call>", False, TOOLS,
     ("<tool_call>\n{\"name\": oops}\n</tool_call>", None, [])),
    ("<think>\n\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>", False, None,
     ("<tool_call>\n<function=f>\n</function>\n</tool_call>", None, [])),
]


class CharTokenizer:
    """One token per character: pushing tokens one at a time cuts the text at every boundary."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def parse(text: str, opened: bool, tools, cuts: list[int]) -> tuple[Message, list]:
    """Feed `text` cut at `cuts`; returns the assembled message and every delta."""
    choice = ChoiceText(CharTokenizer(), [], reasoning=opened, tools=tools)
    ids, deltas = CharTokenizer.encode(text), []
    for start, end in zip([0] + cuts, cuts + [len(ids)], strict=True):
        deltas += choice.push(ids[start:end])
    deltas += choice.finish()
    message = Message()
    message.add(deltas)
    return message, deltas


def summary(message: Message):
    openai = message.as_openai()
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in openai.get("tool_calls", [])]
    return openai["content"] if openai["content"] is not None else "", openai.get("reasoning_content"), calls


@pytest.mark.parametrize("text, opened, tools, expected", CASES)
def test_the_whole_text_gives_the_written_message(text, opened, tools, expected):
    message, deltas = parse(text, opened, tools, [])
    assert summary(message) == expected
    for call in message.as_openai().get("tool_calls", []):
        assert call["id"].startswith("call_") and call["type"] == "function"
        json.loads(call["function"]["arguments"])  # a JSON object string


@pytest.mark.parametrize("text, opened, tools, expected", CASES)
def test_every_cut_streams_the_same_message(text, opened, tools, expected):
    whole = summary(parse(text, opened, tools, [])[0])
    singles = [[i] for i in range(1, len(text))]
    pairs = [[i, j] for i, j in itertools.combinations(range(1, len(text), 3), 2)]
    randoms = [sorted(random.Random(seed).sample(range(1, len(text)), min(12, len(text) - 1))) for seed in range(20)]
    every_char = [list(range(1, len(text)))]
    for cuts in singles + pairs + randoms + every_char:
        message, deltas = parse(text, opened, tools, cuts)
        assert summary(message) == whole, cuts
        for delta in deltas:  # never an empty delta, never a partial tag sent as text
            assert delta and all(v != "" for v in delta.values())
            for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<parameter="):
                assert tag not in delta.get("content", "") or tag in expected[0]


def test_tool_arguments_stream_one_parameter_at_a_time():
    _, deltas = parse(XML_CALLS, False, TOOLS, list(range(1, len(XML_CALLS))))
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
    assert fragments[:3] == ["", '{"city": "San Francisco, CA"', ', "days": 3']
    assert fragments[-1] == "}"


@pytest.mark.parametrize("text, types, expected", [
    ("3", ["integer"], 3), ("-7", ["integer"], -7), ("3.5", ["integer"], "3.5"), ("2.5e3", ["number"], 2500.0),
    ("TRUE", ["boolean"], True), ("null", ["null"], None), ("[1, 2]", ["array"], [1, 2]),
    ("{\"a\": 1}", ["object"], {"a": 1}), ("not json", ["object"], "not json"), ("5", ["string"], "5"),
    ("5", [], "5"), ("x", ["integer", "string"], "x"),
])
def test_parameter_values_are_typed_by_the_schema(text, types, expected):
    assert typed_value(text, types) == expected


@pytest.mark.parametrize("stops", [["STOP"], ["\n\n", "xyz"], ["a"], ["never"]])
def test_stop_strings_cut_where_they_start_at_any_boundary(stops):
    text = "one two\n\nthree STOP four"
    positions = [text.find(s) for s in stops if s in text]
    expected = text[:min(positions)] if positions else text
    for cuts in [[]] + [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        stop = StopStrings(stops)
        sent = "".join(stop.push(text[a:b]) for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)) + stop.flush()
        assert sent == expected and stop.stopped == bool(positions)


def test_incremental_decoding_puts_together_the_decoded_text():
    import clover_jax
    from clover_jax.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(clover_jax.bundled_model_path())
    rng = np.random.default_rng(0)
    for _trial in range(50):
        ids = rng.integers(0, tokenizer.vocab_size, rng.integers(1, 60)).tolist()
        decoder, pieces, start = IncrementalDecoder(tokenizer), [], 0
        while start < len(ids):
            end = start + int(rng.integers(1, 9))
            pieces.append(decoder.push(ids[start:end]))
            start = end
        pieces.append(decoder.flush())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_parallel_tool_calls_false_keeps_the_first_call_and_a_cut_call_keeps_its_complete_parameters():
    from clover_jax.api.serving.responses import ChoiceText, Message

    ids = CharTokenizer.encode(XML_CALLS)
    for cuts in ([], list(range(1, len(ids), 5))):
        message, text = Message(), ChoiceText(CharTokenizer(), [], False, TOOLS, first_call_only=True)
        for start, end in zip([0] + cuts, cuts + [len(ids)], strict=True):
            message.add(text.push(ids[start:end]))
        message.add(text.finish())
        calls = message.as_openai()["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"])["days"] == 3
    # a call cut by max_tokens (a grammar's valid prefix) is closed with the parameters it completed
    response = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2"
    message = Message()
    text = ChoiceText(CharTokenizer(), [], False, TOOLS)
    message.add(text.push(CharTokenizer.encode(response)) + text.finish())
    [call] = message.as_openai()["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert message.as_openai()["content"] is None
