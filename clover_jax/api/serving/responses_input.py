"""A Responses API request (`POST /v1/responses`) read and turned into the chat request the server runs.

The Responses API says with items what chat completions says with messages; the server decodes a
Responses request as the chat request it translates to (`protocol.read_chat`), so the two
endpoints share one template, one grammar and one parser:

    instructions + leading system/developer messages   -> one leading system message
    message (user, assistant, later system/developer)  -> a user or assistant message (a later system or
                                                           developer one as a user turn: Qwen's template
                                                           takes a system turn only first)
    reasoning, assistant message, function_call        -> one assistant message (reasoning_content,
                                                           content, tool_calls)
    function_call_output                               -> a tool message
    tools [{"type": "function", "name", ...}]          -> tools [{"type": "function", "function": {...}}]
    tool_choice {"type": "function", "name"}           -> tool_choice {"type": "function", "function": {...}}
    text.format                                        -> response_format
    max_output_tokens                                  -> max_tokens
    reasoning.effort "none" / "minimal"                -> chat_template_kwargs {"enable_thinking": false}

Items are read by the keys that carry the conversation (ids, statuses, annotations and the like are
ignored); a tool the server does not run (web_search, local_shell, custom, ...) is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from typing import Any, Callable, Iterator

from clover_jax.api.serving.errors import ApiError, bad_request
from clover_jax.api.serving.protocol import ChatRequest, Fields, boolean, one_of, read_chat, text

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
THINKING_OFF = ("none", "minimal")  # reasoning efforts that turn Clover's thinking off
SUMMARIES = ("auto", "concise", "detailed")
# Clover's decoding controls (and vLLM-style ones), sent with extra_body: passed to the chat reader as they are
CLOVER_FIELDS = ("seed", "top_k", "mode", "threshold", "block_size", "schedule", "schedule_params",
                 "repetition_penalty", "presence_penalty", "frequency_penalty")
# Responses fields that would change the output and are not implemented: refused by name when set
REFUSED = {
    "background": "background responses are not supported: wait for the response, or stream it",
    "conversation": "conversations are not supported: send previous_response_id, or the whole input",
    "prompt": "prompt templates are not supported: send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (/v1/chat/completions has logprobs)",
    "context_management": "context_management is not supported",
}
# chat parameter paths (what read_chat and prepare_chat name) -> the Responses request's own
_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"), ("tool_choice.function", "tool_choice"))
_TOOL_PATH = re.compile(r"tools\[(\d+)\]\.function")


@dataclasses.dataclass
class ResponsesRequest:
    chat: ChatRequest
    items: list[dict]      # the conversation as items: the previous response's, then this request's input
    echo: dict[str, Any]   # the request parameters a response repeats
    store: bool
    stream: bool
    tool_positions: list[int]  # per chat tool, its index in the request's `tools` (naming it in errors)


def read_responses(body: Any, previous_items: Callable[[str], list[dict]]) -> ResponsesRequest:
    """The request checked and translated; previous_items(id): a stored response's input and output
    items (raises ApiError 404 for an unknown id)."""
    fields = Fields(body)
    for name, message in REFUSED.items():
        if fields.get(name) not in (None, False, 0, "", [], {}):
            raise bad_request(message, name, "unsupported_parameter")
    _read_neutral(fields)
    previous_id = fields.get("previous_response_id", text)
    items = previous_items(previous_id) if previous_id is not None else []
    items = items + read_input(fields.get("input"))
    instructions = fields.get("instructions", text)
    tools, echoed_tools, positions = read_tools(fields.get("tools"))
    tool_choice = fields.get("tool_choice")
    reasoning = _read_reasoning(fields.get("reasoning"))
    text_config = _read_text(fields.get("text"))
    stream = fields.get("stream", boolean, False)
    store = fields.get("store", boolean, True)
    chat_body = {"model": fields.get("model"), "messages": chat_messages(items, instructions), "stream": stream}
    optional = {"tools": tools or None, "tool_choice": _chat_tool_choice(tool_choice),
                "parallel_tool_calls": fields.get("parallel_tool_calls"),
                "response_format": text_config.get("response_format"),
                "max_tokens": fields.get("max_output_tokens"), "temperature": fields.get("temperature"),
                "top_p": fields.get("top_p"), **{name: fields.get(name) for name in CLOVER_FIELDS}}
    chat_body.update({key: value for key, value in optional.items() if value is not None})
    kwargs = fields.get("chat_template_kwargs") or {}
    if reasoning.get("effort") in THINKING_OFF and isinstance(kwargs, dict):
        kwargs = {"enable_thinking": False, **kwargs}  # Clover's own field, sent explicitly, wins
    if kwargs:
        chat_body["chat_template_kwargs"] = kwargs
    fields.done()
    with responses_params(positions):
        chat = read_chat(chat_body)
    echo = {"instructions": instructions, "max_output_tokens": chat.sampling.max_tokens,
            "parallel_tool_calls": chat.parallel_tool_calls, "previous_response_id": previous_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": store, "temperature": chat.sampling.temperature, "top_p": chat.sampling.top_p,
            "text": {"format": text_config.get("format") or {"type": "text"}},
            "tool_choice": tool_choice if tool_choice is not None else "auto", "tools": echoed_tools,
            "truncation": "disabled", "metadata": fields.data.get("metadata") or {},
            "prompt_cache_key": fields.data.get("prompt_cache_key"),
            "safety_identifier": fields.data.get("safety_identifier"),
            # OpenAI's schema types `user` as a string (deprecated, never null): echoed when sent
            **({"user": fields.data["user"]} if fields.data.get("user") is not None else {})}
    return ResponsesRequest(chat, items, echo, store, stream, positions)


def _read_neutral(fields: Fields) -> None:
    """Fields that do not change the output: checked for their type, then not used."""
    include = fields.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise bad_request("include must be a list of strings", "include")
    for name in ("prompt_cache_key", "prompt_cache_retention", "user", "safety_identifier", "service_tier"):
        fields.get(name, text)
    for name in ("metadata", "client_metadata", "stream_options"):
        fields.get(name, _object)
    if fields.data.get("stream_options") is not None and not fields.data.get("stream"):
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    fields.get("truncation", one_of(("disabled",)))  # "auto" would drop input: the server refuses instead


@contextlib.contextmanager
def responses_params(positions: list[int]) -> Iterator[None]:
    """Within it, an ApiError that names a chat parameter names the Responses request's own
    (`max_tokens` -> `max_output_tokens`, `tools[k].function` -> `tools[i]` of the request, ...).
    positions: per chat tool, its index in the request's `tools`."""
    try:
        yield
    except ApiError as error:
        if error.param:
            renamed = _TOOL_PATH.sub(lambda m: f"tools[{positions[int(m.group(1))]}]", error.param)
            for chat_name, name in _PARAMS:
                if renamed == chat_name or renamed.startswith((chat_name + ".", chat_name + "[")):
                    renamed = name + renamed[len(chat_name):]
                    break
            error.message = error.message.replace(error.param, renamed)
            error.param = renamed
        raise


