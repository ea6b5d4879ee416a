"""The serving engine's pass: one ragged step over every slot's work, K/V in pages, GDN states in slots.

A ragged pass runs one flat row of `T` tokens that concatenates *segments* of the engine's slots
(docs/serving.md, "The engine's shapes"). Each slot contributes, in this order and next to each
other, at most:

* a **causal segment**: rows that append to the slot's prefix — a prefill chunk, a block commit,
  an autoregressive step's token, self-speculative verification rows (which leave the slot's GDN
  state as it was: `PagedBatch.writes` False) or a draft's pending tokens;
* a **block segment**: B rows of a block in block mode (docs/design.md §3), bidirectional inside
  the block and causal to the slot's prefix as the causal segment before it leaves it, routed
  within the block's own coreset.

The state has a fixed shape, whatever the mix of modes and context lengths:

* `KVPages` per attention layer: one pool of `num_pages` pages of `page_size` positions, each
  page a [kv_heads, page_size, head_dim] slab (a head's page is contiguous: what a kernel copies);
  a slot reads and writes its positions through its row of the page table (position p lives at
  row `p % page_size` of page `page_table[slot, p // page_size]`). Every row of a pass writes its K/V
  there (block rows too: past the slot's committed length, where the next write overwrites them
  and no causal read reaches), so attention is one rule: a row attends to its slot's positions
  `[0, limit)`. Page 0 is never handed to a slot: padding rows write there.
* `GDNState` per GDN layer with `[groups, slots, ...]` leaves: a slot's conv window and
  recurrent state, read at the slot's index.

Nothing of the layout is static but the shapes: tokens `T`, slots `S`, pages per slot, the
widest block `Bmax`, the GDN chunks (`NC` of `C` rows) and the logit window `W`. A program of
the engine depends on those alone: one per padded token count.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.config import CloverConfig
from clover_jax.core.state import GDNState, slot_name

TRASH_PAGE = 0  # the page padding rows write to; never part of a slot's page table


class RaggedMode(NamedTuple):
    """What the layers run in a ragged pass (static): whether block rows route within their
    block's coreset (docs/design.md §5)."""

    coreset: bool = False


class KVPages(NamedTuple):
    """key, value: [num_groups, num_pages, kv_heads, page_size, head_dim]; keys stored rotated."""

    key: jax.Array
    value: jax.Array


class PagedState(NamedTuple):
    """layers: {slot name: `GDNState` ([num_groups, slots, ...] leaves) | `KVPages`}."""

    layers: dict

    @property
    def page_size(self) -> int:
        for layer in self.layers.values():
            if isinstance(layer, KVPages):
                return layer.key.shape[3]
        return 1

    @property
    def num_pages(self) -> int:
        for layer in self.layers.values():
            if isinstance(layer, KVPages):
                return layer.key.shape[1]
        return 0


