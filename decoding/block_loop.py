"""The LowConfidence block-diffusion decoder of docs/design.md §4: jitted loops, and the steps they are made of.

The batch moves in lockstep over blocks aligned across sequences (left padding chosen by
`decoding.generation`). A block starts with one model call that commits the previous block and
runs the first denoising step of this one (for the first block: the prefill, then a denoising
step); denoising steps follow until every unfinished sequence has decided its block. A sequence
whose block is decided waits for the others without counting a forward pass, so its tokens,
steps and NFE equal a lone run. The last block of a sequence is never committed: nothing would
read it.

Shape of the loops (why): the prefix state (K/V caches, GDN states) changes only in the commit,
once per block. The denoising steps of a block run in an inner `while_loop` that reads the
state as a loop constant, and the commit runs once per iteration of the outer loop, so the state
is never an output of a `lax.cond` (which would copy every cache on every step).

Three drivers share these steps, so they produce the same tokens:
* `run_block_decoder`: the whole decode in one compiled program, no host call;
* `start_blocks` / `next_block`: one block per call, the host reading each decided block
  (streaming, progress bars) between calls;
* `start_steps` / `next_step`: one denoising step per call (`on_step`).
No program holds a host callback, so every one of them can be served by JAX's persistent
compilation cache.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.executable_cache import persistent_jit
from clover_jax.core.passes import ModelPasses
from clover_jax.core.state import ModelState
from decoding.controls import Controls, TokenIds, choose, process_batch
from decoding.schedules import StepView, as_decision


class LoopSpec(NamedTuple):
    """Static layout of one compiled decoder (changing any field recompiles)."""

    block_size: int
    prefix_blocks: int    # causal prefix length in blocks, after left padding
    max_blocks: int       # decoded blocks the buffers hold
    steps_cap: int        # denoising steps after which a block is force-filled
    do_sample: bool
    schedule: Callable    # `decoding.schedules` signature; its parameters travel traced in `Request`
    coreset: bool
    history: bool         # record every step (`return_history`)
    chunk_size: int       # tokens per causal pass of the prefill

    @property
    def max_steps(self) -> int:
        """Steps a sequence can take in all: each block at most `steps_cap` filling steps plus as many
        post-fill (editing) steps."""
        return self.max_blocks * 2 * self.steps_cap


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
    key: jax.Array               # the call's PRNG key; sequence i samples from fold_in(key, i)
    coreset_top_p: jax.Array     # float32 []
    threshold: jax.Array         # float32 []: τ, which the schedule sees as `StepView.threshold`
    schedule_params: Any         # the schedule's parameters (a pytree of traced scalars)


class History(NamedTuple):
    """Every denoising step of every sequence (docs/design.md §7), filled inside the loop when requested.
    S = `LoopSpec.max_steps`; rows past a sequence's `num_steps` are padding."""

    block_index: jax.Array       # int32 [b, S]
    masked_before: jax.Array     # bool [b, S, B]
    candidate: jax.Array         # int32 [b, S, B]
    confidence: jax.Array        # float32 [b, S, B]
    margin: jax.Array            # float32 [b, S, B]
    entropy: jax.Array           # float32 [b, S, B]
    filled: jax.Array            # bool [b, S, B]: a mask that became a token in this step
    changed: jax.Array           # bool [b, S, B]: a decided token replaced or remasked
    num_steps: jax.Array         # int32 [b]


class Results(NamedTuple):
    """What leaves the device: the per-sequence outputs, not the caches."""

    tokens: jax.Array
    steps_per_block: jax.Array
    fill_step: jax.Array
    fill_confidence: jax.Array
    distinct_experts: jax.Array
    nfe: jax.Array
    history: History | None


