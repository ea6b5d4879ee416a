"""Attention over K/V pages for the serving engine's ragged pass: Pallas for TPU and GPU.

The pass's rows come in *tiles* of at most `tile_rows` consecutive rows of one slot (a slot's rows
sit next to each other in the pass, so a tile never mixes slots). Every row of a tile attends to
its slot's positions `[0, limit)` — a causal row up to itself, a block row to its block's end —
read through the slot's row of the page table, so the rows of a tile share each page they read:

    out[r] = softmax_j(q[r] · k[j]) v[j],  j < limit[r],  k, v the slot's positions (page by page)

A row whose limit is 0 gets zeros. Per tile and key/value head, the kernel reads the slot's pages
up to the tile's largest limit, a block of `pages_per_block` pages at a time, with an online
softmax in float32 (running max, sum and weighted values); the queries of a head's group are one
matrix ([tile_rows x group, head_dim]), so each page block is one matmul for the whole tile.

Two drivers (`pallas_kernels.platforms`):
* "tpu": grid (tiles, kv heads), the pages copied from HBM by DMA into a double buffer (the next
  block's copy runs while the current one is reduced), the whole page table prefetched into SMEM
  (so at most `TPU_TABLE_ENTRIES` entries, slots x pages per slot: SMEM is about 1 MiB a core);
* "gpu": grid (tiles, kv heads), a loop over the pages inside the kernel, each page loaded from
  global memory where the table points.
Both run in interpret mode on a CPU (the tests). The oracle is `paged_attention_reference`.

Layouts: query [T, heads, head_dim] (scaled by the caller), pages [groups, num_pages, kv_heads,
page_size, head_dim] with `group` choosing the layer's group (the pool of every group of a layer
slot is one array, which a slice would copy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as pltriton

from pallas_kernels.platforms import Variant, per_platform

__all__ = ["TILE_ROWS", "TPU_TABLE_ENTRIES", "paged_attention", "tile_pages"]

# Half of a TPU core's ~1 MiB of SMEM (int32 entries), the rest left to the other scalars and the
# compiler: 16 slots of 131,072 positions in pages of 16 use all of it.
TPU_TABLE_ENTRIES = 131072
TILE_ROWS = 16          # rows of a tile: with Clover's group of 8 query heads a key/value head, 128 query rows
PAGES_PER_BLOCK = 8     # pages reduced per step of the online softmax (TPU: per DMA buffer)


def tile_pages(limit: jax.Array, tile_rows: jax.Array, page_size: int) -> jax.Array:
    """int32 [tiles]: the pages each tile reads, up to its rows' largest limit (tile_rows: the
    tile's row indices into the T rows, T meaning none; limit: int32 [T])."""
    padded = jnp.concatenate([limit, jnp.zeros((1,), limit.dtype)])
    return (jnp.max(padded[tile_rows], axis=1) + page_size - 1) // page_size


