"""The oracle of `pallas_kernels.paged_attention`: every row against every position of its slot, in
plain JAX and float32 (a [T, positions] score matrix per head: for tests, not for long contexts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention_reference(query: jax.Array, key_pages: jax.Array, value_pages: jax.Array, group,
                              page_table: jax.Array, slot: jax.Array, limit: jax.Array) -> jax.Array:
    """query: [T, heads, head_dim] (already scaled); key_pages, value_pages: [groups, num_pages,
    kv_heads, page_size, head_dim]; page_table: int32 [S, pages_per_slot]; slot, limit: int32 [T]
    -> [T, heads, head_dim]: row t attends to positions [0, limit[t]) of slot[t] (zeros when none)."""
    _, _, kv_heads, page_size, head_dim = key_pages.shape
    heads = query.shape[1]
    pages = page_table[slot]                                                    # [T, pages_per_slot]

    def positions(stack):  # [T, kv_heads, pages_per_slot * page_size, head_dim]
        rows = stack[group][pages]                                              # [T, pps, kv, page, d]
        return rows.transpose(0, 2, 1, 3, 4).reshape(rows.shape[0], kv_heads, -1, head_dim).astype(jnp.float32)

    keys, values = positions(key_pages), positions(value_pages)
    grouped = query.astype(jnp.float32).reshape(query.shape[0], kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("tkgd,tkpd->tkgp", grouped, keys, precision=jax.lax.Precision.HIGHEST)
    allowed = (jnp.arange(keys.shape[2])[None, :] < limit[:, None])[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(allowed, jnp.exp(scores - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("tkgp,tkpd->tkgd", weights / jnp.where(total > 0, total, 1.0), values,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(query.shape).astype(query.dtype)
