"""`generate`: validation on the host, then one jitted loop on the device.

How prompts are laid out and bucketed for each mode's loop is `decoding.layouts`. Numeric
controls (threshold, penalties, ramps, temperature, top-k/p, coreset top-p) and the schedule's
parameters (`schedule_params`) are traced, so changing them does not recompile; the schedule
itself, `do_sample`, the block size and `max_steps_per_block` do.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import weakref
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from clover_jax.core import compilation_cache
from clover_jax.core.passes import ModelPasses
from decoding.block_loop import History, next_block, next_step, results, start_blocks, start_steps
from decoding.generation_config import GenerationConfig
from decoding.layouts import (
    MODES,
    autoregressive_call,
    bucket,
    controls_of,
    coreset_of,
    diffusion_call,
    prompt_thinking,
    self_speculative_call,
    token_ids_of,
)
from decoding.streaming import BlockListener, BlockReporter

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerateOutput:
    """Per prompt: response tokens (cut at max_new_tokens and after the first EOS, kept), forward
    passes, denoising steps of each decoded block, response tokens per forward, mean distinct
    experts per MoE layer per step of each block; the wall time of the call; and, with
    `return_trajectory=True`, for every response position the denoising step (1-based, within its
    block) that filled it and its confidence then (diffusion), or each round's `drafts` (B tokens),
    `accepted` (drafts accepted) and `emitted` (tokens emitted) (self-speculative). In
    self-speculative mode a "block" is a round: one denoising pass each."""

    sequences: list[list[int]]
    nfe: list[int]
    steps_per_block: list[list[int]]
    tokens_per_forward: list[float]
    distinct_experts_per_block: list[list[float]]
    wall_time: float
    trajectory: list[dict[str, list]] | None = None
    history: History | None = None  # with return_history=True: every denoising step, NumPy arrays [b, S, ...]


class DecodingModel(Protocol):
    """What `generate` needs of a model (`clover_jax.CloverModel` is one): its config (vocabulary,
    context, model type, coreset defaults), its pass interface and the parameters it runs with,
    the prefill's chunk size, a memory check that raises before a call that cannot fit, and
    optionally `path`, the checkpoint directory whose generation_config.json gives the defaults."""

    config: Any
    passes: ModelPasses
    run_params: Any
    chunk_size: int

    def check_memory(self, batch: int, capacity: int, block_size: int) -> None: ...


@functools.lru_cache(maxsize=1)
def _default_key() -> jax.Array:
    return jax.random.key(0)


__all__ = ["DecodingModel", "GenerateOutput", "MODES", "bucket", "generate"]


def generate(model: DecodingModel, prompts: Sequence[Sequence[int]], generation_config: GenerationConfig | None = None,
             *, key: jax.Array | None = None, mode: str = "diffusion", return_trajectory: bool = False,
             return_history: bool = False, on_block: BlockListener | None = None, streamer: Any = None,
             on_step: Callable[[dict], None] | None = None, progress: bool = False,
             **overrides: Any) -> GenerateOutput:
    """Decode a response to each prompt (docs/design.md §4, §6, §7).

    prompts: token ids per prompt; generation_config: defaults to the checkpoint's
    `generation_config.json`; overrides: GenerationConfig fields; key: PRNG key for sampling
    (prompt i uses `jax.random.fold_in(key, i)`); mode: "diffusion", "autoregressive" or
    "self_speculative" (docs/design.md §8: a denoising pass drafts `block_size` tokens, a causal pass verifies
    them; greedy, and its output equals "autoregressive"'s; `return_trajectory=True` gives, per
    prompt, each round's drafts, accepted drafts and emitted tokens).

    Diffusion mode only:
    on_block(prompt index, response tokens of the block, block number) is called on the host as
    each block is decided; streamer: a transformers-style streamer (`put(ids)`, `end()`, one
    prompt), e.g. `decoding.streaming.TextStreamer`; progress: a progress bar of response tokens.
    These are cut at the first EOS and at max_new_tokens, and decode one block per compiled call.
    on_step(record) receives every denoising step's record (NumPy arrays over the batch: active,
    block_index, masked_before, candidate, confidence, margin, entropy, filled, changed), one
    compiled call per step. return_history: `out.history`, every step recorded inside the loop.
    Without any of them the whole decode is one compiled program. Every check runs before
    anything is compiled; an exception raised by a listener reaches the caller as it is.
    """
    compilation_cache.enable()
    config = resolve_config(model, generation_config, overrides)
    prompts = check_prompts(model, prompts, config, mode)
    listening = on_block is not None or streamer is not None or progress or on_step is not None
    if (return_trajectory or return_history or listening) and mode == "autoregressive":
        raise ValueError("return_trajectory, return_history, on_block, streamer, on_step and progress are for "
                         "diffusion decoding")
    if (return_history or listening) and mode == "self_speculative":
        raise ValueError("return_history, on_block, streamer, on_step and progress are for diffusion decoding; "
                         "self-speculative decoding records its rounds with return_trajectory=True")
    if config.do_sample and mode == "self_speculative":
        raise ValueError("self-speculative decoding is greedy: do_sample=True is not supported in this mode "
                         "(sample with mode='autoregressive' or 'diffusion')")
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise ValueError(f"streamer must have put(ids) and end() methods, got {type(streamer).__name__}")
    if config.do_sample and key is None:
        raise ValueError("do_sample=True needs a PRNG key: generate(..., key=jax.random.key(seed))")
    keys = key if key is not None else _default_key()  # prompt i's key, fold_in(key, i), is made in the loop
    controls, ids = controls_of(config), token_ids_of(config)
    thinking = np.array([prompt_thinking(p, config) for p in prompts])
    started = time.perf_counter()
    if mode == "autoregressive":
        output = _generate_autoregressive(model, prompts, config, keys, controls, ids, thinking)
    elif mode == "self_speculative":
        output = _generate_self_speculative(model, prompts, config, controls, ids, thinking, return_trajectory)
    else:
        bar = tqdm(total=len(prompts) * config.max_new_tokens, unit="tok", desc="decoding") if progress else None
        try:
            output = _generate_diffusion(model, prompts, config, keys, controls, ids, thinking,
                                         return_trajectory=return_trajectory, return_history=return_history,
                                         on_block=on_block, streamer=streamer, on_step=on_step, bar=bar)
        finally:
            if bar is not None:
                bar.close()
    output.wall_time = time.perf_counter() - started
    return output


# ---------------------------------------------------------------------- validation
def resolve_config(model: DecodingModel, generation_config: GenerationConfig | None,
                   overrides: dict) -> GenerationConfig:
    config = model_defaults(model) if generation_config is None else _completed(model, generation_config)
    if overrides:
        config = config.replace(**overrides)
    if config.max_new_tokens is None:
        raise ValueError("max_new_tokens is not set: pass max_new_tokens=... or set it in generation_config.json")
    return config


_DEFAULTS: "weakref.WeakKeyDictionary[Any, tuple[Any, GenerationConfig]]" = weakref.WeakKeyDictionary()


def model_defaults(model: DecodingModel) -> GenerationConfig:
    """The checkpoint's generation config, read once per model (and again if `model.path` changes)."""
    path = getattr(model, "path", None)
    cached = _DEFAULTS.get(model)
    if cached is None or cached[0] != path:
        base = GenerationConfig.from_pretrained(path) if path else GenerationConfig.for_model_type(
            model.config.model_type)
        cached = (path, _completed(model, base))
        _DEFAULTS[model] = cached
    return cached[1]


