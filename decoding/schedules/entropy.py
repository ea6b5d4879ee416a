"""Rules that take the masked positions of a block in order of increasing entropy: the
entropy-bounded rule and the EB-sampler.

Each takes `(view: StepView, params: {name: traced scalar})` and returns the decided set
bool [block] after the step."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from decoding.schedules.view import StepView, descending_order, in_order, leading_run


def _by_increasing_entropy(view: StepView) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(order [block], masked in that order [block], their entropies, +inf past the masked)."""
    masked = ~view.decided
    order = descending_order(-view.entropy, masked)
    sorted_masked = masked[order]
    return order, sorted_masked, jnp.where(sorted_masked, view.entropy[order], jnp.inf)


def entropy_bounded(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fill masks in order of increasing entropy while their summed entropy, the one being added
    included, stays within `entropy_bound` nats (at least one per step)."""
    order, sorted_masked, sorted_entropy = _by_increasing_entropy(view)
    first = jnp.arange(order.shape[0]) == 0
    within = leading_run((jnp.cumsum(sorted_entropy) <= params["entropy_bound"]) | first)
    return view.decided | in_order(within & sorted_masked, order)


def eb_sampler(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """EB-sampler (Ben-Hamu et al., 2025): fill the lowest-entropy mask, then keep adding masks in
    order of increasing entropy while the summed entropy of those already taken is <= `gamma`;
    equivalently the largest prefix U with Σ_U H - max_U H <= gamma."""
    order, sorted_masked, sorted_entropy = _by_increasing_entropy(view)
    taken_before = jnp.concatenate([jnp.zeros(1, sorted_entropy.dtype), jnp.cumsum(sorted_entropy)[:-1]])
    return view.decided | in_order(leading_run(taken_before <= params["gamma"]) & sorted_masked, order)
