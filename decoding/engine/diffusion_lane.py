"""The block-diffusion lane: every active request's current block denoised in one pass per step.

Each slot holds one request at its own block and step (docs/design.md §4 per request). A step
is one forward over every slot: the slots whose block closed at the previous step commit it in
the same pass and take the first denoising step of their next block (`commit_and_denoise` with
a per-sequence `commit` mask), the others take their next denoising step; then
`decoding.block_loop.denoising_step` — the function `generate`'s loops run — decides every
slot's positions with that request's own controls, schedule and sampling. So a request decodes
exactly the steps it would decode alone: same blocks, commits, steps and NFE.

Per-request choices ride in the slots as traced values: the controls (`Controls` of [slots]
arrays), the schedule (one `ScheduleSwitch` over every named schedule, a per-slot index and
parameters) and greedy or sampled choice (a per-slot flag; the sampling program is compiled
only while a sampled request is in the lane). Static per lane: block size, step cap, coreset.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.passes import ModelPasses
from clover_jax.core.state import ModelState
from decoding.block_loop import BlockProgress, SequenceFacts, StepRules, denoising_step
from decoding.controls import Controls, TokenIds, process_batch
from decoding.engine.slots import one_slot, per_slot_choice, slot_axes
from decoding.schedules import BY_NAME
from decoding.schedules.switch import ScheduleSwitch

# Every named schedule, in one switch: a request may bring any of them without a recompile.
SCHEDULES = ScheduleSwitch(sorted(BY_NAME))
MAX_TOP_LOGPROBS = 20  # alternatives a slot records per position while its request asks for log-probabilities
# The lane size from which a lone commit runs apart: measured at 16 slots; at 2 the two passes would
# cost about what the lane's one does (an estimate from the one- and 16-sequence costs, not measured).
LONE_COMMITS_FROM = 4


class DiffusionLayout(NamedTuple):
    """What is static in a diffusion lane (changing it compiles another program)."""

    block_size: int
    steps_cap: int
    coreset: bool


class DiffusionSlots(NamedTuple):
    """The lane's device state; S = slots, B = block size."""

    model: ModelState           # every slot's prefix; length int32 [S]
    progress: BlockProgress     # each slot's current block
    facts: SequenceFacts        # each slot's request
    controls: Controls          # [S] each
    schedule: dict              # `SCHEDULES` parameters, leaves [S]
    sample: jax.Array           # bool [S]: the request samples (else greedy)
    commit: jax.Array           # bool [S]: its block closed at the last step; the next step commits it
    nfe: jax.Array              # int32 [S]
    scores: "BlockScores"       # each position's log-probability when it was decided (kept while asked for)


class BlockScores(NamedTuple):
    """Each position of a slot's block: the log-probability of its token under the processed
    distribution of the step that decided it, and the K = MAX_TOP_LOGPROBS likeliest tokens there."""

    logprob: jax.Array          # float32 [S, B]
    top_ids: jax.Array          # int32 [S, B, K]
    top_values: jax.Array       # float32 [S, B, K]


class DiffusionReport(NamedTuple):
    """What the host reads after a step (small: no caches, no logits)."""

    closing: jax.Array          # bool [S]: the slot's block closed in this step
    finished: jax.Array         # bool [S]
    block: jax.Array            # int32 [S, B]: the slot's block after the step
    steps: jax.Array            # int32 [S]: denoising steps of the current block
    nfe: jax.Array              # int32 [S]
    logprob: jax.Array          # `BlockScores` of the block after the step (as the slots hold them)
    top_ids: jax.Array
    top_values: jax.Array


@functools.partial(jax.jit, static_argnames=("passes", "layout", "commit", "sample", "scores", "lone_commits"),
                   donate_argnames=("slots",))
