"""The training batches: packed rows drawn in a deterministic, checkpointable order.

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

from typing import NamedTuple, Sequence

import numpy as np

from clover_jax.training.loss import TrainRows
from clover_jax.training.packing import PackedRows


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
