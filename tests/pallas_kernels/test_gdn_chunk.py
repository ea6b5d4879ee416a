"""`gdn_chunk` (both drivers, interpret mode) equals the token-by-token oracle and the XLA chunked rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn_chunk, gdn_chunk_reference

BATCH, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 2, 4, 16, 32
CHUNK = 16        # small chunks so short sequences cross several of them
VALUE_BLOCK = 16  # two value tiles per head


def rule_inputs(length: int, seed: int, dtype=jnp.float32):
    """Inputs as the GDN layer makes them: q, k L2-normalised (q scaled), g <= 0, beta in (0, 1)."""
    rng = np.random.RandomState(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    query = unit(rng.randn(BATCH, length, KEY_HEADS, KEY_DIM)) * KEY_DIM ** -0.5
    key = unit(rng.randn(BATCH, length, KEY_HEADS, KEY_DIM))
    value = rng.randn(BATCH, length, VALUE_HEADS, VALUE_DIM)
    decay = -np.log1p(np.exp(rng.randn(BATCH, length, VALUE_HEADS)))  # -softplus: a wide range of decays
    beta = 1 / (1 + np.exp(-rng.randn(BATCH, length, VALUE_HEADS)))
    state = rng.randn(BATCH, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    as_array = lambda x: jnp.asarray(x, dtype)
    return tuple(map(as_array, (query, key, value, decay, beta))) + (jnp.asarray(state, jnp.float32),)


def assert_close(actual, expected, rtol=1e-5):
    """Relative to the largest entry: outputs near zero carry no signal of their own."""
    scale = float(jnp.max(jnp.abs(expected)))
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=rtol * scale)


def run_kernel(inputs, with_state, **options):
    query, key, value, decay, beta, state = inputs
    kernel = jax.jit(lambda *args: gdn_chunk(*args, chunk_size=CHUNK, value_block=VALUE_BLOCK, interpret=True,
                                             **options))
    return kernel(query, key, value, decay, beta, state if with_state else None)


def run_oracle(inputs, with_state):
    query, key, value, decay, beta, state = inputs
    return jax.jit(gdn_chunk_reference)(query, key, value, decay, beta, state if with_state else None)


@pytest.mark.parametrize("length,with_state", [(1, True), (37, False), (48, True)])
def test_gpu_driver_matches_token_by_token_oracle_at_awkward_lengths(length, with_state):
    inputs = rule_inputs(length, seed=length)
    out, state = run_kernel(inputs, with_state, variant="gpu")
    expected_out, expected_state = run_oracle(inputs, with_state)
    assert out.shape == (BATCH, length, VALUE_HEADS, VALUE_DIM) and out.dtype == jnp.float32
    assert_close(out, expected_out)
    assert_close(state, expected_state)


@pytest.mark.parametrize("length", [1, 37])
def test_tpu_chunk_grid_driver_matches_token_by_token_oracle(length):
    inputs = rule_inputs(length, seed=100 + length)
    out, state = run_kernel(inputs, True, variant="tpu")
    expected_out, expected_state = run_oracle(inputs, True)
    assert_close(out, expected_out)
    assert_close(state, expected_state)


def test_bf16_inputs_are_upcast_exactly_and_state_stays_float32():
    inputs = rule_inputs(37, seed=7, dtype=jnp.bfloat16)
    out, state = run_kernel(inputs, True)
    assert out.dtype == state.dtype == jnp.float32
    expected_out, expected_state = run_oracle(inputs, True)  # the oracle upcasts the same bf16 values
    assert_close(out, expected_out)
    assert_close(state, expected_state)


def test_equals_the_xla_chunked_rule_with_default_chunks_and_default_interpret():
    from clover_jax.nn.gated_delta import chunked_gated_delta_rule

    query, key, value, decay, beta, state = rule_inputs(100, seed=3)
    # interpret=None: interpreted because this runs on CPU (chosen per platform at lowering).
    out, final = jax.jit(gdn_chunk)(query, key, value, decay, beta, state)
    expected_out, expected_final = jax.jit(chunked_gated_delta_rule)(query, key, value, decay, beta, state)
    assert_close(out, expected_out)
    assert_close(final, expected_final)


def test_oracle_follows_the_spec_recurrence_in_numpy():
    query, key, value, decay, beta, state = (np.asarray(x, np.float64) for x in rule_inputs(5, seed=11))
    out, final = gdn_chunk_reference(*(jnp.asarray(x, jnp.float32) for x in (query, key, value, decay, beta, state)))
    group = VALUE_HEADS // KEY_HEADS
    expected = np.zeros(value.shape)
    for b in range(BATCH):
        for h in range(VALUE_HEADS):
            s = state[b, h].copy()
            for t in range(value.shape[1]):
                q, k = query[b, t, h // group], key[b, t, h // group]
                s = np.exp(decay[b, t, h]) * s
                s = s + np.outer(k, beta[b, t, h] * (value[b, t, h] - s.T @ k))
                expected[b, t, h] = s.T @ q
            np.testing.assert_allclose(final[b, h], s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_rejects_value_heads_that_key_heads_do_not_divide():
    query, key, value, decay, beta, _ = rule_inputs(4, seed=0)
    with pytest.raises(ValueError, match="multiple of key_heads"):
        gdn_chunk(query, key, value[:, :, :3], decay[:, :, :3], beta[:, :, :3], interpret=True)
