"""Long inputs (docs/design.md §1): chunked causal passes and blockwise online-softmax attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import CloverModel
from clover_jax.core.state import empty_state
from clover_jax.nn.fused_attention import fused_attention
from clover_jax.nn.model import TransformerPasses
from clover_jax.nn.online_attention import array_segment, online_attention
from decoding import generate
from tests.conftest import MASK_ID, token_ids


def plain_attention(query, key, value, allowed):
    """Reference: the whole [queries, keys] score matrix at once (float32)."""
    group = query.shape[2] // key.shape[2]
    key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", query, key) * query.shape[-1] ** -0.5
    weights = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
    weights = jnp.where(jnp.any(allowed, -1)[:, None, :, None], weights, 0.0)
    return jnp.einsum("bhts,bshd->bthd", weights, value)


def attention_case(seed: int):
    """Causal rows that end at a filled cache of 50 of 70 rows, then a 4-row block; sequence 1 is
    left-padded by 9 rows. returns (query, segments, plain-attention result)."""
    rng = np.random.RandomState(seed)
    batch, capacity, filled, queries, block, heads, kv_heads, dim = 2, 70, 50, 6, 4, 4, 2, 8
    start = jnp.array([0, 9])
    query = jnp.asarray(rng.randn(batch, queries + block, heads, dim), jnp.float32)
    cache_key, cache_value = (jnp.asarray(rng.randn(batch, capacity, kv_heads, dim), jnp.float32) for _ in range(2))
    block_key, block_value = (jnp.asarray(rng.randn(batch, block, kv_heads, dim), jnp.float32) for _ in range(2))
    rows = filled - queries + jnp.arange(queries + block)  # causal rows end at `filled`, then a block
    is_causal = (jnp.arange(queries + block) < queries)[None, :, None]

    def cache_allowed(index):
        upto = jnp.where(is_causal, index[None, None, :] <= rows[None, :, None], index[None, None, :] < filled)
        return (index[None, None, :] >= start[:, None, None]) & upto

    block_allowed = lambda index: jnp.broadcast_to(~is_causal, (batch, queries + block, index.shape[0]))
    segments = [array_segment(cache_key, cache_value, cache_allowed, filled),
                array_segment(block_key, block_value, block_allowed)]
    allowed = jnp.concatenate([cache_allowed(jnp.arange(capacity)), block_allowed(jnp.arange(block))], axis=-1)
    expected = plain_attention(query, jnp.concatenate([cache_key, block_key], 1),
                               jnp.concatenate([cache_value, block_value], 1), allowed)
    return query, segments, expected


@pytest.mark.parametrize("key_block", [16, 32, 1024])  # 70 keys: clamped last block, exact blocks, one block
def test_online_attention_equals_plain_attention_causal_and_block(key_block):
    query, segments, expected = attention_case(key_block)
    np.testing.assert_allclose(online_attention(query, segments, key_block), expected, atol=1e-5, rtol=1e-5)


def test_platform_fused_attention_equals_plain_attention_causal_and_block():
    """The `impl="pallas"` attention path (`jax.nn.dot_product_attention`; its XLA form on CPU)."""
    query, segments, expected = attention_case(3)
    np.testing.assert_allclose(fused_attention(query, segments, "cpu"), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length, chunk", [(63, 64), (64, 64), (65, 64), (130, 64), (100, 32)])
def test_chunked_prefill_equals_one_pass(clover, length, chunk):
    ids = jnp.asarray(token_ids(2, length, MASK_ID, seed=length))
    state = clover.init_state(2, 160)
    # jitted, as the decoding loops run it: run eagerly, the unchunked pass dispatched the model op by
    # op and compiled every op anew for each length (the five cases took 74 s eagerly, 33 s jitted)
    prefill = jax.jit(TransformerPasses(clover.module).prefill, static_argnames=("chunk_size", "logits"))
    whole_logits, whole = prefill(clover.params, ids, state, chunk_size=10**6, logits="all")
    chunked_logits, chunked = prefill(clover.params, ids, state, chunk_size=chunk, logits="all")
    np.testing.assert_allclose(chunked_logits, whole_logits, atol=1e-4, rtol=1e-4)
    assert int(chunked.length) == int(whole.length) == length
    for left, right in zip(jax.tree.leaves(chunked.layers), jax.tree.leaves(whole.layers), strict=True):
        np.testing.assert_allclose(left, right, atol=1e-4, rtol=1e-4)


def test_prefill_temporary_memory_does_not_grow_with_the_square_of_the_length(clover):
    """Compiled (not run) prefills of 8K and 32K tokens: 4x the length may cost ~4x the
    temporaries (caches, activations), never ~16x (a score matrix)."""
    def temporaries(length):
        state = jax.eval_shape(lambda: empty_state(clover.config, 1, length, clover.dtype))
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
        prefill = TransformerPasses(clover.module).prefill
        compiled = jax.jit(lambda p, i, s: prefill(p, i, s, chunk_size=2048, logits="none")).lower(
            clover.params, ids, state).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    short, long = temporaries(8192), temporaries(32768)
    assert long < 6 * short, (short, long)


def test_memory_estimate_counts_parameters_and_state_exactly(clover):
    from clover_jax.parallel.memory import estimate_memory

    estimate = estimate_memory(clover.config, batch=3, context_length=96, dtype=clover.dtype)
    assert estimate.parameters == sum(leaf.nbytes for leaf in jax.tree.leaves(clover.params))
    state = jax.eval_shape(lambda: empty_state(clover.config, 3, 96, clover.dtype))
    kv = sum(leaf.size * leaf.dtype.itemsize for name, layer in state.layers.items()
             if type(layer).__name__ == "KVCache" for leaf in layer)
    gdn = sum(leaf.size * leaf.dtype.itemsize for name, layer in state.layers.items()
              if type(layer).__name__ == "GDNState" for leaf in layer)
    assert (estimate.kv_cache, estimate.gdn_state) == (kv, gdn)
    assert estimate.activations > 0


def test_a_request_that_cannot_fit_is_refused_before_compute(clover, monkeypatch):
    import clover_jax.parallel.memory as memory
    import decoding.layouts as layouts

    calls = []
    monkeypatch.setattr(layouts, "run_block_decoder", lambda *args: calls.append(args))
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: 1000)
    monkeypatch.setattr(clover, "fitted_requests", set())  # as if this request shape were new
    with pytest.raises(ValueError, match="this request needs about .* but only 0.00 GB are free"):
        generate(clover, [[1, 2, 3]], max_new_tokens=8, block_size=8)
    assert calls == []


def test_a_16k_token_prompt_prefills_and_decodes_a_block(clover):
    """Eight 2048-token prefill chunks through `generate`. The 64K-token prompt runs in `make bench`
    (benchmarks/context_scaling.py, prefixes up to 65536): 10 minutes of this suite on a 2-core CPU."""
    long_context = CloverModel(clover.config.replace(max_position_embeddings=131072), clover.params, clover.dtype)
    prompt = np.random.RandomState(0).randint(0, MASK_ID, 16384).tolist()
    out = generate(long_context, [prompt], max_new_tokens=8, block_size=8, threshold=0.9, eos_token_id=())
    assert len(out.sequences[0]) == 8 and MASK_ID not in out.sequences[0]
    assert out.nfe[0] == 1 + sum(out.steps_per_block[0])
