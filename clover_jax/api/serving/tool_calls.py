"""Tool calls as the Qwen3.5/3.6 family writes them, parsed from the answer as it streams.

Two forms between `<tool_call>` and `</tool_call>`:

    <tool_call>                                  <tool_call>
    <function=get_weather>                       {"name": "get_weather", "arguments": {"city": "Paris"}}
    <parameter=city>                             </tool_call>
    Paris
    </parameter>
    </function>
    </tool_call>

Each call becomes an OpenAI tool call whose `function.arguments` is a JSON object string. In the
parameter form every value is text: it is typed by the tool's JSON schema (`integer`, `number`,
`boolean`, `null`, `object`, `array`, from `type`, `enum`/`const` or `anyOf`/`oneOf`, following a
local `$ref`; `string` and unknown parameters stay text), with the one
newline after `<parameter=…>` and before `</parameter>` dropped. Events come out as soon as the
text allows: a call's name when `<function=NAME>` is complete, its arguments one parameter at a
time (`{"city": "Paris"` … `, "days": 3` … `}`), so the fragments concatenate to the arguments
string. The JSON form is emitted whole at its `</tool_call>`. A call still open when the answer
ends is closed with the parameters it completed. Text outside the tags is the message content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Sequence

from clover_jax.api.serving.text import partial_suffix

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>")
PARAMETER_END, FUNCTION_END = "</parameter>", "</function>"


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """push(text) -> events; finish() -> the events of what is left. Events:
    ("content", text), ("begin", index, name), ("arguments", index, fragment), ("end", index)."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None):
        self.schemas = {}
        for tool in tools or ():
            function = tool.get("function", {}) if isinstance(tool, Mapping) else {}
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                self.schemas[function["name"]] = function.get("parameters") or {}
        self.held = ""
        self.state = "content"
        self.count = 0           # calls begun
        self.name: str | None = None
        self.seen: set[str] = set()
        self.text_since_call = False  # content began after the latest call

    # ------------------------------------------------------------------ streaming
    def push(self, text: str) -> list[tuple]:
        self.held += text
        return self._run(final=False)

    def finish(self) -> list[tuple]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[tuple]:
        events: list[tuple] = []
        while True:
            before = (self.state, self.held, len(events))
            getattr(self, "_" + self.state)(events, final)
            events[:] = [event for event in events if event[0] != "content" or event[1]]
            if (self.state, self.held, len(events)) == before:
                return events

    def _content(self, events: list, final: bool) -> None:
        # Whitespace next to a call (before it, between calls, after the last) is not content: it is
        # held until the next text shows whether a call follows. An answer without calls is untouched.
        if self.count and not self.text_since_call:
            stripped = self.held.lstrip()
            self.held = stripped
            if not stripped:
                return
            self.text_since_call = not stripped.startswith(START[:len(stripped)])
        start = self.held.find(START)
        if start >= 0:
            events.append(("content", self.held[:start].rstrip()))
            self.state, self.held = "call", self.held[start + len(START):]
            return
        if final:
            events.append(("content", self.held.rstrip() if self.count else self.held))
            self.held = ""
            return
        keep = partial_suffix(self.held, START)
        sent = self.held[:len(self.held) - keep].rstrip()
        events.append(("content", sent))
        self.held = self.held[len(sent):]

    def _call(self, events: list, final: bool) -> None:
        """Right after <tool_call>: which form."""
        body = self.held.lstrip()
        if body.startswith("<"):
            self.state = "function"
        elif body.startswith("{"):
            self.state = "json"
        elif body or final:
            self._abandon(events)  # neither form: the tag was text after all

    def _function(self, events: list, final: bool) -> None:
        match = _FUNCTION.match(self.held)
        if match is None:
            if final or not _could_begin(self.held.lstrip(), "<function="):
                self._abandon(events)
            return
        self.name = match.group(1).strip()
        self.held = self.held[match.end():]
        events.append(("begin", self.count, self.name))
        self.seen = set()
        self.state = "parameters"

    def _parameters(self, events: list, final: bool) -> None:
        stripped = self.held.lstrip()
        if stripped.startswith(FUNCTION_END):
            events.append(("arguments", self.count, "}" if self.seen else "{}"))
            self.held = stripped[len(FUNCTION_END):]
            self.state = "closing"
            return
        match = _PARAMETER.match(self.held)
        if match is not None:
            end = self.held.find(PARAMETER_END, match.end())
            if end < 0:
                if final:
                    self._close(events)
                return
            name, value = match.group(1).strip(), self.held[match.end():end]
            self.held = self.held[end + len(PARAMETER_END):]
            if name not in self.seen:
                typed = json.dumps(self._typed(name, value), ensure_ascii=False)
                fragment = ("{" if not self.seen else ", ") + json.dumps(name, ensure_ascii=False) + ": " + typed
                self.seen.add(name)
                events.append(("arguments", self.count, fragment))
            return
        if final:
            self._close(events)
        elif not (FUNCTION_END.startswith(stripped) or _could_begin(stripped, "<parameter=")):
            # Neither a parameter nor </function> (often </tool_call> straight away): the call's
            # arguments end here, and what stands before </tool_call> is dropped as after </function>.
            # Dropping it only up to </tool_call>, never past, keeps the text after the call (a
            # stream cut anywhere and the whole text agree on where it starts).
            events.append(("arguments", self.count, "}" if self.seen else "{}"))
            self.state = "closing"

    def _closing(self, events: list, final: bool) -> None:
        """After </function>: the call ends at </tool_call> (anything else there is dropped)."""
        end = self.held.find(END)
        if end >= 0 or final:
            self.held = self.held[end + len(END):] if end >= 0 else ""
            self._end(events)

    def _json(self, events: list, final: bool) -> None:
        end = self.held.find(END)
        if end < 0:
            if final:
                self._abandon(events)
            return
        try:
            call = json.loads(self.held[:end])
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            self._abandon(events)
            return
        self.held = self.held[end + len(END):]
        events += [("begin", self.count, name), ("arguments", self.count, json.dumps(arguments, ensure_ascii=False))]
        self._end(events)

    # ------------------------------------------------------------------ helpers
    def _end(self, events: list) -> None:
        events.append(("end", self.count))
        self.count += 1
        self.state, self.text_since_call = "content", False

    def _close(self, events: list) -> None:
        """A call that stops early: closed with the parameters it completed."""
        events.append(("arguments", self.count, "}" if self.seen else "{}"))
        self.held = ""
        self._end(events)

    def _abandon(self, events: list) -> None:
        """Not a tool call after all (no function, broken JSON): the tag is content, and the text after
        it is read again as content, so that a later call in it is still a call (as it would be had the
        stream delivered the later call after this one was abandoned)."""
        events.append(("content", START))
        self.state, self.text_since_call = "content", True

    def _typed(self, name: str, text: str) -> Any:
        """A parameter's text as the type the tool's schema gives it."""
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        schema = self.schemas.get(self.name or "", {})
        properties = schema.get("properties", {}) if isinstance(schema, Mapping) else {}
        spec = properties.get(name) if isinstance(properties, Mapping) else None
        return typed_value(text, value_types(spec, schema))


