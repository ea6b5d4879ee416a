"""The self-speculative lane: one draft / verify / roll-back round per live slot per step.

A step is `decoding.speculative.speculative_round` — the round `generate`'s loop runs — over
every slot, each at its own fill and with its own controls. Greedy only, as the mode is.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np

from clover_jax.core.passes import ModelPasses
from clover_jax.core.state import ModelState
from decoding.controls import Controls, TokenIds
from decoding.engine.slots import one_slot
from decoding.speculative import speculative_round


class SpeculativeSlots(NamedTuple):
    """The lane's device state; S = slots, V = vocabulary."""

    model: ModelState           # everything before each slot's pending token; length int32 [S]
    pending: jax.Array          # int32 [S]
    counts: jax.Array           # int32 [S, V]: response tokens emitted
    lengths: jax.Array          # int32 [S]: response tokens emitted
    max_new_tokens: jax.Array   # int32 [S]
    prompt_thinking: jax.Array  # bool [S]
    controls: Controls          # [S] each
    nfe: jax.Array              # int32 [S]


class SpeculativeReport(NamedTuple):
    choices: jax.Array          # int32 [S, B+1]: the first `emitted` are the round's tokens
    emitted: jax.Array          # int32 [S]
    finished: jax.Array         # bool [S]
    nfe: jax.Array              # int32 [S]


@functools.partial(jax.jit, static_argnames=("passes", "block_size", "coreset"), donate_argnames=("slots",))
def speculative_step(passes: ModelPasses, params: Any, block_size: int, coreset: bool, slots: SpeculativeSlots,
                     alive: jax.Array, coreset_top_p: jax.Array,
                     ids: TokenIds) -> tuple[SpeculativeSlots, SpeculativeReport]:
    """One round for every live slot (alive: bool [S]); two forwards."""
    out = speculative_round(passes=passes, params=params, size=block_size, coreset=coreset, coreset_top_p=coreset_top_p,
                            controls=slots.controls, ids=ids, prompt_thinking=slots.prompt_thinking,
                            max_new_tokens=slots.max_new_tokens, model=slots.model, pending=slots.pending,
                            counts=slots.counts, lengths=slots.lengths, active=alive)
    nfe = slots.nfe + 2 * alive
    slots = slots._replace(model=out.model, pending=out.pending, counts=out.counts, lengths=out.lengths, nfe=nfe)
    return slots, SpeculativeReport(out.choices, out.emitted, out.finished, nfe)


def entry(model_state: ModelState, pending: int, max_new_tokens: int, thinking: bool, controls: Controls,
          has_prefill: bool, vocab: int) -> SpeculativeSlots:
    """One slot's state for a request whose prompt but its last token (`pending`) `model_state` holds."""
    one = lambda value, dtype: np.asarray([value], dtype)
    return SpeculativeSlots(model=one_slot(model_state), pending=one(pending, np.int32),
                            counts=np.zeros((1, vocab), np.int32), lengths=one(0, np.int32),
                            max_new_tokens=one(max_new_tokens, np.int32), prompt_thinking=one(thinking, bool),
                            controls=jax.tree_util.tree_map(lambda value: np.asarray(value)[None], controls),
                            nfe=one(int(has_prefill), np.int32))
