"""Attention of a ragged pass over K/V pages, in plain JAX (the XLA form, and the kernels' oracle).

Each of the pass's T rows attends to its own slot's positions `[0, limit)`, read through the
slot's page table (`clover_jax.core.ragged`). The rows are the batch of `online_attention`, one
query each: the pages are read a few at a time with an online softmax, up to the largest limit
of the pass, so memory holds `T x keys per read` scores, never `[T, context]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.nn.online_attention import KeySegment, online_attention

# Keys gathered per row and read (T rows x this many keys x kv heads x head dim at a time).
KEYS_PER_READ = 256


def paged_attention(query: jax.Array, key_pages: jax.Array, value_pages: jax.Array, group, page_table: jax.Array,
                    slot: jax.Array, limit: jax.Array) -> jax.Array:
    """query: [T, heads, head_dim] (rotated, unscaled); key_pages, value_pages: [num_groups,
    num_pages, page_size, kv_heads, head_dim], of which group `group` is read; page_table: int32
    [S, pages_per_slot]; slot, limit: int32 [T] -> [T, heads, head_dim]. Row t attends to
    positions [0, limit[t]) of slot[t]; a row with limit 0 gets zeros."""
    page_size = key_pages.shape[2]
    pages_per_slot = page_table.shape[1]
    per_read = max(1, min(pages_per_slot, KEYS_PER_READ // page_size))
    rows = page_table[slot]                                                   # [T, pages_per_slot]

    def read(first, size):  # `first` is a multiple of the page size (reads are whole pages)
        count = -(-size // page_size)
        pages = jax.lax.dynamic_slice_in_dim(rows, first // page_size, count, axis=1)  # [T, count]
        shape = (query.shape[0], count * page_size) + key_pages.shape[3:]
        return (key_pages[group, pages].reshape(shape)[:, :size], value_pages[group, pages].reshape(shape)[:, :size])

    allowed = lambda index: (index[None, None, :] < limit[:, None, None])
    segment = KeySegment(read, pages_per_slot * page_size, allowed, jnp.max(limit))
    out = online_attention(query[:, None], [segment], key_block=per_read * page_size)
    return out[:, 0]


def write_pages(pages: jax.Array, group, rows: jax.Array, page: jax.Array, row_in_page: jax.Array) -> jax.Array:
    """pages: [num_groups, num_pages, page_size, kv_heads, head_dim] with `rows` ([T, kv_heads,
    head_dim]) written into group `group` at (page, row_in_page) (int32 [T] each)."""
    return pages.at[group, page, row_in_page].set(rows.astype(pages.dtype))
