"""`GenerationConfig`: decoding controls read from `generation_config.json` (spec §4).

For `clover_moe` checkpoints a missing field takes the model card's default; for base Qwen
checkpoints (`qwen3_5_moe*`) a missing control takes the neutral value, as in transformers.
Keyword overrides replace loaded values; every field is validated with a clear `ValueError`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import numbers
import os
from typing import Any, Callable, Mapping

from decoding import schedules

logger = logging.getLogger(__name__)

CLOVER_DEFAULTS = dict(
    block_size=32, threshold=0.95, presence_penalty=0.9, frequency_penalty=0.0, repetition_penalty=1.05,
    dllm_length_penalty=10.0, dllm_length_penalty_start=8192, dllm_length_penalty_window=8192,
    dllm_think_end_bias=10.0, dllm_think_end_start=4096, dllm_think_end_window=4096,
)
NEUTRAL_CONTROLS = dict(
    presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, dllm_length_penalty=0.0,
    dllm_think_end_bias=0.0,
)


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Every knob of `generate`. Field names follow `generation_config.json`."""

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
    # clover-jax additions (documented in README "Decoding"):
    block_alignment: str = "absolute"      # or "prompt": every block starts right after the prompt
    schedule: str | Callable = "low_confidence"
    schedule_params: Mapping[str, Any] | None = None  # the schedule's parameters (traced: new values never recompile)
    max_steps_per_block: int | None = None  # None: block_size; on the last step every mask is filled
    tokens_per_step: int = 2               # fixed_k schedule
    margin_threshold: float = 0.5          # margin schedule: top-1 minus top-2 probability
    entropy_bound: float = 1.0             # entropy_bounded schedule: nats filled per step
    coreset: bool | None = None            # None: the model config's moe_block_coreset_enabled
    coreset_top_p: float | None = None     # None: the model config's moe_block_coreset_top_p

    def __post_init__(self):
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        else:
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id or ()))
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_model_type(cls, model_type: str, **values: Any) -> "GenerationConfig":
        """The defaults of spec §4: the model card's for clover_moe, neutral controls for base Qwen."""
        defaults: dict[str, Any] = dict(CLOVER_DEFAULTS)
        if model_type != "clover_moe":
            defaults.update(NEUTRAL_CONTROLS)
        return cls.from_dict({**defaults, **values})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> "GenerationConfig":
        """Read `generation_config.json` (optional) with the defaults of the checkpoint's model type."""
        path = os.fspath(path)
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"no config.json in {path!r}")
        with open(config_path) as handle:
            model_config = json.load(handle)
        text = model_config.get("text_config", model_config) if model_config.get("model_type") == "qwen3_5_moe" \
            else model_config
        values: dict[str, Any] = dict(CLOVER_DEFAULTS)
        if model_config.get("model_type") != "clover_moe":
            values.update(NEUTRAL_CONTROLS)
        values["eos_token_id"] = text.get("eos_token_id", model_config.get("eos_token_id")) or ()
        values["mask_token_id"] = text.get("mask_token_id", model_config.get("mask_token_id"))
        generation_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_path):
            with open(generation_path) as handle:
                stored = json.load(handle)
            known = {f.name for f in dataclasses.fields(cls)}
            values.update({key: value for key, value in stored.items() if key in known and value is not None})
        thinking = think_tokens_from_tokenizer(path)
        for key, token in thinking.items():
            if values.get(key) is None:
                values[key] = token
        return cls.from_dict(values).replace(**overrides)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GenerationConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})

    def replace(self, **overrides: Any) -> "GenerationConfig":
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown generation options {unknown}; known: "
                             f"{sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **overrides)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        is_int = lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool)
        for name in ("threshold", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "dllm_length_penalty", "dllm_think_end_bias", "margin_threshold",
                     "entropy_bound") + (("coreset_top_p",) if self.coreset_top_p is not None else ()):
            value = getattr(self, name)
            need(isinstance(value, numbers.Real) and not isinstance(value, bool),
                 f"{name} must be a number, got {value!r}")
        need(all(is_int(e) for e in self.eos_token_id),
             f"eos_token_id must be an int or a list of ints, got {self.eos_token_id!r}")
        if self.max_new_tokens is not None:
            need(is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                 f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        need(is_int(self.block_size) and self.block_size >= 1,
             f"block_size must be an integer >= 1, got {self.block_size!r}")
        need(0.0 < self.threshold <= 1.0, f"threshold must be in (0, 1], got {self.threshold}")
        if self.do_sample:  # transformers' configs may carry temperature 0 with greedy decoding
            need(self.temperature > 0, f"temperature must be > 0 when do_sample=True, got {self.temperature}")
        need(is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty", "dllm_length_penalty", "dllm_think_end_bias"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        for name in ("dllm_length_penalty_start", "dllm_length_penalty_window", "dllm_think_end_start",
                     "dllm_think_end_window"):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 0,
                 f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        need(self.block_alignment in ("absolute", "prompt"),
             f"block_alignment must be 'absolute' or 'prompt', got {self.block_alignment!r}")
        need(callable(self.schedule) or self.schedule in schedules.BY_NAME,
             f"schedule must be one of {sorted(schedules.BY_NAME)} or a function, got {self.schedule!r}")
        need(self.schedule_params is None or isinstance(self.schedule_params, Mapping),
             f"schedule_params must be a dict of parameter values, got {self.schedule_params!r}")
        if self.max_steps_per_block is not None:
            need(is_int(self.max_steps_per_block) and self.max_steps_per_block >= 1,
                 f"max_steps_per_block must be an integer >= 1, got {self.max_steps_per_block!r}")
        need(is_int(self.tokens_per_step) and self.tokens_per_step >= 1,
             f"tokens_per_step must be an integer >= 1, got {self.tokens_per_step!r}")
        need(self.margin_threshold >= 0, f"margin_threshold must be >= 0, got {self.margin_threshold}")
        need(self.entropy_bound >= 0, f"entropy_bound must be >= 0, got {self.entropy_bound}")
        if self.coreset_top_p is not None:
            need(0.0 < self.coreset_top_p <= 1.0, f"coreset_top_p must be in (0, 1], got {self.coreset_top_p}")

    @property
    def steps_cap(self) -> int:
        return self.max_steps_per_block or self.block_size


@functools.lru_cache(maxsize=8)
def think_tokens_from_tokenizer(path: str) -> dict[str, int]:
    """`<think>` / `</think>` ids from the checkpoint's tokenizer.json, when it has them."""
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        return {}
    with open(tokenizer_path) as handle:
        tokenizer = json.load(handle)
    vocabulary = dict(tokenizer.get("model", {}).get("vocab", {}) or {})
    vocabulary.update({token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])})
    found = {}
    if "<think>" in vocabulary:
        found["think_start_token_id"] = vocabulary["<think>"]
    if "</think>" in vocabulary:
        found["think_end_token_id"] = vocabulary["</think>"]
    return found
