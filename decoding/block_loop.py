"""The LowConfidence block-diffusion decoder of spec §4 as one jitted `jax.lax.while_loop`.

The batch moves in lockstep over blocks aligned across sequences (left padding chosen by
`decoding.generation`). Each iteration is one model call: a denoising step of the current block,
or — once every unfinished sequence has decided its block — the commit of that block fused
with the first denoising step of the next. A sequence whose block is decided waits for the
others without counting a forward pass, so its tokens, steps and NFE equal a lone run.
The last block of a sequence is never committed: nothing would read it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.chunked import causal_pass
from clover_jax.model import CloverTransformer
from clover_jax.sharding import constrain_state
from clover_jax.state import ModelState, empty_state
from decoding.controls import Controls, TokenIds, choose, process
from decoding.schedules import StepView, as_decision
from decoding.streaming import report_closed_blocks


class LoopSpec(NamedTuple):
    """Static layout of one compiled decoder (changing any field recompiles)."""

    block_size: int
    prefix_blocks: int    # causal prefix length in blocks, after left padding
    max_blocks: int       # decoded blocks the buffers hold
    steps_cap: int        # denoising steps after which a block is force-filled
    do_sample: bool
    schedule: Callable    # `decoding.schedules` signature; its parameters travel traced in `Request`
    coreset: bool
    report_blocks: bool   # call the host once per decided block (streaming, progress)
    chunk_size: int       # tokens per causal pass of the prefill


class Request(NamedTuple):
    """Per-sequence inputs (traced). b = batch, B = block size."""

    prefix_ids: jax.Array        # int32 [b, prefix_blocks * B], left padded
    first_block: jax.Array       # int32 [b, B]: the prompt tail, then masks
    fixed: jax.Array             # bool [b, B]: prompt-tail positions of the first block
    start: jax.Array             # int32 [b]: left padding (first real cache row)
    response_base: jax.Array     # int32 [b]: response index t of row 0 of the first decoded block
    prompt_length: jax.Array     # int32 [b]: P, so that row j's absolute position is P + t
    max_new_tokens: jax.Array    # int32 [b]
    prompt_thinking: jax.Array   # bool [b]: the prompt ends inside an unclosed <think>
    has_prefix: jax.Array        # bool [b]: the sequence alone would have run a prefill
    keys: jax.Array              # PRNG keys [b]
    coreset_top_p: jax.Array     # float32 []
    schedule_params: Any         # the schedule's parameters (a pytree of traced scalars)
    call_id: jax.Array           # int32 []: whose listener gets the decided blocks


class Results(NamedTuple):
    """What leaves the device: the per-sequence outputs, not the caches."""

    tokens: jax.Array
    steps_per_block: jax.Array
    fill_step: jax.Array
    fill_confidence: jax.Array
    distinct_experts: jax.Array
    nfe: jax.Array


class LoopState(NamedTuple):
    model: ModelState
    block: jax.Array             # int32 [b, B]
    decided: jax.Array           # bool [b, B]
    fixed: jax.Array             # bool [b, B]
    block_iter: jax.Array        # int32 []: index of the current decoded block
    step: jax.Array              # int32 [b]: denoising steps taken in the current block
    open: jax.Array              # bool [b]: the current block still takes steps
    post_fill: jax.Array         # int32 [b]: steps of the current block that began with no mask
    commit_pending: jax.Array    # bool []
    counts: jax.Array            # int32 [b, vocab]: response tokens so far (committed + filled)
    finished: jax.Array          # bool [b]
    tokens: jax.Array            # int32 [b, max_blocks, B]: each decoded block as decided
    steps_per_block: jax.Array   # int32 [b, max_blocks]
    fill_step: jax.Array         # int32 [b, max_blocks, B]: step (1-based) that filled each position
    fill_confidence: jax.Array   # float32 [b, max_blocks, B]
    distinct_experts: jax.Array  # float32 [b, max_blocks]: summed over steps, mean over layers
    nfe: jax.Array               # int32 [b]
    iterations: jax.Array        # int32 []


@functools.partial(jax.jit, static_argnames=("module", "spec"))
def run_block_decoder(module: CloverTransformer, params: Any, spec: LoopSpec, request: Request,
                      controls: Controls, ids: TokenIds) -> Results:
    """Prefill, then denoise and commit blocks until every sequence is finished."""
    batch, size = request.first_block.shape
    vocab = module.config.vocab_size
    capacity = (spec.prefix_blocks + spec.max_blocks) * size
    model_state = empty_state(module.config, batch, capacity, module.dtype, request.start)
    model_state = constrain_state(model_state, module.plan)
    call = functools.partial(module.apply, {"params": params})
    if spec.prefix_blocks:
        _, model_state = causal_pass(module, params, request.prefix_ids, model_state, spec.chunk_size)

    rows = jnp.arange(size)
    initial = LoopState(
        model=model_state, block=request.first_block, decided=request.fixed, fixed=request.fixed,
        block_iter=jnp.int32(0), step=jnp.zeros(batch, jnp.int32), open=jnp.ones(batch, bool),
        post_fill=jnp.zeros(batch, jnp.int32), commit_pending=jnp.bool_(False),
        counts=jnp.zeros((batch, vocab), jnp.int32), finished=jnp.zeros(batch, bool),
        tokens=jnp.zeros((batch, spec.max_blocks, size), jnp.int32),
        steps_per_block=jnp.zeros((batch, spec.max_blocks), jnp.int32),
        fill_step=jnp.zeros((batch, spec.max_blocks, size), jnp.int32),
        fill_confidence=jnp.zeros((batch, spec.max_blocks, size), jnp.float32),
        distinct_experts=jnp.zeros((batch, spec.max_blocks), jnp.float32),
        nfe=request.has_prefix.astype(jnp.int32), iterations=jnp.int32(0))

    def denoise(state: LoopState):
        out = call(state.block, state.model, 0, 0, spec.coreset, request.coreset_top_p)
        return out.logits, out.distinct_experts, state.model, state.block, state.decided, state.fixed, \
            state.block_iter, state.step, state.open, state.post_fill

    def commit_and_denoise(state: LoopState):
        masks = jnp.full_like(state.block, ids.mask)
        out = call(jnp.concatenate([state.block, masks], axis=1), state.model, size, size, spec.coreset,
                   request.coreset_top_p)
        none = jnp.zeros_like(state.decided)
        return out.logits, out.distinct_experts, out.state, masks, none, none, state.block_iter + 1, \
            jnp.zeros_like(state.step), jnp.ones_like(state.open), jnp.zeros_like(state.post_fill)

    def body(state: LoopState) -> LoopState:
        logits, distinct, model, current, decided, fixed, block_iter, step, open_, post_fill = jax.lax.cond(
            state.commit_pending, commit_and_denoise, denoise, state)
        active = ~state.finished & open_
        response_index = request.response_base[:, None] + block_iter * size + rows[None, :]
        is_response = response_index >= 0

        thinking = (request.prompt_thinking | (_count(state.counts, ids.think_start) > 0)) & \
            (_count(state.counts, ids.think_end) == 0)
        processed = jax.vmap(process, in_axes=(0, 0, 0, 0, None, None))(
            logits, state.counts, response_index, thinking, controls, ids)
        keys = jax.vmap(lambda key, s: jax.random.fold_in(jax.random.fold_in(key, block_iter), s))(
            request.keys, step)
        choice = jax.vmap(lambda l, k: choose(l, controls, spec.do_sample, k))(processed, keys)
        full_before = jnp.all(decided, axis=-1)
        view = StepView(current, choice.token, choice.confidence, choice.margin, choice.entropy, decided, fixed,
                        request.prompt_length[:, None] + response_index, step, block_iter, jnp.int32(spec.steps_cap),
                        post_fill, controls.threshold, jax.vmap(lambda k: jax.random.fold_in(k, 1))(keys))
        per_sequence = StepView(0, 0, 0, 0, 0, 0, 0, 0, 0, None, None, 0, None, 0)
        decision = as_decision(jax.vmap(spec.schedule, in_axes=(per_sequence, None))(view, request.schedule_params))
        forced = decision.decided | fixed | (step[:, None] + 1 >= spec.steps_cap)
        after = jnp.where(active[:, None], forced, decided)
        filled, remasked = after & ~decided, decided & ~after
        edited = active[:, None] & decision.edit & decided & after & ~fixed & (choice.token != current)
        block = jnp.where(filled | edited, choice.token, jnp.where(remasked, ids.mask, current))
        counted = is_response.astype(jnp.int32)
        added, removed = (filled | edited) * counted, (remasked | edited) * counted
        batch_rows = jnp.arange(batch)[:, None]
        counts = state.counts.at[batch_rows, choice.token].add(added).at[batch_rows, current].add(-removed)
        step = step + active
        slot = (jnp.arange(batch), block_iter)
        fill_step = state.fill_step.at[slot].set(jnp.where(filled, step[:, None], state.fill_step[slot]))
        fill_confidence = state.fill_confidence.at[slot].set(
            jnp.where(filled, choice.confidence, state.fill_confidence[slot]))
        distinct_experts = state.distinct_experts.at[slot].add(
            jnp.where(active, jnp.mean(distinct.astype(jnp.float32), axis=0), 0.0))

        # A full block stays open while its schedule asks for more (editing) steps, at most steps_cap of them.
        keep_open = decision.keep_open & (post_fill + full_before < spec.steps_cap)
        closing = active & jnp.all(after, axis=-1) & ~keep_open
        open_ = open_ & ~closing
        post_fill = post_fill + (active & full_before)
        tokens = state.tokens.at[slot].set(jnp.where(closing[:, None], block, state.tokens[slot]))
        steps_per_block = state.steps_per_block.at[slot].set(jnp.where(closing, step, state.steps_per_block[slot]))
        inside = is_response & (response_index < request.max_new_tokens[:, None])
        has_eos = jnp.any(inside & jnp.any(block[..., None] == ids.eos, axis=-1), axis=-1)
        reached = request.response_base + (block_iter + 1) * size >= request.max_new_tokens
        finished = state.finished | (closing & (has_eos | reached))
        if spec.report_blocks:
            jax.lax.cond(jnp.any(closing), lambda: jax.debug.callback(
                report_closed_blocks, request.call_id, closing, block, block_iter, request.response_base,
                ordered=True), lambda: None)
        waiting = finished | ~open_
        return LoopState(model, block, after, fixed, block_iter, step, open_, post_fill,
                         jnp.all(waiting) & ~jnp.all(finished), counts, finished, tokens, steps_per_block, fill_step,
                         fill_confidence, distinct_experts, state.nfe + active, state.iterations + 1)

    limit = spec.max_blocks * (2 * spec.steps_cap + 1)
    final = jax.lax.while_loop(lambda s: ~jnp.all(s.finished) & (s.iterations < limit), body, initial)
    return Results(final.tokens, final.steps_per_block, final.fill_step, final.fill_confidence,
                   final.distinct_experts, final.nfe)


def _count(counts: jax.Array, token: jax.Array) -> jax.Array:
    """counts[:, token], or 0 when the token id is -1 (absent)."""
    return jnp.where(token >= 0, counts[:, jnp.maximum(token, 0)], 0)
