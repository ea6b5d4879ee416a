"""The training pass's layout: a clean stream and a noisy stream that advance together.

One training forward (docs/training.md) holds, per row of a batch:

* the *clean stream*: `L` tokens, one or more examples packed one after another, each starting at
  a block boundary of the row. It runs causally (docs/design.md §1), resetting at every example
  start: attention does not cross examples, the GDN conv window and recurrent state restart from
  zeros, RoPE positions restart at 0.
* the *noisy stream*: `N` blocks of `B` tokens, block `n` a noisy copy of the clean stream's block
  `block_index[n]`. Each runs in block mode (docs/design.md §3) against the clean prefix of its own
  example before it, exactly as `denoise_logits` runs that block after that prefix.

`Streams` holds what the layers need to lay both out, derived once on the host side of the trace
from the segment ids and the block indices. Row `p`'s example is `segment[p]` (0: padding, which
no example sees); blocks are aligned to the row, so an example must start at a multiple of `B`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class StreamMode(NamedTuple):
    """What the layers run in a training pass (static: each layout compiles once): `block_size`
    tokens per block, and whether noisy blocks route within their coreset (docs/design.md §5)."""

    block_size: int
    coreset: bool = False


class Streams(NamedTuple):
    """The traced layout of one training pass. b = batch, L = clean tokens, N = noisy blocks.

    segment: int32 [b, L], the example each clean row belongs to (0: padding);
    positions: int32 [b, L], each clean row's position within its example (RoPE);
    block_index: int32 [b, N], the clean block each noisy block denoises;
    block_segment: int32 [b, N], that block's example (0: a padding block, trained on nothing).
    """

    segment: jax.Array
    positions: jax.Array
    block_index: jax.Array
    block_segment: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.block_index.shape[1]

    def noisy_positions(self, block_size: int) -> jax.Array:
        """int32 [b, N * B]: the RoPE position of every noisy row (its clean row's)."""
        rows = self.block_index[:, :, None] * block_size + jnp.arange(block_size)
        return jnp.take_along_axis(self.positions, rows.reshape(rows.shape[0], -1), axis=1)

    def clean_attention_rule(self, block_size: int) -> tuple[jax.Array, jax.Array]:
        """Which clean keys each row of both streams attends to, as two int32 [b, L + N * B]:
        (segment, limit) — row q sees clean key j when `segment[q] == self.segment[j]` and
        `j < limit[q]`. A clean row p sees the rows of its example up to itself (limit p + 1); a
        noisy row of block k sees the rows of its example before k's first row (limit kB: the
        clean prefix `denoise_logits` holds). Linear in the length, unlike the mask it describes."""
        batch, length = self.segment.shape
        clean_limit = jnp.broadcast_to(jnp.arange(1, length + 1, dtype=jnp.int32), (batch, length))
        segment = jnp.concatenate([self.segment, jnp.repeat(self.block_segment, block_size, axis=1)], axis=1)
        limit = jnp.concatenate([clean_limit, jnp.repeat(self.block_index * block_size, block_size, axis=1)], axis=1)
        return segment, limit

    def clean_attention_mask(self, block_size: int) -> jax.Array:
        """bool [b, L + N * B, L]: `clean_attention_rule` written out as a mask (for inspection and
        tests: it is quadratic in the length)."""
        segment, limit = self.clean_attention_rule(block_size)
        index = jnp.arange(self.segment.shape[1])
        return (segment[:, :, None] == self.segment[:, None, :]) & (index[None, None, :] < limit[:, :, None])

    def example_starts(self) -> jax.Array:
        """bool [b, L]: rows where an example (or a padding run) begins."""
        previous = jnp.pad(self.segment[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        return self.segment != previous


def make_streams(segment: jax.Array, block_index: jax.Array, block_size: int) -> Streams:
    """`Streams` from the clean rows' segment ids (int [b, L], 0 = padding) and the noisy blocks'
    clean block indices (int [b, N]; an index past the row's blocks marks an unused block)."""
    segment = jnp.asarray(segment, jnp.int32)
    block_index = jnp.asarray(block_index, jnp.int32)
    batch, length = segment.shape
    starts = segment != jnp.pad(segment[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    first_row = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    positions = index - first_row
    num_blocks = length // block_size
    in_row = (block_index >= 0) & (block_index < num_blocks)
    safe_index = jnp.where(in_row, block_index, 0)
    block_segment = jnp.where(in_row, jnp.take_along_axis(segment, safe_index * block_size, axis=1), 0)
    return Streams(segment, positions, safe_index, block_segment)