def value_types(spec: Any, root: Any = None) -> list[str]:
    """The JSON types a parameter schema allows (`type`, a list of types, the types of `const` or
    `enum`, or those of `anyOf`/`oneOf`; a local `$ref` into `root`, the tool's parameters, is
    followed); [] when it says none (the value is read as text)."""
    spec = resolve(spec, root)
    if not isinstance(spec, Mapping):
        return []
    kind = spec.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "const" in spec:
        return [json_type(spec["const"])]
    if isinstance(spec.get("enum"), list):
        return list(dict.fromkeys(json_type(value) for value in spec["enum"]))
    options = spec.get("anyOf", spec.get("oneOf", []))
    return list(dict.fromkeys(t for option in options for t in value_types(option, root))) \
        if isinstance(options, list) else []


def resolve(spec: Any, root: Any, depth: int = 16) -> Any:
    """`spec` with a local `$ref` ("#/$defs/name", any JSON pointer into `root`) followed; a
    reference that leads nowhere is left as it is."""
    while depth and isinstance(spec, Mapping) and isinstance(spec.get("$ref"), str) and spec["$ref"].startswith("#"):
        target = root
        for part in spec["$ref"][1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, Mapping) else None
        if target is None:
            return spec
        spec, depth = target, depth - 1
    return spec


def json_type(value: Any) -> str:
    """The JSON type of a Python value as `json.loads` gives it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def typed_value(text: str, types: Sequence[str]) -> Any:
    """`text` as the first of `types` it reads as; text when none (or when "string" is allowed
    and no other type reads it)."""
    for kind in types:
        if kind == "string":
            continue
        try:
            if kind == "integer" and re.fullmatch(r"\s*-?\d+\s*", text):
                return int(text)
            if kind == "number":
                value = json.loads(text)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return value
            if kind == "boolean" and text.strip().lower() in ("true", "false"):
                return text.strip().lower() == "true"
            if kind == "null" and text.strip().lower() in ("null", "none"):
                return None
            if kind in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except ValueError:
            continue
    return text


def _could_begin(text: str, tag: str) -> bool:
    """Whether `text` may still grow into `tag` followed by a name and ">" (no newline in the name)."""
    if len(text) <= len(tag):
        return tag.startswith(text)
    return text.startswith(tag) and not any(c in text[len(tag):] for c in "\n>")
