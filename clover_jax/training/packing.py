"""Packing examples into rows of clean tokens, each example starting at a block boundary.

An example of n tokens takes `ceil(n / B) · B` rows of a row: its last block's positions after
its last token hold the pad token, trained by the diffusion loss (decoding must fill them before
it can close the block) and not by the next-token loss. In a multi-turn example, a block that
holds the end of an assistant turn has pad targets after that end (the noisy stream learns to
close the turn), while the clean stream keeps the real transcript. Rows are filled best-fit (the
example goes to the fullest row it fits), in an order shuffled by the seed, so the packing is a
function of the data, the block size and the seed.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import numpy as np

from clover_jax.training.examples import DataError, Example

logger = logging.getLogger(__name__)


class PackedRows(NamedTuple):
    """Every packed row of one block size, NumPy [rows, seq_len] (the fields of `batches.TrainRows`
    but the noisy blocks, which are chosen per step): clean_ids, segment, targets, maskable,
    next_token; and `examples` int [rows], the examples each row holds."""

    clean_ids: np.ndarray
    segment: np.ndarray
    targets: np.ndarray
    maskable: np.ndarray
    next_token: np.ndarray
    examples: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.clean_ids.shape[0]


def fit_examples(examples: Sequence[Example], *, seq_len: int, block_size: int, truncate: bool) -> list[Example]:
    """`examples` checked against the row length: one longer than `seq_len` is a `DataError`
    naming its line, or with `truncate` cut at the last block boundary that fits (logged with the count)."""
    fitted, cut = [], 0
    limit = seq_len // block_size * block_size
    for example in examples:
        if len(example.ids) > seq_len or -(-len(example.ids) // block_size) * block_size > seq_len:
            if not truncate:
                file, _, line = example.source.rpartition(", line ")
                raise DataError(file, int(line or 0), f"the example holds {len(example.ids)} tokens, more than "
                                f"seq_len={seq_len} in whole blocks of {block_size}; raise seq_len or pass "
                                "truncate=True")
            example = Example(example.ids[:limit], example.loss[:limit],
                              tuple(min(end, limit) for end in example.turn_ends), example.source)
            cut += 1
        if example.loss.any():
            fitted.append(example)
    if cut:
        logger.info("truncate=True: %d of %d examples cut to %d tokens", cut, len(examples), limit)
    return fitted


def pack(examples: Sequence[Example], *, seq_len: int, block_size: int, pad_id: int, seed: int) -> PackedRows:
    """Pack `examples` (each fits `seq_len`, see `fit_examples`) into rows."""
    if seq_len % block_size:
        raise ValueError(f"seq_len={seq_len} must be a multiple of block_size={block_size}")
    blocks_per_row = seq_len // block_size
    order = np.random.default_rng([seed, block_size]).permutation(len(examples))
    rows: list[list[int]] = []          # example indices per row
    by_room: dict[int, list[int]] = {}  # free blocks -> rows with that much room
    for index in order:
        need = -(-len(examples[index].ids) // block_size)
        if need > blocks_per_row:
            raise ValueError(f"{examples[index].source or 'an example'}: {len(examples[index].ids)} tokens do not "
                             f"fit a row of {seq_len} (check them with fit_examples first)")
        room = next((free for free in range(need, blocks_per_row) if by_room.get(free)), None)
        if room is None:
            rows.append([])
            row, room = len(rows) - 1, blocks_per_row
        else:
            row = by_room[room].pop()
        rows[row].append(int(index))
        by_room.setdefault(room - need, []).append(row)
    shape = (len(rows), seq_len)
    packed = PackedRows(np.full(shape, pad_id, np.int32), np.zeros(shape, np.int32), np.full(shape, pad_id, np.int32),
                        np.zeros(shape, bool), np.zeros(shape, bool), np.asarray([len(r) for r in rows], np.int32))
    for row, members in enumerate(rows):
        offset = 0
        for number, index in enumerate(members, start=1):
            offset = _place(packed, row, offset, examples[index], number, block_size=block_size, pad_id=pad_id)
    return packed


def _place(packed: PackedRows, row: int, offset: int, example: Example, number: int, *, block_size: int,
           pad_id: int) -> int:
    """Write `example` at `offset` of `row`; returns the offset after its last block."""
    length = len(example.ids)
    end = offset + -(-length // block_size) * block_size
    span = slice(offset, offset + length)
    packed.clean_ids[row, span] = example.ids
    packed.segment[row, offset:end] = number
    packed.targets[row, span] = example.ids
    packed.maskable[row, span] = example.loss
    packed.next_token[row, offset + 1:offset + length] = example.loss[1:]
    for turn_end in example.turn_ends + (length,):  # pad targets from a turn's end to the end of its block
        block_end = offset + -(-turn_end // block_size) * block_size
        packed.targets[row, offset + turn_end:block_end] = pad_id
        packed.maskable[row, offset + turn_end:block_end] = True
    return end