class LoopState(NamedTuple):
    """The lockstep batch's loop: every sequence's current block (`BlockProgress`, as one denoising
    step reads and leaves it; its `block_index` is `block_iter` for every sequence), the caches,
    and what the outputs keep."""

    model: ModelState
    progress: BlockProgress
    block_iter: jax.Array        # int32 []: index of the current decoded block
    tokens: jax.Array            # int32 [b, max_blocks, B]: each decoded block as decided
    steps_per_block: jax.Array   # int32 [b, max_blocks]
    fill_step: jax.Array         # int32 [b, max_blocks, B]: step (1-based) that filled each position
    fill_confidence: jax.Array   # float32 [b, max_blocks, B]
    distinct_experts: jax.Array  # float32 [b, max_blocks]: summed over steps, mean over layers
    nfe: jax.Array               # int32 [b]
    history: History | None
    last_step: Any               # the record of the latest step (for `on_step`), or None


class Decoder(NamedTuple):
    """Everything static or shared by the steps of one decode."""

    passes: ModelPasses
    params: Any
    spec: LoopSpec
    request: Request
    controls: Controls
    ids: TokenIds


# ---------------------------------------------------------------------- steps
class BlockProgress(NamedTuple):
    """Each sequence's current block, as one denoising step reads and leaves it. b = batch, B = block size."""

    block: jax.Array             # int32 [b, B]: tokens, the mask id where masked
    decided: jax.Array           # bool [b, B]
    fixed: jax.Array             # bool [b, B]: prompt-tail positions (never changed)
    block_index: jax.Array       # int32 [b]: the sequence's decoded block number
    step: jax.Array              # int32 [b]: denoising steps taken in this block
    post_fill: jax.Array         # int32 [b]: steps of this block that began with no mask
    counts: jax.Array            # int32 [b, vocab]: response tokens so far (committed + filled)
    finished: jax.Array          # bool [b]
    open: jax.Array              # bool [b]: the block still takes steps


class SequenceFacts(NamedTuple):
    """What a step needs to know of each sequence's request ([b] each)."""

    response_base: jax.Array     # int32: response index t of row 0 of the first decoded block
    prompt_length: jax.Array     # int32: P
    max_new_tokens: jax.Array    # int32
    prompt_thinking: jax.Array   # bool: the prompt ends inside an unclosed <think>
    threshold: jax.Array         # float32: the generation config's τ, as the schedule sees it
    key: jax.Array               # the sequence's PRNG key (a step draws from fold_in(fold_in(key, block), step))


class StepRules(NamedTuple):
    """How a step decides. controls: scalars (one for the batch) or [b] arrays (one per sequence);
    steps_cap: an int (one for the batch) or int32 [b] (one per sequence, the serving engine's);
    choose(processed logits [b, B, V], keys [b]) -> Choice [b, B]; schedule(view) -> Decision,
    `view` a `StepView` whose fields carry a leading [b] axis; fill_at_cap: the step that reaches
    the cap fills every mask (under a grammar the host decides that step's fills instead)."""

    controls: Controls
    ids: TokenIds
    steps_cap: Any
    choose: Callable
    schedule: Callable
    fill_at_cap: bool = True


class StepDetails(NamedTuple):
    """What happened at each position ([b, B]) and to each sequence ([b]) in the step."""

    active: jax.Array            # [b]: the sequence took this step
    choice: Any                  # `decoding.controls.Choice`, [b, B] fields
    filled: jax.Array            # a mask became a token
    edited: jax.Array            # a decided token was replaced
    remasked: jax.Array          # a decided token was masked again
    masked_before: jax.Array
    closing: jax.Array           # [b]: the block is decided and closes


def denoising_step(progress: BlockProgress, facts: SequenceFacts, logits: jax.Array,
                   rules: StepRules) -> tuple[BlockProgress, StepDetails]:
    """Decide positions of every active sequence's block from one forward's logits ([b, B, V]):
    choose the candidates, let the schedule decide, apply the decision (docs/design.md §4, §7).
    Shared by `generate`'s loops and the serving engine, which batches sequences at different
    blocks and steps."""
    _, keys, choice, decision = propose(progress, facts, logits, rules)
    return apply_step(progress, facts, choice, decision, rules)