def _completed(model: DecodingModel, config: GenerationConfig) -> GenerationConfig:
    """The special token ids a generation config leaves out, from config.json and the tokenizer."""
    return config.with_token_ids(model.config, getattr(model, "path", None))


def check_prompts(model: DecodingModel, prompts, config: GenerationConfig, mode: str) -> list[list[int]]:
    vocab, limit = model.config.vocab_size, model.config.max_position_embeddings
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if mode != "autoregressive" and config.mask_token_id is None:
        raise ValueError(f"{mode.replace('_', '-')} decoding needs mask_token_id (config.json or "
                         "generation_config.json); base Qwen checkpoints decode with mode='autoregressive'")
    for name in ("mask_token_id", "think_start_token_id", "think_end_token_id"):
        value = getattr(config, name)
        if value is not None and not 0 <= value < vocab:
            raise ValueError(f"{name}={value} is outside the vocabulary [0, {vocab})")
    if config.top_k > vocab:  # transformers would clamp it; a top_k past the vocabulary is a mistake
        raise ValueError(f"top_k={config.top_k} is larger than the vocabulary ({vocab}); 0 turns top-k off")
    bad_eos = [e for e in config.eos_token_id if not 0 <= e < vocab]
    if bad_eos:
        raise ValueError(f"eos_token_id {bad_eos} outside the vocabulary [0, {vocab})")
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    checked = []
    size, new = config.block_size, config.max_new_tokens
    for index, prompt in enumerate(prompts):
        array = np.asarray(prompt)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"prompt {index} must be a non-empty list of int token ids")
        if array.min() < 0 or array.max() >= vocab:
            raise ValueError(f"prompt {index} holds ids in [{array.min()}, {array.max()}], outside the vocabulary "
                             f"[0, {vocab})")
        if config.mask_token_id is not None and np.any(array == config.mask_token_id):
            raise ValueError(f"prompt {index} contains the mask token id {config.mask_token_id}")
        length = int(array.size)
        if mode != "diffusion":  # drafted positions past N are never emitted
            needed, rule = length + new, "P + N"
        elif config.block_alignment == "absolute":
            needed, rule = math.ceil((length + new) / size) * size, "ceil((P + N) / B) * B"
        else:
            needed, rule = length + math.ceil(new / size) * size, "P + ceil(N / B) * B"
        if needed > limit:
            raise ValueError(f"prompt {index}: {rule} = {needed} positions (P={length}, N={new}, B={size}) "
                             f"exceeds the model's context of {limit} (max_position_embeddings)")
        checked.append([int(t) for t in array])
    return checked


