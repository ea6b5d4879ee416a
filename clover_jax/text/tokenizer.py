"""Tokenizer and chat template of a checkpoint, without `transformers`, behaving as transformers'.

`Tokenizer.from_pretrained(path_or_hub_id)` reads what a Hugging Face checkpoint ships for text:

  * ``tokenizer.json``         — the `tokenizers` model (required);
  * ``tokenizer_config.json``  — named special tokens (``bos_token``, ``eos_token``, ``pad_token``,
    ..., and model-specific ``*_token`` keys), ``additional_special_tokens`` /
    ``extra_special_tokens``, ``padding_side``, ``clean_up_tokenization_spaces`` and
    ``chat_template`` (a string, or a list of ``{"name", "template"}``); a field of the wrong JSON
    type is a `TokenizerConfigError` (a `clover_jax.ConfigError`) naming it;
  * ``special_tokens_map.json`` — for legacy tokenizers whose config has no ``added_tokens_decoder``;
  * ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` — when present they take
    precedence over ``tokenizer_config.json``'s template.

Every public name that transformers' `PreTrainedTokenizerFast` (5.x) also has behaves as it does
there (tested against it): `apply_chat_template` (``add_generation_prompt=False``,
``tokenize=True``, ``return_dict=True`` by default, so it returns a `BatchEncoding` with
``input_ids`` and ``attention_mask``; ``return_dict=False`` gives the ids; ``return_tensors``,
``continue_final_message``), ``__call__``, `encode`, `decode`, `batch_decode`, `vocab_size`
(without added tokens) and ``len()`` (with them), the special tokens and their ids,
`all_special_ids`, `convert_tokens_to_ids` / `convert_ids_to_tokens`. ``return_tensors`` takes
"np" or "jax" (no PyTorch). transformers options that change the result and are not implemented
here (truncation, assistant masks, control-token sanitising) are refused, not ignored.

Chat templates render in the bounded sandbox of `clover_jax.text.chat_templates`
(`render_chat_template`, importable from here too, as are its bounds and errors).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from clover_jax.core.hub import resolve_checkpoint
from clover_jax.core.json_fields import ConfigError, json_type, read_json_object, show
from clover_jax.text.chat_templates import (
    MAX_TEMPLATE_CHARS,
    MAX_TEMPLATE_STEPS,
    Message,
    render_chat_template,
)
from clover_jax.text.errors import (
    ChatTemplateError,
    TokenizerConfigError,
    TokenizerError,
    one_line as _one_line,
)

# the sandbox's names stay importable from here (`from clover_jax.text.tokenizer import render_chat_template`)
__all__ = [
    "MAX_TEMPLATE_CHARS", "MAX_TEMPLATE_STEPS", "BatchEncoding", "ChatTemplateError", "Message", "Tokenizer",
    "TokenizerConfigError", "TokenizerError", "check_tokenizer_config", "has_chat_template", "render_chat_template",
    "stored_chat_template",
]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TENSOR_TYPES = ("np", "jax")
# transformers options of apply_chat_template that this class does not implement: refused when set,
# rather than passed to the template as variables and silently ignored
_UNSUPPORTED_OPTIONS = ("truncation", "max_length", "return_assistant_tokens_mask", "sanitize_control_tokens",
                        "tokenizer_kwargs")


class BatchEncoding(dict):
    """What transformers' tokenizers return: ``{"input_ids": ..., "attention_mask": ...}``, the
    values also readable as attributes (``encoding.input_ids``). Lists of ints, or arrays of
    shape [batch, tokens] with ``return_tensors``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """A checkpoint's `tokenizers.Tokenizer` plus its `tokenizer_config.json` and chat template(s).

    `chat_template` is a string, a {name: template} dict (several templates, one of them usually
    "default"), or None when the checkpoint has none.
    """

    def __init__(self, backend, config: Mapping[str, Any] | None = None,
                 chat_template: str | dict[str, str] | None = None, path: str | None = None,
                 special_tokens_map_file: Mapping[str, Any] | None = None):
        config = dict(config or {})
        check_tokenizer_config(config, "tokenizer_config.json")
        if special_tokens_map_file:
            check_tokenizer_config(special_tokens_map_file, "special_tokens_map.json")
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.name_or_path = self.path = path
        self.padding_side = config.get("padding_side") or "right"
        named, extra = _special_tokens(config, special_tokens_map_file or {})
        self.special_tokens_map: dict[str, str] = named  # template variables, as in transformers
        self.extra_special_tokens: list[str] = extra

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, revision: str | None = None) -> "Tokenizer":
        """Load the tokenizer of a checkpoint directory or Hub id ("org/name", at `revision`)."""
        from tokenizers import Tokenizer as Backend

        directory = resolve_checkpoint(path, revision, require=("tokenizer.json",))
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"no tokenizer.json in {os.fspath(path)!r}: clover-jax reads the `tokenizers` "
                                 "format (save one with transformers' save_pretrained or tokenizers' Tokenizer.save)")
        config = _read_json(directory / "tokenizer_config.json")  # checked before tokenizer.json is parsed
        check_tokenizer_config(config, "tokenizer_config.json")
        legacy = None
        if "added_tokens_decoder" not in config:  # transformers reads special_tokens_map.json only then
            legacy = _read_json(directory / "special_tokens_map.json")
            check_tokenizer_config(legacy, "special_tokens_map.json")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{tokenizer_file} cannot be read by `tokenizers`: {_one_line(error)}") from error
        return cls(backend, config, stored_chat_template(directory, config), os.fspath(path), legacy)

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (``len(tokenizer)`` counts them)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False):
        if isinstance(ids, (int, np.integer)):
            return self.backend.id_to_token(int(ids))
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in special]

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens_map.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    mask_token = property(lambda self: self.special_tokens_map.get("mask_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))
    mask_token_id = property(lambda self: self._named_id("mask_token"))

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, each once (transformers' order)."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend.token_to_id(token) for token in self.all_special_tokens]

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs tokenizer.json's post-processor (BOS etc.),
        which Qwen tokenizers do not have."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode takes a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, padding: bool | str = False,
                 padding_side: str | None = None, return_tensors: str | None = None,
                 return_attention_mask: bool = True) -> BatchEncoding:
        """`input_ids` and `attention_mask` of a text (lists of ints) or of a list of texts (lists of
        lists); `padding=True` pads to the longest with `pad_token_id` on `padding_side`;
        `return_tensors` "np" or "jax" gives [batch, tokens] arrays."""
        batched = not isinstance(text, str)
        texts = list(text) if batched else [text]
        if not all(isinstance(item, str) for item in texts):
            raise TokenizerError("the tokenizer takes a str or a list of str")
        ids = [self.encode(item, add_special_tokens=add_special_tokens) for item in texts]
        return self._batch(ids, batched, padding, padding_side, return_tensors, return_attention_mask)

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of one sequence of ids (an int, a list, or a 1-D NumPy/JAX array);
        `skip_special_tokens` drops added tokens marked special (e.g. <|im_end|>)."""
        ids = np.asarray(token_ids)
        if ids.ndim > 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise TokenizerError(f"decode takes one sequence of int ids (use batch_decode for several), got "
                                 f"{type(token_ids).__name__} of shape {ids.shape} and dtype {ids.dtype}")
        if ids.size and ids.min() < 0:
            raise TokenizerError(f"token ids must be >= 0, got {int(ids.min())}")
        # ids past the tokenizer's vocabulary (models pad their embedding) decode to nothing, as in `tokenizers`
        text = self.backend.decode(ids.reshape(-1).tolist(), skip_special_tokens=skip_special_tokens)
        clean = self.config.get("clean_up_tokenization_spaces") if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        if clean and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)  # what transformers does for non-BPE models that ask for it
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]

    def _batch(self, ids: list[list[int]], batched: bool, padding, padding_side, return_tensors,
               return_attention_mask: bool = True) -> BatchEncoding:
        if return_tensors is not None and return_tensors not in TENSOR_TYPES:
            raise TokenizerError(f"return_tensors={return_tensors!r}: clover-jax returns 'np' or 'jax' arrays")
        if padding not in (False, True, "longest", "do_not_pad"):
            raise TokenizerError(f"padding={padding!r}: clover-jax pads to the longest sequence (True or 'longest') "
                                 "or not at all (False)")
        side = self.padding_side if padding_side is None else padding_side
        if side not in ("left", "right"):
            raise TokenizerError(f"padding_side must be 'left' or 'right', got {side!r}")
        masks = [[1] * len(row) for row in ids]
        if padding in (True, "longest") and len({len(row) for row in ids}) > 1:
            if self.pad_token_id is None:
                raise TokenizerError("padding needs a pad token, and this tokenizer has none (no pad_token in "
                                     "tokenizer_config.json)")
            width = max(len(row) for row in ids)
            fill = lambda row, value: ([value] * (width - len(row)) + row if side == "left"
                                       else row + [value] * (width - len(row)))
            ids = [fill(row, self.pad_token_id) for row in ids]
            masks = [fill(row, 0) for row in masks]
        if return_tensors is not None:
            if len({len(row) for row in ids}) > 1:
                raise TokenizerError("sequences of different lengths cannot form one array: pass padding=True")
            ids, masks = _tensor(ids, return_tensors), _tensor(masks, return_tensors)
        elif not batched:
            ids, masks = ids[0], masks[0]
        return BatchEncoding(input_ids=ids, attention_mask=masks) if return_attention_mask \
            else BatchEncoding(input_ids=ids)

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

    def apply_chat_template(self, conversation: Sequence[Message] | Sequence[Sequence[Message]], *,
                            tools: list | None = None, documents: list | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, padding: bool | str = False, return_tensors: str | None = None,
                            return_dict: bool = True, **kwargs: Any):
        """Render a conversation (a list of {"role", "content", ...} dicts) with the chat template,
        as transformers' `apply_chat_template` does, with its defaults.

        Returns the text (tokenize=False), a `BatchEncoding` with ``input_ids`` and
        ``attention_mask`` (the default), or the ids alone (return_dict=False); a list of
        conversations gives one of each per conversation. The text is encoded without adding
        special tokens. `add_generation_prompt` opens the assistant's turn (what `generate` needs);
        `continue_final_message` leaves the last message open instead (True: its "content", or the
        name of the field to continue). Every extra keyword (``enable_thinking=False``, ...) is a
        template variable and overrides a named special token of the same name.
        """
        refused = [name for name in _UNSUPPORTED_OPTIONS if kwargs.get(name)]
        if refused:
            raise TokenizerError(f"apply_chat_template({refused[0]}=...) is a transformers option clover-jax does "
                                 "not implement")
        for name in _UNSUPPORTED_OPTIONS:
            kwargs.pop(name, None)
        if isinstance(conversation, Mapping) or not isinstance(conversation, (list, tuple)) or not conversation:
            raise ChatTemplateError("the conversation must be a non-empty list of {'role': ..., 'content': ...} "
                                    "dicts (or a list of such lists)")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other: one "
                                    "continues the last message, the other opens a new assistant turn")
        batched = isinstance(conversation[0], (list, tuple))
        conversations = conversation if batched else [conversation]
        template = self.get_chat_template(chat_template, tools)
        variables = {**self.special_tokens_map, **kwargs}
        rendered = [render_chat_template(template, chat, add_generation_prompt=add_generation_prompt, tools=tools,
                                         documents=documents, continue_final_message=continue_final_message,
                                         **variables)
                    for chat in conversations]
        if not tokenize:
            return rendered if batched else rendered[0]
        ids = [self.encode(text, add_special_tokens=False) for text in rendered]
        encoding = self._batch(ids, batched, padding, None, return_tensors)
        return encoding if return_dict else encoding["input_ids"]

    def __repr__(self) -> str:
        return (f"Tokenizer(name_or_path={self.path!r}, vocab_size={self.vocab_size}, len={len(self)}, "
                f"eos_token={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


# ---------------------------------------------------------------------- tokenizer_config.json
def stored_chat_template(directory: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) a checkpoint ships: `chat_template.jinja` and
    `additional_chat_templates/*.jinja` win over `config`'s (tokenizer_config.json's)
    `chat_template`, as in transformers. A string, a {name: template} dict, or None."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {entry["name"]: entry["template"] for entry in template}
    files = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if files:
        template = files["default"] if list(files) == ["default"] else files
    return template


def has_chat_template(directory: str | os.PathLike) -> bool:
    """Whether the checkpoint directory ships a chat template, without loading its tokenizer
    (a tokenizer_config.json that cannot be read counts as none)."""
    directory = Path(directory)
    if (directory / CHAT_TEMPLATE_FILE).is_file() or any((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        return True
    try:
        return bool(_read_json(directory / "tokenizer_config.json").get("chat_template"))
    except TokenizerConfigError:
        return False


def check_tokenizer_config(config: Any, file: str) -> None:
    """Refuse, naming the field, a tokenizer_config.json / special_tokens_map.json whose fields that
    clover-jax reads have the wrong JSON type (nothing is coerced)."""
    if not isinstance(config, Mapping):
        raise TokenizerConfigError(f"{file} must hold a JSON object {{...}}, got {json_type(config)}")

    def fail(field: str, expected: str, value: Any) -> None:
        raise TokenizerConfigError(f"{file}: {field} must be {expected}, got {show(value)}")

    def token(field: str, value: Any) -> None:
        if isinstance(value, str):
            return
        if not isinstance(value, Mapping) or not isinstance(value.get("content"), str):
            fail(field, 'a string or an object with a string "content"', value)

    for name, value in config.items():
        if value is None:
            continue
        if name in SPECIAL_TOKEN_NAMES:
            token(name, value)
        elif name in ("additional_special_tokens", "extra_special_tokens"):
            if isinstance(value, Mapping) and name == "extra_special_tokens":
                for key, item in value.items():
                    token(f"{name}.{key}", item)
            elif isinstance(value, list):
                for index, item in enumerate(value):
                    token(f"{name}[{index}]", item)
            else:
                fail(name, "a list of tokens" + (" or an object" if name == "extra_special_tokens" else ""), value)
        elif name == "chat_template":
            if isinstance(value, list):
                for index, entry in enumerate(value):
                    if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                            and isinstance(entry.get("template"), str)):
                        fail(f"chat_template[{index}]", 'an object with string "name" and "template"', entry)
            elif not isinstance(value, str):
                fail(name, "a string or a list of {name, template} objects", value)
        elif name == "clean_up_tokenization_spaces" and not isinstance(value, bool):
            fail(name, "true or false", value)
        elif name == "padding_side" and value not in ("left", "right"):
            fail(name, '"left" or "right"', value)


def _special_tokens(config: Mapping[str, Any], legacy: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """(named special tokens, extra special tokens) as transformers 5 collects them."""
    # special_tokens_map.json (read for legacy tokenizers only) overrides tokenizer_config.json, as in transformers
    merged = {**{k: v for k, v in config.items() if v is not None},
              **{k: v for k, v in legacy.items() if v is not None}}
    named = {name: _token_content(merged[name]) for name in SPECIAL_TOKEN_NAMES if name in merged}
    # model-specific named tokens (image_token, ...) are template variables too
    named.update({key: _token_content(value) for key, value in merged.items()
                  if key.endswith("_token") and key not in named and isinstance(value, (str, Mapping))})
    extra = merged.get("extra_special_tokens") or merged.get("additional_special_tokens") or []
    if isinstance(extra, Mapping):
        named.update({key: _token_content(value) for key, value in extra.items()})
        extra = []
    return named, [_token_content(item) for item in extra]


# ---------------------------------------------------------------------- helpers
def _read_json(path: Path) -> dict:
    """A JSON file's object ({} when the file is absent)."""
    if not path.is_file():
        return {}
    try:
        return read_json_object(path)
    except ConfigError as error:
        raise TokenizerConfigError(_one_line(error)) from None


def _tensor(rows: list[list[int]], kind: str):
    array = np.asarray(rows, dtype=np.int64)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(array, dtype=jnp.int32)
    return array


def _token_content(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return str(value["content"]) if isinstance(value, Mapping) else str(value)


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
