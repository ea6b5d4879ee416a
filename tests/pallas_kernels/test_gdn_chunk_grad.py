"""`gdn_chunk`'s block states and backward pass (interpret mode) against the token-by-token oracle,
differentiated by JAX: the state before every block, with packed examples restarting it, and the
gradients for query, key, value, decay, beta and the initial state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn_chunk, gdn_chunk_reference, gdn_chunk_with_block_states
from tests.pallas_kernels.test_gdn_chunk import BATCH, CHUNK, VALUE_BLOCK, assert_close, rule_inputs


def reference_with_block_states(query, key, value, decay, beta, state, *, block_size, resets):
    """The recurrence token by token, block after block: the state restarts where `resets` says and
    is recorded before each block. returns (out, final state, states [b, blocks, h, dk, dv])."""
    outs, states = [], []
    for block in range(key.shape[1] // block_size):
        state = jnp.where(resets[:, block, None, None, None], 0.0, state)
        states.append(state)
        rows = slice(block * block_size, (block + 1) * block_size)
        out, state = gdn_chunk_reference(query[:, rows], key[:, rows], value[:, rows], decay[:, rows],
                                         beta[:, rows], state)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), state, jnp.stack(states, axis=1)


def weighted_sum(results, seed):
    """A scalar that weighs every entry of every result differently, so each cotangent is checked."""
    rng = np.random.RandomState(seed)
    return sum(jnp.sum(r * jnp.asarray(rng.randn(*r.shape), jnp.float32)) for r in results)


def assert_gradients_close(function, reference, inputs, seed):
    """Value and gradients w.r.t. q, k, v, decay, beta, initial state, each to 1e-5 of its scale."""
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: weighted_sum(f(*a), seed), argnums=tuple(range(6))))
    value, grads = loss(function)(*inputs)
    expected, expected_grads = loss(reference)(*inputs)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == want.dtype and float(jnp.max(jnp.abs(want))) > 0
        assert_close(got, want)


@pytest.mark.parametrize("variant,block_size,length", [("gpu", 8, 40), ("tpu", 32, 64)])
def test_block_states_and_gradients_match_the_oracle_with_restarts(variant, block_size, length):
    """A block of 8 is a chunk of its own; a block of 32 is two chunks of 16 (the state is written
    at the block's first chunk). Restarts: row 0 at its third block, row 1 at its first."""
    inputs = rule_inputs(length, seed=block_size)
    blocks = length // block_size
    resets = np.zeros((BATCH, blocks), bool)
    resets[0, min(2, blocks - 1)] = resets[1, 0] = True
    resets = jnp.asarray(resets)
    kernel = lambda *a: gdn_chunk_with_block_states(*a, block_size=block_size, resets=resets, chunk_size=CHUNK,
                                                    value_block=VALUE_BLOCK, variant=variant, interpret=True)
    reference = lambda *a: reference_with_block_states(*a, block_size=block_size, resets=resets)
    got, want = jax.jit(kernel)(*inputs), jax.jit(reference)(*inputs)
    assert got[2].shape == (BATCH, blocks) + inputs[-1].shape[1:]
    for actual, expected in zip(got, want, strict=True):
        assert_close(actual, expected)
    np.testing.assert_array_equal(np.asarray(got[2][1, 0]), 0.0)  # restarted before its first block
    assert_gradients_close(kernel, reference, inputs, seed=length)


def test_gradients_at_a_length_that_is_not_a_whole_number_of_chunks():
    inputs = rule_inputs(37, seed=5)
    kernel = lambda *a: gdn_chunk(*a, chunk_size=CHUNK, value_block=VALUE_BLOCK, interpret=True)
    assert_gradients_close(kernel, gdn_chunk_reference, inputs, seed=37)


def test_bf16_values_get_bf16_gradients():
    query, key, value, decay, beta, state = rule_inputs(16, seed=9)
    value, beta = value.astype(jnp.bfloat16), beta.astype(jnp.bfloat16)
    grads = jax.jit(jax.grad(lambda v, b: jnp.sum(gdn_chunk(query, key, v, decay, b, state, chunk_size=CHUNK,
                                                    interpret=True)[0]), argnums=(0, 1)))(value, beta)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


def test_block_sizes_that_do_not_end_on_chunk_boundaries_are_refused():
    query, key, value, decay, beta, state = rule_inputs(48, seed=0)
    call = lambda **options: gdn_chunk_with_block_states(query, key, value, decay, beta, state, interpret=True,
                                                         chunk_size=CHUNK, **options)
    with pytest.raises(ValueError, match="block_size=24 must divide the chunk \\(16\\) or be a multiple of it"):
        call(block_size=24)
    with pytest.raises(ValueError, match="48 tokens are not a whole number of blocks of 32"):
        call(block_size=32)
    with pytest.raises(ValueError, match="resets \\(2, 4\\) must be \\[batch, blocks\\]"):
        call(block_size=16, resets=jnp.zeros((BATCH, 4), bool))