def propose(progress: BlockProgress, facts: SequenceFacts, logits: jax.Array, rules: StepRules):
    """(processed logits [b, B, V], the step's keys [b], each position's `Choice`, the schedule's
    `Decision`): a denoising step before its decision is applied (`apply_step`)."""
    response_index = _response_index(progress, facts)
    processed, keys = _process(progress, facts, logits, response_index, rules)
    choice = rules.choose(processed, keys)
    return processed, keys, choice, _decide(progress, facts, choice, keys, response_index, rules)


def _response_index(progress: BlockProgress, facts: SequenceFacts) -> jax.Array:
    """int32 [b, B]: each position's response index t (negative in the prompt's tail)."""
    size = progress.block.shape[1]
    return facts.response_base[:, None] + progress.block_index[:, None] * size + jnp.arange(size)[None, :]


def _process(progress: BlockProgress, facts: SequenceFacts, logits: jax.Array, response_index: jax.Array,
             rules: StepRules):
    """The controls (`process`) applied to the logits ([b, B, V]), and the step's key per sequence;
    `rules.choose` then gives each position's candidate with its confidence, margin and entropy."""
    processed = process_batch(logits, progress.counts, response_index, facts.prompt_thinking, rules.controls,
                              rules.ids)
    keys = jax.vmap(lambda key, block, step: jax.random.fold_in(jax.random.fold_in(key, block), step))(
        facts.key, progress.block_index, progress.step)
    return processed, keys


def _decide(progress: BlockProgress, facts: SequenceFacts, choice, keys: jax.Array, response_index: jax.Array,
            rules: StepRules):
    """The schedule's decision on what the block holds after the step."""
    batch = progress.block.shape[0]
    view = StepView(
        tokens=progress.block, candidates=choice.token, confidence=choice.confidence, margin=choice.margin,
        entropy=choice.entropy, decided=progress.decided, fixed=progress.fixed,
        positions=facts.prompt_length[:, None] + response_index, step=progress.step,
        block_index=progress.block_index, steps_cap=_per_sequence(rules.steps_cap, batch),
        post_fill_steps=progress.post_fill, threshold=facts.threshold,
        key=jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys))
    return as_decision(rules.schedule(view))


def apply_step(progress: BlockProgress, facts: SequenceFacts, choice, decision,
               rules: StepRules) -> tuple[BlockProgress, StepDetails]:
    """The decision applied to the active sequences: the step cap, fills, edits and remasks, the
    counts, and whether the block closes and the sequence finishes."""
    response_index = _response_index(progress, facts)
    ids = rules.ids
    batch, size = progress.block.shape
    steps_cap = _per_sequence(rules.steps_cap, batch)
    step, decided, fixed, current = progress.step, progress.decided, progress.fixed, progress.block
    active = ~progress.finished & progress.open
    is_response = response_index >= 0
    full_before = jnp.all(decided, axis=-1)
    forced = decision.decided | fixed
    if rules.fill_at_cap:
        forced = forced | (step[:, None] + 1 >= steps_cap[:, None])
    after = jnp.where(active[:, None], forced, decided)
    filled, remasked = after & ~decided, decided & ~after
    edited = active[:, None] & decision.edit & decided & after & ~fixed & (choice.token != current)
    block = jnp.where(filled | edited, choice.token, jnp.where(remasked, ids.mask, current))
    counted = is_response.astype(jnp.int32)
    added, removed = (filled | edited) * counted, (remasked | edited) * counted
    batch_rows = jnp.arange(batch)[:, None]
    counts = progress.counts.at[batch_rows, choice.token].add(added).at[batch_rows, current].add(-removed)

    # A full block stays open while its schedule asks for more (editing) steps, at most steps_cap of them.
    keep_open = decision.keep_open & (progress.post_fill + full_before < steps_cap)
    closing = active & jnp.all(after, axis=-1) & ~keep_open
    inside = is_response & (response_index < facts.max_new_tokens[:, None])
    has_eos = jnp.any(inside & jnp.any(block[..., None] == ids.eos, axis=-1), axis=-1)
    reached = facts.response_base + (progress.block_index + 1) * size >= facts.max_new_tokens
    finished = progress.finished | (closing & (has_eos | reached))
    progress = progress._replace(block=block, decided=after, step=step + active,
                                 post_fill=progress.post_fill + (active & full_before), counts=counts,
                                 finished=finished, open=progress.open & ~closing)
    return progress, StepDetails(active=active, choice=choice, filled=filled & active[:, None], edited=edited,
                                 remasked=remasked, masked_before=~decided, closing=closing)


