"""Oracle for `grouped_matmul`: quantised weights dequantised whole, `jax.lax.ragged_dot` on the
transposed weights, then the rows that must be 0 (past Σ group_sizes, or of a group left out of
`active_groups`) set to 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_weights import dequantized


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 [rows]: the group owning each row; `groups` (one past the last) for rows past the total."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right").astype(jnp.int32)


def grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    rhs_scales: jax.Array | None = None,
    active_groups: jax.Array | None = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """lhs [rows, depth], rhs [groups, cols, depth] (or quantised with `rhs_scales`, as for
    `grouped_matmul`), group_sizes int [groups] -> [rows, cols]."""
    if rhs_scales is not None:
        rhs = dequantized(rhs, rhs_scales, jnp.float32)
    num_groups = rhs.shape[0]
    out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    owner = row_groups(group_sizes, lhs.shape[0])
    keep = owner < num_groups
    if active_groups is not None:
        keep &= jnp.isin(owner, active_groups)
    return jnp.where(keep[:, None], out, 0.0).astype(preferred_element_type or lhs.dtype)
