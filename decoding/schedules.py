"""Denoising schedules: which positions of a block are decided after a step.

Signature (one sequence's block; the decoder vmaps it over the batch):

    schedule(step: StepView, knobs: ScheduleKnobs) -> bool [block]

`StepView` holds, for every position j of the block, the candidate token chosen this step
and its confidence / top-1 minus top-2 margin / entropy, which positions are decided now
(`decided`), which hold prompt tokens (`fixed`, never changed), and the step number within
the block. The result is the decided set after the step: positions that become decided take
their candidate token, decided positions that the result leaves out are remasked (a schedule
may do so), `fixed` positions stay decided whatever it says. On step `max_steps_per_block`
every remaining mask is filled with its candidate, so every block ends.

A schedule must be a pure JAX function of its arguments (it runs inside the jitted loop);
any Python callable with this signature can be passed as `schedule=`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ScheduleKnobs(NamedTuple):
    """The schedule settings of `GenerationConfig` (static: changing them recompiles)."""

    tokens_per_step: int
    margin_threshold: float
    entropy_bound: float


class StepView(NamedTuple):
    candidates: jax.Array   # int32 [block]
    confidence: jax.Array   # float32 [block]
    margin: jax.Array       # float32 [block]
    entropy: jax.Array      # float32 [block]
    decided: jax.Array      # bool [block]
    fixed: jax.Array        # bool [block]
    step: jax.Array         # int32 [], 0 for the first step of the block
    threshold: jax.Array    # float32 [], the config's threshold


def _most(scores: jax.Array, eligible: jax.Array) -> jax.Array:
    """One-hot of the eligible position with the largest score (ties: the lowest index)."""
    best = jnp.argmax(jnp.where(eligible, scores, -jnp.inf))
    return (jnp.arange(scores.shape[0]) == best) & jnp.any(eligible)


def _above_or_best(step: StepView, scores: jax.Array, threshold) -> jax.Array:
    """Decide every mask whose score exceeds `threshold`; if none does, the best one."""
    masked = ~step.decided
    fill = masked & (scores > threshold)
    return step.decided | jnp.where(jnp.any(fill), fill, _most(scores, masked))


def low_confidence(step: StepView, knobs: ScheduleKnobs) -> jax.Array:
    """Spec §4: fill every mask with confidence > threshold; if none, the most confident one."""
    return _above_or_best(step, step.confidence, step.threshold)


def fixed_k(step: StepView, knobs: ScheduleKnobs) -> jax.Array:
    """Fill the `tokens_per_step` most confident masks (ties: lower index first)."""
    masked = ~step.decided
    order = jnp.argsort(jnp.where(masked, -step.confidence, jnp.inf), stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return step.decided | (masked & (rank < knobs.tokens_per_step))


def margin(step: StepView, knobs: ScheduleKnobs) -> jax.Array:
    """Fill masks whose top-1 minus top-2 probability exceeds `margin_threshold`; else the widest."""
    return _above_or_best(step, step.margin, knobs.margin_threshold)


def entropy_bounded(step: StepView, knobs: ScheduleKnobs) -> jax.Array:
    """Fill masks in order of increasing entropy while their summed entropy stays within
    `entropy_bound` nats (at least one per step)."""
    masked = ~step.decided
    order = jnp.argsort(jnp.where(masked, step.entropy, jnp.inf), stable=True)
    sorted_entropy = jnp.where(masked[order], step.entropy[order], jnp.inf)
    within = (jnp.cumsum(sorted_entropy) <= knobs.entropy_bound) | (jnp.arange(order.shape[0]) == 0)
    fill = jnp.zeros_like(masked).at[order].set(within) & masked
    return step.decided | fill


BY_NAME = {"low_confidence": low_confidence, "fixed_k": fixed_k, "margin": margin,
           "entropy_bounded": entropy_bounded}


def resolve(schedule):
    """A schedule name or function -> the function."""
    return BY_NAME[schedule] if isinstance(schedule, str) else schedule