def _per_sequence(steps_cap, batch: int) -> jax.Array:
    """int32 [b]: a step cap given once for the batch or per sequence."""
    return jnp.broadcast_to(jnp.asarray(steps_cap, jnp.int32), (batch,))


def _denoise_logits(d: Decoder, state: LoopState):
    out = d.passes.denoise(d.params, state.progress.block, state.model, coreset=d.spec.coreset,
                           coreset_top_p=d.request.coreset_top_p, distinct_experts=True)
    return out.logits, out.distinct_experts


def _step_inputs(d: Decoder, state: LoopState, fill_at_cap: bool = True
                 ) -> tuple[BlockProgress, SequenceFacts, StepRules]:
    """What `denoising_step` reads of `generate`'s lockstep batch."""
    spec, request, controls = d.spec, d.request, d.controls
    batch = state.progress.block.shape[0]
    progress = state.progress._replace(block_index=jnp.broadcast_to(state.block_iter, (batch,)))
    facts = SequenceFacts(
        response_base=request.response_base, prompt_length=request.prompt_length,
        max_new_tokens=request.max_new_tokens, prompt_thinking=request.prompt_thinking,
        threshold=jnp.broadcast_to(request.threshold, (batch,)),
        key=jax.vmap(lambda i: jax.random.fold_in(request.key, i))(jnp.arange(batch)))
    rules = StepRules(
        controls=controls, ids=d.ids, steps_cap=spec.steps_cap,
        choose=lambda processed, keys: jax.vmap(
            lambda logits, k: choose(logits, controls, spec.do_sample, k))(processed, keys),
        schedule=lambda view: as_decision(jax.vmap(spec.schedule, in_axes=(0, None))(view, request.schedule_params)),
        fill_at_cap=fill_at_cap)
    return progress, facts, rules


def _apply_step(d: Decoder, state: LoopState, logits: jax.Array, distinct: jax.Array) -> LoopState:
    """One denoising step of `generate`'s lockstep batch: `denoising_step`, then the step recorded."""
    progress, facts, rules = _step_inputs(d, state)
    progress, details = denoising_step(progress, facts, logits, rules)
    return _record_step(d.spec, state, progress, details, distinct)


