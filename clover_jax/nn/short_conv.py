"""The short depthwise convolutions of a Gated DeltaNet layer: the causal one of every pass and
Clover's right-context branch of block mode (docs/design.md §1, §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_depthwise_conv(window: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise convolution of each channel over the last K rows up to each position.

    window: [batch, K-1 + tokens, channels] (the previous K-1 rows, then the new rows)
    weight: [channels, K]
    returns [batch, tokens, channels]; row i is Σ_j weight[:, j] · window[i + j]
    """
    kernel = weight.shape[-1]
    num_tokens = window.shape[1] - (kernel - 1)
    return sum(window[:, j:j + num_tokens] * weight[:, j] for j in range(kernel))


def right_context_conv(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """r_i = Σ_{t<K} weight[:, t] · rows[i + 1 + t], rows past the block being zero.

    rows: [batch, block, channels]; weight: [channels, K] -> [batch, block, channels]
    """
    kernel = weight.shape[-1]
    padded = jnp.pad(rows, [(0, 0), (0, kernel), (0, 0)])
    block = rows.shape[1]
    return sum(padded[:, 1 + t:1 + t + block] * weight[:, t] for t in range(kernel))
