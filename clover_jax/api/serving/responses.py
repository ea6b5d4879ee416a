"""From response tokens to what a choice says: text, reasoning and tool calls, piece by piece.

    tokens -> IncrementalDecoder -> StopStrings -> ReasoningSplitter -> ToolCallParser -> deltas

A streamed response sends each push's deltas as they come; a whole response is the same deltas
put together (`Message`), so the two say the same thing by construction. Completions use the first
two stages only: their text is the model's, untouched.
"""

from __future__ import annotations

from typing import Any, Sequence

from clover_jax.api.serving.reasoning import ReasoningSplitter
from clover_jax.api.serving.text import IncrementalDecoder, StopStrings
from clover_jax.api.serving.tool_calls import ToolCallParser, call_id

Delta = dict[str, Any]  # OpenAI's `delta`: {"content"} | {"reasoning_content"} | {"tool_calls": [...]}


class ChoiceText:
    """One choice's tokens as deltas. reasoning: None (no reasoning parsing: completions), or
    whether the prompt already opened `<think>`; tools: the request's tools (None: no tool calls);
    first_call_only: `parallel_tool_calls: false` (calls after the first are dropped: a response
    decoded without a grammar may write several)."""

    def __init__(self, tokenizer, stops: Sequence[str], reasoning: bool | None = None,
                 tools: list[dict] | None = None, first_call_only: bool = False):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(stops)
        self.reasoning = None if reasoning is None else ReasoningSplitter(reasoning)
        self.tools = ToolCallParser(tools) if tools else None
        self.call_ids: list[str] = []
        self.first_call_only = first_call_only

    @property
    def stopped(self) -> bool:
        """A stop string was found: nothing after it is sent, and the request can end."""
        return self.stops.stopped

    def push(self, ids: Sequence[int]) -> list[Delta]:
        return self._text(self.stops.push(self.decoder.push(ids)), final=False)

    def finish(self) -> list[Delta]:
        text = "" if self.stops.stopped else self.stops.push(self.decoder.flush())
        return self._text(text + self.stops.flush(), final=True)

    @property
    def called(self) -> bool:
        return bool(self.call_ids)

    def _text(self, text: str, final: bool) -> list[Delta]:
        if self.reasoning is None:
            return [{"content": text}] if text else []
        pieces = self.reasoning.push(text) if text else []
        if final:
            pieces += self.reasoning.finish()
        deltas: list[Delta] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning_content": piece})
            else:
                deltas += self._content(piece, final=False)
        if final:
            deltas += self._content("", final=True)
        return _coalesced(deltas)

    def _content(self, text: str, final: bool) -> list[Delta]:
        if self.tools is None:
            return [{"content": text}] if text else []
        events = self.tools.push(text) if text else []
        if final:
            events += self.tools.finish()
        deltas = []
        for event in events:
            if self.first_call_only and event[0] in ("begin", "arguments") and event[1] > 0:
                continue  # parallel_tool_calls: false keeps the first call
            if event[0] == "content":
                deltas.append({"content": event[1]})
            elif event[0] == "begin":
                self.call_ids.append(call_id())
                deltas.append({"tool_calls": [{"index": event[1], "id": self.call_ids[-1], "type": "function",
                                               "function": {"name": event[2], "arguments": ""}}]})
            elif event[0] == "arguments":
                deltas.append({"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]})
        return deltas


def _coalesced(deltas: list[Delta]) -> list[Delta]:
    """Neighbouring text deltas of one kind joined (fewer, larger stream chunks)."""
    out: list[Delta] = []
    for delta in deltas:
        kind = next(iter(delta))
        if out and kind in ("content", "reasoning_content") and kind in out[-1]:
            out[-1] = {kind: out[-1][kind] + delta[kind]}
        else:
            out.append(delta)
    return out


class Message:
    """The deltas of a choice put together: OpenAI's `message` of a whole response."""

    def __init__(self):
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []

    def add(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            if "content" in delta:
                self.content.append(delta["content"])
            if "reasoning_content" in delta:
                self.reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls", ()):
                if call["index"] == len(self.calls):
                    self.calls.append({"id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}})
                self.calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")

    @property
    def text(self) -> str:
        return "".join(self.content)

    def as_openai(self) -> dict:
        # `refusal` is required by OpenAI's published response schema (null: the model never refuses by a
        # separate channel); SDKs treat it as optional, so only a schema check notices it missing.
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.text if (self.content or not self.calls) else None,
                                   "refusal": None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        return message


def prompt_tokens_details(stats: Sequence[Any]) -> dict[str, int]:
    """OpenAI's `usage.prompt_tokens_details` for the engine's `RequestStats` of a response's
    choices: `cached_tokens`, the prompt tokens whose state came from the prefix cache."""
    return {"cached_tokens": sum(one.cached_tokens for one in stats if one is not None)}
