"""What the engine keeps on the device for each slot's request, beside its prefix state: one
structure per decoding mode, every leaf with a leading [S] slot axis (S = `max_running`).

The requests admitted at one step boundary are written into their slots together (`put_slots`:
one program per structure, the slot indices an [S] argument padded with S, past the last slot), so
joining, leaving and finishing change data, never a shape, and admitting 16 requests costs one
device write per structure rather than 16.
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
    """A request's diffusion slot ([1]-slot leaves, NumPy; the key as raw key data): its first
    block is its prompt tail (fixed) then masks, as `generate` lays out a prompt alone."""
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


def admission_rows(entry):
    """`entry` without the fields every request starts at zero (None there: `put_slots` writes the
    zeros on the device, so that no [V]-wide row of zeros crosses from the host per request)."""
    if isinstance(entry, DiffusionSlots):
        return entry._replace(progress=entry.progress._replace(counts=None), scores=None)
    if isinstance(entry, AutoregressiveSlots):
        return entry._replace(counts=None)
    return entry._replace(counts=None, drafts=None, pending_logits=None)


def stacked_rows(entries: list, slot_indices: list[int], *, slots: int) -> tuple[np.ndarray, object]:
    """The argument pair of `put_slots` for requests of one structure: (int32 [S] slot indices, S
    past the last used; the requests' `admission_rows`, stacked and padded to S rows)."""
    if not 0 < len(entries) <= slots or len(entries) != len(slot_indices):
        raise ValueError(f"{len(entries)} entries for {len(slot_indices)} slots of {slots}")
    indices = np.full((slots,), slots, np.int32)
    indices[:len(slot_indices)] = slot_indices
    rows = [admission_rows(entry) for entry in entries]
    padding = slots - len(rows)
    return indices, jax.tree_util.tree_map(
        lambda *leaves: np.concatenate([*leaves, np.repeat(leaves[0], padding, axis=0)]), *rows)


def empty_slot_states(*, slots: int, max_block: int, vocab: int, ids: TokenIds, template) -> SlotStates:
    """Every structure with `slots` empty slots (on the host but the PRNG keys; the engine puts
    them on its devices). template: a prepared request of each kind's shapes (its schedule
    parameters and key)."""
    def widen(entry):
        return jax.tree_util.tree_map(lambda leaf: np.repeat(leaf, slots, axis=0), entry)

    diffusion = widen(diffusion_entry(template, max_block=max_block, ids=ids, vocab=vocab))
    autoregressive = widen(autoregressive_entry(template, vocab=vocab))
    return SlotStates(diffusion._replace(facts=diffusion.facts._replace(key=_keys(diffusion.facts.key))),
                      autoregressive._replace(key=_keys(autoregressive.key)),
                      widen(speculative_entry(template, max_block=max_block, vocab=vocab)))


def _keys(data: np.ndarray) -> jax.Array:
    return jax.random.wrap_key_data(data)


def _is_key(leaf) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


@functools.partial(jax.jit, donate_argnames=("slots",))
def put_slots(slots, indices: jax.Array, rows):
    """`slots` (one mode's structure) with slot `indices[i]` holding row i of `rows` (`stacked_rows`:
    int32 [S] indices, S marking an unused row; [S]-row leaves, the key as raw key data, None for
    a field written as zeros)."""
    def put(row, full):
        if row is None:
            return jax.tree_util.tree_map(
                lambda leaf: leaf.at[indices].set(jax.numpy.zeros((), leaf.dtype), mode="drop"), full)
        row = jax.random.wrap_key_data(row, impl=jax.random.key_impl(full)) if _is_key(full) \
            else jax.numpy.asarray(row, full.dtype)
        return full.at[indices].set(row, mode="drop")

    return jax.tree_util.tree_map(put, rows, slots, is_leaf=lambda leaf: leaf is None)