def _record_step(spec: LoopSpec, state: LoopState, progress: BlockProgress, details: StepDetails,
                 distinct: jax.Array) -> LoopState:
    """The loop state after a step: the block's progress, and what the outputs keep of it (the
    decided block, its steps, each position's fill step and confidence, the experts, the history)."""
    batch = state.progress.block.shape[0]
    active, filled, closing, choice = details.active, details.filled, details.closing, details.choice
    slot = (jnp.arange(batch), state.block_iter)
    fill_step = state.fill_step.at[slot].set(jnp.where(filled, progress.step[:, None], state.fill_step[slot]))
    fill_confidence = state.fill_confidence.at[slot].set(
        jnp.where(filled, choice.confidence, state.fill_confidence[slot]))
    distinct_experts = state.distinct_experts.at[slot].add(
        jnp.where(active, jnp.mean(distinct.astype(jnp.float32), axis=0), 0.0))
    tokens = state.tokens.at[slot].set(jnp.where(closing[:, None], progress.block, state.tokens[slot]))
    steps_per_block = state.steps_per_block.at[slot].set(
        jnp.where(closing, progress.step, state.steps_per_block[slot]))

    record = dict(active=active, block_index=state.block_iter, masked_before=details.masked_before,
                  candidate=choice.token, confidence=choice.confidence, margin=choice.margin,
                  entropy=choice.entropy, filled=filled,
                  changed=(details.edited | details.remasked) & active[:, None])
    history = _record(state.history, record, active) if spec.history else state.history
    return state._replace(
        progress=progress, tokens=tokens,
        steps_per_block=steps_per_block, fill_step=fill_step, fill_confidence=fill_confidence,
        distinct_experts=distinct_experts, nfe=state.nfe + active, history=history,
        last_step=record if state.last_step is not None else None)


def _record(history: History, record: dict, active: jax.Array) -> History:
    """Write this step's row for every active sequence at its own step count."""
    batch = active.shape[0]
    index = jnp.where(active, history.num_steps, history.block_index.shape[1])  # inactive: dropped
    put = lambda buffer, value: buffer.at[jnp.arange(batch), index].set(value, mode="drop")
    block_index = jnp.broadcast_to(record["block_index"], (batch,))
    return history._replace(
        block_index=put(history.block_index, block_index),
        **{name: put(getattr(history, name), record[name]) for name in History._fields[1:-1]},
        num_steps=history.num_steps + active)


def _denoise_step(d: Decoder, state: LoopState) -> LoopState:
    return _apply_step(d, state, *_denoise_logits(d, state))


def _commit_step(d: Decoder, state: LoopState) -> LoopState:
    """Commit the decided block and run the first denoising step of the next, in one forward."""
    state, logits, distinct = _commit_logits(d, state)
    return _apply_step(d, state, logits, distinct)


def _commit_logits(d: Decoder, state: LoopState) -> tuple[LoopState, jax.Array, jax.Array]:
    """The commit of the decided block fused with the next block's first forward: (the state on
    the new block, its logits [b, B, V], the distinct experts)."""
    progress = state.progress
    masks = jnp.full_like(progress.block, d.ids.mask)
    out = d.passes.commit_and_denoise(d.params, progress.block, masks, state.model, coreset=d.spec.coreset,
                                      coreset_top_p=d.request.coreset_top_p, distinct_experts=True)
    none = jnp.zeros_like(progress.decided)
    progress = progress._replace(block=masks, decided=none, fixed=none, step=jnp.zeros_like(progress.step),
                                 open=~progress.finished, post_fill=jnp.zeros_like(progress.post_fill))
    state = state._replace(model=out.state, progress=progress, block_iter=state.block_iter + 1)
    return state, out.logits, out.distinct_experts


def _finish_block(d: Decoder, state: LoopState) -> LoopState:
    """Denoising steps until no unfinished sequence has its block open (the state is read only)."""
    limit = 2 * d.spec.steps_cap
    state, _ = jax.lax.while_loop(lambda c: jnp.any(c[0].progress.open & ~c[0].progress.finished) & (c[1] < limit),
                                  lambda c: (_denoise_step(d, c[0]), c[1] + 1), (state, jnp.int32(0)))
    return state


