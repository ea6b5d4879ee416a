"""The backward pass of the grouped matmul `out[r] = lhs[r] @ W[g(r)]ᵀ` (W = rhs [groups, cols, depth]).

* d lhs [rows, depth]: `d_out[r] @ W[g(r)]` — a grouped matmul contracting the weights' *output*
  dimension (`grouped_matmul_dx`), over the same work list as the forward, reading the stored
  `[groups, cols, depth]` layout in place (no transposed copy of the stack). Quantised weights are
  dequantised tile by tile as in the forward, with the scales moved to the other operand: a scale
  belongs to an output row `o` of W (int8) or to (input group, `o`) (int4), and `o` is now the
  contraction, so the d_out tile is scaled along its lanes before the dot; an int4 output tile is
  one pair of groups, its low nibbles giving the first group's columns, the high nibbles the second's.
* d rhs [groups, cols, depth] (float weights only): `Σ_{r in g} d_out[r]ᵀ ⊗ lhs[r]`, the
  transposed grouped matmul (`weight_gradient`): megablox `tgmm` on the TPU driver, our Triton
  kernel on the GPU driver (interpreted on CPU). A group without rows, or left out of
  `active_groups`, gets 0; rows past Σ group_sizes take no part.

Quantised weights are frozen (QLoRA): their values and scales get no cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as pltriton

from pallas_kernels.grouped_matmul_schedule import WorkTiles, work_tiles
from pallas_kernels.grouped_matmul_tiles import (
    Tiles,
    WeightFormat,
    default_precision,
    fit_tile,
    output_zeros,
    row_mask,
    scale_row,
)
from pallas_kernels.platforms import Variant, per_platform
from pallas_kernels.quantized_weights import unpack_int4_halves

_A_B = (((1,), (0,)), ((), ()))  # d_out tile [rows, k] @ weight tile [k, n]
_AT_B = (((0,), (0,)), ((), ()))     # d_out tile [rows, n]ᵀ @ lhs tile [rows, k]

DX_GPU_TILES = Tiles(64, 128, 64)    # rows, output columns (the weights' depth), contraction (their cols)
DX_TPU_TILES = Tiles(128, 512, 1024)
DW_GPU_TILES = Tiles(64, 64, 64)     # rows per step, W's cols, W's depth


def _dx_pieces(d_out, rhs, scales, col, fmt: WeightFormat, compute_dtype, precision) -> tuple:
    """float32 output pieces of d_out tile [rows, k] · (dequantised) weight tile [k, n]: one piece
    [rows, n], or for int4 (rhs bytes [k, n / 2], output tile `col` = one pair of groups) the low
    and the high group, [rows, n / 2] each. scales: [scale groups, k] or None."""
    dot = lambda a, b: jax.lax.dot_general(a.astype(compute_dtype), b.astype(compute_dtype), _A_B,
                                           precision=precision, preferred_element_type=jnp.float32)
    if fmt.bits is None:
        return (dot(d_out, rhs),)
    scaled = lambda index: d_out.astype(jnp.float32) * scale_row(scales, index)
    if fmt.bits == 8:
        return (dot(scaled(0), rhs),)
    low, high = unpack_int4_halves(rhs)
    return dot(scaled(2 * col), low), dot(scaled(2 * col + 1), high)


def _dx_gpu_kernel(groups_ref, row_tiles_ref, starts_ref, ends_ref, count_ref, d_out_ref, rhs_ref, *refs,
                   tiles, compute_dtype, precision, fmt):
    """d_out_ref [m, k], rhs_ref [groups, k, n / depth_per_byte], (scales_ref [groups, s, k]), out_ref
    [m, n] whole."""
    scales_ref, out_ref = (refs[0], refs[2]) if fmt.bits else (None, refs[1])
    work, col = pl.program_id(0), pl.program_id(1)
    pieces = 2 if fmt.bits == 4 else 1
    width = tiles.cols // pieces  # output columns per piece

    @pl.when(work < count_ref[0])
    def _compute():
        group, row_tile = groups_ref[work], row_tiles_ref[work]
        rows = pl.ds(pl.multiple_of(row_tile * tiles.rows, tiles.rows), tiles.rows)
        stored = pl.ds(pl.multiple_of(col * width, width), width)  # int4: a pair of groups' bytes

        def accumulate(step, accs):
            depth = pl.ds(pl.multiple_of(step * tiles.depth, tiles.depth), tiles.depth)
            scales = None if scales_ref is None else scales_ref[group, :, depth]
            new = _dx_pieces(d_out_ref[rows, depth], rhs_ref[group, depth, stored], scales, col, fmt,
                             compute_dtype, precision)
            return tuple(acc + piece for acc, piece in zip(accs, new, strict=True))

        steps = d_out_ref.shape[1] // tiles.depth
        accs = jax.lax.fori_loop(0, steps, accumulate,
                                 tuple(jnp.zeros((tiles.rows, width), jnp.float32) for _ in range(pieces)))
        mask = row_mask(starts_ref[work], ends_ref[work], row_tile, tiles.rows, accs[0].shape)
        for index, acc in enumerate(accs):
            cols = pl.ds(pl.multiple_of(col * tiles.cols + index * width, width), width)
            pltriton.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=mask)


def _dx_tpu_kernel(groups_ref, row_tiles_ref, starts_ref, ends_ref, count_ref, d_out_ref, rhs_ref, *refs,
                   tiles, compute_dtype, precision, fmt):
    """d_out_ref [rows, k], rhs_ref [k, n / depth_per_byte], (scales_ref [s, k]), out_ref [rows, n]
    blocks; acc_ref float32 VMEM [rows, n]."""
    scales_ref, out_ref, acc_ref = (refs[0], refs[2], refs[3]) if fmt.bits else (None, refs[1], refs[2])
    col, work, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    last_step = pl.num_programs(2) - 1
    row_tile = row_tiles_ref[work]
    first_visit = (work == 0) | (row_tile != row_tiles_ref[jnp.maximum(work - 1, 0)])
    in_use = work < count_ref[0]

    @pl.when((step == 0) & first_visit)
    def _zero_output():
        out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(step == 0)
    def _zero_accumulator():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(in_use)
    def _accumulate():
        scales = None if scales_ref is None else scales_ref[...]
        pieces = _dx_pieces(d_out_ref[...], rhs_ref[...], scales, col, fmt, compute_dtype, precision)
        width = tiles.cols // len(pieces)
        for index, piece in enumerate(pieces):
            acc_ref[:, index * width:(index + 1) * width] += piece

    @pl.when(in_use & (step == last_step))
    def _store():
        mask = row_mask(starts_ref[work], ends_ref[work], row_tile, tiles.rows, acc_ref.shape)
        out_ref[...] = jnp.where(mask, acc_ref[...], out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def _dx_call(variant, interpret, *, shapes, max_tiles, tiles, out_dtype, compute_dtype, precision, fmt,
             scale_groups):
    """The pallas_call of one driver; arguments: the 5 schedule arrays, d_out, rhs, (scales,) zeros [m, n]."""
    rows, contraction, num_groups, out_cols = shapes
    stored_cols, stored_tile = out_cols // fmt.depth_per_byte, tiles.cols // fmt.depth_per_byte
    out_shape = jax.ShapeDtypeStruct((rows, out_cols), out_dtype)
    zeros_index = 5 + (3 if fmt.bits else 2)
    options = dict(tiles=tiles, compute_dtype=compute_dtype, precision=precision, fmt=fmt)

    if variant == "gpu":
        whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
        scale_specs = [whole((num_groups, scale_groups, contraction))] if fmt.bits else []
        return pl.pallas_call(
            functools.partial(_dx_gpu_kernel, **options),
            out_shape=out_shape,
            grid=(max_tiles, out_cols // tiles.cols),
            in_specs=[whole((max_tiles,))] * 4 + [whole((1,)), whole((rows, contraction)),
                      whole((num_groups, contraction, stored_cols))] + scale_specs + [whole((rows, out_cols))],
            out_specs=whole((rows, out_cols)),
            input_output_aliases={zeros_index: 0},
            compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=3),
            interpret=interpret,
            name="grouped_matmul_dx_gpu",
        )

    steps = contraction // tiles.depth
    step_of = lambda work, step, count: jnp.where(work < count[0], step, steps - 1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(out_cols // tiles.cols, max_tiles, steps),
        in_specs=[pl.BlockSpec((tiles.rows, tiles.depth),
                               lambda col, work, step, g, rt, s, e, n: (rt[work], step_of(work, step, n))),
                  pl.BlockSpec((None, tiles.depth, stored_tile),
                               lambda col, work, step, g, rt, s, e, n: (g[work], step_of(work, step, n), col))]
                 + ([pl.BlockSpec((None, scale_groups, tiles.depth),
                                  lambda col, work, step, g, rt, s, e, n: (g[work], 0, step_of(work, step, n)))]
                    if fmt.bits else [])
                 + [pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((tiles.rows, tiles.cols), lambda col, work, step, g, rt, s, e, n: (rt[work], col)),
        scratch_shapes=[pltpu.VMEM((tiles.rows, tiles.cols), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_dx_tpu_kernel, **options),
        out_shape=out_shape,
        grid_spec=grid_spec,
        input_output_aliases={zeros_index: 0},
        compiler_params=None if interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="grouped_matmul_dx_tpu",
    )


def grouped_matmul_dx(
    d_out: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    fmt: WeightFormat,
    rhs_scales: jax.Array | None = None,
    active_groups: jax.Array | None = None,
    out_dtype,
    compute_dtype,
    variant: Variant = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """d lhs [rows, depth] = d_out[r] @ W[g(r)] for d_out [rows, cols] and rhs [groups, cols, depth]
    (stored as `grouped_matmul` takes it, `fmt` its format); rows past Σ group_sizes and rows of
    groups left out of `active_groups` give 0."""
    rows, cols = d_out.shape
    num_groups = rhs.shape[0]
    depth = rhs.shape[2] * fmt.depth_per_byte
    listed = num_groups if active_groups is None else active_groups.shape[0]
    if rows == 0 or listed == 0:
        return jnp.zeros((rows, depth), out_dtype)
    precision = default_precision(compute_dtype)
    scale_groups = 0 if rhs_scales is None else rhs_scales.shape[1]

    def build(chosen_variant, chosen_interpret):
        preferred = DX_TPU_TILES if chosen_variant == "tpu" else DX_GPU_TILES
        tile_rows = min(preferred.rows, max(16, pl.next_power_of_2(rows)))
        tile_cols = 2 * fmt.group if fmt.bits == 4 else fit_tile(depth, preferred.cols)
        chosen = Tiles(tile_rows, tile_cols, fit_tile(cols, preferred.depth))
        padded_rows = rows + (-rows) % chosen.rows
        max_tiles = max(1, -(-padded_rows // chosen.rows) + min(listed, padded_rows) - 1)
        call = _dx_call(chosen_variant, chosen_interpret, shapes=(padded_rows, cols, num_groups, depth),
                        max_tiles=max_tiles, tiles=chosen, out_dtype=out_dtype, compute_dtype=compute_dtype,
                        precision=precision, fmt=fmt, scale_groups=scale_groups)

        def run(d_out, rhs, group_sizes, *extra):
            scales = extra[:1] if fmt.bits else ()
            active = extra[len(scales)] if len(extra) > len(scales) else None
            schedule: WorkTiles = work_tiles(group_sizes, rows, chosen.rows, active)
            padded = jnp.pad(d_out, [(0, padded_rows - rows), (0, 0)])
            return call(*schedule, padded, rhs, *scales, output_zeros(padded, (padded_rows, depth), out_dtype))[:rows]

        return run

    extra = (() if rhs_scales is None else (rhs_scales,)) + (() if active_groups is None else (active_groups,))
    return per_platform(build, variant, interpret)(d_out, rhs, group_sizes, *extra)


def group_row_ranges(group_sizes: jax.Array, rows: int, active_groups: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """int32 [groups] starts and ends of each group's rows (clipped to `rows`); a group left out of
    `active_groups` gets an empty range."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.minimum(ends - sizes, rows).clip(0)
    if active_groups is not None:
        listed = jnp.isin(jnp.arange(group_sizes.shape[0]), active_groups)
        ends = jnp.where(listed, ends, starts)
    return starts.astype(jnp.int32), ends.astype(jnp.int32)


