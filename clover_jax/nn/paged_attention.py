"""Attention of a ragged pass over K/V pages, in plain JAX (the XLA form; the Pallas kernel's rule).

Each of the pass's T rows attends to its own slot's positions `[0, limit)`, read through the
slot's page table (`clover_jax.core.ragged`). The rows come in the pass's attention tiles (up to
16 consecutive rows of one slot), which are the batch of `online_attention`: a tile's rows share
the pages they read, read a few at a time with an online softmax up to the largest limit of the
pass, so memory holds `tiles x rows x keys per read` scores, never `[T, context]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from clover_jax.core.ragged import gather_rows, on_live, scatter_rows
from clover_jax.nn.online_attention import KeySegment, online_attention

# Keys a tile gathers per read (tiles x this many keys x kv heads x head dim at a time).
KEYS_PER_READ = 256


def paged_attention(query: jax.Array, key_pages: jax.Array, value_pages: jax.Array, group, page_table: jax.Array,
                    tile_rows: jax.Array, tile_slot: jax.Array, limit: jax.Array, *,
                    compact: bool = False) -> jax.Array:
    """query: [T, heads, head_dim] (rotated, unscaled); key_pages, value_pages: [num_groups,
    num_pages, kv_heads, page_size, head_dim], of which group `group` is read; page_table: int32
    [S, pages_per_slot]; tile_rows: int32 [tiles, R] (T: none), each tile's rows of one slot, the
    tiles holding rows first (`layout`'s); tile_slot: int32 [tiles]; limit: int32 [T] ->
    [T, heads, head_dim]. Row t attends to positions [0, limit[t]) of its slot; a row with limit 0
    gets zeros. compact: only the tiles holding rows are computed, at a width of `on_live`'s (a
    pass of one request's rows runs its few tiles, not the `S` more its shape has room for)."""
    page_size = key_pages.shape[3]
    pages_per_slot = page_table.shape[1]
    per_read = max(1, min(pages_per_slot, KEYS_PER_READ // page_size))
    num_tokens = query.shape[0]

    def attend(width: int) -> jax.Array:
        rows = tile_rows[:width]
        tables = page_table[tile_slot[:width]]                                # [tiles, pages_per_slot]
        tile_limit = gather_rows(limit, rows)                                 # [tiles, R]

        def read(first, size):  # `first` is a multiple of the page size (reads are whole pages)
            count = -(-size // page_size)
            pages = jax.lax.dynamic_slice_in_dim(tables, first // page_size, count, axis=1)  # [tiles, count]
            shape = (tables.shape[0], count * page_size, key_pages.shape[2], key_pages.shape[4])
            positions = lambda stack: stack[group, pages].transpose(0, 1, 3, 2, 4).reshape(shape)[:, :size]
            return positions(key_pages), positions(value_pages)

        allowed = lambda index: index[None, None, :] < tile_limit[:, :, None]
        segment = KeySegment(read, pages_per_slot * page_size, allowed, jnp.max(tile_limit))
        out = online_attention(gather_rows(query, rows), [segment], key_block=per_read * page_size)
        return scatter_rows(jnp.zeros_like(query), rows, out)

    count = jnp.sum(tile_rows[:, 0] < num_tokens)
    return on_live(count, tile_rows.shape[0], attend, compact=compact)


def write_pages(pages: jax.Array, group, rows: jax.Array, page: jax.Array, row_in_page: jax.Array) -> jax.Array:
    """pages: [num_groups, num_pages, kv_heads, page_size, head_dim] with `rows` ([T, kv_heads,
    head_dim]) written into group `group` at (page, row_in_page) (int32 [T] each)."""
    # one head's row at a time (index [T, kv_heads], window [head_dim]): each write is contiguous in the
    # pool's own layout, which a [kv_heads, head_dim] window is not (TPU: the pool was copied to another
    # layout and back, two pool-sized temporaries)
    heads = jnp.arange(pages.shape[2])[None, :]
    return pages.at[group, page[:, None], heads, row_in_page[:, None]].set(rows.astype(pages.dtype))


def paged_kernel(query: jax.Array, pages, group, batch, limit: jax.Array, kernels, mesh_sharding) -> jax.Array:
    """The same attention by the Pallas kernel (`pallas_kernels.paged_attention`, over the pass's
    attention tiles), query already scaled. On a mesh the kernel runs per device inside `shard_map`
    (XLA cannot partition a Pallas custom call), each device on its key/value heads when they divide
    the heads' axis."""
    from pallas_kernels.paged_attention import paged_attention as kernel  # Pallas costs startup time on CPU

    run = lambda query, key, value, group, table, limit, rows, slot: kernel(
        query, key, value, group, table, limit, rows, slot, interpret=kernels.interpret)
    if mesh_sharding is not None:
        axis = mesh_sharding.rules.kv_heads
        size = mesh_sharding.axis_size(axis)
        heads_axis = axis if size > 1 and pages.key.shape[2] % size == 0 else None
        whole = PartitionSpec()
        in_specs = (PartitionSpec(None, heads_axis, None), PartitionSpec(None, None, heads_axis, None, None),
                    PartitionSpec(None, None, heads_axis, None, None), whole, whole, whole, whole, whole)
        run = jax.shard_map(run, mesh=mesh_sharding.mesh, in_specs=in_specs,
                            out_specs=PartitionSpec(None, heads_axis, None), check_vma=False)
    return run(query, pages.key, pages.value, jnp.asarray(group, jnp.int32), batch.page_table, limit, batch.tile_rows,
               batch.tile_slot)
