"""What the engine keeps on the device for each slot's request, beside its prefix state: one
structure per decoding mode, every leaf with a leading [S] slot axis (S = `max_running`).

A request's entry is written into its slot when it is admitted (`put_slot`: one program per
structure, the slot an argument), so joining, leaving and finishing change data, never a shape.
The decisions of `decoding.engine.decisions` read and update these after each ragged pass.

Per-request choices ride as traced values: the controls (`Controls` of [S] arrays), the schedule
(one `ScheduleSwitch` over every named schedule: a per-slot index and parameters), greedy or
sampled choice, the step cap. A diffusion slot's block is held `Bmax` wide (the widest block the
engine serves); a request of block size B uses its first B positions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np

from decoding.block_loop import BlockProgress, SequenceFacts
from decoding.controls import Controls, TokenIds
from decoding.schedules import BY_NAME
from decoding.schedules.switch import ScheduleSwitch

# Every named schedule, in one switch: a request may bring any of them without a recompile.
SCHEDULES = ScheduleSwitch(sorted(BY_NAME))
MAX_TOP_LOGPROBS = 20  # alternatives a slot records per position while its request asks for log-probabilities


class BlockScores(NamedTuple):
    """Each position of a slot's block: the log-probability of its token under the processed
    distribution of the step that decided it, and the K = MAX_TOP_LOGPROBS likeliest tokens there."""

    logprob: jax.Array          # float32 [S, Bmax]
    top_ids: jax.Array          # int32 [S, Bmax, K]
    top_values: jax.Array       # float32 [S, Bmax, K]


class DiffusionSlots(NamedTuple):
    """Block-diffusion requests: each slot's current block and what a step needs of its request."""

    progress: BlockProgress     # [S, Bmax] blocks, [S] counters, [S, V] counts
    facts: SequenceFacts        # [S] each
    controls: Controls          # [S] each
    schedule: dict              # `SCHEDULES` parameters, leaves [S]
    sample: jax.Array           # bool [S]: the request samples (else greedy)
    steps_cap: jax.Array        # int32 [S]
    scores: BlockScores         # each position's log-probability when it was decided (kept while asked for)


class AutoregressiveSlots(NamedTuple):
    counts: jax.Array           # int32 [S, V]: response tokens so far
    generated: jax.Array        # int32 [S]: response tokens so far
    max_new_tokens: jax.Array   # int32 [S]
    prompt_thinking: jax.Array  # bool [S]
    key: jax.Array              # PRNG keys [S]
    controls: Controls          # [S] each
    sample: jax.Array           # bool [S]


class SpeculativeSlots(NamedTuple):
    counts: jax.Array           # int32 [S, V]: response tokens emitted
    lengths: jax.Array          # int32 [S]: response tokens emitted
    max_new_tokens: jax.Array   # int32 [S]
    prompt_thinking: jax.Array  # bool [S]
    controls: Controls          # [S] each
    drafts: jax.Array           # int32 [S, Bmax]: the round's drafts (from its draft pass)
    pending_logits: jax.Array   # float32 [S, V]: the draft pass's logits at the pending token's row


class SlotStates(NamedTuple):
    """Every mode's slot structure (a slot's request uses one of them)."""

    diffusion: DiffusionSlots
    autoregressive: AutoregressiveSlots
    speculative: SpeculativeSlots


def _one(value, dtype) -> np.ndarray:
    return np.asarray([value], dtype)


def _controls_row(controls: Controls) -> Controls:
    return jax.tree_util.tree_map(lambda value: np.asarray(value)[None], controls)


def diffusion_entry(prepared, *, max_block: int, ids: TokenIds, vocab: int) -> DiffusionSlots:
    """A request's diffusion slot ([1]-slot leaves, NumPy but its key): its first block is its
    prompt tail (fixed) then masks, as `generate` lays out a prompt alone."""
    size = prepared.config.block_size
    prompt = prepared.prompt
    tail = len(prompt) % size
    block = np.full((1, max_block), int(ids.mask), np.int32)
    block[0, :tail] = prompt[len(prompt) - tail:]
    fixed = np.zeros((1, max_block), bool)
    fixed[0, :tail] = True
    progress = BlockProgress(block=block, decided=fixed.copy(), fixed=fixed, block_index=_one(0, np.int32),
                             step=_one(0, np.int32), post_fill=_one(0, np.int32), counts=np.zeros((1, vocab), np.int32),
                             finished=_one(False, bool), open=_one(True, bool))
    config = prepared.config
    facts = SequenceFacts(response_base=_one(-tail, np.int32), prompt_length=_one(len(prompt), np.int32),
                          max_new_tokens=_one(config.max_new_tokens, np.int32),
                          prompt_thinking=_one(prepared.thinking, bool),
                          threshold=_one(config.threshold, np.float32), key=prepared.key)
    scores = BlockScores(np.zeros((1, max_block), np.float32), np.zeros((1, max_block, MAX_TOP_LOGPROBS), np.int32),
                         np.zeros((1, max_block, MAX_TOP_LOGPROBS), np.float32))
    return DiffusionSlots(progress=progress, facts=facts, controls=_controls_row(prepared.controls),
                          schedule=prepared.schedule, sample=_one(config.do_sample, bool),
                          steps_cap=_one(config.steps_cap, np.int32), scores=scores)


def autoregressive_entry(prepared, *, vocab: int) -> AutoregressiveSlots:
    config = prepared.config
    return AutoregressiveSlots(counts=np.zeros((1, vocab), np.int32), generated=_one(0, np.int32),
                               max_new_tokens=_one(config.max_new_tokens, np.int32),
                               prompt_thinking=_one(prepared.thinking, bool), key=prepared.key,
                               controls=_controls_row(prepared.controls), sample=_one(config.do_sample, bool))


def speculative_entry(prepared, *, max_block: int, vocab: int) -> SpeculativeSlots:
    return SpeculativeSlots(counts=np.zeros((1, vocab), np.int32), lengths=_one(0, np.int32),
                            max_new_tokens=_one(prepared.config.max_new_tokens, np.int32),
                            prompt_thinking=_one(prepared.thinking, bool), controls=_controls_row(prepared.controls),
                            drafts=np.zeros((1, max_block), np.int32),
                            pending_logits=np.zeros((1, vocab), np.float32))


def empty_slot_states(*, slots: int, max_block: int, vocab: int, ids: TokenIds, template) -> SlotStates:
    """Every structure with `slots` empty slots (on the host; the engine puts them on its devices).
    template: a prepared request of each kind's shapes (its schedule parameters and key)."""
    def widen(entry):
        return jax.tree_util.tree_map(
            lambda leaf: jax.numpy.repeat(leaf, slots, axis=0) if _is_key(leaf) else np.repeat(leaf, slots, axis=0),
            entry)

    return SlotStates(widen(diffusion_entry(template, max_block=max_block, ids=ids, vocab=vocab)),
                      widen(autoregressive_entry(template, vocab=vocab)),
                      widen(speculative_entry(template, max_block=max_block, vocab=vocab)))


def _is_key(leaf) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


@functools.partial(jax.jit, donate_argnames=("slots",))
def put_slot(slots, slot: jax.Array, entry):
    """`slots` (one mode's structure) with slot `slot` (int32 []) holding `entry` ([1]-slot leaves)."""
    def put(full, one):
        one = one if _is_key(full) else jax.numpy.asarray(one, full.dtype)
        return jax.lax.dynamic_update_index_in_dim(full, one[0], slot, 0)

    return jax.tree_util.tree_map(put, slots, entry)
