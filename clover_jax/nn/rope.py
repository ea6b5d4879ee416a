"""Partial rotary position embedding (Qwen3.5: the first `head_dim * 0.25` dims rotate).

For text the multimodal "mrope" sections of Qwen3.5 all carry the same position id, so they
collapse to plain RoPE over positions 0, 1, 2, ...
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Cosine and sine tables.

    positions: int [batch, tokens] -> cos, sin: float32 [batch, tokens, rotary_dim]
    """
    inverse_frequency = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inverse_frequency
    angles = jnp.concatenate([angles, angles], axis=-1)  # rotate_half layout
    return jnp.cos(angles), jnp.sin(angles)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the leading `rotary_dim` dims of every head, pass the rest through.

    x: [batch, tokens, heads, head_dim]; cos, sin: [batch, tokens, rotary_dim]
    """
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    first, second = jnp.split(rotated, 2, axis=-1)
    rotate_half = jnp.concatenate([-second, first], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = rotated * cos + rotate_half * sin
    return jnp.concatenate([rotated.astype(x.dtype), passed], axis=-1)
