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

Quantised weights (`rhs_scales` given) are read as stored and dequantised tile by tile in the
kernel — int8 `[groups, out, in]` with scales `[groups, 1, out]`, or packed int4 uint8
`[groups, out, in / 2]` with scales `[groups, in / group, out]` (`quantized_weights` states the
layout) — so a step reads 1 or ½ byte per weight of the groups it uses and no float copy of a
weight exists. The integer codes are exact in the lhs dtype, so the dot runs on them and the
product of a tile is scaled afterwards by its scale row, along the output lanes. An int4
contraction tile is one pair of groups: its bytes' low nibbles are the first group, the high
nibbles the second, each multiplying its own half of the lhs tile and scaled by its own row.

Differentiable: `grouped_matmul` has a custom VJP whose d lhs and d rhs kernels are in
`grouped_matmul_backward.py` (a quantised rhs is frozen and gets no cotangent).

Routed experts: gate_up is rhs [experts, 2 * intermediate, hidden], down is rhs
[experts, hidden, intermediate].
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as pltriton

from pallas_kernels.grouped_matmul_backward import grouped_matmul_dx, weight_gradient
from pallas_kernels.grouped_matmul_schedule import WorkTiles, work_tiles
from pallas_kernels.grouped_matmul_tiles import (
    GPU_TILES,
    TPU_TILES,
    Tiles,
    WeightFormat,
    default_precision,
    fit_tile,
    output_zeros,
    row_mask,
    scale_row,
    weight_format,
)
from pallas_kernels.platforms import Variant, per_platform
from pallas_kernels.quantized_weights import unpack_int4_halves

_A_BT = (((1,), (1,)), ((), ()))  # lhs tile [rows, k] @ rhs tile [n, k]ᵀ


def _tile_product(lhs_parts, rhs, scales, step, fmt: WeightFormat, compute_dtype, precision) -> jax.Array:
    """float32 [rows, cols] = lhs tile [rows, depth] · (dequantised) rhs tile ᵀ.

    lhs_parts: (the lhs tile,), or for int4 its two halves [rows, depth / 2] (loaded apart: Triton
    cannot slice a loaded value); rhs: float or int8 [cols, depth], or int4 bytes [cols, depth / 2]
    of the `step`-th pair of groups of a row; scales: [scale groups, cols] of the whole row, or
    None for float rhs.
    """
    dot = lambda a, b: jax.lax.dot_general(a.astype(compute_dtype), b.astype(compute_dtype), _A_BT,
                                           precision=precision, preferred_element_type=jnp.float32)
    if fmt.bits is None:
        return dot(lhs_parts[0], rhs)
    if fmt.bits == 8:
        return dot(lhs_parts[0], rhs) * scale_row(scales, 0)
    low, high = unpack_int4_halves(rhs)
    return (dot(lhs_parts[0], low) * scale_row(scales, 2 * step)
            + dot(lhs_parts[1], high) * scale_row(scales, 2 * step + 1))


def _lhs_parts(load, start, depth, fmt: WeightFormat) -> tuple:
    """The lhs tile from `load(start, width)`, as `_tile_product` takes it."""
    if fmt.bits != 4:
        return (load(start, depth),)
    half = depth // 2
    return load(start, half), load(start + half, half)


def _gpu_kernel(groups_ref, row_tiles_ref, starts_ref, ends_ref, count_ref, lhs_ref, rhs_ref, *refs,
                tiles, compute_dtype, precision, fmt):
    """lhs_ref [m, k], rhs_ref [groups, n, k / depth_per_byte], (scales_ref [groups, s, n]), out_ref
    [m, n] whole (Triton refs are pointers)."""
    scales_ref, out_ref = (refs[0], refs[2]) if fmt.bits else (None, refs[1])
    work, col_tile = pl.program_id(0), pl.program_id(1)

    @pl.when(work < count_ref[0])
    def _compute():
        group, row_tile = groups_ref[work], row_tiles_ref[work]
        rows = pl.ds(pl.multiple_of(row_tile * tiles.rows, tiles.rows), tiles.rows)
        cols = pl.ds(pl.multiple_of(col_tile * tiles.cols, tiles.cols), tiles.cols)
        stored = tiles.depth // fmt.depth_per_byte
        scales = None if scales_ref is None else scales_ref[group, :, cols]
        load_lhs = lambda start, width: lhs_ref[rows, pl.ds(pl.multiple_of(start, width), width)]

        def accumulate(step, acc):
            stored_depth = pl.ds(pl.multiple_of(step * stored, stored), stored)
            return acc + _tile_product(_lhs_parts(load_lhs, step * tiles.depth, tiles.depth, fmt),
                                       rhs_ref[group, cols, stored_depth], scales, step, fmt, compute_dtype, precision)

        steps = lhs_ref.shape[1] // tiles.depth
        acc = jax.lax.fori_loop(0, steps, accumulate, jnp.zeros((tiles.rows, tiles.cols), jnp.float32))
        mask = row_mask(starts_ref[work], ends_ref[work], row_tile, tiles.rows, acc.shape)
        pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)