class PagedBatch(NamedTuple):
    """One ragged pass's layout (every field traced). T = tokens, S = slots, Bmax = the widest
    block, NC x C = the GDN chunk layout, W = logit rows per slot; a "row index" is an index into
    the T tokens, and T itself marks "none".

    Per token [T]:
      slot: int32, the slot it belongs to (padding rows: 0); position: int32, its position in its
      sequence (RoPE and page position); valid: bool, a real row; causal: bool, a causal row (else a
      block row); limit: int32, the slot positions it attends to are [0, limit) (a causal row:
      its position + 1; a block row: its block's end); offset: int32, its index inside its segment.
    Per slot [S]:
      page_table: int32 [S, pages_per_slot]; writes: bool, the slot's causal segment advances its
      GDN state (False: verification rows, computed and discarded); causal_start, causal_length:
      int32, its causal segment's first row and length (0: none this pass); block_rows: int32
      [S, Bmax], its block segment's rows (T past its length or where it has none); block_length:
      int32, its block size (0: none); logit_rows: int32 [S, W], the rows whose logits the pass
      returns for the slot.
    Per GDN chunk [NC]:
      chunk_rows: int32 [NC, C], each chunk's rows (T: padding), a causal segment split into
      whole chunks from its first row; chunk_slot: int32, the chunk's slot; chunk_first: bool,
      the chunk starts its segment (the recurrence restarts from the slot's state).
    Per attention tile [NA] (what the paged attention kernel runs, `pallas_kernels.paged_attention`):
      tile_rows: int32 [NA, R], up to R consecutive rows of one slot (T: padding); tile_slot: int32.
    """

    slot: jax.Array
    position: jax.Array
    valid: jax.Array
    causal: jax.Array
    limit: jax.Array
    offset: jax.Array
    page_table: jax.Array
    writes: jax.Array
    causal_start: jax.Array
    causal_length: jax.Array
    block_rows: jax.Array
    block_length: jax.Array
    logit_rows: jax.Array
    chunk_rows: jax.Array
    chunk_slot: jax.Array
    chunk_first: jax.Array
    tile_rows: jax.Array
    tile_slot: jax.Array

    @property
    def num_tokens(self) -> int:
        return self.slot.shape[0]

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    def page_address(self, page_size: int) -> tuple[jax.Array, jax.Array]:
        """(page, row in the page) that each token writes its K/V to: int32 [T] each; padding rows
        write to `TRASH_PAGE`."""
        pages_per_slot = self.page_table.shape[1]
        index = jnp.clip(self.position // page_size, 0, pages_per_slot - 1)
        page = self.page_table[self.slot, index]
        return jnp.where(self.valid, page, TRASH_PAGE), jnp.where(self.valid, self.position % page_size, 0)


def gather_rows(values: jax.Array, rows: jax.Array) -> jax.Array:
    """values [T, ...] at `rows` (int, any shape, T = none -> zeros): [*rows.shape, ...]."""
    padded = jnp.concatenate([values, jnp.zeros((1,) + values.shape[1:], values.dtype)], axis=0)
    return padded[rows]


def scatter_rows(base: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """`base` [T, ...] with `values` [*rows.shape, ...] written at `rows` (T = none: dropped)."""
    flat_rows = rows.reshape(-1)
    return base.at[flat_rows].set(values.reshape((flat_rows.shape[0],) + base.shape[1:]).astype(base.dtype),
                                  mode="drop")


# Where a pass's per-slot and per-tile work runs at a width bounded by data (`on_live`): a CPU. An XLA
# conditional costs a GPU a host round trip per layer; there the Pallas paged kernel skips padding
# tiles itself and the slots' block work is small beside reading the weights.
COMPACT_PLATFORMS = ("cpu",)


def live_widths(size: int) -> tuple[int, ...]:
    """The widths `on_live` runs `size` entries at: 0, 1 and `size` (each width is a branch compiled
    into every forward: more of them would cost more compiling than they save)."""
    return (0, 1, size) if size > 1 else (0, size)


def on_live(count: jax.Array, size: int, run: Callable[[int], object], *, compact: bool, empty=None):
    """`run(width)` for the smallest width of `live_widths(size)` that holds `count` (int32 []: the
    entries that hold work, first of the `size`), chosen at run time by `jax.lax.switch`: one program
    whatever the count, and the entries past the chosen width (padding: no work) cost nothing. `run`
    must give the same result at any width >= count. empty: the result when `count` is 0 (None: run
    at the next width). Not `compact`: `run(size)` alone."""
    widths = live_widths(size) if compact else (size,)
    if empty is None or not compact:
        widths = tuple(width for width in widths if width > 0)
    if len(widths) == 1:
        return run(widths[0])
    index = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < count)
    branches = [(lambda empty=empty: empty) if width == 0 else functools.partial(run, width) for width in widths]
    return jax.lax.switch(index, branches)


def slots_first(has_work: jax.Array) -> jax.Array:
    """int32 [S]: the slots with work (`has_work` bool [S]) first, in order, then the others."""
    return jnp.argsort(~has_work, stable=True).astype(jnp.int32)


def empty_paged_state(config: CloverConfig, slots: int, num_pages: int, page_size: int, dtype) -> PagedState:
    """A paged state with nothing in it: `slots` GDN slots, `num_pages` pages of `page_size`."""
    groups = config.num_groups
    layers = {}
    for index, layer_type in enumerate(config.group_pattern):
        if layer_type == "linear_attention":
            layers[slot_name(index)] = GDNState(
                conv=jnp.zeros((groups, slots, config.linear_conv_kernel_dim - 1, config.conv_dim), dtype),
                recurrent=jnp.zeros((groups, slots, config.linear_num_value_heads, config.linear_key_head_dim,
                                     config.linear_value_head_dim), jnp.float32))
        else:
            shape = (groups, num_pages, config.num_key_value_heads, page_size, config.head_dim)
            layers[slot_name(index)] = KVPages(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype))
    return PagedState(layers)