def _dw_gpu_kernel(starts_ref, ends_ref, lhs_ref, d_out_ref, out_ref, *, tiles, compute_dtype, precision):
    """lhs_ref [m, depth], d_out_ref [m, cols], out_ref [groups, cols, depth] whole; program (group,
    col tile, depth tile) sums its group's row tiles."""
    group, col, deep = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = starts_ref[group], ends_ref[group]
    cols = pl.ds(pl.multiple_of(col * tiles.cols, tiles.cols), tiles.cols)
    depth = pl.ds(pl.multiple_of(deep * tiles.depth, tiles.depth), tiles.depth)

    def accumulate(row_tile, acc):
        rows = pl.ds(pl.multiple_of(row_tile * tiles.rows, tiles.rows), tiles.rows)
        mine = row_mask(start, end, row_tile, tiles.rows, (tiles.rows, 1))
        # Both operands masked: another group's rows may hold anything, even non-finite values.
        d_out = jnp.where(mine, d_out_ref[rows, cols].astype(jnp.float32), 0.0).astype(compute_dtype)
        lhs = jnp.where(mine, lhs_ref[rows, depth].astype(jnp.float32), 0.0).astype(compute_dtype)
        return acc + jax.lax.dot_general(d_out, lhs, _AT_B, precision=precision, preferred_element_type=jnp.float32)

    first = start // tiles.rows
    last = jnp.where(end > start, (end + tiles.rows - 1) // tiles.rows, first)
    acc = jax.lax.fori_loop(first, last, accumulate, jnp.zeros((tiles.cols, tiles.depth), jnp.float32))
    pltriton.store(out_ref.at[group, cols, depth], acc.astype(out_ref.dtype))


def _dw_gpu(lhs, d_out, group_sizes, active_groups, *, num_groups, out_dtype, interpret):
    rows, depth = lhs.shape
    cols = d_out.shape[1]
    compute_dtype = jnp.promote_types(lhs.dtype, d_out.dtype)
    tiles = Tiles(min(DW_GPU_TILES.rows, max(16, pl.next_power_of_2(rows))), fit_tile(cols, DW_GPU_TILES.cols),
                  fit_tile(depth, DW_GPU_TILES.depth))
    padded_rows = rows + (-rows) % tiles.rows
    starts, ends = group_row_ranges(group_sizes, rows, active_groups)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    call = pl.pallas_call(
        functools.partial(_dw_gpu_kernel, tiles=tiles, compute_dtype=compute_dtype,
                          precision=default_precision(compute_dtype)),
        out_shape=jax.ShapeDtypeStruct((num_groups, cols, depth), out_dtype),
        grid=(num_groups, cols // tiles.cols, depth // tiles.depth),
        in_specs=[whole((num_groups,)), whole((num_groups,)), whole((padded_rows, depth)),
                  whole((padded_rows, cols))],
        out_specs=whole((num_groups, cols, depth)),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="grouped_matmul_dw_gpu",
    )
    pad = lambda x: jnp.pad(x, [(0, padded_rows - rows), (0, 0)])
    return call(starts, ends, pad(lhs), pad(d_out))


def _dw_megablox(lhs, d_out, group_sizes, active_groups, *, num_groups, out_dtype, interpret):
    from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm

    rows, depth = lhs.shape
    if active_groups is not None:  # tgmm has no listed-subset form: other groups' rows add nothing
        starts, ends = group_row_ranges(group_sizes, rows, active_groups)
        row = jnp.arange(rows)
        listed_row = jnp.any((row[:, None] >= starts) & (row[:, None] < ends), axis=1)
        d_out = jnp.where(listed_row[:, None], d_out, jnp.zeros((), d_out.dtype))
        lhs = jnp.where(listed_row[:, None], lhs, jnp.zeros((), lhs.dtype))
    tile_rows = min(128, max(16, pl.next_power_of_2(rows)))
    pad = lambda x: jnp.pad(x, [(0, (-rows) % tile_rows), (0, 0)])
    tiling = (tile_rows, fit_tile(d_out.shape[1], 512), fit_tile(depth, 512))
    return tgmm(pad(d_out).T, pad(lhs), group_sizes.astype(jnp.int32), out_dtype, tiling, interpret=interpret)


def weight_gradient(
    lhs: jax.Array,
    d_out: jax.Array,
    group_sizes: jax.Array,
    *,
    active_groups: jax.Array | None = None,
    out_dtype,
    variant: Variant = "auto",
    interpret: bool | None = None,
) -> jax.Array:
    """d rhs [groups, cols, depth] = Σ_{r in g} d_out[r]ᵀ ⊗ lhs[r] for lhs [rows, depth], d_out
    [rows, cols] sorted by group (float32 accumulation, `out_dtype` result): megablox `tgmm` in the
    TPU driver, our Triton kernel in the GPU one."""
    num_groups = group_sizes.shape[0]
    rows, depth = lhs.shape
    if rows == 0 or (active_groups is not None and active_groups.shape[0] == 0):
        return jnp.zeros((num_groups, d_out.shape[1], depth), out_dtype)
    options = dict(num_groups=num_groups, out_dtype=out_dtype)

    def build(chosen_variant, chosen_interpret):
        kernel = _dw_megablox if chosen_variant == "tpu" else _dw_gpu
        if active_groups is None:
            return lambda lhs, d_out, sizes: kernel(lhs, d_out, sizes, None, interpret=chosen_interpret, **options)
        return lambda lhs, d_out, sizes, active: kernel(lhs, d_out, sizes, active, interpret=chosen_interpret,
                                                        **options)

    extra = () if active_groups is None else (active_groups,)
    return per_platform(build, variant, interpret)(lhs, d_out, group_sizes, *extra)