def diffusion_step(passes: ModelPasses, params: Any, layout: DiffusionLayout, slots: DiffusionSlots,
                   alive: jax.Array, coreset_top_p: jax.Array, ids: TokenIds, *, commit: bool,
                   sample: bool, scores: bool = False, lone_commits: bool = False
                   ) -> tuple[DiffusionSlots, DiffusionReport]:
    """One forward over every slot, then one denoising step of each live one.

    alive: bool [S], the slots holding a request (the others compute and are ignored);
    commit: some live slot commits its block in this pass (else a plain denoising pass);
    sample: some live slot samples; scores: some live slot asked for log-probabilities (each
    position filled or edited in this step records its token's, `BlockScores`); lone_commits: a
    step where one slot alone commits runs it apart (`_commit_pass`).
    """
    progress = slots.progress._replace(finished=slots.progress.finished | ~alive)
    model = slots.model
    if commit:
        pending = slots.commit & alive
        masks = jnp.full_like(progress.block, ids.mask)
        block_rows = jnp.where(pending[:, None], masks, progress.block)
        logits, model = _commit_pass(passes, params, layout, progress.block, block_rows, model, pending,
                                     coreset_top_p, lone_commits=lone_commits)
        fresh = pending[:, None]
        progress = progress._replace(
            block=block_rows, decided=progress.decided & ~fresh, fixed=progress.fixed & ~fresh,
            block_index=progress.block_index + pending, step=jnp.where(pending, 0, progress.step),
            post_fill=jnp.where(pending, 0, progress.post_fill), open=progress.open | pending)
    else:
        logits = passes.denoise(params, progress.block, model, coreset=layout.coreset,
                                coreset_top_p=coreset_top_p).logits

    controls = slots.controls

    choose_rows = per_slot_choice(controls, slots.sample, sample)

    rules = StepRules(controls=controls, ids=ids, steps_cap=layout.steps_cap, choose=choose_rows,
                      schedule=lambda view: jax.vmap(SCHEDULES)(view, slots.schedule))
    before = progress
    progress, details = denoising_step(progress, slots.facts, logits, rules)
    nfe = slots.nfe + details.active
    recorded = _scored(before, slots.facts, logits, controls, ids, details, slots.scores) if scores \
        else slots.scores
    slots = slots._replace(model=model, progress=progress, commit=details.closing & ~progress.finished, nfe=nfe,
                           scores=recorded)
    # the scores leave the device only while asked for (a step's report stays small)
    return slots, DiffusionReport(details.closing, progress.finished, progress.block, progress.step, nfe,
                                  *(recorded if scores else (None, None, None)))


def _commit_pass(passes: ModelPasses, params: Any, layout: DiffusionLayout, block: jax.Array, block_rows: jax.Array,
                 model: ModelState, pending: jax.Array, coreset_top_p: jax.Array, *,
                 lone_commits: bool) -> tuple[jax.Array, ModelState]:
    """The logits ([S, B, vocab]) and state of a step where the `pending` slots (bool [S]) commit
    `block` ([S, B]) and denoise `block_rows` after it, the others denoise `block`.

    One pass over the whole lane runs every slot's commit rows, committing or not: on a device
    whose passes are compute-bound (a CPU) that pass costs about twice a denoising pass (medium
    model, 16 slots: 1,039 against 534 ms), for one slot's commit. With `lone_commits`, when one
    slot alone commits (the common case: slots close their blocks at different steps) it commits
    in a pass of its own, on its slot of the state, beside a denoising pass of the lane (534 +
    147 ms); `lax.cond` keeps both forms in one program, so the engine's set of programs is the
    same. On an accelerator a lane's pass is bound by reading the weights, so one pass is cheaper
    than two: the engine passes `lone_commits` on a CPU only (`ModelContext.lone_commits`)."""
    def whole_lane(model):
        out = passes.commit_and_denoise(params, block, block_rows, model, coreset=layout.coreset,
                                        coreset_top_p=coreset_top_p, commit=pending)
        return out.logits, out.state

    if not lone_commits or block.shape[0] < LONE_COMMITS_FROM:
        return whole_lane(model)

    def lone(model):
        slot = jnp.argmax(pending)
        axes = slot_axes(model)
        take = lambda leaf, axis: jax.lax.dynamic_slice_in_dim(leaf, slot, 1, axis)
        alone = passes.commit_and_denoise(params, take(block, 0), take(block_rows, 0),
                                          jax.tree_util.tree_map(take, model, axes), coreset=layout.coreset,
                                          coreset_top_p=coreset_top_p, commit=jnp.ones((1,), bool))
        # the committing slot's row of this pass denoises its closed block: replaced by its own pass's
        rest = passes.denoise(params, block, model, coreset=layout.coreset, coreset_top_p=coreset_top_p)
        put = lambda leaf, new, axis: jax.lax.dynamic_update_slice_in_dim(leaf, new.astype(leaf.dtype), slot, axis)
        return put(rest.logits, alone.logits, 0), jax.tree_util.tree_map(put, model, alone.state, axes)

    return jax.lax.cond(jnp.sum(pending) == 1, lone, whole_lane, model)


