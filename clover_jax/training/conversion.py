"""Turning the model a run starts from into the Clover checkpoint it writes.

A Qwen3.5/3.6-MoE checkpoint has no mask token and no block-mode tensors. The written model is
a `clover_moe` checkpoint (docs/training.md, "Conversion"):

* its block-mode tensors start at their documented defaults (the loader already fills them, so a
  base model's parameters hold them) and are trained like every other weight;
* a mask token `<|mask|>` is added to the tokenizer at the first id past its vocabulary; while
  that id is below the config's `vocab_size` the embedding keeps its size (Qwen checkpoints pad
  their embeddings), else the embedding and LM head grow to the next multiple of 256 rows, the
  new rows starting at the mean of the old ones (`clover_jax.adapters.vocabulary`);
* `generation_config.json` holds the Clover defaults (block size 32, threshold 0.95 and the
  model card's controls) over the source's own fields, then `FinetuneConfig.generation_config`.

A Clover source keeps its mask token, its tokenizer and its `generation_config.json`, with the
same overrides. Either way the overrides are checked before training starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, NamedTuple

import numpy as np

from clover_jax.core.config import CloverConfig
from clover_jax.core.errors import FieldError
from decoding.generation_config import CLOVER_DEFAULTS, GenerationConfig, read_generation_config_json

MASK_TOKEN = "<|mask|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json")


class Target(NamedTuple):
    """What a run writes: config (`clover_moe`), the parameters' new vocabulary size (None: kept),
    the mask token id, whether the tokenizer gains the mask token, the generation_config.json dict."""

    config: CloverConfig
    grown_vocab: int | None
    mask_token_id: int
    adds_mask_token: bool
    generation_config: dict[str, Any]


def plan_target(config: CloverConfig, tokenizer, source_dir: str | None, overrides: dict[str, Any] | None) -> Target:
    """The Clover a run on a model of `config` (its tokenizer, its checkpoint directory) writes."""
    stored: dict[str, Any] = {}
    if source_dir and os.path.isfile(os.path.join(source_dir, "generation_config.json")):
        stored = read_generation_config_json(os.path.join(source_dir, "generation_config.json"))
    if config.model_type == "clover_moe" and config.mask_token_id is not None:
        mask, adds, grown = config.mask_token_id, False, None
        generation = {**stored}
    else:
        existing = tokenizer.token_to_id(MASK_TOKEN)
        mask = existing if existing is not None else len(tokenizer)
        adds = existing is None
        grown = None if mask < config.vocab_size else -(-(mask + 1) // 256) * 256
        generation = {**CLOVER_DEFAULTS, **{k: v for k, v in stored.items() if k not in CLOVER_DEFAULTS}}
    generation["mask_token_id"] = mask
    if not generation.get("eos_token_id") and config.eos_token_id:
        generation["eos_token_id"] = list(config.eos_token_id)
    generation.update(overrides or {})
    try:
        GenerationConfig.from_dict(dict(generation))
    except ValueError as error:
        raise FieldError("generation_config", f"FinetuneConfig.generation_config: {error}") from None
    target = dataclasses.replace(config, model_type="clover_moe", mask_token_id=mask,
                                 vocab_size=grown or config.vocab_size)
    return Target(target, grown, mask, adds, generation)


def write_tokenizer(source_dir: str, out_dir: str, target: Target) -> None:
    """Copy the source's tokenizer files to `out_dir`, adding the mask token when the target does."""
    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source_dir, name)):
            shutil.copyfile(os.path.join(source_dir, name), os.path.join(out_dir, name))
    if not target.adds_mask_token:
        return
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    backend.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
    if backend.token_to_id(MASK_TOKEN) != target.mask_token_id:
        raise AssertionError(f"the tokenizer gave {MASK_TOKEN} id {backend.token_to_id(MASK_TOKEN)}, "
                             f"expected {target.mask_token_id}")
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    tokenizer_config = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as handle:
            tokenizer_config = json.load(handle)
    tokenizer_config.setdefault("added_tokens_decoder", {})[str(target.mask_token_id)] = {
        "content": MASK_TOKEN, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True}
    tokenizer_config["mask_token"] = MASK_TOKEN
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(tokenizer_config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def write_generation_config(out_dir: str, target: Target) -> None:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as handle:
        json.dump(_plain(target.generation_config), handle, indent=2)
        handle.write("\n")


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
