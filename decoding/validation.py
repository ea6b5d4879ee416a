"""The checks a decoding request passes before anything is compiled, written once for `generate`
and the serving engine (`decoding.engine.requests`).

Each raises `clover_jax.core.errors.FieldError` (a ValueError carrying the argument's name and a
code), so that the server and the CLI name the offending request field or flag from `field` and
`code`, never from the message. The ranges of single fields are `GenerationConfig.validate`'s;
what depends on the model (vocabulary, context) or on the mode (`decoding.modes`) is here.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from clover_jax.core.errors import CONTEXT_LENGTH, INVALID_TYPE, MISSING_FIELD, FieldError
from decoding.generation_config import TOKEN_ID_FIELDS, GenerationConfig
from decoding.modes import Mode, strategy


def resolve_config(model: Any, generation_config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    """The generation config a call decodes with: the model's defaults (or `generation_config`,
    its token ids completed) with `overrides` applied; max_new_tokens must be set."""
    config = model_defaults(model) if generation_config is None else _completed(model, generation_config)
    if overrides:
        config = config.replace(**overrides)
    if config.max_new_tokens is None:
        raise FieldError("max_new_tokens", "max_new_tokens is not set: pass max_new_tokens=... or set it in "
                                           "generation_config.json", code=MISSING_FIELD)
    return config


_DEFAULTS: "weakref.WeakKeyDictionary[Any, tuple[Any, GenerationConfig]]" = weakref.WeakKeyDictionary()


def model_defaults(model: Any) -> GenerationConfig:
    """The checkpoint's generation config, read once per model (and again if `model.path` changes)."""
    path = getattr(model, "path", None)
    cached = _DEFAULTS.get(model)
    if cached is None or cached[0] != path:
        base = GenerationConfig.from_pretrained(path) if path else GenerationConfig.for_model_type(
            model.config.model_type)
        cached = (path, _completed(model, base))
        _DEFAULTS[model] = cached
    return cached[1]


def _completed(model: Any, config: GenerationConfig) -> GenerationConfig:
    """The special token ids a generation config leaves out, from config.json and the tokenizer."""
    return config.with_token_ids(model.config, getattr(model, "path", None))


def check_vocabulary(config: GenerationConfig, vocab_size: int) -> None:
    """The special token ids and top_k against the model's vocabulary."""
    for name in TOKEN_ID_FIELDS[1:]:
        value = getattr(config, name)
        if value is not None and not 0 <= value < vocab_size:
            raise FieldError(name, f"{name}={value} is outside the vocabulary [0, {vocab_size})")
    if config.top_k > vocab_size:  # transformers would clamp it; a top_k past the vocabulary is a mistake
        raise FieldError("top_k", f"top_k={config.top_k} is larger than the vocabulary ({vocab_size}); 0 turns "
                                  "top-k off")
    bad_eos = [e for e in config.eos_token_id if not 0 <= e < vocab_size]
    if bad_eos:
        raise FieldError("eos_token_id", f"eos_token_id {bad_eos} outside the vocabulary [0, {vocab_size})")


def check_prompts(model: Any, prompts, config: GenerationConfig, mode: str | Mode) -> list[list[int]]:
    """`prompts` as lists of ints, each checked against the vocabulary, the mask token and the
    model's context (`ModeStrategy.positions_needed`); the mode's need of a mask token."""
    decoder = strategy(mode)
    vocab, limit = model.config.vocab_size, model.config.max_position_embeddings
    decoder.check_mask_token(config.mask_token_id)
    check_vocabulary(config, vocab)
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise FieldError("prompts", "prompts must be a non-empty list of token-id lists", code=INVALID_TYPE)
    checked = []
    size, new = config.block_size, config.max_new_tokens
    for index, prompt in enumerate(prompts):
        array = np.asarray(prompt)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise FieldError("prompts", f"prompt {index} must be a non-empty list of int token ids",
                             code=INVALID_TYPE)
        if array.min() < 0 or array.max() >= vocab:
            raise FieldError("prompts", f"prompt {index} holds ids in [{array.min()}, {array.max()}], outside the "
                                        f"vocabulary [0, {vocab})")
        if config.mask_token_id is not None and np.any(array == config.mask_token_id):
            raise FieldError("prompts", f"prompt {index} contains the mask token id {config.mask_token_id}")
        length = int(array.size)
        needed, rule = decoder.positions_needed(length, new, size, config.block_alignment)
        if needed > limit:
            raise FieldError("prompts", f"prompt {index}: {rule} = {needed} positions (P={length}, N={new}, B={size}) "
                                        f"exceeds the model's context of {limit} (max_position_embeddings)",
                             code=CONTEXT_LENGTH)
        checked.append([int(t) for t in array])
    return checked