def _start(d: Decoder, track_steps: bool) -> LoopState:
    """The prefill; the first block's steps follow (`_finish_block`, or `next_step` one by one)."""
    spec, request = d.spec, d.request
    batch, size = request.first_block.shape
    vocab = d.passes.config.vocab_size
    capacity = (spec.prefix_blocks + spec.max_blocks) * size
    model_state = d.passes.new_state(batch, capacity, request.start)
    if spec.prefix_blocks:
        _, model_state = d.passes.prefill(d.params, request.prefix_ids, model_state, chunk_size=spec.chunk_size)
    history = None
    if spec.history:
        steps = spec.max_steps
        zeros = lambda dtype, *shape: jnp.zeros((batch, steps) + shape, dtype)
        history = History(
            block_index=zeros(jnp.int32), masked_before=zeros(bool, size), candidate=zeros(jnp.int32, size),
            confidence=zeros(jnp.float32, size), margin=zeros(jnp.float32, size), entropy=zeros(jnp.float32, size),
            filled=zeros(bool, size), changed=zeros(bool, size), num_steps=jnp.zeros(batch, jnp.int32))
    progress = BlockProgress(
        block=request.first_block, decided=request.fixed, fixed=request.fixed,
        block_index=jnp.zeros(batch, jnp.int32), step=jnp.zeros(batch, jnp.int32),
        post_fill=jnp.zeros(batch, jnp.int32), counts=jnp.zeros((batch, vocab), jnp.int32),
        finished=jnp.zeros(batch, bool), open=jnp.ones(batch, bool))
    state = LoopState(
        model=model_state, progress=progress, block_iter=jnp.int32(0),
        tokens=jnp.zeros((batch, spec.max_blocks, size), jnp.int32),
        steps_per_block=jnp.zeros((batch, spec.max_blocks), jnp.int32),
        fill_step=jnp.zeros((batch, spec.max_blocks, size), jnp.int32),
        fill_confidence=jnp.zeros((batch, spec.max_blocks, size), jnp.float32),
        distinct_experts=jnp.zeros((batch, spec.max_blocks), jnp.float32),
        nfe=request.has_prefix.astype(jnp.int32), history=history,
        last_step={} if track_steps else None)  # not None: every step leaves its record there
    return state


def results(state: LoopState) -> Results:
    return Results(tokens=state.tokens, steps_per_block=state.steps_per_block, fill_step=state.fill_step,
                   fill_confidence=state.fill_confidence, distinct_experts=state.distinct_experts, nfe=state.nfe,
                   history=state.history)


def _all_finished(state: LoopState) -> jax.Array:
    return jnp.all(state.progress.finished)


# ---------------------------------------------------------------------- drivers
# passes: the model's pass interface (`CloverModel.passes`); params: in the layout it runs with
# (`CloverModel.run_params`).
_STATIC = ("passes", "spec")


@persistent_jit(static_argnames=_STATIC)
def run_block_decoder(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request,
                      controls: Controls, ids: TokenIds) -> Results:
    """Prefill, then denoise and commit blocks until every sequence is finished: one program."""
    d = Decoder(passes, params, spec, request, controls, ids)
    state = _finish_block(d, _start(d, track_steps=False))
    state = jax.lax.while_loop(lambda s: ~_all_finished(s), lambda s: _finish_block(d, _commit_step(d, s)), state)
    return results(state)


@persistent_jit(static_argnames=_STATIC)
def start_blocks(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
                 ids: TokenIds) -> LoopState:
    """Prefill and decide the first block (host-driven decoding, one block per call)."""
    d = Decoder(passes, params, spec, request, controls, ids)
    return _finish_block(d, _start(d, track_steps=False))


@persistent_jit(static_argnames=_STATIC, donate_argnames=("state",))
def next_block(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
               ids: TokenIds, state: LoopState) -> LoopState:
    """Commit the decided block and decide the next one."""
    d = Decoder(passes, params, spec, request, controls, ids)
    return _finish_block(d, _commit_step(d, state))


@persistent_jit(static_argnames=_STATIC)
def start_steps(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
                ids: TokenIds) -> LoopState:
    """Prefill and the first denoising step (host-driven decoding, one step per call)."""
    d = Decoder(passes, params, spec, request, controls, ids)
    return _denoise_step(d, _start(d, track_steps=True))