def paged_attention(query: jax.Array, key_pages: jax.Array, value_pages: jax.Array, group: jax.Array,
                    page_table: jax.Array, limit: jax.Array, tile_rows: jax.Array, tile_slot: jax.Array, *,
                    pages_per_block: int = PAGES_PER_BLOCK, variant: Variant = "auto",
                    interpret: bool | None = None) -> jax.Array:
    """query: [T, heads, head_dim] (already scaled); key_pages, value_pages: [groups, num_pages,
    kv_heads, page_size, head_dim]; group: int32 []; page_table: int32 [S, pages_per_slot]; limit:
    int32 [T] (0 for padding rows); tile_rows: int32 [tiles, tile_rows] (T: none), each tile's rows
    of one slot; tile_slot: int32 [tiles] -> [T, heads, head_dim] in the query's dtype."""
    num_tokens, heads, head_dim = query.shape
    _, _, kv_heads, page_size, _ = key_pages.shape
    group_size = heads // kv_heads
    tiles, rows_per_tile = tile_rows.shape
    per_block = min(pages_per_block, page_table.shape[1])
    # [tiles, kv_heads, rows x group, head_dim]: a head's group of queries of the tile's rows, row-major
    padded = jnp.concatenate([query, jnp.zeros((1, heads, head_dim), query.dtype)])
    grouped = padded[tile_rows].reshape(tiles, rows_per_tile, kv_heads, group_size, head_dim)
    grouped = grouped.transpose(0, 2, 1, 3, 4).reshape(tiles, kv_heads, rows_per_tile * group_size, head_dim)
    row_limit = jnp.concatenate([limit, jnp.zeros((1,), jnp.int32)])[tile_rows]              # [tiles, rows]
    row_limit = jnp.repeat(row_limit, group_size, axis=1)[..., None].astype(jnp.int32)       # [tiles, rows x g, 1]
    pages = tile_pages(limit, tile_rows, page_size).astype(jnp.int32)
    meta = (jnp.reshape(group, (1,)).astype(jnp.int32), tile_slot.astype(jnp.int32), pages,
            page_table.astype(jnp.int32))

    def build(chosen_variant, chosen_interpret):
        make = _tpu_call if chosen_variant == "tpu" else _gpu_call
        return make(grouped.shape, key_pages.shape, page_table.shape, per_block, query.dtype, chosen_interpret)

    out = per_platform(build, variant, interpret)(*meta, grouped, row_limit, key_pages, value_pages)
    out = out.reshape(tiles, kv_heads, rows_per_tile, group_size, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(tiles * rows_per_tile, heads, head_dim)
    flat_rows = tile_rows.reshape(-1)
    return jnp.zeros((num_tokens, heads, head_dim), query.dtype).at[flat_rows].set(out, mode="drop")


def _online_step(query, key, value, positions, row_limit, carry):
    """Fold one block of keys ([keys, head_dim]) at `positions` ([1, keys]) into the running
    (max, sum, weighted values) of `query` ([rows, head_dim]; rows see positions < row_limit [rows, 1])."""
    peak, total, weighted = carry
    scores = jax.lax.dot_general(query, key, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    allowed = positions < row_limit
    scores = jnp.where(allowed, scores, -jnp.inf)
    new_peak = jnp.maximum(peak, jnp.max(scores, axis=1, keepdims=True))
    safe = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)
    weights = jnp.where(allowed, jnp.exp(scores - safe), 0.0)
    rescale = jnp.exp(jnp.where(peak == -jnp.inf, -jnp.inf, peak - safe))
    total = total * rescale + jnp.sum(weights, axis=1, keepdims=True)
    weighted = weighted * rescale + jnp.dot(weights.astype(value.dtype), value, preferred_element_type=jnp.float32)
    return new_peak, total, weighted


def _finish(total, weighted):
    return jnp.where(total > 0, weighted / jnp.where(total > 0, total, 1.0), 0.0)


# ---------------------------------------------------------------------- TPU
def _tpu_call(grouped_shape, pages_shape, table_shape, per_block, dtype, interpret):
    tiles, kv_heads, rows, head_dim = grouped_shape
    _, _, _, page_size, _ = pages_shape
    pages_per_slot = table_shape[1]
    block_keys = per_block * page_size
    if table_shape[0] * pages_per_slot > TPU_TABLE_ENTRIES:
        raise ValueError(f"the page table ({table_shape[0]} slots x {pages_per_slot} pages) exceeds the "
                         f"{TPU_TABLE_ENTRIES:,} entries the TPU kernel keeps in SMEM; serve fewer slots or a "
                         "shorter context, or use larger pages (the engine's page_size)")

    def kernel(group_ref, slot_ref, pages_ref, table_ref, query_ref, limit_ref, *refs):
        key_hbm, value_hbm, out_ref, key_buffer, value_buffer, copies = refs
        tile, head = pl.program_id(0), pl.program_id(1)
        count, slot, group = pages_ref[tile], slot_ref[tile], group_ref[0]
        blocks = (count + per_block - 1) // per_block

        def transfers(block, buffer):
            for j in range(per_block):
                index = jnp.minimum(block * per_block + j, jnp.maximum(count - 1, 0))
                page = table_ref[slot, index]
                for source, target, which in ((key_hbm, key_buffer, 0), (value_hbm, value_buffer, 1)):
                    yield pltpu.make_async_copy(source.at[group, page, head], target.at[buffer, j],
                                                copies.at[which, buffer])

        def start(block, buffer):
            for copy in transfers(block, buffer):
                copy.start()

        def wait(block, buffer):
            for copy in transfers(block, buffer):
                copy.wait()

        query = query_ref[...]
        row_limit = limit_ref[...]

        @pl.when(blocks > 0)
        def _():
            start(0, 0)

        def body(block, carry):
            buffer = block % 2
            wait(block, buffer)

            @pl.when(block + 1 < blocks)
            def _():
                start(block + 1, 1 - buffer)

            key = key_buffer[buffer].reshape(block_keys, head_dim)
            value = value_buffer[buffer].reshape(block_keys, head_dim)
            positions = block * block_keys + jax.lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
            return _online_step(query, key, value, positions, row_limit, carry)

        initial = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                   jnp.zeros((rows, head_dim), jnp.float32))
        _, total, weighted = jax.lax.fori_loop(0, blocks, body, initial)
        out_ref[...] = _finish(total, weighted).astype(out_ref.dtype)

    block = lambda *shape: pl.BlockSpec((None, None) + shape, lambda t, h, *_: (t, h) + (0,) * len(shape))
    limits = pl.BlockSpec((None, rows, 1), lambda t, h, *_: (t, 0, 0))  # every head's rows see the same limits
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(tiles, kv_heads),
        in_specs=[block(rows, head_dim), limits, pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block(rows, head_dim),
        scratch_shapes=[pltpu.VMEM((2, per_block, page_size, head_dim), dtype),
                        pltpu.VMEM((2, per_block, page_size, head_dim), dtype),
                        pltpu.SemaphoreType.DMA((2, 2))])
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(grouped_shape, dtype),
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret)


