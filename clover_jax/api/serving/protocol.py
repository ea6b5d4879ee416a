"""The OpenAI request bodies the server accepts, read and checked field by field.

Every field is checked for its type and range before anything is computed. OpenAI fields that do
not change the output (`store`, `metadata`, `user`, `service_tier`, `prompt_cache_key`,
`safety_identifier`) are accepted and checked for their type; OpenAI fields that would change the
output and are not implemented (`UNSUPPORTED`: `logit_bias`, `suffix`, `best_of` other than 1,
...) are refused by name rather than ignored,
and so is any field the server does not know (a typo is a 400, not a silent default). Clover's own
decoding controls ride as extra fields (`threshold`, `block_size`, `schedule`, `schedule_params`,
`mode`; vLLM-style `top_k` and `repetition_penalty` too), as OpenAI clients send them with `extra_body`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable

from clover_jax.api.serving.errors import bad_request
from clover_jax.core.errors import FieldError
from decoding.constraints.spec import Constraint
from decoding.modes import MODES

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_PROMPTS = 64
MAX_CHOICES = 8                # n
MAX_TOP_LOGPROBS = 20          # chat's top_logprobs (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5    # completions' logprobs (OpenAI's bound)
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # response_format.json_schema.name (OpenAI's rule)
# Output-changing OpenAI fields the server does not implement: refused by name when set.
UNSUPPORTED = {
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix is not supported",
    "reasoning_effort": "reasoning_effort is not supported: send chat_template_kwargs {'enable_thinking': false} to "
                        "turn thinking off",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "functions": "functions and function_call are the legacy form: send tools and tool_choice",
    "function_call": "functions and function_call are the legacy form: send tools and tool_choice",
    "prediction": "predicted outputs are not supported",
    "audio": "audio is not supported",
}


@dataclasses.dataclass
class Sampling:
    """The generation fields shared by both endpoints (None: the checkpoint's default)."""

    max_tokens: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    threshold: float | None = None
    block_size: int | None = None
    schedule: str | None = None
    schedule_params: dict | None = None
    mode: str = "diffusion"
    stream: bool = False
    include_usage: bool = False
    n: int = 1                      # choices per prompt; choice i samples with seed + i
    logprobs: bool = False          # log-probabilities of the response tokens (and, with echo, the prompt's)
    top_logprobs: int = 0           # the most likely alternatives at each position
    echo: bool = False              # completions: the prompt is part of the text (and of the logprobs)
    response_format: Constraint | None = None  # json_object / json_schema (None: text)


@dataclasses.dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    sampling: Sampling
    forced: str | None = None        # tool_choice: None (auto), "required", or the name of a function
    parallel_tool_calls: bool = True  # false: at most one tool call
    strict: list[bool] = dataclasses.field(default_factory=list)  # per tool, its `strict`


@dataclasses.dataclass
class CompletionRequest:
    model: str
    prompts: list  # each a str or a list of token ids
    sampling: Sampling


class Fields:
    """Reads a JSON object field by field; `done()` refuses the fields nobody read."""

    def __init__(self, data: Any, where: str = ""):
        if not isinstance(data, dict):
            raise bad_request(f"{where or 'the request body'} must be a JSON object")
        self.data, self.where, self.read = data, where, set()

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, check: Callable[[Any, str], Any] | None = None, default: Any = None) -> Any:
        self.read.add(key)
        value = self.data.get(key)
        if value is None:
            return default
        return check(value, self.name(key)) if check else value

    def done(self) -> None:
        for key in self.data:
            if key in UNSUPPORTED and self.data[key] not in (None, False, 0, "", [], {}):
                raise bad_request(UNSUPPORTED[key], self.name(key), "unsupported_parameter")
            if key not in self.read and key not in UNSUPPORTED:
                raise bad_request(f"unknown parameter {self.name(key)!r}", self.name(key), "unknown_parameter")


# ---------------------------------------------------------------------- value checks
def text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {_show(value)}", name)
    return value


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {_show(value)}", name)
    return value


