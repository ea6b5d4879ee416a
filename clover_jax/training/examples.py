"""Training data: JSONL files read into tokenised examples with their loss tokens.

One example per line, in one of three shapes (docs/training.md, "Data"):

* `{"messages": [...], "tools": [...]}`: an OpenAI-format chat, rendered once with the
  checkpoint's chat template; the loss tokens are the assistant turns as rendered, each through
  its end-of-turn token. A turn is located as the text the template adds after the conversation
  before it and the assistant's generation prompt, up to the first end-of-turn token; a template
  that renders earlier turns differently once later ones follow (Qwen's drops the reasoning of
  turns before the last user message) cannot be located that way, and `split_turns=True` makes
  one example per assistant turn instead, its prompt rendered as at inference.
* `{"prompt": str, "completion": str}`: the loss on the completion and an end-of-turn token.
* `{"text": str}`: the loss on every token and an end-of-turn token.

The text is encoded piece by piece (prompt, turn, prompt, ...), as inference encodes a prompt
and generates a response, so no token straddles a turn's edge. A malformed line, an unknown key,
a wrong type or a turn that cannot be located is a `DataError` (a `ValueError`) naming the file
and line, raised while reading — before anything is compiled.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from clover_jax.text.errors import ChatTemplateError

SHAPES = {"messages": ("messages", "tools"), "prompt": ("prompt", "completion"), "text": ("text",)}
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


class DataError(ValueError):
    """A training data line that cannot be used: `file`, `line` (1-based) and what is wrong."""

    def __init__(self, file: str, line: int, message: str):
        super().__init__(f"{file}, line {line}: {message}")
        self.file, self.line = file, line


class Example(NamedTuple):
    """ids: int32 [n] tokens; loss: bool [n], the trained tokens; turn_ends: the index after each
    trained span (an assistant turn's end-of-turn token, an example's last token); source:
    "file, line N", for errors about the example."""

    ids: np.ndarray
    loss: np.ndarray
    turn_ends: tuple[int, ...]
    source: str = ""


def read_examples(paths: str | os.PathLike | Sequence[str | os.PathLike], tokenizer, *, end_of_turn: Sequence[int],
                  split_turns: bool = False) -> list[Example]:
    """Every example of the JSONL file(s) `paths`, in file and line order.

    tokenizer: a `clover_jax.Tokenizer` (its chat template renders chats); end_of_turn: the
    end-of-turn (EOS) ids — the first closes completions and texts, any closes an assistant turn."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no training data: pass one or more JSONL files")
    eos_texts = [tokenizer.decode([token], skip_special_tokens=False) for token in end_of_turn]
    examples: list[Example] = []
    for path in paths:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"training data file {path!r} does not exist")
        for line_number, record in _records(path):
            where = lambda message, file=path, line=line_number: DataError(file, line, message)
            examples.extend(example._replace(source=f"{path}, line {line_number}")
                            for example in _examples(record, tokenizer, eos_texts, end_of_turn[0], split_turns, where))
    return examples


