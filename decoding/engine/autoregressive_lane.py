"""The autoregressive lane: one token per live slot per step, through the causal backbone.

A step chooses each slot's next token from the logits its last forward left
(`decoding.autoregressive.next_tokens`, the function `generate`'s loop runs, with the request's
own controls and sampling), then runs the forward of those tokens for every slot at its own
fill. A slot's first logits come from its prefill. NFE counts as `generate` counts it: the
prefill, then one forward per token after the first, none after the last.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.passes import ModelPasses
from clover_jax.core.state import ModelState
from decoding.autoregressive import next_tokens
from decoding.controls import Controls, TokenIds
from decoding.engine.slots import one_slot, per_slot_choice


class AutoregressiveSlots(NamedTuple):
    """The lane's device state; S = slots, V = vocabulary."""

    model: ModelState           # every slot's prompt and response so far but the latest token; length int32 [S]
    logits: jax.Array           # float32 [S, V]: the next token's
    counts: jax.Array           # int32 [S, V]: response tokens so far
    generated: jax.Array        # int32 [S]: response tokens so far
    max_new_tokens: jax.Array   # int32 [S]
    prompt_thinking: jax.Array  # bool [S]
    key: jax.Array              # PRNG keys [S]
    controls: Controls          # [S] each
    sample: jax.Array           # bool [S]
    nfe: jax.Array              # int32 [S]


class AutoregressiveReport(NamedTuple):
    token: jax.Array            # int32 [S]: the token each slot chose in this step
    finished: jax.Array         # bool [S]: it was the slot's last
    nfe: jax.Array              # int32 [S]


@functools.partial(jax.jit, static_argnames=("passes", "sample"), donate_argnames=("slots",))
def autoregressive_step(passes: ModelPasses, params: Any, slots: AutoregressiveSlots, alive: jax.Array,
                        ids: TokenIds, sample: bool) -> tuple[AutoregressiveSlots, AutoregressiveReport]:
    """Choose every live slot's next token, then run its forward (alive: bool [S])."""
    controls = slots.controls

    choose_rows = per_slot_choice(controls, slots.sample, sample)

    token = next_tokens(logits=slots.logits, counts=slots.counts, index=slots.generated,
                        prompt_thinking=slots.prompt_thinking, sequence_keys=slots.key, controls=controls, ids=ids,
                        choose_rows=choose_rows)
    generated = slots.generated + alive
    finished = alive & (jnp.any(token[:, None] == ids.eos[None, :], axis=-1) | (generated >= slots.max_new_tokens))
    counts = slots.counts.at[jnp.arange(token.shape[0]), token].add(alive.astype(jnp.int32))
    out = passes.causal(params, token[:, None], slots.model)
    going_on = alive & ~finished
    model = out.state._replace(length=jnp.where(going_on, out.state.length, slots.model.length))
    nfe = slots.nfe + going_on
    slots = slots._replace(model=model, logits=out.logits[:, 0], counts=counts, generated=generated, nfe=nfe)
    return slots, AutoregressiveReport(token, finished, nfe)


def entry(model_state: ModelState, last_logits: jax.Array, max_new_tokens: int, thinking: bool, key: jax.Array,
          controls: Controls, sample: bool, vocab: int) -> AutoregressiveSlots:
    """One slot's state for a request whose prompt `model_state` holds; last_logits: float32 [1, V];
    key: the request's key with a slot axis ([1])."""
    one = lambda value, dtype: np.asarray([value], dtype)
    return AutoregressiveSlots(model=one_slot(model_state), logits=last_logits, counts=np.zeros((1, vocab), np.int32),
                               generated=one(0, np.int32), max_new_tokens=one(max_new_tokens, np.int32),
                               prompt_thinking=one(thinking, bool), key=key,
                               controls=jax.tree_util.tree_map(lambda value: np.asarray(value)[None], controls),
                               sample=one(sample, bool), nfe=one(1, np.int32))