# ---------------------------------------------------------------------- diffusion
def _generate_diffusion(model, prompts, config, keys, controls, ids, thinking, *, return_trajectory, return_history,
                        on_block, streamer, on_step, bar) -> GenerateOutput:
    coreset, coreset_top_p = coreset_of(config, model.config)
    call = diffusion_call(model.passes, model.run_params, prompts, config, model.chunk_size, coreset=coreset,
                          coreset_top_p=coreset_top_p, key=keys, thinking=thinking, controls=controls, ids=ids,
                          history=return_history)
    model.check_memory(len(prompts), call.capacity, call.block)
    reporter = None
    if on_block is not None or streamer is not None or bar is not None:
        reporter = BlockReporter(prompts, call.tails, config.max_new_tokens, config.eos_token_id, on_block, streamer,
                                 bar)
    try:
        if on_step is not None:
            final = _drive_steps(call.args, on_step, reporter)
        elif reporter is not None:
            final = _drive_blocks(call.args, reporter)
        else:
            final = jax.device_get(call.run())
    finally:
        if reporter is not None:
            reporter.close()
    return _diffusion_output(final, call.tails, config.max_new_tokens, config, return_trajectory)


def _drive_blocks(args, reporter: BlockReporter):
    """One compiled call per block, the host reporting each decided block in between."""
    state = start_blocks(*args)
    block_number = 0
    while True:
        finished, block = jax.device_get((state.finished, state.tokens[:, block_number]))
        reporter.report(block_number, block, np.ones_like(finished))
        if finished.all():
            return jax.device_get(results(state))
        state = next_block(*args, state)
        block_number += 1


def _drive_steps(args, on_step, reporter: BlockReporter | None):
    """One compiled call per denoising step, the host receiving each step's record."""
    state = start_steps(*args)
    while True:
        record, finished, open_, block_number, steps = jax.device_get(
            (state.last_step, state.finished, state.open, state.block_iter, state.steps_per_block))
        on_step(record)
        waiting = ~open_ | finished
        if reporter is not None and waiting.all():
            closed = steps[:, int(block_number)] > 0
            reporter.report(int(block_number), np.asarray(jax.device_get(state.tokens[:, int(block_number)])), closed)
        if finished.all():
            return jax.device_get(results(state))
        state = next_step(*args, state, commit=bool(waiting.all()))


