"""Structured outputs in the server: a request's tools and response_format as one grammar.

`response_format` json_object/json_schema is a JSON constraint (`decoding.constraints.Constraint`).
Tool calls are decoded under a Lark grammar (llguidance's dialect) of the tool-call format the chat
template teaches, the Qwen3.5/3.6 parameter form that `tool_calls.ToolCallParser` reads:

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

with calls joined by "\\n". A tool's properties are written in its schema's order, each required one
always and each optional one at most once, and each VALUE is exactly a text the parser reads as a
value its schema allows: a string as itself (never containing `</parameter>`, within `enum`,
`const`, `minLength`/`maxLength` and `pattern`), any other type as its JSON (llguidance's `%json`,
laid out as `json.dumps` writes it), a union as either, the string side never spelling what the
parser would read as one of the others (`"null"` for `["string", "null"]`). A tag that is one token
of the vocabulary (Qwen's `<tool_call>`) is written as that token (`<[ID]>`: llguidance never spells
an added token from text), and free text never contains the tag's text.

    tool_choice named       one call of that tool
    tool_choice "required"  one call of any tool; several, joined, with parallel_tool_calls
    auto, a strict tool     free text, or free text and then calls (one without parallel_tool_calls)
                            (a response_format: its JSON, or calls)

A tool whose parameters the grammar cannot express (keywords beyond those above, a name that the
format cannot carry) is refused by name when it is strict; any other tool's calls then take any
parameters with text values, as the model writes them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

from clover_jax.api.serving.errors import bad_request
from clover_jax.api.serving.tool_calls import END, START, resolve, value_types
from decoding.constraints.matcher import JSON_LAYOUT, grammar_text
from decoding.constraints.spec import Constraint

# keywords that say nothing about a value (read and ignored)
_NOTES = {"description", "title", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema",
          "$id", "strict"}
_STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "pattern"} | _NOTES
_OBJECT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions"} | _NOTES
_ANY_TEXT = "/(?s:.*)/"
_VALUE_END = "\n</parameter>"
# what the parser reads as a value of another type than string (`tool_calls.typed_value`), per type
_READ_AS = {"integer": r"\s*-?\d+\s*", "boolean": r"\s*(?i:true|false)\s*", "null": r"\s*(?i:null|none)\s*",
            "number": r"[ \t\n\r]*(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|NaN|-?Infinity)[ \t\n\r]*",
            "object": r"[ \t\n\r]*[\[{](?s:.*)", "array": r"[ \t\n\r]*[\[{](?s:.*)"}


class Inexpressible(ValueError):
    """A schema the tool-call grammar cannot express; `field` names where (a request path)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class Tags:
    """The tool-call tags as Lark expressions: a one-token tag as its id (`<[ID]>`), else its text."""

    open: str
    close: str

    @property
    def open_is_token(self) -> bool:
        return self.open.startswith("<[")


def tags_of(tokenizer) -> Tags:
    """`tokenizer`'s tags: an added token whose text is the tag is written as that token."""
    added = {token.content: index for index, token in tokenizer.backend.get_added_tokens_decoder().items()}
    tag = lambda text: f"<[{added[text]}]>" if text in added else _literal(text)
    return Tags(tag(START), tag(END))


