"""The noise of the block-diffusion objective: which positions of each noisy block are masked.

Per noisy block (one block of one example, docs/training.md): a ratio `t ~ U(ε, 1 − ε)`; each
maskable position is masked with probability `t`, and at least one is when the block has any.
With the complementary copy (Fast-dLLM v2), the block's second copy masks exactly the maskable
positions the first left clean (ratio `1 − t`); the two copies share `t`.

The noise is an argument of the loss (`clover_jax.training.loss`), not drawn inside it, so a test
can pass the same masks to the one-pass loss and to a per-block reference.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Noise(NamedTuple):
    """masked: bool [b, N, B], the masked positions of every noisy block (copies included);
    ratio: float32 [b, N], the masking ratio each block was drawn with (the complement's is 1 − t)."""

    masked: jax.Array
    ratio: jax.Array


def draw_noise(key: jax.Array, maskable: jax.Array, *, min_ratio: float, complementary: bool) -> Noise:
    """maskable: bool [b, N0, B], the maskable positions of the blocks of the first copy (a block's
    positions that the data marks as trained). returns `Noise` over N = N0 blocks, or 2 · N0 with
    `complementary` (the first copies, then their complements in the same order)."""
    ratio_key, mask_key, pick_key = jax.random.split(key, 3)
    ratio = jax.random.uniform(ratio_key, maskable.shape[:2], jnp.float32, min_ratio, 1.0 - min_ratio)
    masked = maskable & (jax.random.uniform(mask_key, maskable.shape) < ratio[..., None])
    # A block with maskable positions and none drawn masks one of them, chosen uniformly.
    pick = jnp.argmax(jnp.where(maskable, jax.random.uniform(pick_key, maskable.shape), -1.0), axis=-1)
    forced = jax.nn.one_hot(pick, maskable.shape[-1], dtype=bool) & maskable
    masked = jnp.where(jnp.any(masked, axis=-1, keepdims=True), masked, forced)
    if not complementary:
        return Noise(masked, ratio)
    return Noise(jnp.concatenate([masked, maskable & ~masked], axis=1), jnp.concatenate([ratio, 1.0 - ratio], axis=1))