def _tpu_kernel(groups_ref, row_tiles_ref, starts_ref, ends_ref, count_ref, lhs_ref, rhs_ref, *refs,
                tiles, compute_dtype, precision, fmt):
    """lhs_ref [rows, depth], rhs_ref [cols, depth / depth_per_byte], (scales_ref [s, cols]), out_ref
    [rows, cols] blocks; acc_ref float32 VMEM."""
    scales_ref, out_ref, acc_ref = (refs[0], refs[2], refs[3]) if fmt.bits else (None, refs[1], refs[2])
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
        scales = None if scales_ref is None else scales_ref[...]
        load_lhs = lambda start, width: lhs_ref[:, pl.ds(start, width)]
        acc_ref[...] += _tile_product(_lhs_parts(load_lhs, 0, tiles.depth, fmt), rhs_ref[...], scales, step, fmt,
                                      compute_dtype, precision)

    @pl.when(in_use & (step == last_step))
    def _store():
        mask = row_mask(starts_ref[work], ends_ref[work], row_tile, tiles.rows, acc_ref.shape)
        out_ref[...] = jnp.where(mask, acc_ref[...], out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def _build_call(variant, interpret, *, shapes, max_tiles, tiles, out_dtype, compute_dtype, precision, fmt,
                scale_groups, num_warps, num_stages):
    """The pallas_call of one driver; arguments: the 5 schedule arrays, lhs, rhs, (scales,) zeros [m, n]."""
    rows, depth, num_groups, cols = shapes
    stored_depth, stored_tile = depth // fmt.depth_per_byte, tiles.depth // fmt.depth_per_byte
    out_shape = jax.ShapeDtypeStruct((rows, cols), out_dtype)
    schedule_args = 5
    zeros_index = schedule_args + (3 if fmt.bits else 2)
    options = dict(tiles=tiles, compute_dtype=compute_dtype, precision=precision, fmt=fmt)

    if variant == "gpu":
        whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
        scale_specs = [whole((num_groups, scale_groups, cols))] if fmt.bits else []
        return pl.pallas_call(
            functools.partial(_gpu_kernel, **options),
            out_shape=out_shape,
            grid=(max_tiles, cols // tiles.cols),
            in_specs=[whole((max_tiles,))] * 4 + [whole((1,)), whole((rows, depth)),
                      whole((num_groups, cols, stored_depth))] + scale_specs + [whole((rows, cols))],
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

    def scales_index(col, work, step, groups, row_tiles, starts, ends, count):
        return groups[work], 0, col  # the row's every scale group (a few), one block per expert tile

    def out_index(col, work, step, groups, row_tiles, starts, ends, count):
        return row_tiles[work], col

    scale_specs = [pl.BlockSpec((None, scale_groups, tiles.cols), scales_index)] if fmt.bits else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=schedule_args,
        grid=(cols // tiles.cols, max_tiles, steps),
        in_specs=[pl.BlockSpec((tiles.rows, tiles.depth), lhs_index),
                  pl.BlockSpec((None, tiles.cols, stored_tile), rhs_index)] + scale_specs
                 + [pl.BlockSpec(memory_space=pl.ANY)],
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
    rhs_scales: jax.Array | None = None,
    active_groups: jax.Array | None = None,
    preferred_element_type: jnp.dtype | None = None,
    tiles: Tiles | None = None,
    variant: Variant = "auto",
    interpret: bool | None = None,
    precision: jax.lax.Precision | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """out[r] = lhs[r] @ rhs[g(r)]ᵀ for rows sorted by group.

    lhs: [rows, depth]; rhs: [groups, cols, depth] (the checkpoint's [out, in]) float, or quantised
        with `rhs_scales`: int8 [groups, cols, depth] with scales [groups, 1, cols], or packed int4
        uint8 [groups, cols, depth / 2] with scales [groups, depth / group, cols]
        (`pallas_kernels.quantized_weights`); group_sizes: int32 [groups]
    active_groups: int32 [listed] (static length) or None: only these groups are computed and
        only their weights are read; rows of other groups give 0
    returns [rows, cols] in `preferred_element_type` (default lhs.dtype), accumulated in float32;
    rows past Σ group_sizes give 0.

    `tiles` (rows, cols, depth) defaults to GPU_TILES / TPU_TILES per driver, shrunk to divide the
    shapes (`fit_tile`); an int4 contraction tile is always one pair of groups. `precision`
    defaults to `default_precision` of the operands. `variant`/`interpret` pick the driver per
    platform (`platforms.py`).
    """
    rows, depth = lhs.shape
    num_groups, cols, _ = rhs.shape
    fmt = weight_format(rhs, rhs_scales, depth)
    if rhs.shape[2] * fmt.depth_per_byte != depth or group_sizes.shape != (num_groups,):
        raise ValueError(f"lhs {lhs.shape}, rhs {rhs.shape} and group_sizes {group_sizes.shape} must be "
                         "[rows, depth], [groups, cols, depth] and [groups]")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    compute_dtype = lhs.dtype if fmt.bits else jnp.promote_types(lhs.dtype, rhs.dtype)
    precision = default_precision(compute_dtype) if precision is None else precision
    options = _Options(out_dtype, compute_dtype, precision, tiles, variant, interpret, num_warps, num_stages)
    return _differentiable(options, lhs, rhs, group_sizes, rhs_scales, active_groups)


class _Options(NamedTuple):
    out_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    precision: jax.lax.Precision
    tiles: Tiles | None
    variant: Variant
    interpret: bool | None
    num_warps: int
    num_stages: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(options: _Options, lhs, rhs, group_sizes, rhs_scales, active_groups):
    """`grouped_matmul` with its backward pass (`grouped_matmul_backward`): d lhs through the
    weights as stored (quantised ones dequantised per tile), d rhs for float weights only."""
    return _forward(options, lhs, rhs, group_sizes, rhs_scales, active_groups)


def _differentiable_forward(options, lhs, rhs, group_sizes, rhs_scales, active_groups):
    out = _forward(options, lhs, rhs, group_sizes, rhs_scales, active_groups)
    return out, (lhs, rhs, group_sizes, rhs_scales, active_groups)


def _differentiable_backward(options: _Options, residuals, d_out):
    lhs, rhs, group_sizes, rhs_scales, active_groups = residuals
    fmt = weight_format(rhs, rhs_scales, lhs.shape[1])
    compute_dtype = jnp.promote_types(d_out.dtype, lhs.dtype if fmt.bits else rhs.dtype)
    d_lhs = grouped_matmul_dx(d_out, rhs, group_sizes, fmt=fmt, rhs_scales=rhs_scales, active_groups=active_groups,
                              out_dtype=lhs.dtype, compute_dtype=compute_dtype, variant=options.variant,
                              interpret=options.interpret)
    # Quantised weights are frozen (QLoRA): neither their codes nor their scales get a cotangent.
    d_rhs = None if fmt.bits else weight_gradient(lhs, d_out, group_sizes, active_groups=active_groups,
                                                  out_dtype=rhs.dtype, variant=options.variant,
                                                  interpret=options.interpret)
    return d_lhs, d_rhs, None, None, None


_differentiable.defvjp(_differentiable_forward, _differentiable_backward)


def _forward(options: _Options, lhs, rhs, group_sizes, rhs_scales, active_groups):
    rows, depth = lhs.shape
    num_groups, cols, _ = rhs.shape
    fmt = weight_format(rhs, rhs_scales, depth)
    out_dtype, compute_dtype, precision, tiles = options[:4]
    listed = num_groups if active_groups is None else active_groups.shape[0]
    if rows == 0 or listed == 0:
        return jnp.zeros((rows, cols), out_dtype)
    scale_groups = 0 if rhs_scales is None else rhs_scales.shape[1]

    def build(chosen_variant, chosen_interpret):
        preferred = tiles or (TPU_TILES if chosen_variant == "tpu" else GPU_TILES)
        # GPU dots need >= 16 rows; small decode batches get one padded tile instead of a long list.
        tile_rows = min(preferred.rows, max(16, pl.next_power_of_2(rows)))
        tile_depth = 2 * fmt.group if fmt.bits == 4 else fit_tile(depth, preferred.depth)
        chosen = Tiles(tile_rows, fit_tile(cols, preferred.cols), tile_depth)
        padded_rows = rows + (-rows) % chosen.rows
        max_tiles = -(-padded_rows // chosen.rows) + min(listed, padded_rows) - 1
        call = _build_call(chosen_variant, chosen_interpret, shapes=(padded_rows, depth, num_groups, cols),
                           max_tiles=max(1, max_tiles), tiles=chosen, out_dtype=out_dtype,
                           compute_dtype=compute_dtype, precision=precision, fmt=fmt, scale_groups=scale_groups,
                           num_warps=options.num_warps, num_stages=options.num_stages)

        def run(lhs, rhs, group_sizes, *extra):
            scales = extra[:1] if fmt.bits else ()
            active = extra[len(scales)] if len(extra) > len(scales) else None
            schedule: WorkTiles = work_tiles(group_sizes, rows, chosen.rows, active)
            padded = jnp.pad(lhs, [(0, padded_rows - rows), (0, 0)])
            return call(*schedule, padded, rhs, *scales, output_zeros(padded, (padded_rows, cols), out_dtype))[:rows]

        return run

    run = per_platform(build, options.variant, options.interpret)
    extra = (() if rhs_scales is None else (rhs_scales,)) + (() if active_groups is None else (active_groups,))
    return run(lhs, rhs, group_sizes, *extra)