def integer(low: int | None = None, high: int | None = None) -> Callable[[Any, str], int]:
    def check(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{name} must be an integer, got {_show(value)}", name)
        if low is not None and value < low or high is not None and value > high:
            raise bad_request(f"{name} must be {_range(low, high)}, got {value}", name)
        return value
    return check


def number(low: float | None = None, high: float | None = None, low_open: bool = False) -> Callable[[Any, str], float]:
    def check(value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {_show(value)}", name)
        if low is not None and (value <= low if low_open else value < low) or high is not None and value > high:
            raise bad_request(f"{name} must be {_range(low, high, low_open)}, got {value}", name)
        return float(value)
    return check


def one_of(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def check(value: Any, name: str) -> str:
        if value not in choices:
            raise bad_request(f"{name} must be one of {list(choices)}, got {_show(value)}", name)
        return value
    return check


def _range(low, high, low_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"<= {high}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def _show(value: Any) -> str:
    shown = json.dumps(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


# ---------------------------------------------------------------------- shared fields
def read_sampling(fields: Fields, max_tokens_names: tuple[str, ...]) -> Sampling:
    sampling = Sampling()
    given = {name: fields.get(name, integer(1)) for name in max_tokens_names}
    values = {v for v in given.values() if v is not None}
    if len(values) > 1:
        raise bad_request(f"{' and '.join(max_tokens_names)} differ ({given}); send one of them", max_tokens_names[0])
    sampling.max_tokens = values.pop() if values else None
    sampling.n = fields.get("n", integer(1, MAX_CHOICES), 1)
    sampling.stop = read_stop(fields)
    sampling.temperature = fields.get("temperature", number(0.0, 2.0))
    sampling.top_p = fields.get("top_p", number())  # its range, and the others' below: GenerationConfig's
    sampling.top_k = fields.get("top_k", integer(-1))
    seed = fields.get("seed", integer(-2**63, 2**63 - 1))
    sampling.seed = None if seed is None else seed % 2**63
    for name in ("presence_penalty", "frequency_penalty"):  # OpenAI's range; Clover's controls need >= 0
        setattr(sampling, name, fields.get(name, number(-2.0, 2.0)))
    sampling.repetition_penalty = fields.get("repetition_penalty", number())
    sampling.threshold = fields.get("threshold", number())
    sampling.block_size = fields.get("block_size", integer(1))
    sampling.schedule = fields.get("schedule", text)
    sampling.schedule_params = fields.get("schedule_params", _object)
    sampling.mode = fields.get("mode", one_of(MODES), "diffusion")
    sampling.stream = fields.get("stream", boolean, False)
    options = fields.get("stream_options", _object)
    if options is not None:
        if not sampling.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        option_fields = Fields(options, "stream_options")
        sampling.include_usage = option_fields.get("include_usage", boolean, False)
        option_fields.done()
    read_neutral(fields)
    fields.get("best_of", _one("best_of"))
    sampling.response_format = fields.get("response_format", read_response_format)
    return sampling


def read_response_format(value: Any, name: str) -> Constraint | None:
    """response_format: {"type": "text"} (None), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}} (the response is decoded under the
    schema whether `strict` is true or not)."""
    fields = Fields(_object(value, name), name)
    kind = fields.get("type", one_of(RESPONSE_FORMATS))
    if kind is None:
        raise bad_request(f"{name}.type is required: one of {list(RESPONSE_FORMATS)}", f"{name}.type")
    constraint = None
    if kind == "json_object":
        constraint = Constraint.json_object(field=name)
    elif kind == "json_schema":
        where = f"{name}.json_schema"
        if fields.data.get("json_schema") is None:
            raise bad_request(f"{where} is required for type json_schema", where)
        spec = Fields(fields.get("json_schema", _object), where)
        label = spec.get("name", text)
        if label is None or not FORMAT_NAME.fullmatch(label):
            raise bad_request(f"{where}.name is required: 1 to 64 letters, digits, underscores or dashes",
                              f"{where}.name")
        spec.get("description", text)
        spec.get("strict", boolean)
        schema = spec.get("schema", _object)
        if schema is None:
            raise bad_request(f"{where}.schema is required: the JSON schema the response keeps to", f"{where}.schema")
        spec.done()
        try:
            constraint = Constraint.json_schema(schema, field=f"{where}.schema")
        except FieldError as error:
            raise bad_request(str(error), error.field) from None
    fields.done()
    return constraint


def read_neutral(fields: Fields) -> None:
    """OpenAI fields that do not change the output: read for their type, then not used (storage,
    tiers, caching hints and end-user ids mean nothing to a server that keeps nothing)."""
    fields.get("store", boolean)
    metadata = fields.get("metadata", _object)
    if metadata is not None and not all(isinstance(value, str) for value in metadata.values()):
        raise bad_request("metadata must map keys to strings", "metadata")
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        fields.get(name, text)
    modalities = fields.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("only text is supported: modalities must be ['text']", "modalities", "unsupported_parameter")


def read_stop(fields: Fields) -> list[str]:
    stop = fields.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"stop holds at most {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                          "stop")
    return stops


def _one(name: str):
    def check(value: Any, where: str) -> int:
        if value != 1:
            raise bad_request(f"{name} must be 1, got {_show(value)}", where, "unsupported_parameter")
        return value
    return check


def _object(value: Any, name: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON object, got {_show(value)}", name)
    return value


# ---------------------------------------------------------------------- chat
def read_chat(body: Any) -> ChatRequest:
    fields = Fields(body)
    model = fields.get("model", text)
    if model is None:
        raise bad_request("model is required", "model")
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of message objects", "messages")
    messages = [read_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    tools = fields.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list of {'type': 'function', 'function': {...}} objects", "tools")
        tools = [read_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)] or None
        names = [tool["function"]["name"] for tool in tools or ()]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise bad_request(f"tools[{i}].function.name {name!r} names a tool twice", f"tools[{i}].function.name")
    forced = read_tool_choice(fields.get("tool_choice"), tools)
    strict = [bool(tool["function"].pop("strict", False)) for tool in tools or ()]
    if forced == "none":
        tools, forced, strict = None, None, []
    parallel = fields.get("parallel_tool_calls", boolean, True)
    template_kwargs = fields.get("chat_template_kwargs", _object, {})
    if "enable_thinking" in template_kwargs and not isinstance(template_kwargs["enable_thinking"], bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be true or false",
                          "chat_template_kwargs.enable_thinking")
    sampling = read_sampling(fields, ("max_tokens", "max_completion_tokens"))
    sampling.logprobs = fields.get("logprobs", boolean, False)
    sampling.top_logprobs = fields.get("top_logprobs", integer(0, MAX_TOP_LOGPROBS), 0)
    if sampling.top_logprobs and not sampling.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    fields.done()
    return ChatRequest(model, messages, tools, template_kwargs, sampling, forced, parallel, strict)


def read_tool_choice(choice: Any, tools: list[dict] | None) -> str | None:
    """tool_choice: None or "auto" -> None; "none"; "required"; {"type": "function", "function":
    {"name": N}} -> N, a function of `tools`."""
    if choice is None or choice == "auto":
        return None
    if choice == "none":
        return "none"
    if choice == "required" or isinstance(choice, dict):
        if not tools:
            raise bad_request("tool_choice forces a tool call: send tools", "tool_choice")
        if choice == "required":
            return "required"
        fields = Fields(choice, "tool_choice")
        fields.get("type", one_of(("function",)))
        function = Fields(fields.get("function", _object, {}), "tool_choice.function")
        name = function.get("name", text)
        function.done()
        fields.done()
        names = [tool["function"]["name"] for tool in tools]
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not one of the tools {names}",
                              "tool_choice.function.name")
        return name
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")


def read_message(message: Any, where: str) -> dict:
    fields = Fields(message, where)
    role = fields.get("role", one_of(ROLES))
    if role is None:
        raise bad_request(f"{where}.role is required", f"{where}.role")
    out = {"role": "system" if role == "developer" else role}
    content = fields.get("content")
    out["content"] = "" if content is None else read_content(content, f"{where}.content")
    name = fields.get("name", text)
    if name is not None:
        out["name"] = name
    if role == "assistant":
        reasoning = fields.get("reasoning_content", text)
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        calls = fields.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            out["tool_calls"] = [read_history_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
        fields.get("refusal")
    if role == "tool":
        call_id = fields.get("tool_call_id", text)
        if call_id is not None:
            out["tool_call_id"] = call_id
    if content is None and role != "assistant":
        raise bad_request(f"{where}.content is required for a {role} message", f"{where}.content")
    fields.done()
    return out


def read_content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    pieces = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                              f"{where}[{j}]")
        pieces.append(part["text"])
    return "".join(pieces)


def read_history_call(call: Any, where: str) -> dict:
    """An assistant's earlier tool call, with its arguments as an object (chat templates iterate them)."""
    fields = Fields(call, where)
    fields.get("id", text)
    fields.get("type", one_of(("function",)))
    function = Fields(fields.get("function", _object, {}), f"{where}.function")
    name = function.get("name", text)
    if name is None:
        raise bad_request(f"{where}.function.name is required", f"{where}.function.name")
    arguments = function.get("arguments", None, "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise bad_request(f"{where}.function.arguments is not valid JSON ({error.msg})",
                              f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    function.done()
    fields.done()
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if fields.data.get("id") is not None:
        out["id"] = fields.data["id"]
    return out


def read_tool(tool: Any, where: str) -> dict:
    fields = Fields(tool, where)
    fields.get("type", one_of(("function",)))
    function = Fields(fields.get("function", _object, {}), f"{where}.function")
    name = function.get("name", text)
    if not name:
        raise bad_request(f"{where}.function.name is required", f"{where}.function.name")
    out = {"name": name}
    description = function.get("description", text)
    if description is not None:
        out["description"] = description
    parameters = function.get("parameters", _object)
    if parameters is not None:
        out["parameters"] = parameters
    strict = function.get("strict", boolean)
    if strict is not None:  # taken out by read_chat (the chat template is not shown it)
        out["strict"] = strict
    function.done()
    fields.done()
    return {"type": "function", "function": out}


# ---------------------------------------------------------------------- completions
def read_completion(body: Any) -> CompletionRequest:
    fields = Fields(body)
    model = fields.get("model", text)
    if model is None:
        raise bad_request("model is required", "model")
    prompt = fields.get("prompt")
    prompts = read_prompts(prompt)
    sampling = read_sampling(fields, ("max_tokens",))
    top = fields.get("logprobs", integer(0, MAX_COMPLETION_LOGPROBS))
    sampling.logprobs, sampling.top_logprobs = top is not None, top or 0
    sampling.echo = fields.get("echo", boolean, False)
    fields.done()
    return CompletionRequest(model, prompts, sampling)


def read_prompts(prompt: Any) -> list:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    is_ids = lambda value: isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                          "token ids", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts
