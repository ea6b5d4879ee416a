"""Anthropic's Messages API request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), read
into the server's own chat request (`protocol.ChatRequest`), so that one pipeline serves both APIs.

    system, messages (text, tool_use, tool_result, thinking blocks)  ->  OpenAI-style chat messages
    tools (name, description, input_schema, strict)                   ->  function tools
    tool_choice auto / any / tool / none                              ->  None / "required" / NAME / "none"
    thinking enabled / adaptive / disabled (left out: disabled)       ->  chat_template_kwargs.enable_thinking
    output_config.format json_schema                                  ->  the response_format grammar

As on the chat endpoint, every field is checked before the engine sees the request; fields that do
not change the output (`metadata`, `cache_control` anywhere, `service_tier`, ...) are accepted and
not used, fields that would change it and are not implemented (image and document blocks, server
tools, MCP servers, a final assistant turn to continue) are refused by name, and an unknown field is
a 400.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from clover_jax.api.serving.errors import bad_request
from clover_jax.api.serving.protocol import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    ChatRequest,
    Fields,
    Sampling,
    boolean,
    integer,
    number,
    one_of,
    text,
)
from clover_jax.core.errors import FieldError
from decoding.constraints.spec import Constraint

ROLES = ("user", "assistant", "system")
THINKING = ("enabled", "adaptive", "disabled")
TOOL_CHOICES = ("auto", "any", "tool", "none")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# top-level fields that say nothing about the output: routing, billing, caching and tracing hints
NEUTRAL_TEXT = ("service_tier", "speed", "inference_geo", "user_profile_id", "workspace_id")
NEUTRAL_OBJECTS = ("metadata", "cache_control", "diagnostics", "context_management")
# top-level fields that would change the output and have no counterpart here
REFUSED = {"mcp_servers": "MCP servers are not supported: send their tools as tools",
           "container": "containers (code execution) are not supported"}
ERROR_PREFIX = "Error: "  # a tool_result with is_error: true reaches the template as this text before its content


@dataclasses.dataclass
class MessagesRequest:
    model: str          # as the client named it (any name is served by the one model)
    chat: ChatRequest   # the same request for the chat pipeline, under the served model's name


def read_messages(body: Any, served: str, counting: bool = False) -> MessagesRequest:
    """A Messages body (counting: a count_tokens body, where max_tokens may be left out)."""
    fields = Fields(body)
    model = _required(fields, "model", text)
    max_tokens = fields.get("max_tokens", integer(1))
    if max_tokens is None and not counting:
        raise bad_request("max_tokens is required: the most tokens the response may have", "max_tokens")
    conversation = fields.get("system", _system, []) + _conversation(fields.get("messages"))
    tools, strict = fields.get("tools", _tools, (None, []))
    forced, parallel = _tool_choice(fields.get("tool_choice"), tools)
    if forced == "none":  # as read_chat: the template is not shown the tools
        tools, forced, strict = None, None, []
    thinking = fields.get("thinking", _thinking, False)
    sampling = _sampling(fields, max_tokens)
    for name in NEUTRAL_TEXT:
        fields.get(name, text)
    for name in NEUTRAL_OBJECTS:
        fields.get(name, _object)
    for name, why in REFUSED.items():
        if fields.get(name) not in (None, [], {}):
            raise bad_request(why, name, "unsupported_parameter")
    fields.done()
    chat = ChatRequest(served, conversation, tools, {"enable_thinking": thinking}, sampling, forced, parallel, strict)
    return MessagesRequest(model, chat)


def _sampling(fields: Fields, max_tokens: int | None) -> Sampling:
    sampling = Sampling(max_tokens=max_tokens)
    sampling.stop = fields.get("stop_sequences", _stops, [])
    sampling.temperature = fields.get("temperature", number(0.0, 1.0))  # Anthropic's range
    sampling.top_p = fields.get("top_p", number(0.0, 1.0, low_open=True))
    sampling.top_k = fields.get("top_k", integer(0))
    sampling.stream = fields.get("stream", boolean, False)
    sampling.include_usage = True  # a stream's last chunk carries the usage of message_delta
    sampling.response_format = fields.get("output_config", _output_config)
    return sampling


# ---------------------------------------------------------------------- conversation
def _system(value: Any, name: str) -> list[dict]:
    return [{"role": "system", "content": _text_of(value, name)}]


def _conversation(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    turns = []
    for i, message in enumerate(value):
        turns += _turn(message, f"messages[{i}]")
    if value[-1].get("role") == "assistant":
        raise bad_request("a final assistant message (prefill) is not supported: end with a user message",
                          f"messages[{len(value) - 1}]", "unsupported_parameter")
    return turns


def _turn(message: Any, where: str) -> list[dict]:
    fields = Fields(message, where)
    role = _required(fields, "role", one_of(ROLES))
    content = _required(fields, "content")
    fields.done()
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    if role == "system":
        return [{"role": "system", "content": _text_of(content, f"{where}.content")}]
    blocks = [_block(block, role, f"{where}.content[{j}]") for j, block in enumerate(content)]
    return [_assistant(blocks)] if role == "assistant" else _user(blocks)


def _user(blocks: list[dict]) -> list[dict]:
    """Tool results become tool messages (the template renders them), in order; the text blocks
    between them, joined by newlines, a user message."""
    turns, texts = [], []
    for block in blocks:
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        if texts:
            turns.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        turns.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": block["content"]})
    if texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _assistant(blocks: list[dict]) -> dict:
    turn: dict[str, Any] = {"role": "assistant",
                            "content": "\n".join(b["text"] for b in blocks if b["type"] == "text")}
    reasoning = [b["thinking"] for b in blocks if b["type"] == "thinking"]
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    calls = [{"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}}
             for b in blocks if b["type"] == "tool_use"]
    if calls:
        turn["tool_calls"] = calls
    return turn


# the blocks each role may send; any other type (image, document, server tool blocks) is refused by name
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}


def _block(block: Any, role: str, where: str) -> dict:
    fields = Fields(block, where)
    kind = _required(fields, "type", text)
    if kind not in _BLOCKS[role]:
        raise bad_request(f"{where}.type: {kind!r} blocks are not supported in a {role} message; supported: "
                          f"{list(_BLOCKS[role])}", f"{where}.type", "unsupported_parameter")
    fields.get("cache_control", _object)
    out: dict[str, Any] = {"type": kind}
    if kind == "text":
        out["text"] = _required(fields, "text", text)
        fields.get("citations")  # where an earlier answer's text came from: not part of the text
    elif kind == "tool_result":
        out["tool_use_id"] = _required(fields, "tool_use_id", text)
        content = _text_of(fields.get("content", None, ""), f"{where}.content")
        out["content"] = ERROR_PREFIX + content if fields.get("is_error", boolean, False) else content
    elif kind == "thinking":
        out["thinking"] = _required(fields, "thinking", text)
        fields.get("signature", text)  # nothing here signs or checks thinking
    elif kind == "redacted_thinking":
        fields.get("data", text)  # encrypted by another server: unreadable here, dropped
    else:  # tool_use
        out["id"] = _required(fields, "id", text)
        out["name"] = _required(fields, "name", text)
        out["input"] = _required(fields, "input", _object)
        fields.get("caller", _object)
    fields.done()
    return out


def _text_of(value: Any, where: str) -> str:
    """A string, or text blocks joined by newlines (system prompts, tool results)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(value):
        fields = Fields(block, f"{where}[{j}]")
        kind = _required(fields, "type", text)
        if kind != "text":
            raise bad_request(f"{where}[{j}].type: {kind!r} blocks are not supported here; only text blocks",
                              f"{where}[{j}].type", "unsupported_parameter")
        texts.append(_required(fields, "text", text))
        fields.get("cache_control", _object)
        fields.get("citations")
        fields.done()
    return "\n".join(texts)


