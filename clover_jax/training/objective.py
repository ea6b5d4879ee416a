"""The training objective: block diffusion (BD3-LM weighting) on Clover's real block-mode pass,
jointly with the next-token loss on its causal pass.

For each example, a masking ratio t ~ U(min_ratio, 1) (min_ratio small, default 0.02, so that
the 1/t weight stays bounded; BD3-LM clips its schedule the same way) masks each maskable
position of the block independently with probability t, at least one position per example.
One `CloverTransformer` call runs the clean prefix as causal rows (appending to an empty state
whose `start` marks the left padding) and then the noisy block as block rows (docs/design.md §3), with
the coreset routing that decoding uses. The loss is the cross-entropy on masked positions,
weighted 1/t and normalised by the block size:

    loss = mean over examples of  (1 / (t · B)) · Σ_{masked j} −log p(x_j | prefix, noisy block)

Every parameter, the Clover block-mode ones included, receives gradients.

`joint_loss` adds the next-token cross-entropy of the same examples' clean conversations on
the causal pass (`clover_jax.training.next_token`), weighted by λ:

    joint = block-diffusion loss + λ · next-token loss

Block diffusion alone teaches the block-mode pass but leaves the causal pass's own
predictions (row p → token p + 1) untrained, so autoregressive decoding, and the verify pass
of self-speculative decoding, would produce nonsense; the joint objective trains both.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.state import empty_state
from clover_jax.nn.model import CloverTransformer, Params, TransformerPasses
from clover_jax.training.batches import TrainBatch
from clover_jax.training.next_token import NextTokenParts, differentiable, next_token_loss


class JointParts(NamedTuple):
    """Diagnostics of the joint loss: the block-diffusion loss and its parts, and the next-token parts
    (NaN when the next-token weight is 0 and the causal pass is skipped)."""

    diffusion_loss: jax.Array
    diffusion: "LossParts"
    next_token: NextTokenParts


class NoisyBlock(NamedTuple):
    """ids: int32 [b, B] with masks; masked: bool [b, B]; ratio: float32 [b], the t of each example."""

    ids: jax.Array
    masked: jax.Array
    ratio: jax.Array


class LossParts(NamedTuple):
    """Diagnostics of one batch: the weighted loss's per-token cross-entropy and accuracy on
    masked positions, and the mean masked fraction of each block."""

    cross_entropy: jax.Array
    accuracy: jax.Array
    masked_fraction: jax.Array


def corrupt_block(key: jax.Array, block_ids: jax.Array, maskable: jax.Array, mask_token_id: int,
                  min_ratio: float = 0.02) -> NoisyBlock:
    """Mask each maskable position with probability t ~ U(min_ratio, 1), at least one per row.

    block_ids: int [b, B]; maskable: bool [b, B] with at least one True per row.
    """
    ratio_key, mask_key, pick_key = jax.random.split(key, 3)
    batch = block_ids.shape[0]
    ratio = jax.random.uniform(ratio_key, (batch,), jnp.float32, min_ratio, 1.0)
    masked = maskable & (jax.random.uniform(mask_key, block_ids.shape) < ratio[:, None])
    # A row with nothing masked masks one maskable position chosen uniformly.
    pick = jnp.argmax(jnp.where(maskable, jax.random.uniform(pick_key, block_ids.shape), -1.0), axis=-1)
    forced = jax.nn.one_hot(pick, block_ids.shape[1], dtype=bool) & maskable
    masked = jnp.where(jnp.any(masked, axis=-1, keepdims=True), masked, forced)
    return NoisyBlock(jnp.where(masked, mask_token_id, block_ids).astype(jnp.int32), masked, ratio)


def weighted_masked_cross_entropy(logits: jax.Array, targets: jax.Array,
                                  noisy: NoisyBlock) -> tuple[jax.Array, LossParts]:
    """logits: float [b, B, V]; targets: int [b, B] -> (scalar loss, diagnostics), in float32."""
    block_size = targets.shape[1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_loss = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]  # [b, B]
    masked = noisy.masked.astype(jnp.float32)
    per_example = jnp.sum(token_loss * masked, axis=-1) / (noisy.ratio * block_size)
    count = jnp.maximum(jnp.sum(masked), 1.0)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    parts = LossParts(jnp.sum(token_loss * masked) / count, jnp.sum(correct * masked) / count,
                      jnp.mean(jnp.mean(masked, axis=-1)))
    return jnp.mean(per_example), parts


def block_logits(module: CloverTransformer, params: Params, prefix_ids: jax.Array, start: jax.Array,
                 block_ids: jax.Array, coreset: bool, coreset_top_p: float) -> jax.Array:
    """float32 [b, B, V]: one pass, the prefix causal (from an empty state) then the block."""
    batch, width = prefix_ids.shape
    state = empty_state(module.config, batch, width, module.dtype, start)
    passes = TransformerPasses(differentiable(module))
    return passes.commit_and_denoise(params, prefix_ids, block_ids, state, coreset=coreset,
                                     coreset_top_p=coreset_top_p).logits


def block_diffusion_loss(params: Params, module: CloverTransformer, batch: TrainBatch, key: jax.Array,
                         mask_token_id: int, coreset: bool = True, coreset_top_p: float = 0.9,
                         min_ratio: float = 0.02) -> tuple[jax.Array, LossParts]:
    """The BD3-LM-weighted masked cross-entropy of one batch (see the module docstring)."""
    block_ids = jnp.asarray(batch.block_ids)
    noisy = corrupt_block(key, block_ids, jnp.asarray(batch.maskable), mask_token_id, min_ratio)
    logits = block_logits(module, params, jnp.asarray(batch.prefix_ids), jnp.asarray(batch.start), noisy.ids,
                          coreset, coreset_top_p)
    return weighted_masked_cross_entropy(logits, block_ids, noisy)


def joint_loss(params: Params, module: CloverTransformer, batch: TrainBatch, key: jax.Array, mask_token_id: int, *,
               next_token_weight: float = 1.0, coreset: bool = True, coreset_top_p: float = 0.9,
               min_ratio: float = 0.02) -> tuple[jax.Array, JointParts]:
    """Block-diffusion loss + next_token_weight · next-token loss of one batch (see the module docstring)."""
    diffusion, parts = block_diffusion_loss(params, module, batch, key, mask_token_id, coreset, coreset_top_p,
                                            min_ratio)
    if next_token_weight == 0:  # a static choice: the causal pass is not traced at all
        nan = jnp.float32(jnp.nan)
        return diffusion, JointParts(diffusion, parts, NextTokenParts(nan, nan))
    next_token = next_token_loss(params, module, batch.sequence_ids, batch.sequence_start, batch.is_response)
    return diffusion + next_token_weight * next_token.cross_entropy, JointParts(diffusion, parts, next_token)