def _diffusion_output(final, tails, new: int, config, return_trajectory: bool) -> GenerateOutput:
    eos = set(config.eos_token_id)
    output = GenerateOutput([], [], [], [], [], 0.0, [] if return_trajectory else None)
    for i in range(len(tails)):
        closed = int(np.sum(final.steps_per_block[i] > 0))
        flat = lambda array, i=i, closed=closed: np.asarray(array[i, :closed]).reshape(-1)[tails[i]:tails[i] + new]
        response = flat(final.tokens).tolist()
        cut = next((n + 1 for n, token in enumerate(response) if token in eos), len(response))
        steps = final.steps_per_block[i, :closed]
        output.sequences.append(response[:cut])
        output.nfe.append(int(final.nfe[i]))
        output.steps_per_block.append([int(s) for s in steps])
        output.tokens_per_forward.append(cut / max(int(final.nfe[i]), 1))
        output.distinct_experts_per_block.append(
            [float(d) / int(s) for d, s in zip(final.distinct_experts[i, :closed], steps, strict=True)])
        if return_trajectory:
            output.trajectory.append({"step": flat(final.fill_step)[:cut].tolist(),
                                      "confidence": flat(final.fill_confidence)[:cut].tolist()})
    if final.history is not None:
        used = int(np.max(final.history.num_steps))
        output.history = History(*(np.asarray(field)[:, :used] for field in final.history[:-1]),
                                 np.asarray(final.history.num_steps))
    return output


# ---------------------------------------------------------------------- autoregressive
def _generate_autoregressive(model, prompts, config, key, controls, ids, thinking) -> GenerateOutput:
    call = autoregressive_call(model.passes, model.run_params, prompts, config, model.chunk_size, key=key,
                               thinking=thinking, controls=controls, ids=ids)
    model.check_memory(len(prompts), call.capacity, call.block)
    tokens, generated, nfe = jax.device_get(call.run())
    output = GenerateOutput([], [], [], [], [], 0.0, None)
    for i in range(len(prompts)):
        response = tokens[i, :int(generated[i])].tolist()
        output.sequences.append(response)
        output.nfe.append(int(nfe[i]))
        output.steps_per_block.append([1] * len(response))
        output.tokens_per_forward.append(len(response) / max(int(nfe[i]), 1))
        output.distinct_experts_per_block.append([])
    return output


# ---------------------------------------------------------------------- self-speculative
def _generate_self_speculative(model, prompts, config, controls, ids, thinking,
                               return_trajectory: bool) -> GenerateOutput:
    """Prompts left-padded as for autoregressive decoding; rounds of `decoding.speculative`."""
    coreset, coreset_top_p = coreset_of(config, model.config)
    call = self_speculative_call(model.passes, model.run_params, prompts, config, model.chunk_size, coreset=coreset,
                                 coreset_top_p=coreset_top_p, thinking=thinking, controls=controls, ids=ids,
                                 trajectory=return_trajectory)
    model.check_memory(len(prompts), call.capacity, call.block)
    final = jax.device_get(call.run())
    lengths = call.lengths
    output = GenerateOutput([], [], [], [], [], 0.0, [] if return_trajectory else None)
    for i in range(len(prompts)):
        response = final.tokens[i, :int(final.lengths[i])].tolist()
        rounds = (int(final.nfe[i]) - int(lengths[i] > 1)) // 2
        output.sequences.append(response)
        output.nfe.append(int(final.nfe[i]))
        output.steps_per_block.append([1] * rounds)  # one denoising pass per round
        output.tokens_per_forward.append(len(response) / max(int(final.nfe[i]), 1))
        output.distinct_experts_per_block.append([float(d) for d in final.distinct_experts[i, :rounds]])
        if return_trajectory:
            output.trajectory.append({"drafts": final.rounds.drafts[i, :rounds].tolist(),
                                      "accepted": final.rounds.accepted[i, :rounds].tolist(),
                                      "emitted": final.rounds.emitted[i, :rounds].tolist()})
    return output
