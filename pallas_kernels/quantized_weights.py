"""The in-memory layout of weight-only quantised weights, which the grouped matmul reads in place.

A float weight `[..., out, in]` is held as `values` and `scales`:

* int8: `values` int8 `[..., out, in]`, `scales` `[..., 1, out]`; `w[o, i] = values[o, i] × scales[0, o]`.
* int4: `values` uint8 `[..., out, in / 2]`, `scales` `[..., in / group, out]`; codes in [-8, 7],
  `w[o, i] = code[o, i] × scales[i // group, o]`. The inputs of a row are packed in *pairs of groups*: inputs
  `[2·q·group, 2·(q+1)·group)` fill bytes `[q·group, (q+1)·group)`, byte `q·group + j` holding
  input `2·q·group + j` in its low nibble and input `(2·q+1)·group + j` in its high nibble.

Why pairs of groups rather than neighbouring inputs in one byte: a kernel reading one tile of
`2·group` inputs gets `group` bytes whose low nibbles are one whole group and whose high nibbles
the next, so it unpacks with two bit operations and multiplies two contiguous halves of the
activations — no interleaving of lanes, which TPU vector units cannot do cheaply — and each
half has one scale per output row. It needs an even number of groups per row.

Why scales are `[groups, out]`, one row of output scales per group: the kernels scale a tile's
`[rows, out]` product by one group's scales, a vector along the output lanes; and a TPU lays out
the two minor dimensions in (8, 128) tiles, so `[out, groups]` with a handful of groups would be
stored (or copied, per call) with its groups padded to 128 lanes. `[groups, out]` pads only the
groups to the sublane tile (1 or 4 groups are stored as 16 rows of bfloat16).

This module is the one statement of the layout: `clover_jax.core.quantization` packs with it,
the kernels and their oracle unpack with it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def int4_group_size(values_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> int:
    """The int4 group of packed `values` [..., out, in / 2] with `scales` [..., in / group, out]."""
    return 2 * values_shape[-1] // scales_shape[-2]


def check_int4_widths(inputs: int, group_size: int) -> str | None:
    """Why rows of `inputs` inputs cannot be packed in groups of `group_size`, or None."""
    if group_size < 1 or inputs % (2 * group_size):
        return (f"int4 packs pairs of groups, so the input width must be a multiple of 2 x group_size = "
                f"{2 * group_size}; got {inputs}")
    return None


def pack_int4(codes: np.ndarray, group_size: int) -> np.ndarray:
    """int codes in [-8, 7] [..., in] -> uint8 [..., in / 2] in the paired-groups layout (NumPy)."""
    problem = check_int4_widths(codes.shape[-1], group_size)
    if problem:
        raise ValueError(problem)
    pairs = np.asarray(codes).reshape(codes.shape[:-1] + (-1, 2, group_size))  # [..., pair, low/high, j]
    nibbles = (pairs & 0xF).astype(np.uint8)
    return (nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)).reshape(codes.shape[:-1] + (-1,))


def unpack_int4_halves(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 bytes [..., n] -> (low codes, high codes) int32 [..., n], sign-extended to [-8, 7]."""
    as_int = packed.astype(jnp.int32)
    low, high = as_int & 0xF, (as_int >> 4) & 0xF
    return jnp.where(low >= 8, low - 16, low), jnp.where(high >= 8, high - 16, high)


def unpack_int4(packed: jax.Array, group_size: int) -> jax.Array:
    """uint8 [..., in / 2] -> int32 codes [..., in] (the inverse of `pack_int4`)."""
    low, high = unpack_int4_halves(packed.reshape(packed.shape[:-1] + (-1, group_size)))  # [..., pair, j]
    return jnp.stack([low, high], axis=-2).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def dequantized(values: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """The float weight [..., out, in] in `dtype`: int8 values [..., out, in] or packed int4 uint8
    [..., out, in / 2], with their scales [..., groups, out]."""
    scales = jnp.swapaxes(scales.astype(jnp.float32), -1, -2)  # [..., out, groups]
    if values.dtype == jnp.int8:
        return (values.astype(jnp.float32) * scales).astype(dtype)
    if values.dtype != jnp.uint8:
        raise ValueError(f"quantised values are int8 or packed int4 (uint8), got {values.dtype}")
    group = 2 * values.shape[-1] // scales.shape[-1]
    codes = unpack_int4(values, group).astype(jnp.float32)
    grouped = codes.reshape(codes.shape[:-1] + (scales.shape[-1], group))
    return (grouped * scales[..., None]).reshape(codes.shape).astype(dtype)
