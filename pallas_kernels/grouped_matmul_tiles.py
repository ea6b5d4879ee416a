"""The grouped matmul's shared vocabulary: tile sizes, the weight formats it reads, and the
small helpers its forward kernels (`grouped_matmul`) and backward kernels
(`grouped_matmul_backward`) both use, so neither imports the other for them."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_weights import check_int4_widths, int4_group_size


class Tiles(NamedTuple):
    rows: int
    cols: int
    depth: int  # the contraction dimension


GPU_TILES = Tiles(64, 128, 64)
TPU_TILES = Tiles(128, 512, 1024)  # large n/k tiles: routed experts are weight-bandwidth bound


class WeightFormat(NamedTuple):
    """How rhs is stored: bits None (float), 8 or 4; group: int4 inputs per scale."""

    bits: int | None = None
    group: int = 0

    @property
    def depth_per_byte(self) -> int:
        return 2 if self.bits == 4 else 1


def weight_format(rhs: jax.Array, rhs_scales: jax.Array | None, depth: int) -> WeightFormat:
    """The format of `rhs` [groups, cols, stored depth] given its scales; ValueError when they disagree."""
    if rhs_scales is None:
        if not jnp.issubdtype(rhs.dtype, jnp.floating):
            raise ValueError(f"rhs of dtype {rhs.dtype} is quantised: pass its rhs_scales")
        return WeightFormat()
    if rhs_scales.ndim != 3 or (rhs_scales.shape[0], rhs_scales.shape[2]) != rhs.shape[:2]:
        raise ValueError(f"rhs_scales {rhs_scales.shape} must be [groups, scale groups, cols] for rhs {rhs.shape}")
    if rhs.dtype == jnp.int8:
        if rhs_scales.shape[1] != 1 or rhs.shape[2] != depth:
            raise ValueError(f"int8 rhs {rhs.shape} takes one scale per output row, got rhs_scales {rhs_scales.shape}")
        return WeightFormat(8)
    if rhs.dtype == jnp.uint8:
        group = int4_group_size(rhs.shape, rhs_scales.shape)
        problem = check_int4_widths(depth, group)
        if rhs.shape[2] * 2 != depth or problem:
            raise ValueError(f"packed int4 rhs {rhs.shape} with scales {rhs_scales.shape} does not hold lhs depth "
                             f"{depth}" + (f": {problem}" if problem else ""))
        return WeightFormat(4, group)
    raise ValueError(f"quantised rhs must be int8 or packed int4 (uint8), got {rhs.dtype}")


def fit_tile(size: int, preferred: int) -> int:
    """`preferred` when it divides `size`; all of `size` when smaller; else the largest power-of-two
    divisor below `preferred` (GPU loads need powers of two, TPU blocks multiples of 128)."""
    if size <= preferred:
        return size
    tile = preferred
    while size % tile:
        tile //= 2
    return tile


def default_precision(compute_dtype) -> jax.lax.Precision:
    """HIGHEST for float32 operands (exact parity); DEFAULT otherwise — a bfloat16 dot is exact in
    float32 accumulation anyway, and TPU Mosaic rejects HIGHEST on bfloat16 operands."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def row_mask(schedule_row_start, schedule_row_end, row_tile, tile_rows, shape):
    rows = row_tile * tile_rows + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= schedule_row_start) & (rows < schedule_row_end)


def scale_row(scales: jax.Array, index) -> jax.Array:
    """Row `index` (traced) of scales [scale groups, cols] as float32 [1, cols], without a dynamic
    slice (which Mosaic and Triton lower poorly): a select and a sum over the few groups."""
    chosen = jax.lax.broadcasted_iota(jnp.int32, scales.shape, 0) == index
    return jnp.sum(jnp.where(chosen, scales.astype(jnp.float32), 0.0), axis=0, keepdims=True)


def output_zeros(anchor: jax.Array, shape: tuple[int, int], dtype) -> jax.Array:
    """The zeros a kernel's output starts from (aliased into the call), made only once `anchor`
    (the call's lhs) exists.

    A plain `jnp.zeros` has no operands: XLA is free to compute it anywhere, and fuses the zeros of
    many calls into one multi-output broadcast, after which every call's output buffer is live at
    once. In a LoRA train step (H200x8, 4 layers, 1 x 4,096 tokens per GPU) that held twelve
    float32 and twelve bfloat16 [98,304, 2,048] buffers and more: about 20 of the step's 24.4 GB
    of temporaries. A zero drawn through an optimization barrier with the lhs ties each buffer to
    its own call."""
    _, zero = jax.lax.optimization_barrier((anchor, jnp.zeros((), dtype)))
    return jnp.broadcast_to(zero, shape)
