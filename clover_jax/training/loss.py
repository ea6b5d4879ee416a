"""The block-diffusion fine-tuning loss on the one training pass (docs/training.md has the formulas).

    loss = Σ_{corrupted j} w_j · CE_j / n_loss                   (block diffusion, noisy stream)
         + κ · Σ_{kept loss positions k} CE_k / n_loss            (token editing's keep term)
         + λ · Σ_{next-token targets p} CE_p / n_next             (next token, clean stream)
         + α · mean over layers of E · Σ_e f_e · P_e                 (load balance)
         + β · mean over rows of logsumexp(router logits)²          (router z-loss)

A corrupted position holds the mask token or, with token editing (`masking.Editing`), a
substituted token; its target is the original token either way. κ is `Editing.keep_weight` (0
without editing): the kept positions are a noisy block's loss positions left clean.
`w_j` is 1 ("uniform") or 1/t of the copy that corrupted j ("inverse_t"); `n_loss` counts the loss
tokens of the global batch once per pair of copies, `n_next` its next-token targets — both
passed in, so that micro-batches of one optimizer step add up to the loss of the whole batch.
Cross-entropies come from hidden states a chunk at a time (`cross_entropy`), with the mask
token's logit at −∞ as in decoding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.streams import make_streams
from clover_jax.nn.model import CloverTransformer, Params
from clover_jax.nn.moe import RouterStats
from clover_jax.training.batches import Normalisers, TrainRows, block_rows, next_token_targets
from clover_jax.training.block_pass import stream_pass
from clover_jax.training.config import LOSS_WEIGHTINGS
from clover_jax.training.cross_entropy import chunked_cross_entropy
from clover_jax.training.masking import Editing, Noise


class LossSettings(NamedTuple):
    """The static part of the loss (each combination compiles once). mask_token_id None: a model
    without one (next-token training of a base model, whose rows then hold no noisy blocks)."""

    block_size: int
    mask_token_id: int | None
    coreset: bool
    complementary: bool = True
    loss_weighting: str = "uniform"
    next_token_weight: float = 1.0
    load_balance_weight: float = 1e-3
    router_z_weight: float = 0.0
    chunk_rows: int | None = None  # the cross-entropy's rows per chunk (None: by the vocabulary)
    editing: Editing | None = None  # LLaDA2.1's token editing (None: masks only)


class LossParts(NamedTuple):
    """The loss and its parts, float32 []. Sums over this micro-batch divided by the global
    normalisers (so parts of micro-batches add up), except `masked_accuracy` and the per-layer
    `expert_load` (float32 [layers, experts], the fraction of each layer's dispatched pairs that
    went to each expert). With token editing, `diffusion_loss` covers masked and substituted
    positions, `keep_loss` is the unweighted keep term and `substituted_*` count the substituted
    positions and those predicted right (all zero without editing)."""

    loss: jax.Array
    diffusion_loss: jax.Array
    next_token_loss: jax.Array
    load_balance_loss: jax.Array
    router_z_loss: jax.Array
    masked_tokens: jax.Array
    masked_correct: jax.Array
    expert_load: jax.Array
    keep_loss: jax.Array
    substituted_tokens: jax.Array
    substituted_correct: jax.Array


def loss_parts(params: Params, module: CloverTransformer, rows: TrainRows, noise: Noise, normalisers: Normalisers,
               *, settings: LossSettings, coreset_top_p: jax.Array) -> LossParts:
    """The loss of one micro-batch with the given noise (`masking.draw_noise` over `block_rows`'s
    maskable positions). module: a differentiable training module (`block_pass.training_module`)."""
    if settings.loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {settings.loss_weighting!r}")
    block_size = settings.block_size
    batch, length = rows.clean_ids.shape
    copies = 2 if settings.complementary else 1
    targets, maskable = block_rows(rows, block_size)
    targets, maskable = jnp.tile(targets, (1, copies, 1)), jnp.tile(maskable, (1, copies, 1))  # [b, N, B]
    if settings.mask_token_id is None and rows.block_index.shape[1]:
        raise ValueError("a model without a mask token trains next-token only: its rows hold no noisy blocks")
    if (noise.substituted is None) != (settings.editing is None):
        raise ValueError("the noise has substituted tokens exactly when the settings ask for token editing")
    noisy_blocks = targets
    if noise.substituted is not None:
        noisy_blocks = jnp.where(noise.substituted, noise.substitutes, noisy_blocks)
    if settings.mask_token_id is not None:
        noisy_blocks = jnp.where(noise.masked, settings.mask_token_id, noisy_blocks).astype(jnp.int32)
    streams = make_streams(rows.segment, jnp.tile(rows.block_index, (1, copies)), block_size)
    out = stream_pass(module, params, rows.clean_ids, noisy_blocks, streams, block_size=block_size,
                      coreset=settings.coreset, coreset_top_p=coreset_top_p, router_stats=True)
    hidden_size = out.hidden.shape[-1]
    cross_entropy = lambda hidden, labels: chunked_cross_entropy(
        hidden.reshape(-1, hidden_size), out.head, labels.reshape(-1), excluded_token=settings.mask_token_id,
        chunk_rows=settings.chunk_rows)

    # Block diffusion: every corrupted (masked or substituted) position of every noisy block.
    noisy = cross_entropy(out.hidden[:, length:], targets)
    masked, corrupted = noise.masked.reshape(-1), noise.corrupted.reshape(-1)
    weight = jnp.ones_like(noise.ratio) if settings.loss_weighting == "uniform" else 1.0 / noise.ratio
    weight = (jnp.repeat(weight, block_size, axis=1).reshape(-1) * corrupted).astype(jnp.float32)
    diffusion = jnp.sum(noisy.nll * weight) / normalisers.loss_tokens
    zero = jnp.zeros((), jnp.float32)
    keep, substituted_tokens, substituted_correct = zero, zero, zero
    if settings.editing is not None:
        kept = (maskable.reshape(-1) & ~corrupted).astype(jnp.float32)
        keep = jnp.sum(noisy.nll * kept) / normalisers.loss_tokens
        substituted = noise.substituted.reshape(-1)
        substituted_tokens = jnp.sum(substituted.astype(jnp.float32))
        substituted_correct = jnp.sum((noisy.correct & substituted).astype(jnp.float32))

    # Next token: row p of the clean stream predicts token p + 1 of the same example.
    predicts = next_token_targets(rows)
    clean = cross_entropy(out.hidden[:, :length - 1], rows.clean_ids[:, 1:])
    next_token = jnp.sum(clean.nll * predicts.reshape(-1)) / normalisers.next_tokens

    balance, z_loss, load = router_losses(out.router_stats, module.config.num_experts)
    loss = (diffusion + settings.next_token_weight * next_token + settings.load_balance_weight * balance
            + settings.router_z_weight * z_loss)
    if settings.editing is not None and settings.editing.keep_weight:
        loss = loss + settings.editing.keep_weight * keep
    return LossParts(loss, diffusion, next_token, balance, z_loss, jnp.sum(masked.astype(jnp.float32)),
                     jnp.sum((noisy.correct & masked).astype(jnp.float32)), load, keep, substituted_tokens,
                     substituted_correct)


def router_losses(stats: RouterStats, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(load-balance loss, z-loss, expert load [layers, experts]) from each layer's statistics.

    Load balance (Switch Transformer; transformers' `load_balancing_loss_func` for Qwen MoE):
    E · Σ_e f_e · P_e per layer, f_e the fraction of the layer's dispatched pairs that went to e,
    P_e its mean router probability, averaged over the layers; only P carries a gradient."""
    rows = jnp.maximum(stats.rows, 1.0)                                               # [layers]
    load = stats.dispatched / jnp.maximum(jnp.sum(stats.dispatched, axis=-1, keepdims=True), 1.0)
    probability = stats.probability / rows[:, None]
    balance = jnp.mean(num_experts * jnp.sum(jax.lax.stop_gradient(load) * probability, axis=-1))
    return balance, jnp.mean(stats.z / rows), load


def empty_parts(module: CloverTransformer) -> LossParts:
    """`LossParts` of zeros: scalars, and [layers, experts] for the expert load."""
    config = module.config
    scalar = jnp.zeros((), jnp.float32)
    return LossParts(*([scalar] * 7), jnp.zeros((config.num_hidden_layers, config.num_experts), jnp.float32),
                     scalar, scalar, scalar)
