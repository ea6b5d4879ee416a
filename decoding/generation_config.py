"""`GenerationConfig`: decoding controls read from `generation_config.json` (docs/design.md §4).

For `clover_moe` checkpoints a missing field takes the model card's default; for base Qwen
checkpoints (`qwen3_5_moe*`) a missing control takes the neutral value, as in transformers.
Keyword overrides replace loaded values; every field is validated with a clear `ValueError`.

`generation_config.json` is read field by field with its JSON type checked (`"false"` is not a
boolean, `"96"` or `true` not an integer, `null` not a token id); a wrong type is a
`ConfigError` naming the file and the field. Fields clover-jax does not use (`pad_token_id`,
`transformers_version`, ...) are ignored.

The special token ids decoding needs are resolved in one place, `resolve_token_ids`, each from
the first source that has it: generation_config.json (or keyword overrides), then config.json
(`eos_token_id`, `mask_token_id`), then the tokenizer (`<think>` / `</think>`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import os
from typing import Any, Callable, Mapping

import numpy as np

from clover_jax.core.config import CloverConfig
from clover_jax.core.errors import INVALID_TYPE, INVALID_VALUE, UNKNOWN_FIELD, FieldError
from clover_jax.core.hub import resolve_checkpoint
from clover_jax.core.json_fields import ConfigError, JsonFields, is_finite_number, is_integer, read_json_object, show
from decoding import schedules
from decoding.constraints.spec import GAP_RULES, Constraint

logger = logging.getLogger(__name__)

# Upper bounds, checked before anything is compiled: sizes of a block and of its steps (far beyond
# any context a model has), and every other integer (traced as int32 inside the decoding loop).
MAX_BLOCK_COUNT = 2**20
MAX_INT32 = 2**31 - 1
NEUTRAL_CONTROLS = dict(
    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, dllm_length_penalty=0.0,
    dllm_think_end_bias=0.0,
)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Every knob of `generate`. Field names follow `generation_config.json`.

    Every number must be finite; `block_size`, `max_steps_per_block` and `tokens_per_step` are at
    most MAX_BLOCK_COUNT (2**20), and every other integer (`max_new_tokens`, `top_k`, the ramp
    starts and windows, token ids) at most MAX_INT32 (2**31 - 1). Whether a block fits the model's
    context and ids its vocabulary is checked by `generate`, which knows the model.
    """

    max_new_tokens: int | None = None
    block_size: int = 32
    threshold: float = 0.95
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    presence_penalty: float = 0.9
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.05
    dllm_length_penalty: float = 10.0
    dllm_length_penalty_start: int = 8192
    dllm_length_penalty_window: int = 8192
    dllm_think_end_bias: float = 10.0
    dllm_think_end_start: int = 4096
    dllm_think_end_window: int = 4096
    eos_token_id: tuple[int, ...] = ()
    mask_token_id: int | None = None
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None
    # clover-jax additions (documented in docs/design.md §4):
    block_alignment: str = "absolute"      # or "prompt": every block starts right after the prompt
    schedule: str | Callable = "low_confidence"
    schedule_params: Mapping[str, Any] | None = None  # the schedule's parameters (traced: new values never recompile)
    max_steps_per_block: int | None = None  # None: block_size; on the last step every mask is filled
    tokens_per_step: int = 2               # fixed_k schedule
    margin_threshold: float = 0.5          # margin schedule: top-1 minus top-2 probability
    entropy_bound: float = 1.0             # entropy_bounded schedule: nats filled per step
    coreset: bool | None = None            # None: the model config's moe_block_coreset_enabled
    coreset_top_p: float | None = None     # None: the model config's moe_block_coreset_top_p
    # the grammar the answer keeps to (docs/structured_outputs.md): a `Constraint`, or a dict such as
    # {"regex": "[0-9]+"}, {"json_schema": {...}}, {"json_object": true}, {"lark": "start: ..."}
    constraint: Constraint | None = None
    constraint_gap_rule: str = "witness"   # diffusion: commits past an undecided position ("witness") or not

    def __post_init__(self):
        object.__setattr__(self, "constraint", Constraint.of(self.constraint))
        if is_integer(self.eos_token_id):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        elif isinstance(self.eos_token_id, (list, tuple)) or self.eos_token_id is None:
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id or ()))
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_model_type(cls, model_type: str, **values: Any) -> "GenerationConfig":
        """The defaults of docs/design.md §4: the model card's for clover_moe, neutral controls for base Qwen."""
        defaults: dict[str, Any] = dict(CLOVER_DEFAULTS)
        if model_type != "clover_moe":
            defaults.update(NEUTRAL_CONTROLS)
        return cls.from_dict({**defaults, **values})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, revision: str | None = None,
                        **overrides: Any) -> "GenerationConfig":
        """Read `generation_config.json` (optional) with the defaults of the checkpoint's model type.

        path: a checkpoint directory or a Hub id ("org/name", at `revision`; `clover_jax.core.hub`).
        """
        path = os.fspath(resolve_checkpoint(path, revision, require=("config.json",)))
        model_config = CloverConfig.from_pretrained(path)  # config.json, read and checked in one place
        values: dict[str, Any] = dict(CLOVER_DEFAULTS)
        if model_config.model_type != "clover_moe":
            values.update(NEUTRAL_CONTROLS)
        generation_path = os.path.join(path, "generation_config.json")
        stored = {}
        if os.path.isfile(generation_path):
            stored = read_generation_config_json(generation_path)
            values.update(stored)
        values.update(resolve_token_ids(values, model_config, path))
        try:
            loaded = cls.from_dict(values)
        except ValueError as error:  # a stored value out of range: say which file holds it
            if stored:
                raise ConfigError(f"{generation_path}: {error}") from None
            raise
        return loaded.replace(**overrides)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GenerationConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})

    def with_token_ids(self, model_config: CloverConfig, checkpoint: str | os.PathLike | None = None
                       ) -> "GenerationConfig":
        """This config with the special token ids it leaves out filled in (`resolve_token_ids`)."""
        given = {name: getattr(self, name) for name in TOKEN_ID_FIELDS}
        resolved = resolve_token_ids(given, model_config, checkpoint)
        return self if resolved == given else self.replace(**resolved)

    def replace(self, **overrides: Any) -> "GenerationConfig":
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise FieldError(unknown[0], f"unknown generation options {unknown}; known: "
                             f"{sorted(f.name for f in dataclasses.fields(self))}", code=UNKNOWN_FIELD)
        return dataclasses.replace(self, **overrides)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(field: str, condition: bool, message: str, code: str = INVALID_VALUE) -> None:
            if not condition:
                raise FieldError(field, message, code=code)

        def need_int(name: str, low: int, high: int, note: str = "", optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            need(name, is_integer(value) and low <= value <= high,
                 f"{name} must be an integer >= {low} and <= {high}{note}, got {value!r}")

        for name in ("threshold", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "dllm_length_penalty", "dllm_think_end_bias", "margin_threshold",
                     "entropy_bound") + (("coreset_top_p",) if self.coreset_top_p is not None else ()):
            value = getattr(self, name)
            need(name, isinstance(value, numbers.Real) and not isinstance(value, bool),
                 f"{name} must be a number, got {value!r}", INVALID_TYPE)
            need(name, is_finite_number(value), f"{name} must be a finite number, got {value!r}")
        for name in ("do_sample",) + (("coreset",) if self.coreset is not None else ()):
            need(name, isinstance(getattr(self, name), (bool, np.bool_)),
                 f"{name} must be True or False, got {getattr(self, name)!r}", INVALID_TYPE)
        need("eos_token_id", isinstance(self.eos_token_id, tuple) and all(is_integer(e) and 0 <= e <= MAX_INT32
                                                          for e in self.eos_token_id),
             f"eos_token_id must be an int or a list of ints (token ids >= 0), got {self.eos_token_id!r}")
        for name in ("mask_token_id", "think_start_token_id", "think_end_token_id"):
            need_int(name, 0, MAX_INT32, " (a token id)", optional=True)
        need_int("max_new_tokens", 1, MAX_INT32, optional=True)
        need_int("block_size", 1, MAX_BLOCK_COUNT)
        need("threshold", 0.0 < self.threshold <= 1.0, f"threshold must be in (0, 1], got {self.threshold}")
        if self.do_sample:  # transformers' configs may carry temperature 0 with greedy decoding
            need("temperature", self.temperature > 0,
                 f"temperature must be > 0 when do_sample=True, got {self.temperature}")
        need_int("top_k", 0, MAX_INT32, " (0: off)")
        need("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty", "dllm_length_penalty", "dllm_think_end_bias"):
            need(name, getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need("repetition_penalty", self.repetition_penalty > 0,
             f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        for name in ("dllm_length_penalty_start", "dllm_length_penalty_window", "dllm_think_end_start",
                     "dllm_think_end_window"):
            need_int(name, 0, MAX_INT32)
        need("block_alignment",
             isinstance(self.block_alignment, str) and self.block_alignment in ("absolute", "prompt"),
             f"block_alignment must be 'absolute' or 'prompt', got {self.block_alignment!r}")
        need("schedule",
             callable(self.schedule) or isinstance(self.schedule, str) and self.schedule in schedules.BY_NAME,
             f"schedule must be one of {sorted(schedules.BY_NAME)} or a function, got {self.schedule!r}")
        need("schedule_params", self.schedule_params is None or isinstance(self.schedule_params, Mapping),
             f"schedule_params must be a dict of parameter values, got {self.schedule_params!r}")
        need_int("max_steps_per_block", 1, MAX_BLOCK_COUNT, optional=True)
        need_int("tokens_per_step", 1, MAX_BLOCK_COUNT)
        need("margin_threshold", self.margin_threshold >= 0,
             f"margin_threshold must be >= 0, got {self.margin_threshold}")
        need("entropy_bound", self.entropy_bound >= 0, f"entropy_bound must be >= 0, got {self.entropy_bound}")
        need("constraint_gap_rule", self.constraint_gap_rule in GAP_RULES,
             f"constraint_gap_rule must be one of {GAP_RULES}, got {self.constraint_gap_rule!r}")
        if self.coreset_top_p is not None:
            need("coreset_top_p", 0.0 < self.coreset_top_p <= 1.0,
                 f"coreset_top_p must be in (0, 1], got {self.coreset_top_p}")

    @property
    def steps_cap(self) -> int:
        return self.max_steps_per_block or self.block_size


# The model card's decoding controls (docs/design.md §4), as GenerationConfig's field defaults state them.
CLOVER_DEFAULTS = {field.name: field.default for field in dataclasses.fields(GenerationConfig) if field.name in (
    "block_size", "threshold", "presence_penalty", "frequency_penalty", "repetition_penalty", "dllm_length_penalty",
    "dllm_length_penalty_start", "dllm_length_penalty_window", "dllm_think_end_bias", "dllm_think_end_start",
    "dllm_think_end_window")}


# The reader of each annotation's leading type, for generation_config.json (see `read_generation_config_json`).
_JSON_READERS = {"int": "integer", "float": "number", "bool": "boolean", "str": "string", "tuple": "ids",
                 "Mapping": "mapping", "Constraint": "mapping"}


def json_reader(field: dataclasses.Field) -> str:
    """The `JsonFields` method that reads `field` from JSON, from its annotation's first type
    ("int | None" -> "integer", "tuple[int, ...]" -> "ids", "str | Callable" -> "string")."""
    return _JSON_READERS[str(field.type).split("|")[0].split("[")[0].strip()]


def read_generation_config_json(path: str) -> dict[str, Any]:
    """The `GenerationConfig` fields stored in the generation_config.json at `path`, each of the
    JSON type its field needs (ConfigError otherwise); null and unused fields are left out."""
    fields = JsonFields(read_json_object(path), path)
    values = {}
    for field in dataclasses.fields(GenerationConfig):
        if fields.has(field.name):
            reader = json_reader(field)
            values[field.name] = fields.ids(field.name) if reader == "ids" else getattr(fields, reader)(field.name)
    return values


TOKEN_ID_FIELDS = ("eos_token_id", "mask_token_id", "think_start_token_id", "think_end_token_id")


def resolve_token_ids(given: Mapping[str, Any], model_config: CloverConfig,
                      checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """The special token ids decoding uses (`TOKEN_ID_FIELDS`), each from the first source that has it:

      1. `given`: generation_config.json's values, or what the caller set (None, or no EOS ids:
         not given);
      2. config.json, as `model_config`: `eos_token_id`, `mask_token_id`;
      3. the checkpoint's tokenizer.json (when `checkpoint` is a directory): the ids of the
         tokens `<think>` and `</think>`, read only when they are still missing.

    An id none of them has stays None (no EOS ids: an empty tuple).
    """
    ids = {name: given.get(name) for name in TOKEN_ID_FIELDS}
    if not ids["eos_token_id"]:
        ids["eos_token_id"] = tuple(model_config.eos_token_id)
    if ids["mask_token_id"] is None:
        ids["mask_token_id"] = model_config.mask_token_id
    thinking = ("think_start_token_id", "think_end_token_id")
    if checkpoint is not None and any(ids[name] is None for name in thinking):
        found = think_tokens_from_tokenizer(os.fspath(checkpoint))
        ids.update({name: found[name] for name in thinking if ids[name] is None and name in found})
    return ids


@functools.lru_cache(maxsize=8)
def think_tokens_from_tokenizer(path: str) -> dict[str, int]:
    """`<think>` / `</think>` ids from the checkpoint's tokenizer.json, when it has them.

    A tokenizer.json that is not JSON, or whose vocabulary or added tokens have the wrong shape,
    is a ConfigError naming the file."""
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        return {}
    tokenizer = read_json_object(tokenizer_path)
    model = tokenizer.get("model") or {}
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = tokenizer.get("added_tokens") or []
    vocabulary = dict(vocab) if isinstance(vocab, dict) else {}  # BPE: {token: id}; other models: a list
    if not isinstance(added, list) or not all(isinstance(token, dict) for token in added):
        raise ConfigError(f"{tokenizer_path}: added_tokens must be a list of objects, got {show(added)}")
    vocabulary.update({token["content"]: token.get("id") for token in added if isinstance(token.get("content"), str)})
    found = {}
    for key, text in (("think_start_token_id", "<think>"), ("think_end_token_id", "</think>")):
        if text in vocabulary:
            if not is_integer(vocabulary[text]) or vocabulary[text] < 0:
                raise ConfigError(f"{tokenizer_path}: the id of {text} must be an integer >= 0, got "
                                  f"{show(vocabulary[text])}")
            found[key] = vocabulary[text]
    return found