# ---------------------------------------------------------------------- tools
def _tools(value: Any, name: str) -> tuple[list[dict] | None, list[bool]]:
    """Anthropic's custom tools as the chat endpoint's function tools, and each one's `strict`."""
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list of {{'name', 'description', 'input_schema'}} objects", name)
    tools, strict = [], []
    for i, tool in enumerate(value):
        function, is_strict = _tool(tool, f"{name}[{i}]")
        if any(function["name"] == other["function"]["name"] for other in tools):
            raise bad_request(f"{name}[{i}].name {function['name']!r} names a tool twice", f"{name}[{i}].name")
        tools.append({"type": "function", "function": function})
        strict.append(is_strict)
    return tools or None, strict


def _tool(tool: Any, where: str) -> tuple[dict, bool]:
    fields = Fields(tool, where)
    kind = fields.get("type", text, "custom")
    if kind != "custom":  # bash_..., web_search_..., text_editor_...: Anthropic runs those itself
        raise bad_request(f"{where}.type: server tools ({kind!r}) are not supported; send custom tools",
                          f"{where}.type", "unsupported_parameter")
    function = {"name": _required(fields, "name", text)}
    description = fields.get("description", text)
    if description is not None:
        function["description"] = description
    function["parameters"] = _required(fields, "input_schema", _object)
    strict = fields.get("strict", boolean, False)
    fields.get("cache_control", _object)
    fields.get("eager_input_streaming", boolean)  # the input streams as it is decided either way
    fields.done()
    return function, strict


