"""The chat-template sandbox: a checkpoint's Jinja chat template rendered as transformers renders it,
with bounds on the work it does.

Chat templates render in the sandbox transformers uses (`ImmutableSandboxedEnvironment` with
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that does not escape HTML, the
globals ``raise_exception``, ``strftime_now``, a restricted ``dict`` and ``namespace``), with the
same variables (``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named
special tokens, every extra keyword such as ``enable_thinking``). A template comes with the
checkpoint, so it is untrusted: this sandbox also bounds its work — loop iterations and calls
(`MAX_TEMPLATE_STEPS`), the size of any string or list it builds and of its output
(`MAX_TEMPLATE_CHARS`) — and any failure while rendering (a huge ``range``, runaway recursion, an
error in the template) is a one-line `ChatTemplateError`.

`render_chat_template` is the one entry point: `Tokenizer.apply_chat_template`
(`clover_jax.text.tokenizer`) and the training task's `render_chat` both render through it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import functools
import json
import re
from typing import Any, Mapping, Sequence

import numpy as np

from clover_jax.core.json_fields import show
from clover_jax.text.errors import ChatTemplateError, one_line as _one_line

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message

# Bounds on one rendering of a chat template (checkpoints ship templates; they are untrusted code).
MAX_TEMPLATE_STEPS = 1_000_000  # loop iterations + calls; real templates use a few per message
MAX_TEMPLATE_CHARS = 1 << 25    # 33.5M characters for any string, list or the output: far beyond any context
MAX_POWER_BITS = 1 << 16        # `a ** b` whose result would need more bits than this is refused

Message = Mapping[str, Any]


def render_chat_template(template: str, messages: Sequence[Message], add_generation_prompt: bool = False,
                         tools: list | None = None, documents: list | None = None,
                         continue_final_message: bool | str = False, **variables: Any) -> str:
    """Render one conversation with a Jinja chat template, as transformers renders it, within the
    bounds of `MAX_TEMPLATE_STEPS` and `MAX_TEMPLATE_CHARS`. This is the one sandbox every chat
    template in clover-jax renders in (the training task's `render_chat` included)."""
    import jinja2

    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {index} must be a dict with 'role' and 'content', got {show(message)}")
        message = {key: value for key, value in _plain(message).items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not (isinstance(value, list) and all(isinstance(v, Mapping) for v in value)):
            raise ChatTemplateError(f"{name} must be a list of dicts (JSON schemas for tools)")
    final = _mark_final_message(chat, template, continue_final_message) if continue_final_message else None
    budget = _Budget()
    token = _BUDGET.set(budget)
    try:
        compiled = _compile(template)
        pieces = []
        for piece in compiled.generate(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                       add_generation_prompt=add_generation_prompt, **_plain(variables)):
            budget.output += len(piece)
            if budget.output > MAX_TEMPLATE_CHARS:
                raise _TemplateLimit(f"its output exceeds {MAX_TEMPLATE_CHARS} characters")
            pieces.append(piece)
        rendered = "".join(pieces)
    except _TemplateLimit as error:
        raise ChatTemplateError(f"chat template stopped: {error}") from None
    except jinja2.TemplateError as error:  # raise_exception(...), syntax errors, sandbox refusals
        raise ChatTemplateError(f"chat template error: {_one_line(error)}") from error
    except RecursionError:
        raise ChatTemplateError("chat template stopped: it recurses too deeply") from None
    except MemoryError:
        raise ChatTemplateError("chat template stopped: it ran out of memory") from None
    except Exception as error:  # the template is code from the checkpoint: any failure is its error
        raise ChatTemplateError(f"chat template error: {type(error).__name__}: {_one_line(error)}") from error
    finally:
        _BUDGET.reset(token)
    return _cut_at_final_message(rendered, final) if final is not None else rendered


def _mark_final_message(chat: list[dict], template: str, field: bool | str) -> str:
    """transformers' continue_final_message: tag the end of the last message's text; the rendered
    chat is cut at the tag."""
    field = field if isinstance(field, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [name for name in _REASONING_FIELDS if last.get(name) == final]
    if not any(name in template for name in fields):
        raise ChatTemplateError(f'continue_final_message is set to "{field}" but the chat template does not read it')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    else:
        for name in fields:
            last[name] = last[name] + _CONTINUE_TAG
    return final


def _cut_at_final_message(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError("continue_final_message is set but the chat template drops part of the final "
                                "message, so it cannot be continued")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


def _plain(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON types (as transformers does): objects with methods
    the sandbox does not know would otherwise reach the template; anything else becomes a
    placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


class _TemplateLimit(Exception):
    """A chat template that exceeded a bound; reported as a ChatTemplateError."""


class _Budget:
    def __init__(self):
        self.steps = 0
        self.output = 0


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)
_COUNTED_ITERATION = "_clover_counted_iteration"  # filter wrapped around every for-loop's iterable
_SIZE_CHECKED = "_clover_size_checked"            # filter wrapped around every `~` concatenation
_FORMAT_NUMBER = re.compile(r"%[-#0 +]*(\d*|\*)(?:\.(\d*|\*))?")


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.steps += 1
        if budget.steps > MAX_TEMPLATE_STEPS:
            raise _TemplateLimit(f"it ran more than {MAX_TEMPLATE_STEPS} loop iterations and calls")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_TEMPLATE_CHARS:
        raise _TemplateLimit(f"it built a {type(value).__name__} of {len(value)} items, more than "
                             f"{MAX_TEMPLATE_CHARS}")
    return value


def _check_count(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEMPLATE_CHARS:
        raise _TemplateLimit(f"{what} {value} exceeds {MAX_TEMPLATE_CHARS}")


def _check_join(items: Any) -> None:
    if isinstance(items, (list, tuple)):
        total = sum(len(item) for item in items if isinstance(item, str))
        if total > MAX_TEMPLATE_CHARS:
            raise _TemplateLimit(f"joining {total} characters exceeds {MAX_TEMPLATE_CHARS}")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before computing it, an operation whose result would be enormous."""
    sized = (str, list, tuple)
    if operator == "*":
        count, sequence = (right, left) if isinstance(left, sized) else (left, right)
        if isinstance(sequence, sized) and isinstance(count, int) and count > 0 \
                and len(sequence) * count > MAX_TEMPLATE_CHARS:
            raise _TemplateLimit(f"repeating a {type(sequence).__name__} of {len(sequence)} items {count} times "
                                 f"exceeds {MAX_TEMPLATE_CHARS}")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1 \
                and abs(left).bit_length() * right > MAX_POWER_BITS:
            raise _TemplateLimit(f"{left} ** {right} is too large a number")
    elif operator == "%" and isinstance(left, str):
        arguments = right if isinstance(right, tuple) else (right,)
        for width, precision in _FORMAT_NUMBER.findall(left):
            for number in (width, precision):
                if number.isdigit():
                    _check_count(int(number), "a format width")
        if any(star == "*" for pair in _FORMAT_NUMBER.findall(left) for star in pair):
            for argument in arguments:
                _check_count(argument, "a format width")


def _counted_iteration(iterable: Any):
    return _CountedIterable(iterable)


class _CountedIterable:
    """A for-loop's iterable that counts each iteration against the rendering's budget."""

    def __init__(self, iterable: Any):
        self.iterable = iterable

    def __len__(self) -> int:
        return len(self.iterable)

    def __iter__(self):
        for item in self.iterable:
            _step()
            yield item


def _bounded_filter(function):
    # filters marked pass_context / pass_eval_context / pass_environment get that first, then the value
    value_at = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)  # keeps jinja_pass_arg, so jinja still passes the context
    def bounded(*args, **kwargs):
        _step()
        for argument in [*args[value_at + 1:], *kwargs.values()]:  # widths, counts, ...
            _check_count(argument, "a filter argument")
        if function.__name__ == "do_join" and len(args) > value_at:
            _check_join(args[value_at])
        return _check_size(function(*args, **kwargs))
    return bounded


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """transformers' sandbox (`_compile_jinja_template`) with bounds on the work a template does."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        _check_count(indent, "a tojson indent")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` in templates without exposing the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes (no CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attributes = dict(*args, **kwargs)
            for name in attributes:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%", "+"])

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return _check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _step()
            if type(__obj).__name__ == "builtin_function_or_method":  # str.center(width), str.join(items), ...
                for argument in [*args, *kwargs.values()]:
                    _check_count(argument, "an argument")
                if getattr(__obj, "__name__", "") == "join" and args:
                    _check_join(args[0])
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, _COUNTED_ITERATION, [], [], None, None, lineno=loop.lineno)
            for parent in list(tree.find_all(nodes.Node)):  # every `a ~ b` result is size-checked
                for field, child in parent.iter_fields():
                    if isinstance(child, nodes.Concat):
                        setattr(parent, field, nodes.Filter(child, _SIZE_CHECKED, [], [], None, None,
                                                            lineno=child.lineno))
                    elif isinstance(child, list):
                        child[:] = [nodes.Filter(item, _SIZE_CHECKED, [], [], None, None, lineno=item.lineno)
                                    if isinstance(item, nodes.Concat) else item for item in child]
            return tree

    environment = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.filters = {name: _bounded_filter(function) for name, function in environment.filters.items()}
    environment.filters[_COUNTED_ITERATION] = _counted_iteration
    environment.filters[_SIZE_CHECKED] = _check_size
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(template)
