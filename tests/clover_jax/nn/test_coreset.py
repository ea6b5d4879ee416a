"""Coreset selection (docs/design.md §5) on random routers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.nn.coreset import coreset_mask, distinct_experts, route_within

TOP_K, EXPERTS = 8, 64


def router_probabilities(seed: int, batch: int = 3, block: int = 32) -> jax.Array:
    logits = np.random.RandomState(seed).randn(batch, block, EXPERTS) * 1.5
    return jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)


def aggregate_mass(probabilities: np.ndarray) -> np.ndarray:
    """A_e = Σ p_e over the tokens whose top-k holds e: [batch, experts]."""
    kth = np.sort(probabilities, axis=-1)[..., -TOP_K][..., None]
    return np.sum(np.where(probabilities >= kth, probabilities, 0.0), axis=1)


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.9])
def test_kept_mass_reaches_top_p_and_the_set_is_minimal(top_p):
    probabilities = router_probabilities(seed=int(top_p * 10))
    kept = np.asarray(coreset_mask(probabilities, TOP_K, jnp.float32(top_p)))
    aggregate = aggregate_mass(np.asarray(probabilities))
    for sequence in range(kept.shape[0]):
        mass, total = aggregate[sequence], aggregate[sequence].sum()
        chosen = mass[kept[sequence]]
        assert chosen.sum() >= top_p * total * (1 - 1e-6)
        assert chosen.sum() - chosen.min() < top_p * total  # dropping the smallest kept expert falls short
        assert np.all(mass[~kept[sequence]] <= chosen.min())  # kept experts are the heaviest


def test_top_p_one_is_plain_top_k_routing():
    probabilities = router_probabilities(seed=1)
    ids, weights = route_within(probabilities, coreset_mask(probabilities, TOP_K, jnp.float32(1.0)), TOP_K)
    plain_weights, plain_ids = jax.lax.top_k(probabilities, TOP_K)
    np.testing.assert_array_equal(ids, plain_ids)
    np.testing.assert_allclose(weights, plain_weights / plain_weights.sum(-1, keepdims=True), rtol=1e-6)


def test_smaller_top_p_uses_fewer_distinct_experts():
    probabilities = router_probabilities(seed=2)

    def distinct(top_p):
        ids, weights = route_within(probabilities, coreset_mask(probabilities, TOP_K, jnp.float32(top_p)), TOP_K)
        return np.asarray(distinct_experts(ids, weights, EXPERTS))

    assert np.all(distinct(0.5) < distinct(0.9)) and np.all(distinct(0.9) <= distinct(1.0))


def test_a_subset_smaller_than_k_gives_every_token_all_of_it():
    probabilities = router_probabilities(seed=3)
    allowed = jnp.zeros((3, EXPERTS), bool).at[:, [4, 9, 17]].set(True)
    ids, weights = route_within(probabilities, allowed, TOP_K)
    used = np.asarray(ids)[np.asarray(weights) > 0].reshape(3, 32, 3)
    assert np.all(np.sort(used, axis=-1) == np.array([4, 9, 17]))
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
