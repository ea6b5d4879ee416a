"""Training batches laid out the way `decoding.generate` lays out a request (docs/design.md §4).

Blocks are aligned to absolute positions: block k of a sequence (prompt + response) covers
positions [kB, (k+1)B). A training example is one block that generation would decode — one
holding at least one response position, up to the block of the end-of-turn token — with
everything before it as the clean causal prefix (the prompt's whole blocks plus the response
blocks committed before it). Prompt tokens inside the block (the prompt tail of the first
decoded block) are decided and never masked; positions after the response are the pad token,
which generation must fill too before it can close the last block.

Prefixes are left-padded to one width per batch; `start` marks the padding, so RoPE
positions count from each sequence's first real token and padded rows leave the state as if
absent (`clover_jax.core.state`), exactly as in generation's left padding.

Each example also carries its whole clean conversation (prompt + response through the
end-of-turn token), left-padded the same way, for the next-token loss on the causal pass
(`clover_jax.training.next_token`): the layout `generate(mode="autoregressive")` runs.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from clover_jax.training.task import Example


class TrainBatch(NamedTuple):
    """b = batch, W = prefix width, B = block size, S = sequence width."""

    prefix_ids: np.ndarray      # int32 [b, W], left-padded clean prefix
    start: np.ndarray           # int32 [b], first real row of each prefix
    block_ids: np.ndarray       # int32 [b, B], the clean block (the targets)
    maskable: np.ndarray        # bool [b, B], response positions (the noise may mask them)
    sequence_ids: np.ndarray    # int32 [b, S], left-padded clean prompt + response
    sequence_start: np.ndarray  # int32 [b], first real row of each sequence
    is_response: np.ndarray     # bool [b, S], rows holding a response token (the next-token targets)


def decodable_blocks(prompt_length: int, response_length: int, block_size: int) -> range:
    """Absolute indices of the blocks generation decodes for this example."""
    return range(prompt_length // block_size, (prompt_length + response_length - 1) // block_size + 1)


def prefix_width(max_prompt: int, max_response: int, block_size: int) -> int:
    """Prefix width that fits every example's longest prefix (at least one block, so the pass
    always has causal rows)."""
    longest_prefix = (max_prompt + max_response - 1) // block_size * block_size
    return max(block_size, longest_prefix)


def sequence_width(max_prompt: int, max_response: int) -> int:
    """Width of the clean-sequence rows: the longest prompt plus the longest response."""
    return max_prompt + max_response


def make_batch(examples: Sequence[Example], block_size: int, width: int, pad_id: int,
               rng: np.random.Generator, block_indices: Sequence[int] | None = None,
               seq_width: int | None = None) -> TrainBatch:
    """One decodable block per example: uniformly chosen, or the absolute `block_indices` given;
    and each example's clean sequence, left-padded to `seq_width` (None: the longest here)."""
    batch = len(examples)
    lengths = [len(prompt) + len(response) for prompt, response in examples]
    seq_width = max(lengths) if seq_width is None else seq_width
    if max(lengths) > seq_width:
        raise ValueError(f"an example holds {max(lengths)} tokens; the sequence width is {seq_width}")
    prefix_ids = np.full((batch, width), pad_id, np.int32)
    start = np.zeros(batch, np.int32)
    block_ids = np.full((batch, block_size), pad_id, np.int32)
    maskable = np.zeros((batch, block_size), bool)
    for row, (prompt, response) in enumerate(examples):
        sequence = list(prompt) + list(response)
        blocks = decodable_blocks(len(prompt), len(response), block_size)
        index = int(rng.integers(blocks.start, blocks.stop)) if block_indices is None else block_indices[row]
        if index not in blocks:
            raise ValueError(f"block {index} is not decoded for a prompt of {len(prompt)} and a response of "
                             f"{len(response)} tokens at block size {block_size} "
                             f"(blocks {blocks.start}..{blocks.stop - 1})")
        first = index * block_size
        if first > width:
            raise ValueError(f"an example needs a prefix of {first} tokens; the batch width is {width}")
        start[row] = width - first
        prefix_ids[row, start[row]:] = sequence[:first]
        block = sequence[first:first + block_size]
        block_ids[row, :len(block)] = block
        maskable[row] = np.arange(first, first + block_size) >= len(prompt)
    sequence_ids = np.full((batch, seq_width), pad_id, np.int32)
    sequence_start = np.asarray([seq_width - length for length in lengths], np.int32)
    is_response = np.zeros((batch, seq_width), bool)
    for row, (prompt, response) in enumerate(examples):
        sequence_ids[row, sequence_start[row]:] = list(prompt) + list(response)
        is_response[row, seq_width - len(response):] = True
    return TrainBatch(prefix_ids, start, block_ids, maskable, sequence_ids, sequence_start, is_response)