def _tool_choice(value: Any, tools: list[dict] | None) -> tuple[str | None, bool]:
    """(forced: None, "required", a tool's name or "none"; parallel tool calls allowed)."""
    if value is None:
        return None, True
    fields = Fields(value, "tool_choice")
    kind = _required(fields, "type", one_of(TOOL_CHOICES))
    name = fields.get("name", text) if kind == "tool" else None
    parallel = not fields.get("disable_parallel_tool_use", boolean, False)
    fields.done()
    if kind in ("auto", "none"):
        return (None if kind == "auto" else "none"), parallel
    if not tools:
        raise bad_request(f"tool_choice {kind!r} forces a tool call: send tools", "tool_choice")
    if kind == "any":
        return "required", parallel
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise bad_request(f"tool_choice names the tool {name!r}, which is not one of the tools {names}",
                          "tool_choice.name")
    return name, parallel


# ---------------------------------------------------------------------- other fields
def _thinking(value: Any, name: str) -> bool:
    """Whether the chat template opens thinking. budget_tokens and display are read, not enforced:
    the engine has no per-request thinking budget."""
    fields = Fields(_object(value, name), name)
    kind = _required(fields, "type", one_of(THINKING))
    budget = fields.get("budget_tokens", integer(1))
    if kind == "enabled" and budget is None:
        raise bad_request(f"{name}.budget_tokens is required with type 'enabled'", f"{name}.budget_tokens")
    fields.get("display", one_of(("summarized", "omitted")))
    fields.done()
    return kind != "disabled"


def _output_config(value: Any, name: str) -> Constraint | None:
    """output_config.format {"type": "json_schema", "schema"}: the response is decoded under the
    schema, as the chat endpoint's response_format; `effort` is read, not used."""
    fields = Fields(_object(value, name), name)
    fields.get("effort", one_of(EFFORTS))
    spec = fields.get("format", _object)
    fields.done()
    if spec is None:
        return None
    where = f"{name}.format"
    format_fields = Fields(spec, where)
    _required(format_fields, "type", one_of(("json_schema",)))
    schema = _required(format_fields, "schema", _object)
    format_fields.done()
    try:
        return Constraint.json_schema(schema, field=f"{where}.schema")
    except FieldError as error:
        raise bad_request(str(error), error.field) from None


def _stops(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(stop, str) for stop in value):
        raise bad_request(f"{name} must be a list of strings", name)
    if len(value) > MAX_STOPS or any(not stop or len(stop) > MAX_STOP_CHARS for stop in value):
        raise bad_request(f"{name} holds at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} "
                          "characters", name)
    return value


def _required(fields: Fields, key: str, check=None) -> Any:
    value = fields.get(key, check)
    if value is None:
        raise bad_request(f"{fields.name(key)} is required", fields.name(key))
    return value


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON object", name)
    return value
