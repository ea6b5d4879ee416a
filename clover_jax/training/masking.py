"""The noise of the block-diffusion objective: which positions of each noisy block are corrupted, and how.

Per noisy block (one block of one example, docs/training.md): a ratio `t ~ U(ε, 1 − ε)`; each
maskable position is corrupted with probability `t`, and at least one is when the block has any.
With the complementary copy (Fast-dLLM v2), the block's second copy corrupts exactly the maskable
positions the first left clean (ratio `1 − t`); the two copies share `t`.

A corrupted position holds the mask token. With token editing (LLaDA2.1, `Editing`), each
corrupted position instead holds a substituted token with probability `r_edit`: drawn uniformly
from the tokenizer's non-special ids ("uniform"), or from the loss tokens of the same micro-batch,
the data's own unigram distribution ("data"). The editing draws come from a key of their own, so
that without editing the masks are drawn exactly as they always were.

The noise is an argument of the loss (`clover_jax.training.loss`), not drawn inside it, so a test
can pass the same masks to the one-pass loss and to a per-block reference.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.training.config import EDIT_SUBSTITUTES

EDIT_STREAM = 0x0ED17  # folded into the step's noise key for the editing draws


class Editing(NamedTuple):
    """LLaDA2.1's token editing, a static setting of the loss (hashable).

    fraction: r_edit, the share of corrupted positions that get a substituted token instead of the mask;
    keep_weight: the weight of the cross-entropy at a noisy block's kept clean loss positions;
    substitutes: "uniform" or "data" (module docstring);
    vocabulary: the id ranges [start, stop) a uniform substitute is drawn from (the non-special ids)."""

    fraction: float
    keep_weight: float = 0.0
    substitutes: str = "uniform"
    vocabulary: tuple[tuple[int, int], ...] = ()


class Noise(NamedTuple):
    """masked: bool [b, N, B], the positions of every noisy block (copies included) that hold the mask token;
    ratio: float32 [b, N], the corruption ratio each block was drawn with (the complement's is 1 − t);
    substituted: bool [b, N, B], the corrupted positions holding a substituted token (None: no editing);
    substitutes: int32 [b, N, B], those tokens (meaningful where `substituted`)."""

    masked: jax.Array
    ratio: jax.Array
    substituted: jax.Array | None = None
    substitutes: jax.Array | None = None

    @property
    def corrupted(self) -> jax.Array:
        """bool [b, N, B]: masked or substituted, the positions the diffusion loss is taken at."""
        return self.masked if self.substituted is None else self.masked | self.substituted


def draw_noise(key: jax.Array, maskable: jax.Array, *, min_ratio: float, complementary: bool,
               editing: Editing | None = None, targets: jax.Array | None = None) -> Noise:
    """maskable: bool [b, N0, B], the maskable positions of the blocks of the first copy (a block's
    positions that the data marks as trained); targets: int [b, N0, B], their tokens (needed by
    "data" substitutes). returns `Noise` over N = N0 blocks, or 2 · N0 with `complementary` (the
    first copies, then their complements in the same order)."""
    ratio_key, mask_key, pick_key = jax.random.split(key, 3)
    ratio = jax.random.uniform(ratio_key, maskable.shape[:2], jnp.float32, min_ratio, 1.0 - min_ratio)
    corrupted = maskable & (jax.random.uniform(mask_key, maskable.shape) < ratio[..., None])
    # A block with maskable positions and none drawn corrupts one of them, chosen uniformly.
    pick = jnp.argmax(jnp.where(maskable, jax.random.uniform(pick_key, maskable.shape), -1.0), axis=-1)
    forced = jax.nn.one_hot(pick, maskable.shape[-1], dtype=bool) & maskable
    corrupted = jnp.where(jnp.any(corrupted, axis=-1, keepdims=True), corrupted, forced)
    if complementary:
        corrupted, ratio = (jnp.concatenate([corrupted, maskable & ~corrupted], axis=1),
                            jnp.concatenate([ratio, 1.0 - ratio], axis=1))
    if editing is None or editing.fraction == 0:
        return Noise(corrupted, ratio)  # without editing every corrupted position holds the mask
    choose_key, token_key = jax.random.split(jax.random.fold_in(key, EDIT_STREAM))
    substituted = corrupted & (jax.random.uniform(choose_key, corrupted.shape) < editing.fraction)
    if editing.substitutes == "uniform":
        substitutes = uniform_substitutes(token_key, corrupted.shape, editing.vocabulary)
    elif editing.substitutes == "data":
        if targets is None:
            raise ValueError("\"data\" substitutes are drawn from the micro-batch's loss tokens: pass targets")
        substitutes = data_substitutes(token_key, corrupted.shape, targets, maskable)
    else:
        raise ValueError(f"Editing.substitutes must be one of {EDIT_SUBSTITUTES}, got {editing.substitutes!r}")
    return Noise(corrupted & ~substituted, ratio, substituted, substitutes)


def uniform_substitutes(key: jax.Array, shape: tuple[int, ...], vocabulary: tuple[tuple[int, int], ...]) -> jax.Array:
    """int32 `shape`: ids drawn uniformly from the union of the ranges [start, stop) in `vocabulary`."""
    if not vocabulary or any(stop <= start for start, stop in vocabulary):
        raise ValueError(f"uniform substitutes need non-empty id ranges, got {vocabulary!r}")
    starts = jnp.asarray([start for start, _ in vocabulary], jnp.int32)
    ends = jnp.cumsum(jnp.asarray([stop - start for start, stop in vocabulary], jnp.int32))  # inclusive cumulative
    drawn = jax.random.randint(key, shape, 0, ends[-1], jnp.int32)  # an index into the union
    which = jnp.searchsorted(ends, drawn, side="right")
    before = jnp.where(which > 0, ends[jnp.maximum(which - 1, 0)], 0)
    return starts[which] + drawn - before


def data_substitutes(key: jax.Array, shape: tuple[int, ...], targets: jax.Array, maskable: jax.Array) -> jax.Array:
    """int32 `shape`: each a loss token of the micro-batch (targets where `maskable`, [b, N0, B]) drawn uniformly."""
    tokens, trained = targets.reshape(-1), maskable.reshape(-1)
    loss_first = jnp.argsort(~trained, stable=True)  # the loss tokens' indices first, in order
    count = jnp.maximum(jnp.sum(trained.astype(jnp.int32)), 1)
    return tokens[loss_first[jax.random.randint(key, shape, 0, count, jnp.int32)]].astype(jnp.int32)
