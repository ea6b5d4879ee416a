"""Evaluation during training: the objective's parts on held-out data, at fixed masking ratios.

Every block with loss tokens of every held-out row is masked at each ratio of `RATIOS` (each
maskable position with that probability, at least one per block; one fixed key, so every
evaluation sees the same masks), without the complementary copy; the report is the masked
cross-entropy and accuracy per ratio and their means, and the clean stream's next-token
cross-entropy. Comparable across steps and runs of the same data.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.nn.model import CloverTransformer, Params
from clover_jax.training.batches import (
    Normalisers,
    TrainRows,
    block_rows,
    choose_blocks,
    next_token_targets,
    noisy_width,
)
from clover_jax.training.loss import LossSettings, loss_parts
from clover_jax.training.masking import Noise
from clover_jax.training.packing import PackedRows

RATIOS = (0.25, 0.5, 0.75)


class EvalSums(NamedTuple):
    nll: jax.Array        # float32 [ratios], summed over masked positions
    correct: jax.Array    # float32 [ratios]
    masked: jax.Array     # float32 [ratios]
    next_nll: jax.Array   # float32 [], summed over next-token targets
    next_count: jax.Array


def fixed_ratio_noise(key: jax.Array, maskable: jax.Array, ratio: float) -> Noise:
    """Each maskable position masked with probability `ratio`, at least one per block that has one."""
    mask_key, pick_key = jax.random.split(key)
    masked = maskable & (jax.random.uniform(mask_key, maskable.shape) < ratio)
    pick = jnp.argmax(jnp.where(maskable, jax.random.uniform(pick_key, maskable.shape), -1.0), axis=-1)
    forced = jax.nn.one_hot(pick, maskable.shape[-1], dtype=bool) & maskable
    masked = jnp.where(jnp.any(masked, axis=-1, keepdims=True), masked, forced)
    return Noise(masked, jnp.full(maskable.shape[:2], ratio, jnp.float32))


@functools.partial(jax.jit, static_argnames=("module", "settings"))
def _eval_batch(params: Params, rows: TrainRows, coreset_top_p: jax.Array, *, module: CloverTransformer,
                settings: LossSettings) -> EvalSums:
    _, maskable = block_rows(rows, settings.block_size)
    one = Normalisers(jnp.float32(1.0), jnp.float32(1.0))
    sums = []
    for index, ratio in enumerate(RATIOS):
        noise = fixed_ratio_noise(jax.random.fold_in(jax.random.key(0), index), maskable, ratio)
        parts = loss_parts(params, module, rows, noise, one, settings=settings, coreset_top_p=coreset_top_p)
        sums.append((parts.diffusion_loss, parts.masked_correct, parts.masked_tokens, parts.next_token_loss))
    nll, correct, masked, next_nll = (jnp.stack(values) for values in zip(*sums, strict=True))
    predicts = next_token_targets(rows)
    return EvalSums(nll, correct, masked, next_nll[0], jnp.sum(predicts.astype(jnp.float32)))


def held_out_metrics(params: Params, module: CloverTransformer, packed: PackedRows, *, settings: LossSettings,
             batch_size: int, coreset_top_p: float) -> dict[str, float]:
    """The evaluation metrics of `packed` (held-out rows of `settings.block_size`), prefixed "eval_"."""
    size = settings.block_size
    width = noisy_width(packed, size, None)
    # masks only, at fixed ratios: the held-out figures of a run with and without token editing compare
    settings = settings._replace(complementary=False, loss_weighting="uniform", editing=None)
    total = None
    for first in range(0, packed.num_rows, batch_size):
        rows = np.arange(first, first + batch_size) % packed.num_rows
        real = np.arange(first, first + batch_size) < packed.num_rows   # the last batch repeats rows, unweighted
        blocks = choose_blocks(packed, rows, block_size=size, width=width, max_noisy_blocks=None,
                               rng=np.random.default_rng(0))
        batch = TrainRows(packed.clean_ids[rows], np.where(real[:, None], packed.segment[rows], 0),
                          packed.targets[rows], packed.maskable[rows] & real[:, None],
                          packed.next_token[rows] & real[:, None], blocks)
        sums = jax.device_get(_eval_batch(params, batch, jnp.float32(coreset_top_p), module=module, settings=settings))
        total = sums if total is None else jax.tree_util.tree_map(np.add, total, sums)
    per_ratio = total.nll / np.maximum(total.masked, 1.0)
    metrics = {f"eval_diffusion_loss_t{ratio:g}": float(value) for ratio, value in zip(RATIOS, per_ratio, strict=True)}
    metrics.update(eval_diffusion_loss=float(np.mean(per_ratio)),
                   eval_masked_accuracy=float(np.sum(total.correct) / max(float(np.sum(total.masked)), 1.0)),
                   eval_next_token_loss=float(total.next_nll / max(float(total.next_count), 1.0)))
    return metrics