def _scored(before, facts, logits: jax.Array, controls: Controls, ids: TokenIds, details,
            kept: BlockScores) -> BlockScores:
    """`kept` with the positions this step filled or edited given the log-probability of their new
    token under the step's processed distribution (`process`, as `denoising_step` computed it from
    the same logits, counts and response indices) and the top K there."""
    size = before.block.shape[1]
    response_index = facts.response_base[:, None] + before.block_index[:, None] * size + jnp.arange(size)[None, :]
    processed = process_batch(logits, before.counts, response_index, facts.prompt_thinking, controls, ids)
    logp = jax.nn.log_softmax(processed, axis=-1)
    chosen = jnp.take_along_axis(logp, details.choice.token[..., None], axis=-1)[..., 0]
    values, indices = jax.lax.top_k(logp, MAX_TOP_LOGPROBS)
    new = details.filled | details.edited
    return BlockScores(jnp.where(new, chosen, kept.logprob), jnp.where(new[..., None], indices, kept.top_ids),
                       jnp.where(new[..., None], values, kept.top_values))


def entry(model_state: ModelState, prompt_tail: list[int], block_size: int, prompt_length: int,
          max_new_tokens: int, thinking: bool, key: jax.Array, *, controls: Controls, schedule: dict, sample: bool,
          has_prefix: bool, ids: TokenIds, vocab: int, threshold: float) -> DiffusionSlots:
    """One slot's state for a request whose prefix `model_state` holds (a staging state): its first
    block is the prompt tail (fixed) then masks, as `generate` lays out a prompt alone. key: the
    request's key with a slot axis ([1]); schedule: its `SCHEDULES` parameters, leaves [1].
    Everything but the prefix state and the key is NumPy (stacked on the host when requests join)."""
    tail = len(prompt_tail)
    block = np.full((1, block_size), int(ids.mask), np.int32)
    block[0, :tail] = prompt_tail
    fixed = np.arange(block_size)[None, :] < tail
    one = lambda value, dtype: np.asarray([value], dtype)
    progress = BlockProgress(block=block, decided=fixed, fixed=fixed, block_index=one(0, np.int32),
                             step=one(0, np.int32), post_fill=one(0, np.int32), counts=np.zeros((1, vocab), np.int32),
                             finished=one(False, bool), open=one(True, bool))
    facts = SequenceFacts(response_base=one(-tail, np.int32), prompt_length=one(prompt_length, np.int32),
                          max_new_tokens=one(max_new_tokens, np.int32), prompt_thinking=one(thinking, bool),
                          threshold=one(threshold, np.float32), key=key)
    scores = BlockScores(np.zeros((1, block_size), np.float32), np.zeros((1, block_size, MAX_TOP_LOGPROBS), np.int32),
                         np.zeros((1, block_size, MAX_TOP_LOGPROBS), np.float32))
    return DiffusionSlots(model=one_slot(model_state), progress=progress, facts=facts,
                          controls=jax.tree_util.tree_map(lambda value: np.asarray(value)[None], controls),
                          schedule=schedule, sample=one(sample, bool), commit=one(False, bool),
                          nfe=one(int(has_prefix), np.int32), scores=scores)
