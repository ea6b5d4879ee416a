"""Attention that never materialises a [queries, keys] score matrix over a long context.

Keys come in segments (the K/V cache, the block's own keys); each segment is reduced in
blocks of `key_block` keys with an online softmax (running max, running sum, running
weighted values, all float32), so memory is O(queries × key_block). Key blocks that lie
entirely past the filled part of the cache are skipped with `lax.cond`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

KEY_BLOCK = 1024


class KeySegment(NamedTuple):
    """key, value: [batch, keys, kv_heads, head_dim]; allowed(key_index int [K]) -> bool [batch, queries, K];
    live_below: int [] — keys at this index or later are never allowed (their blocks are skipped)."""

    key: jax.Array
    value: jax.Array
    allowed: Callable[[jax.Array], jax.Array]
    live_below: jax.Array | int


class Running(NamedTuple):
    peak: jax.Array     # float32 [b, kv_heads, group, queries]
    total: jax.Array    # float32 [b, kv_heads, group, queries]
    weighted: jax.Array  # float32 [b, kv_heads, group, queries, head_dim]


def _absorb(running: Running, query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array) -> Running:
    """Fold one block of keys into the running softmax. query: [b, t, k, g, d] (pre-scaled)."""
    scores = jnp.einsum("btkgd,bskd->bkgts", query, key, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    peak = jnp.maximum(running.peak, jnp.max(scores, axis=-1))
    safe_peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - safe_peak[..., None])
    rescale = jnp.exp(running.peak - safe_peak)  # 0 while nothing was seen (peak -inf)
    total = running.total * rescale + jnp.sum(weights, axis=-1)
    weighted = running.weighted * rescale[..., None] + jnp.einsum(
        "bkgts,bskd->bkgtd", weights, value.astype(jnp.float32))
    return Running(peak, total, weighted)


def online_attention(query: jax.Array, segments: list[KeySegment], key_block: int = KEY_BLOCK) -> jax.Array:
    """Softmax attention of `query` ([batch, queries, heads, head_dim]) over all segments at once,
    as if their keys were concatenated. Key/value heads serve consecutive query heads.
    A query that may see no key at all gets zeros. returns [batch, queries, heads, head_dim]."""
    num_kv_heads, head_dim = segments[0].key.shape[2], query.shape[-1]
    grouped = rearrange(query, "b t (k g) d -> b t k g d", k=num_kv_heads) * head_dim ** -0.5
    batch, queries, _, group, _ = grouped.shape
    running = Running(jnp.full((batch, num_kv_heads, group, queries), -jnp.inf, jnp.float32),
                      jnp.zeros((batch, num_kv_heads, group, queries), jnp.float32),
                      jnp.zeros((batch, num_kv_heads, group, queries, head_dim), jnp.float32))
    for segment in segments:
        length = segment.key.shape[1]
        if length <= key_block:
            running = _absorb(running, grouped, segment.key, segment.value, segment.allowed(jnp.arange(length)))
            continue

        def block_step(running, block):
            # The last block's slice is clamped to end at `length`; keys it shares with the previous
            # block are masked so that none is counted twice.
            first = jnp.minimum(block * key_block, length - key_block)
            index = first + jnp.arange(key_block)
            take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, key_block, axis=1)
            allowed = segment.allowed(index) & (index >= block * key_block)[None, None, :]
            absorb = lambda r: _absorb(r, grouped, take(segment.key), take(segment.value), allowed)
            return jax.lax.cond(block * key_block < segment.live_below, absorb, lambda r: r, running), None

        running, _ = jax.lax.scan(block_step, running, jnp.arange(-(-length // key_block)))
    out = running.weighted / jnp.where(running.total > 0, running.total, 1.0)[..., None]
    return rearrange(out, "b k g t d -> b t (k g) d").astype(query.dtype)
