"""Tokenizer and chat template of a checkpoint directory, without `transformers`.

Reads what a Hugging Face checkpoint ships for text use (spec §2):

  * ``tokenizer.json``         — the `tokenizers` model (required);
  * ``tokenizer_config.json``  — named special tokens (``bos_token``, ``eos_token``, ``pad_token``,
    ...) and ``chat_template`` (a string, or a list of ``{"name", "template"}``);
  * ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` — when present they take
    precedence over ``tokenizer_config.json``'s template, as in `transformers`.

`Tokenizer.apply_chat_template` renders the template exactly as `transformers`
(5.x `render_jinja_template`) does: an `ImmutableSandboxedEnvironment` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
does not escape HTML, the globals ``raise_exception``, ``strftime_now``, a restricted ``dict`` and
a ``namespace`` that refuses underscore attributes; the template sees
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named special tokens
(``bos_token``, ``eos_token``, ...) and every extra keyword (``enable_thinking``, ...).
Message keys whose value is None are dropped and a message's reasoning is offered under
``reasoning_content`` and ``thinking``, as `transformers` does. The rendered text is encoded
without adding special tokens. `tests/clover_jax/test_tokenization.py` checks text and ids
against `transformers`.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked (missing file, bad JSON, unknown token)."""


class ChatTemplateError(TokenizerError):
    """No chat template, an unknown template name, or an error raised while rendering one."""


class Tokenizer:
    """A checkpoint's `tokenizers.Tokenizer` plus its `tokenizer_config.json` and chat template(s).

    `chat_template` is a string, a {name: template} dict (several templates, one of them usually
    "default"), or None when the checkpoint has none.
    """

    def __init__(self, backend, config: Mapping[str, Any] | None = None,
                 chat_template: str | dict[str, str] | None = None, path: str | None = None,
                 model_mask_token_id: int | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.path = path
        self._model_mask_token_id = model_mask_token_id
        self.special_tokens_map = {name: _token_content(self.config[name]) for name in SPECIAL_TOKEN_NAMES
                                   if self.config.get(name) is not None}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load `tokenizer.json`, `tokenizer_config.json` and the chat template(s) from a directory."""
        from tokenizers import Tokenizer as Backend

        directory = Path(os.fspath(path))
        if not directory.is_dir():
            raise TokenizerError(f"tokenizer directory {os.fspath(path)!r} does not exist")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {os.fspath(path)!r}: clover-jax reads the `tokenizers` "
                                 "format (save one with transformers' save_pretrained or tokenizers' Tokenizer.save)")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tokenizer_file} cannot be read by `tokenizers`: {error}") from error
        config = _read_json(directory / "tokenizer_config.json") or {}
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {entry["name"]: entry["template"] for entry in template}
        files = {}
        if (directory / CHAT_TEMPLATE_FILE).is_file():
            files["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        if (directory / CHAT_TEMPLATE_DIR).is_dir():
            for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
                files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
        if files:  # template files win over tokenizer_config.json, as in transformers
            template = files["default"] if list(files) == ["default"] else files
        return cls(backend, config, template, os.fspath(path), _model_mask_token_id(directory))

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))

    @property
    def mask_token_id(self) -> int | None:
        """`mask_token` of tokenizer_config.json, else the checkpoint's `mask_token_id`
        (generation_config.json, then config.json)."""
        named = self._named_id("mask_token")
        return named if named is not None else self._model_mask_token_id

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the added tokens marked special in tokenizer.json (what `skip_special_tokens` drops)."""
        return sorted(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs tokenizer.json's post-processor (BOS etc.),
        which Qwen tokenizers do not have."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; `skip_special_tokens` drops added tokens marked special (e.g. <|im_end|>)."""
        # ids past the tokenizer's vocabulary (models pad their embedding) decode to nothing, as in `tokenizers`
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.config.get("clean_up_tokenization_spaces") and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)  # what transformers does for non-BPE models that ask for it
        return text

    # ------------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template to render: `chat_template` may be a template string or a template name."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None and chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.chat_template:
                    return self.chat_template["tool_use"]
                if "default" in self.chat_template:
                    return self.chat_template["default"]
                raise ChatTemplateError(f"the checkpoint has several chat templates and none is 'default'; pass "
                                        f"chat_template= one of {sorted(self.chat_template)}")
            return chat_template
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ChatTemplateError(
                f"the tokenizer in {self.path!r} has no chat template (no 'chat_template' in tokenizer_config.json "
                f"and no {CHAT_TEMPLATE_FILE}); pass chat_template=..., or encode the raw text with encode()")
        return self.chat_template

    def apply_chat_template(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
                            add_generation_prompt: bool = True, enable_thinking: bool = True,
                            tokenize: bool = True, chat_template: str | None = None, tools: list | None = None,
                            documents: list | None = None, **kwargs: Any):
        """Render a conversation (a list of {"role", "content", ...} dicts) with the chat template.

        Returns the token ids (tokenize=True, encoded without special tokens added) or the text.
        A list of conversations gives a list of results. `enable_thinking` and every extra keyword
        are template variables; they override the named special tokens of the same name.
        """
        if isinstance(messages, Mapping) or not isinstance(messages, (list, tuple)) or not messages:
            raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        batched = isinstance(messages[0], (list, tuple))
        conversations = messages if batched else [messages]
        template = self.get_chat_template(chat_template, tools)
        variables = {**self.special_tokens_map, "enable_thinking": enable_thinking, **kwargs}
        rendered = [render_chat_template(template, conversation, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=documents, **variables)
                    for conversation in conversations]
        results = [self.encode(text, add_special_tokens=False) for text in rendered] if tokenize else rendered
        return results if batched else results[0]

    def __repr__(self) -> str:
        return (f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, eos_token={self.eos_token!r}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


def render_chat_template(template: str, messages: Sequence[Message], add_generation_prompt: bool = True,
                         tools: list | None = None, documents: list | None = None, **variables: Any) -> str:
    """Render one conversation with a Jinja chat template, as `transformers` renders it."""
    import jinja2

    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {index} must be a dict with 'role' and 'content', got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    try:
        compiled = _compile(template)
        return compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"chat template error: {error}") from error


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The sandboxed environment of transformers' `_compile_jinja_template`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
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

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    return environment.from_string(template)


# ---------------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path} is not valid JSON: {error}") from error


def _token_content(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return str(value["content"]) if isinstance(value, Mapping) else str(value)


def _model_mask_token_id(directory: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        try:
            raw = _read_json(directory / name) or {}
        except TokenizerError:
            continue
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        value = raw.get("mask_token_id", text.get("mask_token_id"))
        if isinstance(value, int):
            return value
    return None


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
