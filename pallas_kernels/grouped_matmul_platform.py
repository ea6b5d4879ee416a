"""Which grouped-matmul kernel to use on a platform, including the ones JAX ships.

* TPU, every group, float weights: megablox `gmm` (`jax.experimental.pallas.ops.tpu.megablox`),
  which takes the [groups, out, in] layout directly (`transpose_rhs=True`) and is JAX's tuned
  TPU kernel. It leaves rows past Σ group_sizes undefined, so they are zeroed here. It has no
  "only these groups" form (its `group_offset` selects a contiguous range, for sharded experts),
  so `active_groups` uses our kernel; it takes bfloat16 / float32 weights only, so quantised
  weights (read in place, dequantised per tile) use our kernel too.
* GPU: our Triton kernel (`grouped_matmul`). JAX's Hopper kernel
  (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, TMA + wgmma) is available as
  `kernel="mosaic_gpu"` but not the default: it is written for a few large groups (the group
  search is unrolled over all groups in every tile, 256 here), hard-codes 132 SMs and sm_90
  instructions, needs lhs and rhs of one dtype, leaves rows past the total undefined, has no
  `active_groups`, and its numbers have not been checked on a GPU in this project yet.
* CPU: `jax.lax.ragged_dot` through XLA (the oracle); Pallas only interprets on CPU.

Every choice is differentiable (`grouped_matmul_backward`): d lhs through the weights as stored
(megablox `gmm` without the transpose on TPU, our kernel otherwise, quantised weights dequantised
per tile), d rhs for float weights (megablox `tgmm` on TPU, our Triton kernel on GPU, XLA's
autodiff of `ragged_dot` on CPU). Quantised weights are frozen: no cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul_backward import grouped_matmul_dx, weight_gradient
from pallas_kernels.grouped_matmul_reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul_tiles import WeightFormat, fit_tile
from pallas_kernels.platforms import GroupedKernel, grouped_matmul_kernel, platform_name


def _rows_past_total_to_zero(out: jax.Array, group_sizes: jax.Array) -> jax.Array:
    keep = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(keep[:, None], out, jnp.zeros((), out.dtype))


def _megablox(lhs, rhs, group_sizes, out_dtype, interpret, transpose_rhs=True):
    """out [rows, n] = lhs [rows, k] @ W[g] for rhs [groups, n, k] (`transpose_rhs`, the forward) or
    [groups, k, n] (d lhs of the forward, through the same stored weights)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    rows, depth = lhs.shape
    tile_rows = min(128, max(16, pl.next_power_of_2(rows)))
    padded = jnp.pad(lhs, [(0, (-rows) % tile_rows), (0, 0)])  # gmm needs whole row tiles
    cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiling = (tile_rows, fit_tile(depth, 512), fit_tile(cols, 512))
    out = gmm(padded, rhs, group_sizes.astype(jnp.int32), out_dtype, tiling, transpose_rhs=transpose_rhs,
              interpret=interpret)
    return _rows_past_total_to_zero(out[:rows], group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _shipped_kernel(kernel: str, out_dtype, interpret: bool, transpose_rhs: bool, lhs, rhs, group_sizes):
    """A kernel JAX ships (float weights, every group) with our backward pass: megablox's `gmm`
    has a VJP of its own, but its d lhs leaves the rows past Σ group_sizes undefined (they are
    real rows here, whose gradient is 0); Hopper's ragged dot has none. rhs: [groups, cols, depth]
    (`transpose_rhs`) or, megablox only, [groups, depth, cols]."""
    if kernel == "megablox":
        return _megablox(lhs, rhs, group_sizes, out_dtype, interpret, transpose_rhs)
    return _mosaic_gpu(lhs, rhs, group_sizes, out_dtype)


def _shipped_forward(kernel, out_dtype, interpret, transpose_rhs, lhs, rhs, group_sizes):
    return _shipped_kernel(kernel, out_dtype, interpret, transpose_rhs, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _shipped_backward(kernel, out_dtype, interpret, transpose_rhs, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    variant = "tpu" if kernel == "megablox" else "gpu"
    if kernel == "megablox":  # d lhs [rows, depth] = d_out [rows, cols] @ W[g] [cols, depth], either layout in place
        d_lhs = _megablox(d_out, rhs, group_sizes, lhs.dtype, interpret, transpose_rhs=not transpose_rhs)
    else:
        d_lhs = grouped_matmul_dx(d_out, rhs, group_sizes, fmt=WeightFormat(), out_dtype=lhs.dtype,
                                  compute_dtype=jnp.promote_types(d_out.dtype, rhs.dtype), variant=variant,
                                  interpret=interpret)
    if transpose_rhs:  # [groups, cols, depth] = Σ d_outᵀ ⊗ lhs
        d_rhs = weight_gradient(lhs, d_out, group_sizes, out_dtype=rhs.dtype, variant=variant, interpret=interpret)
    else:              # [groups, depth, cols] = Σ lhsᵀ ⊗ d_out
        d_rhs = weight_gradient(d_out, lhs, group_sizes, out_dtype=rhs.dtype, variant=variant, interpret=interpret)
    return d_lhs, d_rhs, None


_shipped_kernel.defvjp(_shipped_forward, _shipped_backward)


def _mosaic_gpu(lhs, rhs, group_sizes, out_dtype):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    if lhs.dtype != rhs.dtype:
        raise ValueError(f"kernel='mosaic_gpu' needs lhs and rhs of one dtype, got {lhs.dtype} and {rhs.dtype}")
    out = ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=64, block_n=128,
                                     block_k=64, max_concurrent_steps=4, grid_block_n=1, transpose_rhs=True)
    return _rows_past_total_to_zero(out, group_sizes).astype(out_dtype)


def grouped_matmul_for_platform(
    platform: str,
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_scales: jax.Array | None = None,
    active_groups: jax.Array | None = None,
    preferred_element_type: jnp.dtype | None = None,
    kernel: GroupedKernel = "auto",
    interpret: bool = False,
    transpose_rhs: bool = True,
) -> jax.Array:
    """`grouped_matmul` semantics (lhs [rows, depth], rhs [groups, cols, depth] float, or int8 /
    packed int4 with `rhs_scales`) with the kernel
    chosen for `platform` ("cpu", "gpu", "tpu", e.g. `jax.default_backend()`; an export target's
    "cuda" or "rocm" means "gpu", `platforms.platform_name`). `interpret` runs the Pallas choices
    in interpret mode (tests on CPU).

    transpose_rhs=False: float rhs [groups, depth, cols] (`lhs @ rhs[g]`, as `jax.lax.ragged_dot`
    takes it), for a weight whose depth is narrow, such as a LoRA factor B [rank, out]: a TPU lays
    float32 out in tiles of 8 x 128 over the last two axes, so [out, rank 16] takes 8 times its
    bytes, and its gradient too. megablox reads [groups, depth, cols] in place and its `tgmm`
    returns the gradient in it; the other kernels read [groups, cols, depth] and are given the
    transpose."""
    platform = platform_name(platform)
    chosen = grouped_matmul_kernel(platform, kernel, active_groups is not None, rhs_scales is not None)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if chosen in ("megablox", "mosaic_gpu") and active_groups is not None:
        raise ValueError(f"kernel={chosen!r} computes every group; use kernel='pallas' for active_groups")
    if chosen in ("megablox", "mosaic_gpu") and rhs_scales is not None:
        raise ValueError(f"kernel={chosen!r} takes float weights; use kernel='pallas' for quantised weights")
    if not transpose_rhs:
        if rhs_scales is not None:
            raise ValueError("transpose_rhs=False takes float weights (quantised ones are [groups, cols, depth])")
        if chosen != "megablox":  # the other kernels read [groups, cols, depth]
            rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), True
    if chosen == "xla":
        if rhs_scales is not None:  # a quantised base is frozen, as in the kernels' backward
            rhs, rhs_scales = jax.lax.stop_gradient(rhs), jax.lax.stop_gradient(rhs_scales)
        return grouped_matmul_reference(lhs, rhs, group_sizes, rhs_scales=rhs_scales, active_groups=active_groups,
                                        preferred_element_type=out_dtype)
    if chosen in ("megablox", "mosaic_gpu"):
        return _shipped_kernel(chosen, out_dtype, interpret, transpose_rhs, lhs, rhs, group_sizes)
    if chosen == "pallas":
        return grouped_matmul(lhs, rhs, group_sizes, rhs_scales=rhs_scales, active_groups=active_groups,
                              preferred_element_type=out_dtype, variant="tpu" if platform == "tpu" else "gpu",
                              interpret=interpret)
    raise ValueError(f"kernel must be one of auto, pallas, megablox, mosaic_gpu, xla; got {kernel!r}")
