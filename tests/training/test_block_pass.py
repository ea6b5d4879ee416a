"""The one training pass equals `denoise_logits` block by block (float32, random Clover checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest

from clover_jax.core.errors import FieldError
from clover_jax.training import block_diffusion_logits
from tests.conftest import MASK_ID

TOLERANCE = 1e-5  # of the logit scale


def noisy_copy(clean: np.ndarray, rng: np.random.RandomState, ratio: float = 0.5,
               substituted: float = 0.3) -> np.ndarray:
    """Positions corrupted with probability `ratio`; of those, a share `substituted` holds another
    token (token editing's input, docs/training.md) instead of the mask."""
    corrupted = rng.rand(*clean.shape) < ratio
    substitute = corrupted & (rng.rand(*clean.shape) < substituted)
    tokens = rng.randint(0, MASK_ID, clean.shape)
    return np.where(substitute, tokens, np.where(corrupted, MASK_ID, clean)).astype(np.int32)


def check_blocks(model, clean, noisy, segment, block_size, coreset, blocks):
    """Compare the one-pass logits with `denoise_logits` for `blocks`: (row, first position of the
    example, first position of the block), batched by prefix length."""
    ours = np.asarray(block_diffusion_logits(model, clean, noisy, block_size, segment_ids=segment, coreset=coreset))
    by_prefix: dict[int, list] = {}
    for row, example_start, block_start in blocks:
        by_prefix.setdefault(block_start - example_start, []).append((row, example_start, block_start))
    worst = 0.0
    for prefix_length, group in by_prefix.items():
        prefix = np.stack([clean[r, s:b] for r, s, b in group]).reshape(len(group), prefix_length)
        block = np.stack([noisy[r, b:b + block_size] for r, _, b in group])
        reference = np.asarray(model.denoise_logits(prefix, block, coreset=coreset))
        for (row, _, start), expected in zip(group, reference, strict=True):
            error = np.abs(ours[row, start:start + block_size] - expected).max() / np.abs(expected).max()
            worst = max(worst, float(error))
    assert worst < TOLERANCE, worst


@pytest.fixture(scope="module")
def small_clover(small_clover_checkpoint):
    """One GDN and one attention layer: both layer types, half the compile time of `clover`."""
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(small_clover_checkpoint, progress=False)


# The references batch blocks of one prefix length (each length compiles `denoise_logits` once).
def test_blocks_smaller_than_the_conv_window_read_the_clean_stream_over_several_blocks(small_clover):
    rng = np.random.RandomState(0)
    clean = rng.randint(0, MASK_ID, (2, 10)).astype(np.int32)
    noisy = noisy_copy(clean, rng)
    blocks = [(0, 0, 0), (1, 0, 0), (0, 0, 4), (1, 0, 4), (0, 0, 8), (1, 0, 8)]
    check_blocks(small_clover, clean, noisy, None, 2, False, blocks)


def test_packed_examples_reset_attention_conv_gdn_state_and_positions(clover):
    rng = np.random.RandomState(1)
    clean = rng.randint(0, MASK_ID, (2, 24)).astype(np.int32)
    noisy = noisy_copy(clean, rng)
    segment = np.array([[1] * 8 + [2] * 12 + [0] * 4, [1] * 24])  # row 0: two examples, then padding
    blocks = [(0, 0, 0), (0, 8, 8), (0, 0, 4), (1, 0, 4), (0, 8, 16), (1, 0, 8)]
    check_blocks(clover, clean, noisy, segment, 4, True, blocks)


def test_left_padding_is_as_if_absent_at_a_block_size_of_16(small_clover):
    rng = np.random.RandomState(2)
    clean = rng.randint(0, MASK_ID, (2, 40)).astype(np.int32)
    noisy = noisy_copy(clean, rng, ratio=0.7)
    segment = np.array([[0] * 5 + [1] * 35, [1] * 32 + [0] * 8])  # row 0 left-padded by 5
    blocks = [(0, 5, 5), (0, 5, 21), (1, 0, 0), (1, 0, 16)]
    check_blocks(small_clover, clean, noisy, segment, 16, True, blocks)


def test_an_example_that_does_not_start_on_a_block_boundary_is_refused(clover):
    ids = np.zeros((1, 12), np.int32)
    with pytest.raises(ValueError, match="does not start at a multiple of block_size=4"):
        block_diffusion_logits(clover, ids, ids, 4, segment_ids=np.array([[1] * 6 + [2] * 6]))
    with pytest.raises(FieldError) as caught:
        block_diffusion_logits(clover, ids, ids, 0)
    assert caught.value.field == "block_size"
