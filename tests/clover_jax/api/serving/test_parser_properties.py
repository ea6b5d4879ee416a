"""Generated text for the reasoning and tool-call parsers: any text, cut into any pieces, gives the
events the whole text gives, and neither parser ever raises. The text is drawn from the parsers'
own tags and their fragments (a partial `</think>`, `<parameter=` without its `>`, broken JSON)
mixed with arbitrary characters, so that the held-back states are reached far more often than
random characters alone would reach them."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from clover_jax.api.serving.reasoning import ReasoningSplitter
from clover_jax.api.serving.tool_calls import ToolCallParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "ok": {"type": "boolean"}, "xs": {"type": ["array", "null"]}}}}}]

PIECES = ["<think>", "</think>", "<think", "</thi", "\n", "\n\n", " ", "<tool_call>", "</tool_call>", "<tool_",
          "<function=f>", "<function=", "</function>", "<parameter=n>", "<parameter=ok>", "<parameter=xs>",
          "<parameter=", "</parameter>", "</param", "3", "-7", "true", "null", "[1, 2]", '{"name": "f", ',
          '"arguments": {"n": 1}}', '"arguments": "{\\"n\\": 2}"}', "{", "}", '"', "<", ">", "=", "é", "日本"]
VALUES = st.sampled_from(["3", "\n-7\n", "true", "null", "[1, 2]", "x</param", "", "\n"])
XML_CALL = st.builds(lambda params, close: "<tool_call>\n<function=f>\n" + "".join(params) + close,
                     st.lists(st.builds("<parameter={}>{}</parameter>\n".format,
                                        st.sampled_from(["n", "ok", "xs", "other"]), VALUES), max_size=3),
                     st.sampled_from(["</function>\n</tool_call>", "</function>", "", "</tool_call>"]))
JSON_CALL = st.sampled_from(['<tool_call>\n{"name": "f", "arguments": {"n": 1}}\n</tool_call>',
                             '<tool_call>{"name": "f", "arguments": "{\\"ok\\": true}"}</tool_call>',
                             '<tool_call>{"name": "f", "arguments": {}</tool_call>'])
# Noise, tag fragments, and whole calls (well-formed or cut short), so that a cut inside a call that
# does parse is drawn often: a parser that loses such a call streams content where the whole has a call.
TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6), XML_CALL, JSON_CALL), max_size=16).map("".join)
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True)


def _cuts(draw_text: str, cut_points: list[int]) -> list[str]:
    """`draw_text` cut at the given positions (sorted, deduplicated, within the text)."""
    points = sorted({point % (len(draw_text) + 1) for point in cut_points})
    bounds = [0, *points, len(draw_text)]
    return [draw_text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


def _merged(events: list[tuple]) -> list[tuple]:
    """Adjacent text events of one kind joined (a stream may split a span anywhere), and each call's
    argument fragments joined into its arguments string."""
    merged: list[list] = []
    for event in events:
        kind = event[0]
        if merged and kind in ("content", "reasoning") and merged[-1][0] == kind:
            merged[-1][1] += event[1]
        elif merged and kind == "arguments" and merged[-1][0] == "arguments" and merged[-1][1] == event[1]:
            merged[-1][2] += event[2]
        else:
            merged.append(list(event))
    return [tuple(event) for event in merged]


def _stream(parser, pieces: list[str]) -> list[tuple]:
    events = []
    for piece in pieces:
        events += parser.push(piece)
    return events + parser.finish()


@SETTINGS
@given(text=TEXT, cut_points=st.lists(st.integers(min_value=0), max_size=12), opened=st.booleans())
def test_reasoning_streamed_in_any_pieces_equals_the_whole(text, cut_points, opened):
    whole = _stream(ReasoningSplitter(opened), [text])
    streamed = _stream(ReasoningSplitter(opened), _cuts(text, cut_points))
    assert _merged(streamed) == _merged(whole)
    # nothing is lost but the tags and the newlines the templates drop
    assert all(kind in ("reasoning", "content") and piece for kind, piece in streamed)


@SETTINGS
@given(text=TEXT, cut_points=st.lists(st.integers(min_value=0), max_size=12))
def test_tool_calls_streamed_in_any_pieces_equal_the_whole(text, cut_points):
    whole = _stream(ToolCallParser(TOOLS), [text])
    streamed = _stream(ToolCallParser(TOOLS), _cuts(text, cut_points))
    assert _merged(streamed) == _merged(whole)


@SETTINGS
@given(text=TEXT, cut_points=st.lists(st.integers(min_value=0), max_size=12))
def test_every_call_begins_ends_and_carries_a_json_object(text, cut_points):
    import json

    events = _merged(_stream(ToolCallParser(TOOLS), _cuts(text, cut_points)))
    calls = [event for event in events if event[0] != "content"]
    assert len(calls) % 3 == 0
    for index in range(0, len(calls), 3):
        begin, arguments, end = calls[index:index + 3]
        assert (begin[0], arguments[0], end[0]) == ("begin", "arguments", "end")
        assert begin[1] == arguments[1] == end[1] == index // 3
        assert isinstance(json.loads(arguments[2]), dict), arguments
