"""Grouped matmul over rows sorted by group, with weights in the checkpoint's [groups, out, in] layout.

`out[r] = lhs[r] @ rhs[g]ᵀ` for the group g that owns row r (`jax.lax.ragged_dot` with a
transposed rhs); rows past Σ group_sizes, and rows of groups left out of `active_groups`, are 0.
The work list (`grouped_matmul_schedule.py`) pairs row tiles with groups; the output starts as
zeros (aliased into the kernel) and each work tile writes only its own group's rows:

* GPU driver (Triton): grid (work tile, out-column tile), a `fori_loop` over the contraction
  dimension, then a masked store of the group's rows (tiles sharing a boundary row tile write
  disjoint rows, so the concurrent programs do not race).
* TPU driver (Mosaic): grid (out-column tile, work tile, contraction tile) with the work list
  scalar-prefetched into SMEM, a float32 VMEM accumulator, and the output block resident while
  consecutive work tiles share a row tile (megablox's scheme), merged with a row-masked select.

Routed experts: gate_up is rhs [experts, 2 * intermediate, hidden], down is rhs
[experts, hidden, intermediate].
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.grouped_matmul_schedule import WorkTiles, work_tiles
from pallas_kernels.platforms import Variant, per_platform

_A_BT = (((1,), (1,)), ((), ()))  # lhs tile [rows, k] @ rhs tile [n, k]ᵀ


class Tiles(NamedTuple):
    rows: int
    cols: int
    depth: int  # the contraction dimension


GPU_TILES = Tiles(64, 128, 64)
TPU_TILES = Tiles(128, 512, 1024)  # large n/k tiles: routed experts are weight-bandwidth bound


def fit_tile(size: int, preferred: int) -> int:
    """`preferred` when it divides `size`; all of `size` when smaller; else the largest power-of-two
    divisor below `preferred` (GPU loads need powers of two, TPU blocks multiples of 128)."""
    if size <= preferred:
        return size
    tile = preferred
    while size % tile:
        tile //= 2
    return tile


def _row_mask(schedule_row_start, schedule_row_end, row_tile, tile_rows, shape):
    rows = row_tile * tile_rows + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= schedule_row_start) & (rows < schedule_row_end)


def _gpu_kernel(groups_ref, row_tiles_ref, starts_ref, ends_ref, count_ref, lhs_ref, rhs_ref, _zeros_ref, out_ref,
                *, tiles, compute_dtype, precision):
    """lhs_ref [m, k], rhs_ref [groups, n, k], out_ref [m, n] whole (Triton refs are pointers)."""
    work, col_tile = pl.program_id(0), pl.program_id(1)

    @pl.when(work < count_ref[0])
    def _compute():
        group, row_tile = groups_ref[work], row_tiles_ref[work]
        rows = pl.ds(pl.multiple_of(row_tile * tiles.rows, tiles.rows), tiles.rows)
        cols = pl.ds(pl.multiple_of(col_tile * tiles.cols, tiles.cols), tiles.cols)

        def accumulate(step, acc):
            depth = pl.ds(pl.multiple_of(step * tiles.depth, tiles.depth), tiles.depth)
            lhs = lhs_ref[rows, depth].astype(compute_dtype)
            rhs = rhs_ref[group, cols, depth].astype(compute_dtype)
            return acc + jax.lax.dot_general(lhs, rhs, _A_BT, precision=precision, preferred_element_type=jnp.float32)

        steps = lhs_ref.shape[1] // tiles.depth
        acc = jax.lax.fori_loop(0, steps, accumulate, jnp.zeros((tiles.rows, tiles.cols), jnp.float32))
        mask = _row_mask(starts_ref[work], ends_ref[work], row_tile, tiles.rows, acc.shape)
        pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)


def _tpu_kernel(groups_ref, row_tiles_ref, starts_ref, ends_ref, count_ref, lhs_ref, rhs_ref, _zeros_ref, out_ref,
                acc_ref, *, tiles, compute_dtype, precision):
    """lhs_ref [rows, depth], rhs_ref [cols, depth], out_ref [rows, cols] blocks; acc_ref float32 VMEM."""
    work, step = pl.program_id(1), pl.program_id(2)
    last_step = pl.num_programs(2) - 1
    row_tile = row_tiles_ref[work]
    first_visit = (work == 0) | (row_tile != row_tiles_ref[jnp.maximum(work - 1, 0)])
    in_use = work < count_ref[0]

    @pl.when((step == 0) & first_visit)
    def _zero_output():  # the block's other rows belong to other groups, inactive ones, or nobody
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(step == 0)
    def _zero_accumulator():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(in_use)
    def _accumulate():
        acc_ref[...] += jax.lax.dot_general(lhs_ref[...].astype(compute_dtype), rhs_ref[...].astype(compute_dtype),
                                            _A_BT, precision=precision, preferred_element_type=jnp.float32)

    @pl.when(in_use & (step == last_step))
    def _store():
        mask = _row_mask(starts_ref[work], ends_ref[work], row_tile, tiles.rows, acc_ref.shape)
        out_ref[...] = jnp.where(mask, acc_ref[...], out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def _build_call(variant, interpret, *, shapes, max_tiles, tiles, out_dtype, compute_dtype, precision,
                num_warps, num_stages):
    """The pallas_call of one driver; arguments: the 5 schedule arrays, lhs, rhs, zeros [m, n]."""
    rows, depth, num_groups, cols = shapes
    out_shape = jax.ShapeDtypeStruct((rows, cols), out_dtype)
    schedule_args = 5
    zeros_index = schedule_args + 2
    options = dict(tiles=tiles, compute_dtype=compute_dtype, precision=precision)

    if variant == "gpu":
        whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
        return pl.pallas_call(
            functools.partial(_gpu_kernel, **options),
            out_shape=out_shape,
            grid=(max_tiles, cols // tiles.cols),
            in_specs=[whole((max_tiles,))] * 4 + [whole((1,)), whole((rows, depth)),
                      whole((num_groups, cols, depth)), whole((rows, cols))],
            out_specs=whole((rows, cols)),
            input_output_aliases={zeros_index: 0},
            compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="grouped_matmul_gpu",
        )

    steps = depth // tiles.depth

    def depth_step(work, step, count):
        # Tiles past the ones in use stay on the last block, so they cost no new copies.
        return jnp.where(work < count[0], step, steps - 1)

    def lhs_index(col, work, step, groups, row_tiles, starts, ends, count):
        return row_tiles[work], depth_step(work, step, count)

    def rhs_index(col, work, step, groups, row_tiles, starts, ends, count):
        return groups[work], col, depth_step(work, step, count)

    def out_index(col, work, step, groups, row_tiles, starts, ends, count):
        return row_tiles[work], col

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=schedule_args,
        grid=(cols // tiles.cols, max_tiles, steps),
        in_specs=[pl.BlockSpec((tiles.rows, tiles.depth), lhs_index),
                  pl.BlockSpec((None, tiles.cols, tiles.depth), rhs_index),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((tiles.rows, tiles.cols), out_index),
        scratch_shapes=[pltpu.VMEM((tiles.rows, tiles.cols), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_tpu_kernel, **options),
        out_shape=out_shape,
        grid_spec=grid_spec,
        input_output_aliases={zeros_index: 0},
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="grouped_matmul_tpu",
    )


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    active_groups: jax.Array | None = None,
    preferred_element_type: jnp.dtype | None = None,
    tiles: Tiles | None = None,
    variant: Variant = "auto",
    interpret: bool | None = None,
    precision: jax.lax.Precision = jax.lax.Precision.HIGHEST,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g(r)]ᵀ for rows sorted by group.

    lhs: [rows, depth]; rhs: [groups, cols, depth] (the checkpoint's [out, in]); group_sizes: int32 [groups]
    active_groups: int32 [listed] (static length) or None: only these groups are computed and
        only their weights are read; rows of other groups give 0
    returns [rows, cols] in `preferred_element_type` (default lhs.dtype), accumulated in float32;
    rows past Σ group_sizes give 0.

    `tiles` (rows, cols, depth) defaults to GPU_TILES / TPU_TILES per driver, shrunk to divide the
    shapes (`fit_tile`). `variant`/`interpret` pick the driver per platform (`platforms.py`).
    """
    rows, depth = lhs.shape
    num_groups, cols, rhs_depth = rhs.shape
    if rhs_depth != depth or group_sizes.shape != (num_groups,):
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape} and group_sizes {group_sizes.shape} must be "
                         "[rows, depth], [groups, cols, depth] and [groups]")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    compute_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    listed = num_groups if active_groups is None else active_groups.shape[0]
    if rows == 0 or listed == 0:
        return jnp.zeros((rows, cols), out_dtype)

    def build(chosen_variant, chosen_interpret):
        preferred = tiles or (TPU_TILES if chosen_variant == "tpu" else GPU_TILES)
        # GPU dots need >= 16 rows; small decode batches get one padded tile instead of a long list.
        tile_rows = min(preferred.rows, max(16, pl.next_power_of_2(rows)))
        chosen = Tiles(tile_rows, fit_tile(cols, preferred.cols), fit_tile(depth, preferred.depth))
        padded_rows = rows + (-rows) % chosen.rows
        max_tiles = -(-padded_rows // chosen.rows) + min(listed, padded_rows) - 1
        call = _build_call(chosen_variant, chosen_interpret, shapes=(padded_rows, depth, num_groups, cols),
                           max_tiles=max(1, max_tiles), tiles=chosen, out_dtype=out_dtype,
                           compute_dtype=compute_dtype, precision=precision, num_warps=num_warps,
                           num_stages=num_stages)

        def run(lhs, rhs, group_sizes, *active):
            schedule: WorkTiles = work_tiles(group_sizes, rows, chosen.rows, active[0] if active else None)
            padded = jnp.pad(lhs, [(0, padded_rows - rows), (0, 0)])
            zeros = jnp.zeros((padded_rows, cols), out_dtype)
            return call(*schedule, padded, rhs, zeros)[:rows]

        return run

    run = per_platform(build, variant, interpret)
    active = () if active_groups is None else (active_groups,)
    return run(lhs, rhs, group_sizes, *active)
