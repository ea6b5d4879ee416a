"""Gated grouped-query attention of the full-attention layers (transformers' `Qwen3_5MoeAttention`).

`q_proj` yields `2 * heads * head_dim` features: per head the first `head_dim` are the query,
the next `head_dim` the output gate. q and k pass a zero-centred RMSNorm over `head_dim`, then
partial RoPE; the attention output is multiplied by `sigmoid(gate)` before `o_proj`.

One pass handles `num_causal` causal rows followed by an optional block (docs/design.md §3):
  * causal rows append their K/V to the cache and attend causally to it (at the batch's fill, or
    at each sequence's own when `length` is per sequence: rolling back is setting it, since rows
    past a sequence's fill are masked and the next pass overwrites them; a sequence that skips the
    commit of a pass, `Rows.committed`, is left with its fill, so its rows are discarded the same way);
  * block rows attend to the whole prefix in the cache (after the causal rows) and
    bidirectionally to each other; their K/V are not written.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import linen as nn

from clover_jax.core.config import CloverConfig
from clover_jax.core.kernels import KernelChoice
from clover_jax.core.passes import PassMode
from clover_jax.core.ragged import COMPACT_PLATFORMS, KVPages, PagedBatch, RaggedMode
from clover_jax.core.state import KVCache, Rows
from clover_jax.core.streams import StreamMode
from clover_jax.nn.fused_attention import fused_attention
from clover_jax.nn.layers import Linear, RMSNorm
from clover_jax.nn.online_attention import KEY_BLOCK, KeySegment, array_segment, online_attention
from clover_jax.nn.paged_attention import paged_attention, paged_kernel, write_pages
from clover_jax.nn.rope import apply_partial_rope, rope_angles
from clover_jax.nn.stream_attention import two_stream_attention
from clover_jax.parallel.sharding import MeshSharding


class GatedAttention(nn.Module):
    TABLE_SCOPE: ClassVar = (True, ("self_attn",))  # its rows in the parameter table

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32
    key_block: int = KEY_BLOCK  # keys reduced at a time by the online softmax
    kernels: KernelChoice = KernelChoice()
    mesh_sharding: MeshSharding | None = None  # unused: attention runs through XLA's partitioner on a mesh

    @nn.compact
    def __call__(self, x: jax.Array, cache: KVCache, group, rows: Rows, mode: PassMode) -> tuple[jax.Array, KVCache]:
        """x: [batch, tokens, hidden] -> ([batch, tokens, hidden], cache with the causal rows appended);
        mode: which leading rows are causal (appended), the rest a block.

        cache: this slot's K/V cache for every group, [num_groups, batch, capacity, kv_heads, head_dim];
        group: ours. The cache is written and read in place, block by block.
        """
        config = self.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        split_heads = lambda y, h: rearrange(y, "b t (h d) -> b t h d", h=h)
        query, gate = jnp.split(split_heads(Linear(config, self.dtype, name="q_proj")(x), heads), 2, -1)
        key = split_heads(Linear(config, self.dtype, name="k_proj")(x), kv_heads)
        value = split_heads(Linear(config, self.dtype, name="v_proj")(x), kv_heads)
        query = RMSNorm(config, self.dtype, name="q_norm")(query)
        key = RMSNorm(config, self.dtype, name="k_norm")(key)
        streams = isinstance(mode, StreamMode)  # a training pass (clover_jax.core.streams): no cache
        if isinstance(mode, RaggedMode):  # the serving engine's pass (clover_jax.core.ragged): K/V in pages
            return self._paged(query, key, value, gate, cache, group, rows)
        positions = (jnp.concatenate([rows.positions, rows.noisy_positions(mode.block_size)], axis=1) if streams
                     else rows.positions)
        cos, sin = rope_angles(positions, config.rotary_dim, config.rope_theta)
        query, key = apply_partial_rope(query, cos, sin), apply_partial_rope(key, cos, sin)
        if streams:
            query_segment, query_limit = rows.clean_attention_rule(mode.block_size)
            out = two_stream_attention(query, key, value, query_segment=query_segment, query_limit=query_limit,
                                       key_segment=rows.segment, block_size=mode.block_size,
                                       key_block=self.key_block)
            return self._output(out, gate), None

        causal = mode.num_causal
        if causal:
            if rows.length.ndim:  # each sequence appends at its own fill (after a rollback)
                at = (group, jnp.arange(x.shape[0])[:, None], rows.length[:, None] + jnp.arange(causal))
                write = lambda buffer, new: buffer.at[at].set(new.astype(buffer.dtype))
            else:
                write = lambda buffer, new: jax.lax.dynamic_update_slice(
                    buffer, new[None].astype(buffer.dtype), (group, 0, rows.length, 0, 0))
            cache = KVCache(write(cache.key, key[:, :causal]), write(cache.value, value[:, :causal]))
        # A sequence that skips the commit (`rows.committed`) wrote its causal rows past its fill: unseen.
        appended = causal if rows.committed is None else rows.committed
        filled = jnp.reshape(rows.length + appended, (-1, 1, 1))                   # [1 or b, 1, 1]
        row_index = jnp.reshape(rows.length, (-1, 1)) + jnp.arange(x.shape[1])  # [1 or b, tokens]
        is_causal_row = (jnp.arange(x.shape[1]) < causal)[None, :, None]

        def cache_allowed(index):
            # causal row i sees cache rows start..length+i; block rows see the whole filled prefix.
            upto = jnp.where(is_causal_row, index[None, None, :] <= row_index[:, :, None],
                             index[None, None, :] < filled)
            return (index[None, None, :] >= rows.start[:, None, None]) & upto

        def read_cache(first, size):
            shape = (1,) + cache.key.shape[1:2] + (size,) + cache.key.shape[3:]
            start = (group, 0, first, 0, 0)
            return (jax.lax.dynamic_slice(cache.key, start, shape)[0],
                    jax.lax.dynamic_slice(cache.value, start, shape)[0])

        segments = [KeySegment(read_cache, cache.key.shape[2], cache_allowed, jnp.max(filled))]
        if x.shape[1] > causal:
            block_allowed = lambda index: jnp.broadcast_to(~is_causal_row, (x.shape[0], x.shape[1], index.shape[0]))
            segments.append(array_segment(key[:, causal:], value[:, causal:], block_allowed))
        if self.kernels.attention == "dot_product_attention":
            out = fused_attention(query, segments, self.kernels.platform)
        else:
            out = online_attention(query, segments, self.key_block)
        return self._output(out, gate), cache

    def _paged(self, query: jax.Array, key: jax.Array, value: jax.Array, gate: jax.Array, pages: KVPages, group,
               batch: PagedBatch) -> tuple[jax.Array, KVPages]:
        """A ragged pass: every row writes its K/V at its slot's position, then attends to its
        slot's positions [0, limit) (a causal row up to itself, a block row to its block's end).
        query, gate: [1, T, heads, head_dim]; key, value: [1, T, kv_heads, head_dim];
        pages: [num_groups, num_pages, kv_heads, page_size, head_dim] each (head-major, so a
        page's rows for one head are contiguous)."""
        config = self.config
        cos, sin = rope_angles(batch.position[None], config.rotary_dim, config.rope_theta)
        query, key = apply_partial_rope(query, cos, sin)[0], apply_partial_rope(key, cos, sin)[0]
        page, row_in_page = batch.page_address(pages.key.shape[3])
        # written into the stacked pool in place (a slice of our group would be copied out and back)
        pages = KVPages(write_pages(pages.key, group, key, page, row_in_page),
                        write_pages(pages.value, group, value[0], page, row_in_page))
        limit = jnp.where(batch.valid, batch.limit, 0)
        if self.kernels.pages == "pallas":
            out = paged_kernel(query * config.head_dim ** -0.5, pages, group, batch, limit, self.kernels,
                               self.mesh_sharding)
        else:
            out = paged_attention(query, pages.key, pages.value, group, batch.page_table, batch.tile_rows,
                                  batch.tile_slot, limit, compact=self.kernels.platform in COMPACT_PLATFORMS)
        return self._output(out[None], gate), pages

    def _output(self, out: jax.Array, gate: jax.Array) -> jax.Array:
        """`o_proj(o * sigmoid(gate))`. out, gate: [b, t, heads, head_dim] -> [b, t, hidden]."""
        out = rearrange(out, "b t h d -> b t (h d)") * jax.nn.sigmoid(rearrange(gate, "b t h d -> b t (h d)"))
        return Linear(self.config, self.dtype, name="o_proj")(out)
