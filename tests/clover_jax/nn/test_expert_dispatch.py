"""The grouped routed-expert computation equals evaluating every expert for every token (test oracle)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.nn.expert_dispatch import per_expert, routed_expert_mlp, tile_rows_for

HIDDEN, INTERMEDIATE = 16, 8


def dense_oracle(tokens, expert_ids, expert_weights, gate_up_proj, down_proj):
    gate, up = jnp.split(jnp.einsum("th,eih->tei", tokens, gate_up_proj), 2, axis=-1)
    every_expert = jnp.einsum("tei,ehi->teh", jax.nn.silu(gate) * up, down_proj)  # [tokens, experts, hidden]
    chosen = jnp.take_along_axis(every_expert, expert_ids[..., None], axis=1)
    return jnp.sum(chosen * expert_weights[..., None], axis=1)


def case(num_tokens, num_experts, top_k, seed, only_experts=None):
    rng = np.random.RandomState(seed)
    tokens = jnp.asarray(rng.randn(num_tokens, HIDDEN), jnp.float32)
    pool = np.arange(num_experts) if only_experts is None else np.asarray(only_experts)
    expert_ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(num_tokens)])
    weights = rng.dirichlet(np.ones(top_k), num_tokens).astype(np.float32)
    gate_up = jnp.asarray(rng.randn(num_experts, 2 * INTERMEDIATE, HIDDEN) / 4, jnp.float32)
    down = jnp.asarray(rng.randn(num_experts, HIDDEN, INTERMEDIATE) / 3, jnp.float32)
    return tokens, jnp.asarray(expert_ids, jnp.int32), jnp.asarray(weights), gate_up, down


@pytest.mark.parametrize("num_tokens, num_experts, top_k, only_experts", [
    (1, 16, 4, None),           # decoding: one row per tile
    (3, 64, 2, None),           # more experts than routed pairs: most groups empty
    (200, 6, 2, None),          # prefill: multi-row tiles with partial last tiles
    (130, 8, 1, [5]),           # a single group holds every token
    (97, 12, 3, [0, 4, 11]),    # several empty groups between full ones
])
@pytest.mark.parametrize("strategy", ["loop", "dense"])
def test_grouped_experts_equal_dense_oracle(num_tokens, num_experts, top_k, only_experts, strategy):
    inputs = case(num_tokens, num_experts, top_k, seed=num_tokens, only_experts=only_experts)
    dispatch = jax.jit(functools.partial(routed_expert_mlp, strategy=strategy))
    np.testing.assert_allclose(dispatch(*inputs), dense_oracle(*inputs), atol=1e-5, rtol=1e-5)


def test_pairs_routed_elsewhere_are_dropped_by_both_strategies():
    tokens, expert_ids, weights, gate_up, down = case(9, 8, 2, seed=3)
    held_here = expert_ids < 5  # as an expert-parallel shard holding experts 0..4 sees ids >= 5 as absent
    local = (tokens, jnp.where(held_here, expert_ids, 8), weights, gate_up[:5], down[:5])
    expected = dense_oracle(tokens, expert_ids, jnp.where(held_here, weights, 0.0), gate_up, down)
    for strategy in ("loop", "dense"):
        np.testing.assert_allclose(routed_expert_mlp(*local, strategy=strategy), expected, atol=1e-5, rtol=1e-5)


def test_tile_height_follows_rows_per_expert():
    assert tile_rows_for(8, 256) == 1          # one decoding token, top-8
    assert tile_rows_for(32 * 8, 32) == 8      # a 32-row block, top-8 of 32
    assert tile_rows_for(2048 * 8, 256) == 64  # a 2048-token prefill chunk
    assert tile_rows_for(10**7, 8) == 128


@pytest.mark.parametrize("num_tokens", [1, 3, 200])
@pytest.mark.parametrize("strategy", ["loop", "dense"])
@pytest.mark.parametrize("bits", [None, 8])
def test_experts_held_one_buffer_each_give_the_stacked_result(num_tokens, strategy, bits):
    """The CPU run layout holds each expert in its own buffer (a tuple per stack, read in place
    through a `switch`): the same arithmetic on the same values as indexing the stack."""
    from clover_jax.core.quantization import QuantSpec, quantize

    tokens, expert_ids, weights, gate_up, down = case(num_tokens, 6, 2, seed=num_tokens)
    if bits is not None:
        gate_up, down = (quantize(np.asarray(w), QuantSpec(bits=bits)) for w in (gate_up, down))
    one_each = tuple(tuple(jax.tree_util.tree_map(lambda leaf, expert=expert: jnp.asarray(leaf[expert]), w)
                           for expert in range(6))
                     for w in (gate_up, down))
    assert per_expert(one_each[0]) and not per_expert(gate_up)
    dispatch = jax.jit(functools.partial(routed_expert_mlp, strategy=strategy))
    expected = dispatch(tokens, expert_ids, weights, gate_up, down)
    np.testing.assert_allclose(dispatch(tokens, expert_ids, weights, *one_each), expected, atol=1e-6, rtol=1e-6)
    # and a pair routed elsewhere (id >= experts) is dropped in this layout too
    local_ids = jnp.where(expert_ids < 4, expert_ids, 6)
    np.testing.assert_allclose(
        dispatch(tokens, local_ids, weights, *(w[:4] for w in one_each)),
        dispatch(tokens, local_ids, weights,
                 *(jax.tree_util.tree_map(lambda leaf: leaf[:4], w) for w in (gate_up, down))),
        atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, only_experts", [
    (3, 64, 2, None),           # most experts unused: their gradients stay zero
    (200, 6, 2, None),          # multi-row tiles, partial last tiles
    (97, 12, 3, [0, 4, 11]),    # empty groups between full ones
])
def test_the_expert_loop_backward_equals_the_dense_gradient(num_tokens, num_experts, top_k, only_experts):
    """The loop's written-out backward (what training runs) gives the gradient of every input that
    autodiff of the dense oracle gives, dropped pairs (ids past the experts held) and zero weights included."""
    tokens, expert_ids, weights, gate_up, down = case(num_tokens, num_experts, top_k, seed=3,
                                                     only_experts=only_experts)
    expert_ids = expert_ids.at[::5, -1].set(num_experts)  # not held here: dropped
    weights = weights.at[::7, 0].set(0.0)                 # a coreset's zero-weight choice
    cotangent = jnp.asarray(np.random.RandomState(4).randn(num_tokens, HIDDEN), jnp.float32)

    def loss(function, *args):
        return jnp.sum(function(*args) * cotangent)

    held = lambda t, i, w, g, d: dense_oracle(t, jnp.minimum(i, num_experts - 1), w * (i < num_experts), g, d)
    ours = jax.grad(functools.partial(loss, lambda t, w, g, d: routed_expert_mlp(t, expert_ids, w, g, d,
                                                                                  strategy="loop")),
                    argnums=(0, 1, 2, 3))(tokens, weights, gate_up, down)
    expected = jax.grad(functools.partial(loss, lambda t, w, g, d: held(t, expert_ids, w, g, d)),
                        argnums=(0, 1, 2, 3))(tokens, weights, gate_up, down)
    for got, want in zip(ours, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
