"""What a caller submits to the serving engine, the checks it passes before any compute, and the
events that come back.

A request is checked as `generate` checks one (`decoding.generation.resolve_config` /
`check_prompts`: the same messages), then against what the engine serves: named schedules,
absolute block alignment, the model's coreset setting, and the engine's context per slot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from decoding.controls import Controls
from decoding.engine.diffusion_lane import SCHEDULES
from decoding.generation import check_prompts, resolve_config
from decoding.generation_config import GenerationConfig
from decoding.layouts import MODES, controls_of, prompt_thinking
from decoding.schedules import BY_NAME, resolve_params

FINISH_REASONS = ("eos", "length", "cancelled", "error")


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """prompt: token ids; mode: "diffusion", "autoregressive" or "self_speculative";
    generation_config: as `generate` takes it (None: the checkpoint's); overrides: GenerationConfig
    fields; seed: the PRNG seed of a sampled request (`generate(key=jax.random.key(seed))` alone)."""

    prompt: Sequence[int]
    mode: str = "diffusion"
    generation_config: GenerationConfig | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class LaneKey:
    """Requests that can share a lane: same mode, and for block decoding the same block size and step cap."""

    mode: str
    block_size: int | None = None
    steps_cap: int | None = None


@dataclasses.dataclass
class PreparedRequest:
    """A request that passed every check, with what the engine needs of it on the host."""

    prompt: list[int]
    mode: str
    config: GenerationConfig
    controls: Controls
    thinking: bool
    seed: int
    lane: LaneKey
    key: Any = None              # `sequence_key_row(seed)`, made on the caller's thread
    schedule: Any = None         # diffusion: its parameters of the engine's schedule switch (one slot's row)

    @property
    def max_new_tokens(self) -> int:
        return int(self.config.max_new_tokens)


@dataclasses.dataclass
class RequestStats:
    """Clover's figures for one finished request, as `generate` reports them alone."""

    prompt_tokens: int
    completion_tokens: int
    nfe: int
    steps_per_block: list[int]

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / max(self.nfe, 1)


@dataclasses.dataclass
class EngineEvent:
    """Delivered to a request's listener on the engine's thread, in order: `tokens` (response
    tokens decided since the last event: a block, a token, a self-speculative round's emission),
    then one event with `finish` set ("eos", "length", "cancelled", "error"), its `stats`, and
    `error` (a message) when the engine failed the request."""

    tokens: list[int]
    finish: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


Listener = Callable[[EngineEvent], None]


def rows_needed(prompt_length: int, config: GenerationConfig, mode: str) -> int:
    """Cache rows a request holds in its slot: the last block whole (absolute alignment), or the
    prompt and response plus one drafted block (self-speculative), or the prompt and response."""
    if mode == "diffusion":
        return math.ceil((prompt_length + config.max_new_tokens) / config.block_size) * config.block_size
    if mode == "self_speculative":
        return prompt_length + config.max_new_tokens + config.block_size
    return prompt_length + config.max_new_tokens


def prepare(model, request: EngineRequest, max_context: int) -> PreparedRequest:
    """Check a request before anything is compiled; raises ValueError saying what is wrong."""
    if request.mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {request.mode!r}")
    config = resolve_config(model, request.generation_config, dict(request.overrides))
    if not isinstance(config.schedule, str):
        raise ValueError(f"the serving engine runs the named schedules ({sorted(BY_NAME)}), not schedule functions")
    if config.block_alignment != "absolute":
        raise ValueError("the serving engine aligns blocks to absolute positions (block_alignment='absolute')")
    if config.coreset is not None and bool(config.coreset) != model.config.moe_block_coreset_enabled or \
            config.coreset_top_p is not None and config.coreset_top_p != model.config.moe_block_coreset_top_p:
        raise ValueError("the serving engine uses the model's coreset setting (moe_block_coreset_enabled, "
                         "moe_block_coreset_top_p); coreset and coreset_top_p cannot be set per request")
    if config.do_sample and request.mode == "self_speculative":
        raise ValueError("self-speculative decoding is greedy: do_sample=True is not supported in this mode "
                         "(sample with mode='autoregressive' or 'diffusion')")
    if isinstance(request.seed, bool) or not isinstance(request.seed, (int, np.integer)) or \
            not 0 <= request.seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {request.seed!r}")
    resolve_params(config.schedule, config.schedule_params, config)  # names, types and ranges
    prompt = check_prompts(model, [request.prompt], config, request.mode)[0]
    needed = rows_needed(len(prompt), config, request.mode)
    if needed > max_context:
        rule = {"diffusion": "ceil((P + N) / B) * B", "self_speculative": "P + N + B"}.get(request.mode, "P + N")
        raise ValueError(f"{rule} = {needed} positions (P={len(prompt)}, N={config.max_new_tokens}"
                         + (f", B={config.block_size}" if request.mode != "autoregressive" else "")
                         + f") exceeds the engine's context of {max_context} per request")
    if request.mode == "autoregressive":
        lane = LaneKey("autoregressive")
    else:
        lane = LaneKey(request.mode, config.block_size, config.steps_cap if request.mode == "diffusion" else None)
    schedule = None
    if request.mode == "diffusion":
        schedule = jax.tree_util.tree_map(lambda value: np.asarray(value)[None],
                                          SCHEDULES.params(config.schedule, config.schedule_params, config))
    return PreparedRequest(prompt, request.mode, config, controls_of(config), prompt_thinking(prompt, config),
                           int(request.seed), lane, sequence_key_row(int(request.seed)), schedule)


@functools.lru_cache(maxsize=256)
def sequence_key_row(seed: int) -> jax.Array:
    """The key a request alone draws from, `generate(key=jax.random.key(seed))`'s for prompt 0
    (random schedules draw from it in greedy decoding too), with a slot axis ([1]) as a lane's
    entry holds it. Cached: most requests share a seed (each call is a few device ops, ~0.1 ms)."""
    return jax.random.fold_in(jax.random.key(seed), 0)[None]
