"""Block expert selection ("coreset", docs/design.md §5) for denoising forwards.

Per sequence and MoE layer, over the B block tokens:
  * each token's top-k candidates (e, p_e) under p = softmax(router logits);
  * A_e = Σ p_e over the tokens that have e among their candidates;
  * experts ordered by A_e descending (ties: lower index first); keep the shortest prefix whose
    sum reaches top_p · Σ A (with top_p = 1: every expert with A_e > 0);
  * each token takes the k experts of the subset with its highest p (all of them when the
    subset is smaller than k), weights renormalised to 1.
With top_p = 1 this is plain top-k routing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def coreset_mask(probabilities: jax.Array, top_k: int, top_p: jax.Array) -> jax.Array:
    """probabilities: float32 [batch, block, experts] -> bool [batch, experts], the kept subset."""
    num_experts = probabilities.shape[-1]
    _, candidates = jax.lax.top_k(probabilities, top_k)                          # [b, B, k]
    is_candidate = jnp.any(jax.nn.one_hot(candidates, num_experts, dtype=bool), axis=-2)  # [b, B, E]
    aggregate = jnp.sum(jnp.where(is_candidate, probabilities, 0.0), axis=1)      # [b, E]
    order = jnp.argsort(-aggregate, axis=-1, stable=True)                         # ties: lower index first
    ranked = jnp.take_along_axis(aggregate, order, axis=-1)
    before = jnp.cumsum(ranked, axis=-1) - ranked                                 # mass of the experts ranked higher
    threshold = top_p * jnp.sum(ranked, axis=-1, keepdims=True)
    # An expert is needed while the mass before it has not reached the threshold.
    keep_ranked = (ranked > 0) & ((before < threshold) | (top_p >= 1.0))
    return jnp.zeros_like(keep_ranked).at[jnp.arange(order.shape[0])[:, None], order].set(keep_ranked)


def route_within(probabilities: jax.Array, allowed: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k among its sequence's allowed experts.

    probabilities: float32 [batch, block, experts]; allowed: bool [batch, experts]
    returns expert ids int [batch, block, top_k] and float32 weights summing to 1 over the allowed
    choices (a choice outside the subset, when it has fewer than k experts, gets weight 0)
    """
    masked = jnp.where(allowed[:, None, :], probabilities, -1.0)
    scores, expert_ids = jax.lax.top_k(masked, top_k)
    weights = jnp.maximum(scores, 0.0)
    # Choices beyond a small subset point at the token's first kept expert with weight 0, so the
    # dispatch loads no expert outside the subset.
    expert_ids = jnp.where(scores >= 0, expert_ids, expert_ids[..., :1])
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return expert_ids, weights / jnp.where(total > 0, total, 1.0)


def distinct_experts(expert_ids: jax.Array, weights: jax.Array, num_experts: int) -> jax.Array:
    """Experts used with nonzero weight by any token of each sequence: int32 [batch]."""
    used = jax.nn.one_hot(expert_ids, num_experts, dtype=bool) & (weights > 0)[..., None]
    return jnp.sum(jnp.any(used, axis=(1, 2)), axis=-1).astype(jnp.int32)
