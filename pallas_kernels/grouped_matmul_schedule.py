"""The work list of a grouped matmul: which (group, row tile) pairs hold rows to compute.

Rows of `lhs` are sorted by group, so group g owns rows [start_g, end_g). A work tile is one
row tile of `tile_rows` rows intersected with one group; a tile on a group boundary appears
once per group it touches. Only listed groups get work tiles, so the weights of the others are
never read, and their rows (like rows past Σ group_sizes) keep the zeros the output starts from.

The number of work tiles depends on the data, the grid cannot: the list has a static length
`row_tiles + listed_groups − 1` (each listed group adds at most one shared boundary tile), and
the tiles past `num_tiles` repeat the last tile in use with an empty row range, so a driver can
skip them without new memory traffic.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class WorkTiles(NamedTuple):
    """int32 [max_tiles] each, plus the count in use (int32 [1])."""

    groups: jax.Array      # the group whose weights the tile multiplies by
    row_tiles: jax.Array   # the row tile of lhs/out it covers (non-decreasing)
    row_starts: jax.Array  # rows [row_start, row_end) of that group inside the tile
    row_ends: jax.Array
    num_tiles: jax.Array   # [1]: tiles in use; the rest do nothing


def max_work_tiles(rows: int, tile_rows: int, listed_groups: int) -> int:
    return max(1, -(-rows // tile_rows) + min(listed_groups, rows) - 1)


def work_tiles(group_sizes: jax.Array, rows: int, tile_rows: int, active_groups: jax.Array | None = None) -> WorkTiles:
    """The work list for `rows` lhs rows split into tiles of `tile_rows`.

    group_sizes: int [groups]; active_groups: int [listed] (any order; repeats and ids outside
    [0, groups) are ignored) or None for every group.
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)          # rows past `rows` do not exist
    starts = jnp.minimum(ends - sizes, rows).clip(0)

    if active_groups is None:
        listed = jnp.arange(num_groups, dtype=jnp.int32)
        usable = jnp.ones((num_groups,), bool)
    else:
        listed = jnp.sort(active_groups.astype(jnp.int32))  # row order, so row tiles never decrease
        repeated = jnp.concatenate([jnp.zeros((1,), bool), listed[1:] == listed[:-1]])
        usable = (listed >= 0) & (listed < num_groups) & ~repeated
        listed = listed.clip(0, num_groups - 1)
    group_start = starts[listed]
    group_end = jnp.where(usable, ends[listed], group_start)

    first_tile = group_start // tile_rows
    tiles = jnp.where(group_end > group_start, (group_end - 1) // tile_rows - first_tile + 1, 0)
    tiles_before = jnp.cumsum(tiles) - tiles
    num_tiles = jnp.sum(tiles)

    max_tiles = max_work_tiles(rows, tile_rows, listed.shape[0])
    index = jnp.minimum(jnp.arange(max_tiles, dtype=jnp.int32), jnp.maximum(num_tiles - 1, 0))
    owner = jnp.searchsorted(jnp.cumsum(tiles), index, side="right").clip(0, listed.shape[0] - 1)
    row_tile = (first_tile[owner] + index - tiles_before[owner]).clip(0, -(-rows // tile_rows) - 1)
    in_use = jnp.arange(max_tiles) < num_tiles
    row_start = jnp.maximum(group_start[owner], row_tile * tile_rows)
    row_end = jnp.where(in_use, jnp.minimum(group_end[owner], (row_tile + 1) * tile_rows), row_start)
    return WorkTiles(listed[owner], row_tile.astype(jnp.int32), row_start.astype(jnp.int32),
                     row_end.astype(jnp.int32), num_tiles.astype(jnp.int32)[None])