def _records(path: str) -> Iterable[tuple[int, dict]]:
    with open(path, "rb") as handle:  # read as bytes: a line that is not UTF-8 is that line's error
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(path, line_number, f"not UTF-8 text (byte {raw[error.start]:#04x} at offset "
                                f"{error.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(path, line_number, f"not valid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(record, dict):
                raise DataError(path, line_number, f"expected a JSON object, got {type(record).__name__}")
            yield line_number, record


def _examples(record: dict, tokenizer, eos_texts, eos_id: int, split_turns: bool, where) -> list[Example]:
    shape = next((name for name in SHAPES if name in record), None)
    if shape is None:
        raise where(f"a line holds 'messages', 'prompt' + 'completion' or 'text'; got keys {sorted(record)}")
    unknown = sorted(set(record) - set(SHAPES[shape]))
    if unknown:
        raise where(f"unknown key {unknown[0]!r} in a {shape!r} line (allowed: {', '.join(SHAPES[shape])})")
    if shape == "text":
        text = _string(record, "text", where)
        return [_pieces(tokenizer, [(text, True)], eos_id)]
    if shape == "prompt":
        prompt, completion = _string(record, "prompt", where), _string(record, "completion", where)
        return [_pieces(tokenizer, [(prompt, False), (completion, True)], eos_id)]
    messages, tools = _messages(record, where), record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise where("'tools' must be a list of objects (OpenAI function tools)")
    render = lambda chat, prompt=False: _render(tokenizer, chat, tools, prompt, where)
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise where("a chat needs at least one assistant message (the loss is on assistant turns)")
    if split_turns:
        examples = []
        for index in turns:
            prompt, through = render(messages[:index], True), render(messages[:index + 1])
            if not through.startswith(prompt):
                raise where(f"assistant message {index}: the chat template's rendering of the conversation through "
                            "it does not begin with its generation prompt, so its text cannot be located")
            turn = _through_end_of_turn(through, len(prompt), eos_texts, index, where)
            examples.append(_pieces(tokenizer, [(prompt, False), (through[len(prompt):turn], True)], None))
        return examples
    full = render(messages)
    pieces, done = [], 0
    for index in turns:
        prompt = render(messages[:index], True)
        if not full.startswith(prompt) or len(prompt) < done:
            raise where(f"assistant message {index} cannot be located in the rendered chat: the template renders "
                        "the conversation before it differently once later turns follow (Qwen templates drop "
                        "the reasoning of earlier turns); pass split_turns=True to train one example per turn")
        turn = _through_end_of_turn(full, len(prompt), eos_texts, index, where)
        pieces += [(full[done:len(prompt)], False), (full[len(prompt):turn], True)]
        done = turn
    # What the template adds after the last turn (a newline) is never generated: the example ends there.
    return [_pieces(tokenizer, pieces, None)]


def _messages(record: dict, where) -> list[dict]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise where("'messages' must be a non-empty list of message objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise where(f"message {index} must be an object, got {type(message).__name__}")
        unknown = sorted(set(message) - set(MESSAGE_KEYS))
        if unknown:
            raise where(f"message {index} has the unknown key {unknown[0]!r} (allowed: {', '.join(MESSAGE_KEYS)})")
        if message.get("role") not in ROLES:
            raise where(f"message {index} has role {message.get('role')!r}; roles are {', '.join(ROLES)}")
        for key in ("content", "reasoning_content"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise where(f"message {index}: {key!r} must be a string")
    return messages


def _string(record: dict, key: str, where) -> str:
    if key not in record:
        raise where(f"a {'text' if key == 'text' else 'prompt/completion'} line needs {key!r}")
    if not isinstance(record[key], str):
        raise where(f"{key!r} must be a string, got {type(record[key]).__name__}")
    return record[key]


def _render(tokenizer, messages, tools, add_generation_prompt: bool, where) -> str:
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except ChatTemplateError as error:
        raise where(str(error)) from None


def _through_end_of_turn(text: str, start: int, eos_texts: Sequence[str], index: int, where) -> int:
    """The end (exclusive) of the assistant turn starting at `start`: after its first end-of-turn token."""
    ends = [(text.find(eos, start), eos) for eos in eos_texts if eos]
    ends = [(position, eos) for position, eos in ends if position >= 0]
    if not ends:
        raise where(f"assistant message {index}: no end-of-turn token ({', '.join(map(repr, eos_texts))}) after it "
                    "in the rendered chat")
    position, eos = min(ends)
    return position + len(eos)


def _pieces(tokenizer, pieces: list[tuple[str, bool]], closing: int | None) -> Example:
    """Encode (text, trained) pieces one by one; `closing` (an end-of-turn id) is appended, trained."""
    ids: list[int] = []
    loss: list[bool] = []
    ends: list[int] = []
    for text, trained in pieces:
        if not text:
            continue
        encoded = tokenizer.encode(text, add_special_tokens=False)
        ids += encoded
        loss += [trained] * len(encoded)
        if trained and closing is None:
            ends.append(len(ids))
    if closing is not None:
        ids.append(closing)
        loss.append(True)
        ends.append(len(ids))
    return Example(np.asarray(ids, np.int32), np.asarray(loss, bool), tuple(ends))
