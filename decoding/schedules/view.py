"""What a schedule sees (`StepView`), what it returns (`Decision`), and the ranking helpers the rules share."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class StepView(NamedTuple):
    """What a schedule sees of one sequence's block at one denoising step ([block] = the block's positions)."""

    tokens: jax.Array           # int32 [block]: the block before this step (the mask id where masked)
    candidates: jax.Array       # int32 [block]: the token chosen this step at every position
    confidence: jax.Array       # float32 [block]: its probability under the processed distribution
    margin: jax.Array           # float32 [block]: top-1 minus top-2 probability
    entropy: jax.Array          # float32 [block]: -Σ p log p of the processed distribution (nats)
    decided: jax.Array          # bool [block]: not masked before this step (prompt positions included)
    fixed: jax.Array            # bool [block]: prompt positions (never changed)
    positions: jax.Array        # int32 [block]: absolute positions in the sequence (0 = first prompt token)
    step: jax.Array             # int32 []: steps already taken in this block (0 at its first step)
    block_index: jax.Array      # int32 []: the sequence's decoded block number (0 = its first decoded block)
    steps_cap: jax.Array        # int32 []: on step steps_cap (1-based) every remaining mask is filled
    post_fill_steps: jax.Array  # int32 []: earlier steps of this block that began with no mask
    threshold: jax.Array        # float32 []: the generation config's threshold τ
    key: jax.Array              # PRNG key of this step (per sequence, block and step)

    @property
    def masked(self) -> jax.Array:
        return ~self.decided


class Decision(NamedTuple):
    """decided: bool [block], the decided set after the step; edit: bool [block], decided
    positions whose token is replaced by its candidate; keep_open: bool [], run another step on
    this block even if it has no mask left."""

    decided: jax.Array
    edit: jax.Array
    keep_open: jax.Array


def as_decision(result: "jax.Array | Decision") -> Decision:
    """A schedule's result as a `Decision` (a bool array edits nothing and closes a full block)."""
    if isinstance(result, Decision):
        return result
    return Decision(result, jnp.zeros_like(result), jnp.bool_(False))


# ---------------------------------------------------------------------- ranking helpers
def descending_order(scores: jax.Array, eligible: jax.Array) -> jax.Array:
    """int32 [block]: positions ordered eligible first, then by decreasing score, ties by lower index.

    A three-key sort rather than `argsort(where(eligible, -scores, inf))`, so that an eligible
    score of -inf still ranks before every ineligible position."""
    index = jnp.arange(scores.shape[0], dtype=jnp.int32)
    return jax.lax.sort((~eligible, -scores, index), num_keys=3)[2]


def rank_of(order: jax.Array) -> jax.Array:
    """int32 [block]: the rank of each position in `order` (the inverse permutation)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def top(scores: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
    """bool [block]: the `count` eligible positions with the highest scores (ties: lower index first)."""
    return eligible & (rank_of(descending_order(scores, eligible)) < count)


def most(scores: jax.Array, eligible: jax.Array) -> jax.Array:
    """bool [block]: one-hot of the eligible position with the largest score (ties: the lowest
    index); all False when nothing is eligible."""
    return top(scores, eligible, 1)


def leading_run(passes: jax.Array) -> jax.Array:
    """bool [n]: True for the first entries up to (excluding) the first False."""
    return jnp.cumprod(passes.astype(jnp.int32)).astype(bool)


def in_order(values: jax.Array, order: jax.Array) -> jax.Array:
    """bool [block]: `values` given in `order` ([rank]) put back at their positions."""
    return jnp.zeros(values.shape, values.dtype).at[order].set(values)
