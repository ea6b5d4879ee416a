"""Oracle for `grouped_matmul`: `jax.lax.ragged_dot` on the transposed weights, then the rows that
must be 0 (past Σ group_sizes, or of a group left out of `active_groups`) set to 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 [rows]: the group owning each row; `groups` (one past the last) for rows past the total."""
    return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right").astype(jnp.int32)


def grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    active_groups: jax.Array | None = None,
    preferred_element_type: jnp.dtype | None = None,
) -> jax.Array:
    """lhs [rows, depth], rhs [groups, cols, depth], group_sizes int [groups] -> [rows, cols]."""
    num_groups = rhs.shape[0]
    out = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes.astype(jnp.int32),
                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    owner = row_groups(group_sizes, lhs.shape[0])
    keep = owner < num_groups
    if active_groups is not None:
        keep &= jnp.isin(owner, active_groups)
    return jnp.where(keep[:, None], out, 0.0).astype(preferred_element_type or lhs.dtype)
