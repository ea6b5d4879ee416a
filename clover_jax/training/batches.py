"""The training batches: `TrainRows`, what the loss counts in them, and packed rows drawn in a
deterministic, checkpointable order.

Each optimizer step draws its block size (by `block_size_weights`, from a generator seeded by
(seed, step)) and the next `batch_size` rows of that size's packing. The rows of one block size
come in the order of a grain `MapDataset` — shuffled per epoch by the seed, repeated, read by
index — so a batch is a function of (seed, step, how many batches of that size came before):
the iterator's whole position is that count per block size (`DataPosition`), saved with every
checkpoint and restored on resume.

The noisy stream of a row holds the blocks that have loss tokens (a block of prompt only is
never denoised), or with `max_noisy_blocks=k` up to k of each example's, chosen by the same
seeded generator. Its width, static for the compiled step, is the largest any row of the
packing needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.training.packing import PackedRows


class TrainRows(NamedTuple):
    """One batch of packed rows (`clover_jax.training.packing`). b = rows, L = clean tokens per row,
    N0 = noisy blocks of the first copy per row.

    clean_ids: int32 [b, L], the clean stream (the real transcript);
    segment: int32 [b, L], each token's example (0: padding after the last example);
    targets: int32 [b, L], what each position of a noisy block should become: the clean token, or
        the pad token after an assistant turn's end inside its block and after an example's last token;
    maskable: bool [b, L], the diffusion loss tokens (the noise may mask them);
    next_token: bool [b, L], the next-token targets (token p, predicted by row p − 1 of its example);
    block_index: int32 [b, N0], the clean blocks the noisy stream denoises (an index past the row's
        blocks is an unused slot)."""

    clean_ids: jax.Array
    segment: jax.Array
    targets: jax.Array
    maskable: jax.Array
    next_token: jax.Array
    block_index: jax.Array


class Normalisers(NamedTuple):
    """float32 []: the loss tokens (once per pair of copies) and next-token targets of the global batch."""

    loss_tokens: jax.Array
    next_tokens: jax.Array


def next_token_targets(rows: TrainRows) -> Any:
    """bool [b, L − 1]: whether clean row p predicts token p + 1 — a next-token target of the same
    example (NumPy or JAX arrays alike)."""
    return rows.next_token[:, 1:] & (rows.segment[:, 1:] == rows.segment[:, :-1])


def block_rows(rows: TrainRows, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The first copy's noisy blocks: (targets int32 [b, N0, B], maskable bool [b, N0, B]); an
    unused slot has nothing maskable."""
    batch, length = rows.clean_ids.shape
    in_row = rows.block_index < length // block_size
    positions = jnp.where(in_row, rows.block_index, 0)[:, :, None] * block_size + jnp.arange(block_size)
    gather = lambda array: jnp.take_along_axis(array, positions.reshape(batch, -1), axis=1).reshape(positions.shape)
    return gather(rows.targets), gather(rows.maskable) & in_row[:, :, None]


def normalisers(rows: TrainRows, block_size: int) -> Normalisers:
    """The global batch's loss tokens (in its noisy blocks) and next-token targets, counted on the
    host with NumPy (the step gathers the blocks again on the device, `block_rows`)."""
    maskable, block_index = np.asarray(rows.maskable), np.asarray(rows.block_index)
    batch, length = maskable.shape
    blocks = length // block_size
    in_row = block_index < blocks
    per_block = maskable[:, :blocks * block_size].reshape(batch, blocks, block_size)
    chosen = np.take_along_axis(per_block, np.where(in_row, block_index, 0)[:, :, None], axis=1) & in_row[:, :, None]
    predicts = next_token_targets(TrainRows(*(np.asarray(array) for array in rows)))
    return Normalisers(np.float32(max(int(np.sum(chosen)), 1)), np.float32(max(int(np.sum(predicts)), 1)))


class DataPosition(NamedTuple):
    """step: the next optimizer step; drawn: int [block sizes], batches drawn at each size so far."""

    step: int
    drawn: tuple[int, ...]


class Batch(NamedTuple):
    """One optimizer step's rows: block_size, rows (`TrainRows`, NumPy [batch_size, ...])."""

    block_size: int
    rows: TrainRows