@persistent_jit(static_argnames=_STATIC + ("commit",), donate_argnames=("state",))
def next_step(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
              ids: TokenIds, state: LoopState, commit: bool) -> LoopState:
    """One more forward: the next denoising step, or (`commit`) the commit fused with the next block's first."""
    d = Decoder(passes, params, spec, request, controls, ids)
    return _commit_step(d, state) if commit else _denoise_step(d, state)


# ---------------------------------------------------------------------- steps under a grammar
def frontier_choice(processed: jax.Array, choice, keys: jax.Array, rules: StepRules, *, frontier: jax.Array,
                    allowed: jax.Array) -> jax.Array:
    """int32 [b]: at each sequence's `frontier` position, its candidate if `allowed` (bool [b, V])
    holds it, else the choice among the allowed tokens (the same controls and key)."""
    rows = jnp.arange(processed.shape[0])
    front = jnp.clip(frontier, 0, processed.shape[1] - 1)
    masked = jnp.where(allowed, processed[rows, front], -jnp.inf)[:, None]
    masked_choice = rules.choose(masked, keys).token[:, 0]
    candidate = choice.token[rows, front]
    return jnp.where(allowed[rows, candidate], candidate, masked_choice)


class Proposed(NamedTuple):
    """A denoising step before its decision is applied, for the host's grammar to vet
    (`decoding.constraints.drivers`). b = batch, B = block size."""

    choice: Any                  # `decoding.controls.Choice` [b, B]: the candidates, from the unmasked logits
    decision: Any                # the schedule's `Decision` [b, B]
    frontier_token: jax.Array    # int32 [b]: the frontier's candidate if the grammar allows it, else the
    #                              choice among the tokens it allows
    distinct: jax.Array          # the forward's distinct experts


@persistent_jit(static_argnames=_STATIC + ("track_steps",))
def start_prefill(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
                  ids: TokenIds, track_steps: bool = False) -> LoopState:
    """The prefill alone (host-driven decoding under a grammar, one proposal and one decision per
    step); track_steps: every step leaves its record in `last_step` (`on_step`)."""
    return _start(Decoder(passes, params, spec, request, controls, ids), track_steps=track_steps)


@persistent_jit(static_argnames=_STATIC + ("commit",), donate_argnames=("state",))
def propose_step(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
                 ids: TokenIds, state: LoopState, *, frontier: jax.Array, allowed: jax.Array,
                 commit: bool) -> tuple[LoopState, Proposed]:
    """One forward (`commit`: fused with the commit of the decided block, the new block's first
    step) and the schedule's proposal on it. frontier: int32 [b], the position whose candidate
    the grammar masks (any value where `allowed` is all ones); allowed: bool [b, V]."""
    d = Decoder(passes, params, spec, request, controls, ids)
    state, logits, distinct = _commit_logits(d, state) if commit else (state, *_denoise_logits(d, state))
    progress, facts, rules = _step_inputs(d, state, fill_at_cap=False)
    processed, keys, choice, decision = propose(progress, facts, logits, rules)
    frontier_token = frontier_choice(processed, choice, keys, rules, frontier=frontier, allowed=allowed)
    return state, Proposed(choice=choice, decision=decision, frontier_token=frontier_token, distinct=distinct)


@persistent_jit(static_argnames=_STATIC, donate_argnames=("state",))
def apply_proposal(passes: ModelPasses, params: Any, spec: LoopSpec, request: Request, controls: Controls,
                   ids: TokenIds, state: LoopState, proposed: Proposed) -> LoopState:
    """The step as the host's grammar let it stand: `proposed.decision` and the candidates
    (`proposed.choice.token`) as vetted; no step fills every mask at the cap."""
    d = Decoder(passes, params, spec, request, controls, ids)
    progress, facts, rules = _step_inputs(d, state, fill_at_cap=False)
    progress, details = apply_step(progress, facts, proposed.choice, proposed.decision, rules)
    return _record_step(spec, state, progress, details, proposed.distinct)