# ---------------------------------------------------------------------- GPU
def _gpu_call(grouped_shape, pages_shape, table_shape, per_block, dtype, interpret):
    tiles, kv_heads, rows, head_dim = grouped_shape
    _, _, _, page_size, _ = pages_shape

    def kernel(group_ref, slot_ref, pages_ref, table_ref, query_ref, limit_ref, *refs):
        key_ref, value_ref, out_ref = refs
        tile, head = pl.program_id(0), pl.program_id(1)
        count, slot, group = pages_ref[tile], slot_ref[tile], group_ref[0]
        query = query_ref[...]
        row_limit = limit_ref[...]

        def body(index, carry):
            page = table_ref[slot, index]
            key = key_ref[group, page, head]                        # [page_size, head_dim]
            value = value_ref[group, page, head]
            positions = index * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            return _online_step(query, key, value, positions, row_limit, carry)

        initial = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                   jnp.zeros((rows, head_dim), jnp.float32))
        _, total, weighted = jax.lax.fori_loop(0, count, body, initial)
        out_ref[...] = _finish(total, weighted).astype(out_ref.dtype)

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    block = lambda *shape: pl.BlockSpec((None, None) + shape, lambda t, h: (t, h) + (0,) * len(shape))
    limits = pl.BlockSpec((None, rows, 1), lambda t, h: (t, 0, 0))
    del per_block  # the GPU driver reads a page per step: its dots are [rows, page_size]
    return functools.partial(pl.pallas_call(
        kernel, grid=(tiles, kv_heads),
        in_specs=[whole((1,)), whole((tiles,)), whole((tiles,)), whole(table_shape), block(rows, head_dim),
                  limits, whole(pages_shape), whole(pages_shape)],
        out_specs=block(rows, head_dim),
        out_shape=jax.ShapeDtypeStruct(grouped_shape, dtype),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret))
