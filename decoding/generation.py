"""`generate`: validation on the host, then one jitted loop on the device.

How prompts are laid out and bucketed for each mode's loop is `decoding.layouts`; the checks are
`decoding.validation`'s; what each mode needs is `decoding.modes`'. Numeric
controls (threshold, penalties, ramps, temperature, top-k/p, coreset top-p) and the schedule's
parameters (`schedule_params`) are traced, so changing them does not recompile; the schedule
itself, `do_sample`, the block size and `max_steps_per_block` do.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from clover_jax.core import compilation_cache
from clover_jax.core.errors import INVALID_TYPE, MISSING_FIELD, FieldError
from clover_jax.core.passes import ModelPasses
from decoding.block_loop import next_block, next_step, results, start_blocks, start_steps
from decoding.controls import Controls, TokenIds
from decoding.generation_config import GenerationConfig
from decoding.layouts import (
    autoregressive_call,
    bucket,
    controls_of,
    coreset_of,
    diffusion_call,
    prompt_thinking,
    self_speculative_call,
    token_ids_of,
)
from decoding.modes import MODES, Mode, strategy
from decoding.outputs import GenerateOutput, autoregressive_output, diffusion_output, self_speculative_output
from decoding.streaming import BlockListener, BlockReporter
from decoding.validation import check_prompts, resolve_config

logger = logging.getLogger(__name__)


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


class _Inputs(NamedTuple):
    """One call's checked inputs, as every mode's driver takes them."""

    model: DecodingModel
    prompts: list[list[int]]
    config: GenerationConfig
    key: jax.Array
    controls: Controls
    ids: TokenIds
    thinking: np.ndarray


class _Options(NamedTuple):
    """What the caller asked to record or hear (`generate`'s keywords of the same names)."""

    return_trajectory: bool
    return_history: bool
    on_block: BlockListener | None
    streamer: Any
    on_step: Callable[[dict], None] | None
    progress: bool


@functools.lru_cache(maxsize=1)
def _default_key() -> jax.Array:
    return jax.random.key(0)


__all__ = ["DecodingModel", "GenerateOutput", "MODES", "Mode", "bucket", "generate"]


def generate(model: DecodingModel, prompts: Sequence[Sequence[int]], generation_config: GenerationConfig | None = None,
             *, key: jax.Array | None = None, mode: str | Mode = Mode.DIFFUSION, return_trajectory: bool = False,
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

    constraint (a GenerationConfig field, so also an override): a grammar the answer keeps to, in
    every mode (docs/structured_outputs.md); the decode is then one compiled call per step, the
    grammar on the host, and `out.constraint` reports its steps, host time and commit-rule options.
    """
    compilation_cache.enable()
    config = resolve_config(model, generation_config, overrides)
    decoder = strategy(mode)
    prompts = check_prompts(model, prompts, config, decoder.mode)
    listening = on_block is not None or streamer is not None or progress or on_step is not None
    decoder.check_options(trajectory=return_trajectory, history=return_history, listening=listening)
    decoder.check_sampling(config.do_sample)
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise FieldError("streamer", f"streamer must have put(ids) and end() methods, got {type(streamer).__name__}",
                         code=INVALID_TYPE)
    if config.do_sample and key is None:
        raise FieldError("key", "do_sample=True needs a PRNG key: generate(..., key=jax.random.key(seed))",
                         code=MISSING_FIELD)
    inputs = _Inputs(model=model, prompts=prompts, config=config,
                     key=key if key is not None else _default_key(),  # prompt i's, fold_in(key, i), made in the loop
                     controls=controls_of(config), ids=token_ids_of(config),
                     thinking=np.array([prompt_thinking(p, config) for p in prompts]))
    options = _Options(return_trajectory=return_trajectory, return_history=return_history, on_block=on_block,
                       streamer=streamer, on_step=on_step, progress=progress)
    started = time.perf_counter()
    if config.constraint is not None:
        output = _generate_constrained(decoder.mode, inputs, options)
    else:
        output = _DRIVERS[decoder.mode](inputs, options)
    output.wall_time = time.perf_counter() - started
    return output


# ---------------------------------------------------------------------- diffusion
def _generate_diffusion(inputs: _Inputs, options: _Options) -> GenerateOutput:
    model, prompts, config = inputs.model, inputs.prompts, inputs.config
    coreset, coreset_top_p = coreset_of(config, model.config)
    call = diffusion_call(model.passes, model.run_params, prompts, config, model.chunk_size, coreset=coreset,
                          coreset_top_p=coreset_top_p, key=inputs.key, thinking=inputs.thinking,
                          controls=inputs.controls, ids=inputs.ids, history=options.return_history)
    model.check_memory(len(prompts), call.capacity, call.block)
    bar = tqdm(total=len(prompts) * config.max_new_tokens, unit="tok", desc="decoding") if options.progress else None
    reporter = None
    if options.on_block is not None or options.streamer is not None or bar is not None:
        reporter = BlockReporter(prompts, call.tails, config.max_new_tokens, config.eos_token_id, options.on_block,
                                 options.streamer, bar)
    try:
        if options.on_step is not None:
            final = _drive_steps(call.args, options.on_step, reporter)
        elif reporter is not None:
            final = _drive_blocks(call.args, reporter)
        else:
            final = jax.device_get(call.run())
    finally:
        if reporter is not None:
            reporter.close()
        if bar is not None:
            bar.close()
    return diffusion_output(final, tails=call.tails, new=config.max_new_tokens, eos_token_id=config.eos_token_id,
                            return_trajectory=options.return_trajectory)


def _drive_blocks(args, reporter: BlockReporter):
    """One compiled call per block, the host reporting each decided block in between."""
    state = start_blocks(*args)
    block_number = 0
    while True:
        finished, block = jax.device_get((state.progress.finished, state.tokens[:, block_number]))
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
            (state.last_step, state.progress.finished, state.progress.open, state.block_iter, state.steps_per_block))
        on_step(record)
        waiting = ~open_ | finished
        if reporter is not None and waiting.all():
            closed = steps[:, int(block_number)] > 0
            reporter.report(int(block_number), np.asarray(jax.device_get(state.tokens[:, int(block_number)])), closed)
        if finished.all():
            return jax.device_get(results(state))
        state = next_step(*args, state, commit=bool(waiting.all()))


# ---------------------------------------------------------------------- autoregressive
def _generate_autoregressive(inputs: _Inputs, options: _Options) -> GenerateOutput:
    model = inputs.model
    call = autoregressive_call(model.passes, model.run_params, inputs.prompts, inputs.config, model.chunk_size,
                               key=inputs.key, thinking=inputs.thinking, controls=inputs.controls, ids=inputs.ids)
    model.check_memory(len(inputs.prompts), call.capacity, call.block)
    return autoregressive_output(jax.device_get(call.run()))


# ---------------------------------------------------------------------- self-speculative
def _generate_self_speculative(inputs: _Inputs, options: _Options) -> GenerateOutput:
    """Prompts left-padded as for autoregressive decoding; rounds of `decoding.speculative`."""
    model = inputs.model
    coreset, coreset_top_p = coreset_of(inputs.config, model.config)
    call = self_speculative_call(model.passes, model.run_params, inputs.prompts, inputs.config, model.chunk_size,
                                 coreset=coreset, coreset_top_p=coreset_top_p, thinking=inputs.thinking,
                                 controls=inputs.controls, ids=inputs.ids, trajectory=options.return_trajectory)
    model.check_memory(len(inputs.prompts), call.capacity, call.block)
    return self_speculative_output(jax.device_get(call.run()), lengths=call.lengths,
                                   return_trajectory=options.return_trajectory)


# ---------------------------------------------------------------------- under a grammar
def _generate_constrained(mode: Mode, inputs: _Inputs, options: _Options) -> GenerateOutput:
    """Every mode under `config.constraint`, one compiled call per step (`decoding.constraints.drivers`)."""
    from decoding.constraints import drivers
    from decoding.constraints.commit_rule import BlockGrammar

    model, config = inputs.model, inputs.config
    matchers = _matchers(model, config, inputs.thinking)
    trace = drivers.Trace()
    if mode is Mode.AUTOREGRESSIVE:
        call = autoregressive_call(model.passes, model.run_params, inputs.prompts, config, model.chunk_size,
                                   key=inputs.key, thinking=inputs.thinking, controls=inputs.controls, ids=inputs.ids)
        model.check_memory(len(inputs.prompts), call.capacity, call.block)
        output = autoregressive_output(drivers.autoregressive(call, matchers, trace))
    elif mode is Mode.SELF_SPECULATIVE:
        coreset, coreset_top_p = coreset_of(config, model.config)
        call = self_speculative_call(model.passes, model.run_params, inputs.prompts, config, model.chunk_size,
                                     coreset=coreset, coreset_top_p=coreset_top_p, thinking=inputs.thinking,
                                     controls=inputs.controls, ids=inputs.ids, trajectory=options.return_trajectory)
        model.check_memory(len(inputs.prompts), call.capacity, call.block)
        output = self_speculative_output(drivers.self_speculative(call, matchers, trace), lengths=call.lengths,
                                         return_trajectory=options.return_trajectory)
    else:
        coreset, coreset_top_p = coreset_of(config, model.config)
        call = diffusion_call(model.passes, model.run_params, inputs.prompts, config, model.chunk_size,
                              coreset=coreset, coreset_top_p=coreset_top_p, key=inputs.key, thinking=inputs.thinking,
                              controls=inputs.controls, ids=inputs.ids, history=options.return_history)
        model.check_memory(len(inputs.prompts), call.capacity, call.block)
        grammars = [BlockGrammar(matcher, config.constraint_gap_rule) for matcher in matchers]
        bar = (tqdm(total=len(inputs.prompts) * config.max_new_tokens, unit="tok", desc="decoding")
               if options.progress else None)
        reporter = None
        if options.on_block is not None or options.streamer is not None or bar is not None:
            reporter = BlockReporter(inputs.prompts, call.tails, config.max_new_tokens, config.eos_token_id,
                                     options.on_block, options.streamer, bar)
        try:
            final = drivers.diffusion(call, grammars, trace, reporter=reporter, on_step=options.on_step)
        finally:
            if reporter is not None:
                reporter.close()
            if bar is not None:
                bar.close()
        output = diffusion_output(final, tails=call.tails, new=config.max_new_tokens,
                                  eos_token_id=config.eos_token_id, return_trajectory=options.return_trajectory)
    output.constraint = dict(steps=trace.steps, grammar_seconds=trace.grammar_seconds,
                             grammar_seconds_per_step=trace.grammar_seconds_per_step, options=dict(trace.options),
                             complete=[matcher.accepting for matcher in matchers])
    return output


def _matchers(model: DecodingModel, config: GenerationConfig, thinking: np.ndarray) -> list:
    """One grammar matcher per prompt, from the checkpoint's tokenizer.json."""
    from decoding.constraints.matcher import matcher_for

    return [matcher_for(model, config, bool(row)) for row in thinking]


# The loop each mode runs.
_DRIVERS: dict[Mode, Callable[[_Inputs, _Options], GenerateOutput]] = {
    Mode.DIFFUSION: _generate_diffusion,
    Mode.AUTOREGRESSIVE: _generate_autoregressive,
    Mode.SELF_SPECULATIVE: _generate_self_speculative,
}