# ---------------------------------------------------------------------- input items
def read_input(value: Any) -> list[dict]:
    """`input` as items in one form (each a valid input item again: a stored conversation is read
    back by this same reader)."""
    if value is None:
        raise bad_request("input is required: a string or a list of items", "input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("input must be a string or a list of items", "input")
    return [_read_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _read_item(item: Any, where: str) -> dict:
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = one_of(ROLES)(item.get("role"), f"{where}.role")
        return {"type": "message", "role": role, "content": _read_content(item.get("content"), f"{where}.content")}
    if kind == "function_call":
        arguments = _required(item, "arguments", where)
        try:
            if not isinstance(json.loads(arguments), dict):
                raise ValueError
        except ValueError:
            raise bad_request(f"{where}.arguments must be a JSON object (as a string)", f"{where}.arguments") from None
        return {"type": kind, "call_id": _required(item, "call_id", where), "name": _required(item, "name", where),
                "arguments": arguments}
    if kind == "function_call_output":
        output = item.get("output")
        output = output if isinstance(output, str) else _read_content(output, f"{where}.output")
        return {"type": kind, "call_id": _required(item, "call_id", where), "output": output}
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        reasoning = _read_content(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        return {"type": kind, "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}]}
    raise bad_request(f"{where}.type {kind!r} is not supported: items are messages, function_call, "
                      "function_call_output and reasoning", f"{where}.type", "unsupported_parameter")


def _read_content(content: Any, where: str, kinds: tuple[str, ...] = ("input_text", "output_text", "text")) -> str:
    """A text, or text parts joined (a refusal part counts as text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in kinds + ("refusal",) or not isinstance(part.get(key), str):
            raise bad_request(f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got "
                              f"{kind!r}", f"{where}[{j}]", "unsupported_parameter")
        pieces.append(part[key])
    return "".join(pieces)


def _required(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} is required: a non-empty string", f"{where}.{key}")
    return value


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """The chat messages of a conversation's items (their form from `read_input`)."""
    leading = 0
    while leading < len(items) and items[leading]["type"] == "message" and \
            items[leading]["role"] in ("system", "developer"):
        leading += 1
    system = [instructions] if instructions else []
    system += [item["content"] for item in items[:leading]]
    messages: list[dict] = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for item in items[leading:]:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            messages.append({"role": "user", "content": item["content"]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            _add_to_assistant(messages, item)
    return messages


def _add_to_assistant(messages: list[dict], item: dict) -> None:
    """A reasoning, assistant message or function_call item joins the assistant turn it belongs to
    (reasoning first, then text, then calls), or begins one."""
    turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    kind = item["type"]
    fits = turn is not None and (kind == "function_call" or not turn.get("tool_calls") and not turn["content"] and (
        kind == "message" or "reasoning_content" not in turn))
    if not fits:
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    if kind == "reasoning":
        turn["reasoning_content"] = item["content"][0]["text"]
    elif kind == "message":
        turn["content"] = item["content"]
    else:
        turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
            "name": item["name"], "arguments": item["arguments"]}})


# ---------------------------------------------------------------------- tools, reasoning, text
def read_tools(value: Any) -> tuple[list[dict], list[dict], list[int]]:
    """(chat tools, the function tools as a response echoes them, each chat tool's index in `tools`).
    Tools of other kinds are dropped: the server runs none of them."""
    if value is None:
        return [], [], []
    if not isinstance(value, list):
        raise bad_request("tools must be a list of tool objects", "tools")
    chat_tools, echoed, positions = [], [], []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type is required", f"{where}.type")
        if kind != "function":
            logger.debug("dropped the %s tool %s: the server runs function tools only", kind, where)
            continue
        fields = Fields(tool, where)
        fields.get("type")
        function = {"name": fields.get("name", text)}
        for key, check in (("description", text), ("parameters", _object), ("strict", boolean)):
            if fields.get(key, check) is not None:
                function[key] = fields.data[key]
        fields.get("defer_loading", boolean)
        fields.done()
        chat_tools.append({"type": "function", "function": function})
        echoed.append({"type": "function", "description": None, "parameters": None, "strict": None, **function})
        positions.append(i)
    return chat_tools, echoed, positions


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice  # "auto", "none", "required"; anything else read_chat refuses
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice", "unsupported_parameter")


def _read_reasoning(value: Any) -> dict:
    if value is None:
        return {}
    fields = Fields(_object(value, "reasoning"), "reasoning")
    summary, older = fields.get("summary", one_of(SUMMARIES)), fields.get("generate_summary", one_of(SUMMARIES))
    reasoning = {"effort": fields.get("effort", one_of(EFFORTS)), "summary": summary or older}
    fields.done()
    return reasoning


def _read_text(value: Any) -> dict:
    """`text`: {"format": ..., "verbosity": "medium"} -> {"format": the chat response_format, or None}."""
    if value is None:
        return {}
    # (not `Fields`: chat's refusal of a `verbosity` field would answer for this one)
    value = _object(value, "text")
    for key in value.keys() - {"format", "verbosity"}:
        raise bad_request(f"unknown parameter 'text.{key}'", f"text.{key}", "unknown_parameter")
    if value.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported (only 'medium', the default)", "text.verbosity",
                          "unsupported_parameter")
    form = value.get("format")
    if form is not None:
        form = _object(form, "text.format")
    if form is None or form.get("type") == "text":
        return {}
    if form.get("type") == "json_schema":
        spec = {key: value for key, value in form.items() if key != "type"}
        return {"format": form, "response_format": {"type": "json_schema", "json_schema": spec}}
    return {"format": form, "response_format": form}


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON object", name)
    return value