def check_compiles(constraint: Constraint) -> None:
    """A 400 naming the constraint's field when llguidance refuses its grammar (before any decoding;
    the tokenizer plays no part in a grammar's validity)."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint))
    except ValueError as refusal:
        error = str(refusal)
    if error:
        raise bad_request(f"{constraint.field} cannot be compiled: {error.strip()}", constraint.field)


# ---------------------------------------------------------------------- the whole grammar
def tool_constraint(tools: Sequence[Mapping[str, Any]], choice: str | None, parallel: bool, strict: Sequence[bool],
                    tags: Tags, content: Constraint | None = None) -> Constraint | None:
    """The grammar of a response to a chat request with `tools` (OpenAI's, as protocol reads them):
    choice None (auto), "required" or a tool's name; strict: per tool, its `strict`; content: the
    response_format's constraint. None where nothing constrains the response (auto, no strict tool,
    no response_format)."""
    if choice is None and not any(strict) and content is None:
        return None
    names = [tool["function"]["name"] for tool in tools]
    chosen = [i for i, name in enumerate(names) if choice in (None, "required") or name == choice]
    rules = [rule for i in chosen for rule in _tool_rules(i, tools[i]["function"], strict[i])]
    call = f'"\\n" ({" | ".join(f"t{i}" for i in chosen)}) "\\n" {tags.close}'
    several = parallel and choice in (None, "required")
    calls = f'{call} ("\\n" {tags.open} {call})*' if several else call
    not_a_call = f"/(?s:.+)/ & ~/(?s:.*){re.escape(START)}(?s:.*)/"
    if choice is not None:
        start = [f"start: {tags.open} {calls}"]
    elif content is not None:
        start = [f"start: content | {tags.open} {calls}", f"content: %json {_json(_content_schema(content))}"]
    elif tags.open_is_token:  # free text never holds the tag's text (the parser would read a call there)
        start = [f"start: PROSE? | PROSE? {tags.open} {calls}", f"PROSE: {not_a_call}"]
    else:  # the text before a call and the tag are one lexeme, which ends at the tag's first occurrence
        start = [f"start: PROSE? | HEAD {calls}", f"PROSE: {not_a_call}", f"HEAD: PROSE? {tags.open}"]
    field = f"tools[{names.index(choice)}].function.parameters" if choice not in (None, "required") else "tools"
    # in llguidance's JSON form: `decoding.constraints.matcher` reads a grammar as that JSON when the
    # response starts inside <think> (the grammar then follows `</think>`), and Lark text is not JSON
    lark = "\n".join([*start, *rules]) + "\n"
    return Constraint.lark(json.dumps({"grammars": [{"lark_grammar": lark}]}), field=field)


def _content_schema(content: Constraint) -> dict:
    return content.schema if content.kind == "json_schema" else {"type": "object"}


def _tool_rules(index: int, function: Mapping[str, Any], strict: bool) -> list[str]:
    """The rules of one tool's call body, `t{index}`; a strict tool's inexpressible schema is a 400."""
    name, where = function["name"], f"tools[{index}].function"
    if not _writable_name(name):
        raise bad_request(f"{where}.name {name!r} cannot be written in the tool-call format "
                          "(<function=NAME> holds no '>', newline or surrounding space)", f"{where}.name")
    head = f't{index}: "<function={_escaped(name)}>\\n"'
    try:
        arguments, rules = _parameter_rules(f"t{index}", function.get("parameters") or {}, f"{where}.parameters")
        rules = [f'{head} {arguments} "</function>"', *rules]
        _check(rules, f"{where}.parameters")
    except Inexpressible as error:
        if strict:
            raise bad_request(f"{error.field}: {error} (strict tools are decoded under their schema)",
                              error.field) from None
        rules = [f'{head} t{index}_any* "</function>"',  # any parameters, text values
                 f't{index}_any: "<parameter=" /[^>\\n\\s]([^>\\n]*[^>\\n\\s])?/ ">\\n" T{index}_TEXT "\\n"',
                 f"T{index}_TEXT: ({_text('')}) {_literal(_VALUE_END)}"]
    return rules


def _check(rules: list[str], field: str) -> None:
    """Inexpressible when llguidance refuses the rules (an embedded schema it cannot compile)."""
    import llguidance

    start = "start: " + rules[0].split(":", 1)[0]
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules])))
    if error:
        raise Inexpressible(field, f"llguidance cannot compile it: {error.strip()}")


# ---------------------------------------------------------------------- parameters
def _parameter_rules(prefix: str, parameters: Any, field: str) -> tuple[str, list[str]]:
    """The parameters of one call, in the schema's order: the sequence (a Lark expression) and its rules."""
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise Inexpressible(field, "the parameters must be a JSON schema of type object")
    _only(parameters, _OBJECT_KEYWORDS, field)
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, Mapping) or not isinstance(required, list) or \
            not all(isinstance(key, str) for key in required):
        raise Inexpressible(field, "properties must be an object and required a list of names")
    missing = [key for key in required if key not in properties]
    if missing:
        raise Inexpressible(f"{field}.required", f"required names {missing}, which are not properties")
    rules, items = [], []
    for k, (key, spec) in enumerate(properties.items()):
        where = f"{field}.properties.{key}"
        if not _writable_name(key):
            raise Inexpressible(where, f"the property name {key!r} cannot be written as <parameter=NAME>")
        rules += _value_rules(f"{prefix}_v{k}", spec, parameters, where)
        rules.append(f'{prefix}_p{k}: "<parameter={_escaped(key)}>\\n" {prefix}_v{k} "\\n"')
        items.append(f"{prefix}_p{k}" + ("" if key in required else "?"))
    return " ".join(items), rules


def _value_rules(name: str, spec: Any, root: Mapping, field: str) -> list[str]:
    """`name`: the text of one value up to and with "\\n</parameter>" (the parser cuts a value there)."""
    strings, other = _split(spec, root, field)
    types = value_types(spec, root)
    others = [t for t in types if t != "string"]
    excluded = "".join(f" & ~/{_READ_AS[t]}/" for t in dict.fromkeys(others) if t in _READ_AS)
    options, rules = [], []
    for s, string in enumerate(strings):
        terminal = f"{name.upper()}_S{s}"
        rules.append(f"{terminal}: ({_string(string, field)}{excluded}) {_literal(_VALUE_END)}")
        options.append(terminal)
    if other is not None:
        schema = dict(other)
        for defs in ("$defs", "definitions"):  # what a $ref in it may point at
            if defs in root and "$ref" in json.dumps(other):
                schema.setdefault(defs, root[defs])
        options.append(f"%json {_json(schema)} {_literal(_VALUE_END)}")
    if not options:
        raise Inexpressible(field, "no value of this schema can be written")
    return [f"{name}: {' | '.join(options)}", *rules]


