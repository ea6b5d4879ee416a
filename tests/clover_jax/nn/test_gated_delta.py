"""The chunked gated delta rule equals the per-token recurrence, and transformers' reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_recurrent_gated_delta_rule

from clover_jax.nn.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule
from clover_jax.nn.layers import l2_normalize

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 8


def rule_inputs(length: int, seed: int):
    rng = np.random.RandomState(seed)
    query = l2_normalize(jnp.asarray(rng.randn(2, length, KEY_HEADS, KEY_DIM), jnp.float32))
    key = l2_normalize(jnp.asarray(rng.randn(2, length, KEY_HEADS, KEY_DIM), jnp.float32))
    value = jnp.asarray(rng.randn(2, length, VALUE_HEADS, VALUE_DIM), jnp.float32)
    decay = jnp.asarray(-rng.uniform(0.0, 0.5, (2, length, VALUE_HEADS)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (2, length, VALUE_HEADS)), jnp.float32)
    state = jnp.asarray(rng.randn(2, VALUE_HEADS, KEY_DIM, VALUE_DIM), jnp.float32)
    return query, key, value, decay, beta, state


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_equals_recurrent_step(length, with_state):
    query, key, value, decay, beta, state = rule_inputs(length, seed=length)
    initial = state if with_state else None
    scaled_query = query * KEY_DIM ** -0.5
    chunked_out, chunked_state = jax.jit(chunked_gated_delta_rule)(scaled_query, key, value, decay, beta, initial)
    recurrent_out, recurrent_state = jax.jit(recurrent_gated_delta_rule)(
        scaled_query, key, value, decay, beta, initial)
    np.testing.assert_allclose(chunked_out, recurrent_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(chunked_state, recurrent_state, atol=1e-5, rtol=1e-5)

    as_torch = lambda x: torch.from_numpy(np.array(x))
    reference_out, reference_state = torch_recurrent_gated_delta_rule(
        as_torch(query), as_torch(key), as_torch(value), as_torch(decay), as_torch(beta),
        initial_state=as_torch(initial) if with_state else None, output_final_state=True)
    np.testing.assert_allclose(chunked_out, reference_out.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(chunked_state, reference_state.numpy(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [5, 64])
def test_unit_lower_inverse_by_matmuls_equals_the_matrix_inverse(size):
    from clover_jax.nn.gated_delta import unit_lower_inverse

    strictly_lower = np.tril(np.random.RandomState(size).uniform(-0.2, 0.2, (3, size, size)), -1).astype(np.float32)
    expected = np.linalg.inv(np.eye(size) + strictly_lower.astype(np.float64))
    np.testing.assert_allclose(unit_lower_inverse(jnp.asarray(strictly_lower)), expected, atol=1e-3, rtol=1e-4)
