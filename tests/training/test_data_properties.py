"""Generated training data lines: any line gives valid examples or a `DataError` (a `ValueError`)
naming the file and that line — never another exception, never an example that does not say
where it came from. Lines are drawn as arbitrary bytes, arbitrary JSON, and records that have the
keys a reader looks for but values of any type (chats with odd roles, tool calls and tools)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from clover_jax.text.tokenizer import Tokenizer
from clover_jax.training.examples import DataError, read_examples
from clover_jax.training.tiny.recipe import BUNDLED_DIR

IM_END = 2
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
TEXT = st.lists(st.sampled_from(list("0123456789 sort<>|_\n\\\"{}é") + ["<|im_end|>", "<think>", "</think>"]),
                max_size=12).map("".join)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"])},
    optional={"content": TEXT | JSON, "reasoning_content": TEXT | JSON, "name": TEXT | JSON,
              "tool_call_id": TEXT | JSON, "tool_calls": JSON | st.lists(st.fixed_dictionaries(
                  {"type": st.just("function"), "function": st.fixed_dictionaries(
                      {"name": TEXT, "arguments": TEXT | st.dictionaries(TEXT, JSON, max_size=2)})}), max_size=2),
              "extra": JSON})
RECORD = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4) | JSON},
                          optional={"tools": JSON | st.lists(st.fixed_dictionaries(
                              {"type": st.just("function"), "function": st.dictionaries(TEXT, JSON, max_size=3)}),
                              max_size=2), "extra": JSON}),
    st.fixed_dictionaries({"prompt": TEXT | JSON, "completion": TEXT | JSON}, optional={"extra": JSON}),
    st.fixed_dictionaries({"text": TEXT | JSON}, optional={"extra": JSON}),
    st.dictionaries(st.text(max_size=8), JSON, max_size=3),
)
LINE = st.one_of(RECORD.map(lambda record: json.dumps(record).encode()),
                 JSON.map(lambda value: json.dumps(value).encode()),
                 st.binary(max_size=24).filter(lambda raw: b"\n" not in raw and b"\r" not in raw))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(BUNDLED_DIR)


@SETTINGS
@given(before=st.lists(st.sampled_from([b"", b"   "]), max_size=2), line=LINE, split_turns=st.booleans())
def test_any_line_gives_examples_or_an_error_naming_its_file_and_line(tokenizer, tmp_path_factory, before, line,
                                                                      split_turns):
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_bytes(b"\n".join([*before, line]) + b"\n")
    line_number = len(before) + 1
    try:
        examples = read_examples(str(path), tokenizer, end_of_turn=[IM_END], split_turns=split_turns)
    except DataError as error:
        assert (error.file, error.line) == (str(path), line_number)
        assert str(error).startswith(f"{path}, line {line_number}: ")
        event("refused")
        return
    event("read")
    for example in examples:
        assert example.source == f"{path}, line {line_number}"
        assert len(example.ids) == len(example.loss) > 0 and example.loss.any()
        assert example.turn_ends and example.turn_ends[-1] <= len(example.ids)
