"""The training pass's attention over both streams: value and gradients equal JAX's derivative of a
naive masked softmax, and the compiled backward's temporaries grow linearly with the length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.core.streams import make_streams
from clover_jax.nn.stream_attention import two_stream_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # two query heads per key/value head


def inputs(batch: int, rows: int, seed: int):
    rng = np.random.RandomState(seed)
    return tuple(jnp.asarray(rng.randn(batch, rows, heads, HEAD_DIM), jnp.float32)
                 for heads in (HEADS, KV_HEADS, KV_HEADS))


def naive_attention(query, key, value, streams, block_size):
    """Every row's softmax over all 2-stream keys with one [rows, rows] mask: the clean keys by the
    rule the training pass states, the noisy keys of the row's own block."""
    batch, length = streams.segment.shape
    rows = query.shape[1]
    block = (jnp.arange(rows) - length) // block_size
    noisy_row = jnp.arange(rows) >= length
    own = noisy_row[:, None] & noisy_row[None, :] & (block[:, None] == block[None, :])
    mask = jnp.concatenate([streams.clean_attention_mask(block_size),
                            jnp.broadcast_to(own[None, :, length:], (batch, rows, rows - length))], axis=-1)
    key, value = (jnp.repeat(x, HEADS // KV_HEADS, axis=2) for x in (key, value))
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key, precision="highest") * HEAD_DIM ** -0.5
    weights = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value, precision="highest")


def ours(query, key, value, streams, block_size, key_block):
    query_segment, query_limit = streams.clean_attention_rule(block_size)
    return two_stream_attention(query, key, value, query_segment=query_segment, query_limit=query_limit,
                                key_segment=streams.segment, block_size=block_size, key_block=key_block)


@pytest.mark.parametrize("key_block", [8, 64])
def test_value_and_gradients_equal_autodiff_of_a_naive_masked_softmax(key_block):
    """22 clean rows (not whole key blocks of 8, nor blocks of 4), two packed examples and padding in
    row 0, an unused noisy slot, GQA."""
    block_size, length = 4, 22
    segment = np.array([[1] * 8 + [2] * 10 + [0] * 4, [1] * 22])
    streams = make_streams(jnp.asarray(segment), jnp.asarray([[0, 2, 3, 99], [1, 4, 0, 2]]), block_size)
    query, key, value = inputs(2, length + 4 * block_size, seed=key_block)
    weights = jnp.asarray(np.random.RandomState(1).randn(*query.shape), jnp.float32)

    def loss(function):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(function(q, k, v) * weights), argnums=(0, 1, 2)))

    got = loss(lambda q, k, v: ours(q, k, v, streams, block_size, key_block))(query, key, value)
    want = loss(lambda q, k, v: naive_attention(q, k, v, streams, block_size))(query, key, value)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    out = jax.jit(lambda q, k, v: ours(q, k, v, streams, block_size, key_block))(query, key, value)
    expected = naive_attention(query, key, value, streams, block_size)
    np.testing.assert_allclose(out, expected, atol=1e-5 * float(jnp.abs(expected).max()))
    for actual, reference in zip(got[1], want[1], strict=True):
        scale = float(jnp.abs(reference).max())
        np.testing.assert_allclose(actual, reference, atol=1e-5 * scale, rtol=0)


def backward_temp_bytes(length: int, block_size: int = 16, key_block: int = 128) -> int:
    """The compiled gradient's temporaries for one row of `length` clean tokens and a complementary
    pair of noisy copies of every block (2L noisy rows)."""
    blocks = length // block_size
    streams = make_streams(jnp.ones((1, length), jnp.int32), jnp.tile(jnp.arange(blocks), (1, 2)), block_size)
    rows = length + 2 * blocks * block_size
    spec = lambda heads: jax.ShapeDtypeStruct((1, rows, heads, HEAD_DIM), jnp.float32)
    loss = lambda q, k, v: jnp.sum(ours(q, k, v, streams, block_size, key_block) ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec(HEADS), spec(KV_HEADS), spec(KV_HEADS)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_backward_pass_memory_grows_linearly_with_the_length():
    """Measured: 7.5 MB at L = 2,048 and 14.5 MB at 4,096 (12,288 rows); reverse mode through the
    earlier masked product took 1.02 GB and 4.08 GB."""
    short, long = backward_temp_bytes(2048), backward_temp_bytes(4096)
    assert long / short < 2.3, (short, long)  # quadratic would be 4x
    score_matrix = (2 * 4096) ** 2 * 4  # one [2L, 2L] float32 score matrix at L = 4096, one head
    assert long < score_matrix / 10, (long, score_matrix)
