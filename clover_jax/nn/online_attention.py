"""Attention that never materialises a [queries, keys] score matrix over a long context.

Keys come in segments (the K/V cache, the block's own keys); each segment is reduced in
blocks of `key_block` keys with an online softmax (running max, running sum, running
weighted values, all float32), so memory is O(queries × key_block). A segment is read block by
block through its `read` function (the cache is a slice of the stacked state, read in place),
and the loop over blocks stops at the filled part of the cache: blocks past it are never read.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from clover_jax.core.kernels import KEY_BLOCK


class KeySegment(NamedTuple):
    """read(first, size) -> (key, value), each [batch, size, kv_heads, head_dim]: keys first..first+size-1;
    length: the segment's (static) number of keys; allowed(key_index int [K]) -> bool [batch, queries, K];
    live_below: int [] — keys at this index or later are never allowed (their blocks are not read)."""

    read: Callable[[Any, int], tuple[jax.Array, jax.Array]]
    length: int
    allowed: Callable[[jax.Array], jax.Array]
    live_below: jax.Array | int


def array_segment(key: jax.Array, value: jax.Array, allowed: Callable, live_below=None) -> KeySegment:
    """A segment over whole key/value arrays [batch, keys, kv_heads, head_dim]."""
    read = lambda first, size: (jax.lax.dynamic_slice_in_dim(key, first, size, axis=1),
                                jax.lax.dynamic_slice_in_dim(value, first, size, axis=1))
    return KeySegment(read, key.shape[1], allowed, key.shape[1] if live_below is None else live_below)


class Running(NamedTuple):
    peak: jax.Array     # float32 [b, kv_heads, group, queries]
    total: jax.Array    # float32 [b, kv_heads, group, queries]
    weighted: jax.Array  # float32 [b, kv_heads, group, queries, head_dim]


def absorb(running: Running, query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array) -> Running:
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
    num_kv_heads, head_dim = jax.eval_shape(lambda: segments[0].read(0, 1))[0].shape[2], query.shape[-1]
    grouped = rearrange(query, "b t (k g) d -> b t k g d", k=num_kv_heads) * head_dim ** -0.5
    batch, queries, _, group, _ = grouped.shape
    running = Running(jnp.full((batch, num_kv_heads, group, queries), -jnp.inf, jnp.float32),
                      jnp.zeros((batch, num_kv_heads, group, queries), jnp.float32),
                      jnp.zeros((batch, num_kv_heads, group, queries, head_dim), jnp.float32))
    for segment in segments:
        length = segment.length
        if length <= key_block:
            key, value = segment.read(0, length)
            running = absorb(running, grouped, key, value, segment.allowed(jnp.arange(length)))
            continue

        def block_step(block, running, segment=segment, length=length):  # this segment's, bound
            # The last block's slice is clamped to end at `length`; keys it shares with the previous
            # block are masked so that none is counted twice.
            first = jnp.minimum(block * key_block, length - key_block)
            index = first + jnp.arange(key_block)
            allowed = segment.allowed(index) & (index >= block * key_block)[None, None, :]
            return absorb(running, grouped, *segment.read(first, key_block), allowed)

        live_blocks = jnp.minimum(-(-jnp.asarray(segment.live_below) // key_block), -(-length // key_block))
        running = jax.lax.fori_loop(0, live_blocks, block_step, running)
    out = running.weighted / jnp.where(running.total > 0, running.total, 1.0)[..., None]
    return rearrange(out, "b k g t d -> b t (k g) d").astype(query.dtype)