def page_bytes(config: CloverConfig, page_size: int, dtype) -> int:
    """Bytes one page holds over every attention layer (keys and values)."""
    attention_layers = sum(kind != "linear_attention" for kind in config.layer_types)
    return 2 * attention_layers * page_size * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize


def slot_state_bytes(config: CloverConfig, dtype) -> int:
    """Bytes of one slot's GDN states over every GDN layer (conv windows and recurrent states)."""
    gdn_layers = sum(kind == "linear_attention" for kind in config.layer_types)
    conv = (config.linear_conv_kernel_dim - 1) * config.conv_dim * jnp.dtype(dtype).itemsize
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    return gdn_layers * (conv + recurrent)


class SlotWork(NamedTuple):
    """One slot's part of a ragged pass, on the host: a causal segment of `causal` tokens at
    positions `start, start + 1, ...` (empty: none), then a block of `block` tokens right after it
    (empty: none). writes: the causal segment advances the slot's GDN state (False: verification
    rows). logit_rows: indices into causal + block (in that order) whose logits the pass returns,
    in the order of the slot's logit window."""

    slot: int
    start: int
    causal: tuple = ()
    block: tuple = ()
    writes: bool = True
    logit_rows: tuple = ()


def chunk_shape(num_tokens: int, num_slots: int, chunk: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of a pass of `num_tokens` padded tokens: segments start whole
    chunks, so at most one partial chunk per slot beside the full ones. A chunk holds about a slot's
    share of the pass (a power of two from 16 up to `chunk`): a pass of many short segments (commits,
    tokens) pays for short chunks, a long prefill's pass for long ones."""
    share = max(1, num_tokens // max(num_slots, 1))
    rows = min(chunk, num_tokens, max(16, 1 << (share.bit_length() - 1)))
    return -(-num_tokens // rows) + num_slots, rows


ATTENTION_TILE = 16  # rows per attention tile (`pallas_kernels.paged_attention.TILE_ROWS`)


def layout(works: list[SlotWork], *, num_tokens: int, page_table, max_block: int, logit_width: int,
           chunk: int, tile: int = ATTENTION_TILE) -> tuple:
    """(token ids int32 [T], `PagedBatch` of NumPy arrays) for `works` (at most one per slot, each
    slot's rows next to each other) padded to `num_tokens` rows. page_table: int32 [S,
    pages_per_slot]. ValueError when the works do not fit the shapes."""
    import numpy as np

    page_table = np.asarray(page_table, np.int32)
    num_slots = page_table.shape[0]
    num_chunks, chunk_rows_each = chunk_shape(num_tokens, num_slots, chunk)
    ids = np.zeros(num_tokens, np.int32)
    slot = np.zeros(num_tokens, np.int32)
    position = np.zeros(num_tokens, np.int32)
    valid = np.zeros(num_tokens, bool)
    causal = np.zeros(num_tokens, bool)
    limit = np.zeros(num_tokens, np.int32)
    offset = np.zeros(num_tokens, np.int32)
    writes = np.zeros(num_slots, bool)
    causal_start = np.zeros(num_slots, np.int32)
    causal_length = np.zeros(num_slots, np.int32)
    block_rows = np.full((num_slots, max_block), num_tokens, np.int32)
    block_length = np.zeros(num_slots, np.int32)
    logit_rows = np.full((num_slots, logit_width), num_tokens, np.int32)
    chunk_rows = np.full((num_chunks, chunk_rows_each), num_tokens, np.int32)
    chunk_slot = np.zeros(num_chunks, np.int32)
    chunk_first = np.ones(num_chunks, bool)  # padding chunks restart (from slot 0's state) and change nothing
    num_tiles, _ = chunk_shape(num_tokens, num_slots, tile)
    tile_rows = np.full((num_tiles, min(tile, num_tokens)), num_tokens, np.int32)
    tile_slot = np.zeros(num_tiles, np.int32)
    row, next_chunk, next_tile, seen = 0, 0, 0, set()
    for work in works:
        if work.slot in seen or not 0 <= work.slot < num_slots:
            raise ValueError(f"slot {work.slot} appears twice or is not one of the {num_slots} slots")
        seen.add(work.slot)
        count = len(work.causal) + len(work.block)
        if any(not 0 <= index < count for index in work.logit_rows):
            raise ValueError(f"slot {work.slot}'s logit rows {list(work.logit_rows)} are not among its {count} rows")
        if len(work.block) > max_block or len(work.logit_rows) > logit_width or row + count > num_tokens:
            raise ValueError(f"slot {work.slot}'s work ({len(work.causal)} causal rows, a block of {len(work.block)}, "
                             f"{len(work.logit_rows)} logit rows) does not fit a pass of {num_tokens} tokens "
                             f"(blocks up to {max_block}, {logit_width} logit rows)")
        rows = slice(row, row + count)
        ids[rows] = list(work.causal) + list(work.block)
        slot[rows], valid[rows] = work.slot, True
        position[rows] = work.start + np.arange(count)
        causal[row:row + len(work.causal)] = True
        limit[rows] = np.where(np.arange(count) < len(work.causal), position[rows] + 1, work.start + count)
        offset[rows] = np.where(np.arange(count) < len(work.causal), np.arange(count),
                                np.arange(count) - len(work.causal))
        if work.causal:
            writes[work.slot] = work.writes
            causal_start[work.slot], causal_length[work.slot] = row, len(work.causal)
            for first in range(0, len(work.causal), chunk_rows_each):
                if next_chunk == num_chunks:
                    raise ValueError(f"the causal segments need more than {num_chunks} chunks")
                size = min(chunk_rows_each, len(work.causal) - first)
                chunk_rows[next_chunk, :size] = row + first + np.arange(size)
                chunk_slot[next_chunk], chunk_first[next_chunk] = work.slot, first == 0
                next_chunk += 1
        if work.block:
            block_rows[work.slot, :len(work.block)] = row + len(work.causal) + np.arange(len(work.block))
            block_length[work.slot] = len(work.block)
        logit_rows[work.slot, :len(work.logit_rows)] = row + np.asarray(work.logit_rows, np.int32)
        for first in range(0, count, tile_rows.shape[1]):
            size = min(tile_rows.shape[1], count - first)
            tile_rows[next_tile, :size] = row + first + np.arange(size)
            tile_slot[next_tile] = work.slot
            next_tile += 1
        row += count
    batch = PagedBatch(slot=slot, position=position, valid=valid, causal=causal, limit=limit, offset=offset,
                       page_table=page_table, writes=writes, causal_start=causal_start, causal_length=causal_length,
                       block_rows=block_rows, block_length=block_length, logit_rows=logit_rows,
                       chunk_rows=chunk_rows, chunk_slot=chunk_slot, chunk_first=chunk_first, tile_rows=tile_rows,
                       tile_slot=tile_slot)
    return ids, batch