def _split(spec: Any, root: Mapping, field: str) -> tuple[list[dict], dict | None]:
    """The string schemas a value may satisfy (written as text) and the schema of its other values
    (written as JSON), or None."""
    spec = resolve(spec, root)
    if spec is True or spec == {}:
        return [{}], None  # any value: the parser reads it as text
    if not isinstance(spec, Mapping):
        raise Inexpressible(field, "a property's schema must be an object")
    options = spec.get("anyOf", spec.get("oneOf"))
    if options is not None and "type" not in spec:
        if not isinstance(options, list) or set(spec) - {"anyOf", "oneOf"} - _NOTES:
            raise Inexpressible(field, "anyOf/oneOf are written beside annotations only")
        strings, others = [], []
        for option in options:
            one_strings, one_other = _split(option, root, field)
            strings += one_strings
            others += [one_other] if one_other is not None else []
        key = "oneOf" if "oneOf" in spec else "anyOf"
        return strings, (None if not others else others[0] if len(others) == 1 else {key: others})
    types = value_types(spec, root)
    if not types:
        if set(spec) - _NOTES:
            raise Inexpressible(field, f"a schema without a type is read as text; it has {sorted(set(spec) - _NOTES)}")
        return [{}], None
    strings = [_narrowed(spec, lambda t: t == "string")] if "string" in types else []
    rest = [t for t in types if t != "string"]
    other = _narrowed(spec, lambda t: t != "string") if rest else None
    strings = [s for s in strings if s is not None]
    return strings, other


def _narrowed(spec: Mapping, keep) -> dict | None:
    """`spec` restricted to the types `keep` accepts (its type list and its enum/const values)."""
    out = dict(spec)
    if isinstance(spec.get("type"), list):
        kept = [t for t in spec["type"] if keep(t)]
        out["type"] = kept[0] if len(kept) == 1 else kept
    if "const" in spec and not keep(value_types({"const": spec["const"]})[0]):
        return None
    if isinstance(spec.get("enum"), list):
        out["enum"] = [v for v in spec["enum"] if keep(value_types({"const": v})[0])]
        if not out["enum"]:
            return None
    return out


def _string(spec: Mapping, field: str) -> str:
    """A Lark terminal expression for the text of a string value that this schema allows."""
    _only(spec, _STRING_KEYWORDS, field)
    if "const" in spec or "enum" in spec:
        values = [spec["const"]] if "const" in spec else spec["enum"]
        if not isinstance(values, list):
            raise Inexpressible(field, "enum must be a list")
        values = [v for v in values if isinstance(v, str) and "</parameter>" not in v]
        if not values:
            raise Inexpressible(field, "no value of its enum can be written")
        return "(" + " | ".join(_literal(v) for v in values) + ")"
    low, high = spec.get("minLength", 0), spec.get("maxLength")
    counts = lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if not counts(low) or not (high is None or counts(high)):
        raise Inexpressible(field, "minLength and maxLength must be integers >= 0")
    text = _text(f"{{{low},{'' if high is None else high}}}" if low or high is not None else "")
    if "pattern" in spec:
        text += f" & /{_pattern(spec['pattern'], field)}/"
    return text


def _text(count: str) -> str:
    """Any text (of `count` characters: a regex repetition) that does not contain `</parameter>`."""
    return f"/(?s:.{count or '*'})/ & ~/(?s:.*)<\\/parameter>(?s:.*)/"


def _pattern(pattern: Any, field: str) -> str:
    """A JSON schema pattern (a search, ECMA syntax) as a whole-text Lark regex."""
    import llguidance

    if not isinstance(pattern, str):
        raise Inexpressible(field, "pattern must be a string")
    head = pattern.startswith("^")
    tail = pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[int(head):len(pattern) - int(tail)]
    try:
        core = llguidance.regex_to_lark(core, "dw")
    except ValueError as error:
        raise Inexpressible(field, f"pattern {pattern!r}: {error}") from None
    return f"{'' if head else '(?s:.*)'}({core}){'' if tail else '(?s:.*)'}"


# ---------------------------------------------------------------------- text
def _only(spec: Mapping, keywords: set[str], field: str) -> None:
    extra = sorted(set(spec) - keywords)
    if extra:
        raise Inexpressible(field, f"the tool-call grammar does not express {extra} here")


def _writable_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and name == name.strip() and not set(name) & {">", "\n"}


def _literal(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _escaped(text: str) -> str:
    """`text` inside a Lark string literal."""
    return _literal(text)[1:-1]


def _json(schema: Mapping) -> str:
    """An embedded JSON schema, laid out as `json.dumps` writes JSON (as response_format's is)."""
    return json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}})
