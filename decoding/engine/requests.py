"""What a caller submits to the serving engine, the checks it passes before any compute, and the
events that come back.

A request is checked as `generate` checks one (`decoding.validation`: the same checks and
messages), then against what the engine serves: named schedules,
absolute block alignment, the model's coreset setting, and the engine's context per slot. A
request under a constraint has its grammar compiled here, on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from clover_jax.core.errors import CONTEXT_LENGTH, UNSUPPORTED, FieldError
from decoding.constraints.matcher import matcher_for
from decoding.controls import Controls
from decoding.engine.slot_states import MAX_TOP_LOGPROBS, SCHEDULES
from decoding.generation_config import GenerationConfig
from decoding.layouts import controls_of, prompt_thinking
from decoding.modes import Mode, strategy
from decoding.schedules import BY_NAME, resolve_params
from decoding.validation import check_prompts, resolve_config

FINISH_REASONS = ("eos", "length", "cancelled", "error", "shutdown")


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """prompt: token ids; mode: "diffusion", "autoregressive" or "self_speculative";
    generation_config: as `generate` takes it (None: the checkpoint's); overrides: GenerationConfig
    fields; seed: the PRNG seed of a sampled request (`generate(key=jax.random.key(seed))` alone);
    logprobs: diffusion only — record each response token's log-probability at the denoising step
    that decided it, with this many alternatives (None: record nothing; see `EngineEvent.logprobs`)."""

    prompt: Sequence[int]
    mode: str | Mode = Mode.DIFFUSION
    generation_config: GenerationConfig | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0
    logprobs: int | None = None


@dataclasses.dataclass
class PreparedRequest:
    """A request that passed every check, with what the engine needs of it on the host."""

    prompt: list[int]
    mode: Mode
    config: GenerationConfig
    controls: Controls
    thinking: bool
    seed: int
    key: Any = None              # `sequence_key_row(seed)`, made on the caller's thread
    schedule: Any = None         # diffusion: its parameters of the engine's schedule switch (one slot's row)
    logprobs: int | None = None  # diffusion: alternatives recorded per token (None: no log-probabilities)
    grammar: Any = None          # under `config.constraint`: the request's `GrammarMatcher` (its state on the host)

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
    cached_tokens: int = 0      # prompt tokens whose state came from the prefix cache

    @property
    def tokens_per_forward(self) -> float:
        return self.completion_tokens / max(self.nfe, 1)


@dataclasses.dataclass
class EngineEvent:
    """Delivered to a request's listener on the engine's thread, in order: `tokens` (response
    tokens decided since the last event: a block, a token, a self-speculative round's emission),
    then one event with `finish` set ("eos", "length", "cancelled", "error", "shutdown": the engine
    was closed), its `stats`, and `error` (a message) when the engine failed the request.
    logprobs: for a request that asked for them, one (log-probability, top ids, top log-probabilities)
    per token of `tokens`, the processed distribution of the denoising step that decided it."""

    tokens: list[int]
    finish: str | None = None
    stats: RequestStats | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


Listener = Callable[[EngineEvent], None]


def rows_needed(prompt_length: int, config: GenerationConfig, mode: str | Mode) -> int:
    """Cache rows a request holds in its slot (`ModeStrategy.rows_needed`)."""
    return strategy(mode).rows_needed(prompt_length, config.max_new_tokens, config.block_size)[0]


def prepare(model, request: EngineRequest, max_context: int) -> PreparedRequest:
    """Check a request before anything is compiled; raises FieldError (a ValueError) saying what is wrong."""
    decoder = strategy(request.mode)
    config = resolve_config(model, request.generation_config, dict(request.overrides))
    if not isinstance(config.schedule, str):
        raise FieldError("schedule", f"the serving engine runs the named schedules ({sorted(BY_NAME)}), not "
                                     "schedule functions", code=UNSUPPORTED)
    if config.block_alignment != "absolute":
        raise FieldError("block_alignment", "the serving engine aligns blocks to absolute positions "
                                            "(block_alignment='absolute')", code=UNSUPPORTED)
    if config.coreset is not None and bool(config.coreset) != model.config.moe_block_coreset_enabled or \
            config.coreset_top_p is not None and config.coreset_top_p != model.config.moe_block_coreset_top_p:
        raise FieldError("coreset", "the serving engine uses the model's coreset setting (moe_block_coreset_enabled, "
                                    "moe_block_coreset_top_p); coreset and coreset_top_p cannot be set per request",
                         code=UNSUPPORTED)
    decoder.check_sampling(config.do_sample)
    if isinstance(request.seed, bool) or not isinstance(request.seed, (int, np.integer)) or \
            not 0 <= request.seed < 2**63:
        raise FieldError("seed", f"seed must be an integer in [0, 2**63), got {request.seed!r}")
    schedule = schedule_rows(config, whole_blocks=decoder.whole_blocks)  # names, types and ranges checked
    if request.logprobs is not None:
        if decoder.mode != Mode.DIFFUSION:
            raise FieldError("logprobs", "the engine records log-probabilities in diffusion mode only (the causal "
                                         "modes are scored by one causal pass: decoding.scoring)", code=UNSUPPORTED)
        if isinstance(request.logprobs, bool) or not isinstance(request.logprobs, int) or \
                not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise FieldError("logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, "
                                         f"got {request.logprobs!r}")
    prompt = check_prompts(model, [request.prompt], config, decoder.mode)[0]
    needed, rule = decoder.rows_needed(len(prompt), config.max_new_tokens, config.block_size)
    if needed > max_context:
        raise FieldError("max_new_tokens", f"{rule} = {needed} positions (P={len(prompt)}, N={config.max_new_tokens}"
                         + (f", B={config.block_size}" if decoder.decodes_blocks else "")
                         + f") exceeds the engine's context of {max_context} per request", code=CONTEXT_LENGTH)
    thinking = prompt_thinking(prompt, config)
    grammar = None
    if config.constraint is not None:  # compiled here, so a grammar llguidance refuses fails before any compute
        grammar = matcher_for(model, config, thinking)
    return PreparedRequest(prompt=prompt, mode=decoder.mode, config=config, controls=controls_of(config),
                           thinking=thinking, seed=int(request.seed), key=sequence_key_row(int(request.seed)),
                           schedule=schedule, logprobs=request.logprobs, grammar=grammar)


def schedule_rows(config: GenerationConfig, *, whole_blocks: bool) -> dict | None:
    """The request's `SCHEDULES` parameters ([1] leaves, read-only) when its mode decodes whole
    blocks, else None; either way its schedule and schedule_params are checked (FieldError).
    Cached per config: most requests share one, and the switch's parameters resolve every named
    schedule (~0.07 ms a request, on the engine's thread when a listener submits). Equal configs
    give equal rows: a config is validated, so equal fields are equal numbers of the same kinds."""
    try:
        hash(config)
    except TypeError:  # schedule_params or a constraint that holds a dict: not cached
        return _schedule_rows(config, whole_blocks)
    return _cached_schedule_rows(config, whole_blocks)


def _schedule_rows(config: GenerationConfig, whole_blocks: bool) -> dict | None:
    resolve_params(config.schedule, config.schedule_params, config)
    if not whole_blocks:
        return None

    def row(value):
        array = np.asarray(value)[None]
        array.setflags(write=False)  # shared by every request of this config
        return array

    return jax.tree_util.tree_map(row, SCHEDULES.params(config.schedule, config.schedule_params, config))


_cached_schedule_rows = functools.lru_cache(maxsize=64)(_schedule_rows)


@functools.lru_cache(maxsize=256)
def sequence_key_row(seed: int) -> np.ndarray:
    """The key a request alone draws from, `generate(key=jax.random.key(seed))`'s for prompt 0
    (random schedules draw from it in greedy decoding too), as raw key data with a slot axis
    ([1, ...] uint32) as a slot's entry holds it. Cached: most requests share a seed (each call is a
    few device ops, ~0.1 ms)."""
    data = np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 0)[None]))
    data.setflags(write=False)  # shared by every request of this seed
    return data