def noisy_width(packed: PackedRows, block_size: int, max_noisy_blocks: int | None) -> int:
    """The noisy stream's width in blocks (first copy): the most blocks with loss tokens of any row,
    or with `max_noisy_blocks` at most that many per example of a row."""
    with_loss = packed.maskable.reshape(packed.num_rows, -1, block_size).any(-1).sum(-1)
    widest = int(with_loss.max()) if packed.num_rows else 1
    if max_noisy_blocks is not None:
        widest = min(widest, max_noisy_blocks * int(packed.examples.max()))
    return max(widest, 1)


def choose_blocks(packed: PackedRows, rows: np.ndarray, *, block_size: int, width: int, max_noisy_blocks: int | None,
                  rng: np.random.Generator) -> np.ndarray:
    """int32 [len(rows), width]: each row's noisy blocks (its blocks with loss tokens, up to
    `max_noisy_blocks` per example chosen at random), then unused slots (index past the row)."""
    blocks_per_row = packed.clean_ids.shape[1] // block_size
    chosen = np.full((len(rows), width), blocks_per_row, np.int32)
    if width == 0:
        return chosen
    for slot, row in enumerate(rows):
        has_loss = packed.maskable[row].reshape(-1, block_size).any(-1)
        example = packed.segment[row, ::block_size]
        picked: list[int] = []
        for number in np.unique(example[has_loss]):
            candidates = np.flatnonzero(has_loss & (example == number))
            if max_noisy_blocks is not None and len(candidates) > max_noisy_blocks:
                candidates = np.sort(rng.choice(candidates, max_noisy_blocks, replace=False))
            picked.extend(int(block) for block in candidates)
        chosen[slot, :len(picked)] = picked
    return chosen


class BatchIterator:
    """The batches of a run, from a position (`DataPosition`), for one or several block sizes.

    packings: {block_size: PackedRows}; weights: the draw probability of each size (in the order
    of `block_sizes`)."""

    def __init__(self, packings: dict[int, PackedRows], *, block_sizes: Sequence[int], weights: Sequence[float],
                 batch_size: int, seed: int, max_noisy_blocks: int | None, noisy: bool = True):
        import grain  # the shuffled, repeated, random-access order of each size's rows

        self.packings, self.block_sizes = packings, tuple(block_sizes)
        self.weights = np.asarray(weights, np.float64) / np.sum(weights)
        self.batch_size, self.seed, self.max_noisy_blocks = batch_size, seed, max_noisy_blocks
        self.order = {size: grain.MapDataset.range(packings[size].num_rows).shuffle(seed=seed + size).repeat()
                      for size in self.block_sizes}
        # noisy=False: rows without a noisy stream (next-token training of a base model)
        self.widths = {size: noisy_width(packings[size], size, max_noisy_blocks) if noisy else 0
                       for size in self.block_sizes}
        self.position = DataPosition(0, (0,) * len(self.block_sizes))

    def block_size_at(self, step: int) -> int:
        if len(self.block_sizes) == 1:
            return self.block_sizes[0]
        return self.block_sizes[int(np.random.default_rng([self.seed, step, 1]).choice(len(self.block_sizes),
                                                                                        p=self.weights))]

    def next(self) -> Batch:
        """The batch at the current position; the position moves past it."""
        step, drawn = self.position
        size = self.block_size_at(step)
        which = self.block_sizes.index(size)
        first = drawn[which] * self.batch_size
        rows = np.asarray([self.order[size][index] for index in range(first, first + self.batch_size)])
        packed = self.packings[size]
        blocks = choose_blocks(packed, rows, block_size=size, width=self.widths[size],
                               max_noisy_blocks=self.max_noisy_blocks, rng=np.random.default_rng([self.seed, step, 2]))
        self.position = DataPosition(step + 1, tuple(count + (i == which) for i, count in enumerate(drawn)))
        return Batch(size, TrainRows(packed.clean_ids[rows], packed.segment[rows], packed.targets[rows],
                                     packed.maskable[rows], packed.next_token[rows], blocks))
