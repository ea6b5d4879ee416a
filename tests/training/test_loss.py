"""The loss of the one pass equals per-block losses built on the decoding passes: value and gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.core.state import empty_state
from clover_jax.nn.model import TransformerPasses
from clover_jax.training.batches import Normalisers, TrainRows, block_rows
from clover_jax.training.block_pass import differentiable, training_module
from clover_jax.training.cross_entropy import (
    CHUNK_LOGIT_BYTES,
    DEFAULT_CHUNK_ROWS,
    chunk_rows_for,
    chunked_cross_entropy,
)
from clover_jax.training.loss import LossSettings, loss_parts
from clover_jax.training.masking import Editing, draw_noise
from tests.conftest import MASK_ID

B, L, PAD = 4, 24, 0


@pytest.fixture(scope="module")
def model(small_clover_checkpoint):
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(small_clover_checkpoint, progress=False)


def packed_rows() -> TrainRows:
    """Row 0: examples of 10 and 6 tokens (tails padded to their blocks) and a padding block; row 1:
    one example of 24 tokens. Prompts untrained; a noisy slot past the row is unused."""
    rng = np.random.RandomState(1)
    clean = rng.randint(0, MASK_ID, (2, L)).astype(np.int32)
    segment = np.zeros((2, L), np.int32)
    segment[0, :12], segment[0, 12:20], segment[1] = 1, 2, 1
    clean[0, 10:12] = clean[0, 18:20] = PAD
    targets = clean.copy()
    maskable = segment > 0
    maskable[0, :3] = maskable[0, 12:14] = maskable[1, :5] = False
    next_token = maskable.copy()
    next_token[0, 10:12] = next_token[0, 18:20] = False
    blocks = np.array([[1, 2, 3, 4, 99, 99], [1, 2, 3, 4, 5, 99]], np.int32)  # the blocks with loss tokens
    return TrainRows(*map(jnp.asarray, (clean, segment, targets, maskable, next_token, blocks)))


def reference_loss(params, passes, rows: TrainRows, noise, *, next_token_weight, count, keep_weight=0.0):
    """Σ over noisy blocks of the block's weighted cross-entropy at its corrupted (masked or
    substituted) positions on the decoding pass (its example's clean prefix, then the noisy block),
    plus `keep_weight` times the cross-entropy at its kept loss positions, over the same
    normaliser, plus the next-token cross-entropy of each example's causal pass. All blocks in one
    batch: prefixes left-padded."""
    clean, segment = np.asarray(rows.clean_ids), np.asarray(rows.segment)
    masked, ratio = np.asarray(noise.masked), np.asarray(noise.ratio)
    substituted = np.zeros_like(masked) if noise.substituted is None else np.asarray(noise.substituted)
    substitutes = None if noise.substitutes is None else np.asarray(noise.substitutes)
    indices = np.tile(np.asarray(rows.block_index), (1, 2))
    prefixes, blocks, weights, targets, starts, kept = [], [], [], [], [], []
    for row, slots in enumerate(indices):
        for slot, index in enumerate(slots):
            if index >= L // B:
                continue
            first = int(np.argmax(segment[row] == segment[row, index * B]))
            prefix = clean[row, first:index * B]
            prefixes.append(np.pad(prefix, (L - len(prefix), 0)))
            starts.append(L - len(prefix))
            target = np.asarray(rows.targets)[row, index * B:(index + 1) * B]
            block = np.where(masked[row, slot], MASK_ID, target)
            if substitutes is not None:
                block = np.where(substituted[row, slot], substitutes[row, slot], block)
            blocks.append(block)
            targets.append(target)
            corrupted = masked[row, slot] | substituted[row, slot]
            weights.append(corrupted / ratio[row, slot])
            kept.append(np.asarray(rows.maskable)[row, index * B:(index + 1) * B] & ~corrupted)
    state = empty_state(passes.config, len(blocks), L + B, jnp.float32, np.asarray(starts))
    logits = passes.commit_and_denoise(params, jnp.asarray(np.stack(prefixes)), jnp.asarray(np.stack(blocks)), state,
                                       coreset=True, coreset_top_p=jnp.float32(0.9)).logits
    nll = cross_entropy(logits, np.stack(targets))
    diffusion = jnp.sum(nll * np.stack(weights)) / count.loss_tokens
    keep = jnp.sum(nll * np.stack(kept)) / count.loss_tokens
    # next token: each example alone, left-padded
    examples = [(row, np.flatnonzero(segment[row] == number)) for row in range(2)
                for number in np.unique(segment[row][segment[row] > 0])]
    ids = np.stack([np.pad(clean[row, where], (L - len(where), 0)) for row, where in examples])
    next_token = np.asarray(rows.next_token)
    trained = np.stack([np.pad(next_token[row, where], (L - len(where), 0)) for row, where in examples])
    state = empty_state(passes.config, len(examples), L, jnp.float32, np.asarray([L - len(w) for _, w in examples]))
    causal = passes.causal(params, jnp.asarray(ids), state).logits
    next_nll = cross_entropy(causal[:, :-1], ids[:, 1:])
    next_token = jnp.sum(next_nll * trained[:, 1:]) / count.next_tokens
    return diffusion + next_token_weight * next_token + keep_weight * keep, (diffusion, next_token, keep)


def cross_entropy(logits, targets):
    logits = logits.at[..., MASK_ID].set(-jnp.inf)
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, jnp.asarray(targets)[..., None], -1)[..., 0]


# Token editing (LLaDA2.1): of the corrupted positions 40% hold a token drawn from the batch's loss
# tokens, and the kept loss positions add their cross-entropy at weight 0.5.
EDITING = Editing(0.4, keep_weight=0.5, substitutes="data")


@pytest.mark.parametrize("editing", [None, EDITING], ids=["masks", "editing"])
def test_loss_and_gradient_equal_per_block_losses_on_the_decoding_passes(model, editing):
    rows = packed_rows()
    targets, maskable = block_rows(rows, B)
    noise = draw_noise(jax.random.key(3), maskable, min_ratio=0.02, complementary=True, editing=editing,
                       targets=targets)
    if editing is not None:  # the draw substituted some positions, and not always the original token
        assert np.asarray(noise.substituted).any() and np.asarray(noise.masked).any()
        assert np.any(np.asarray(noise.substitutes) != np.asarray(jnp.tile(targets, (1, 2, 1))))
    segment, next_token = np.asarray(rows.segment), np.asarray(rows.next_token)
    count = Normalisers(jnp.float32(np.sum(np.asarray(maskable))),
                        jnp.float32(np.sum(next_token[:, 1:] & (segment[:, 1:] == segment[:, :-1]))))
    settings = LossSettings(block_size=B, mask_token_id=MASK_ID, coreset=True, complementary=True,
                            loss_weighting="inverse_t", next_token_weight=0.7, load_balance_weight=0.0,
                            editing=editing)
    module = training_module(model.module)

    @jax.jit
    def ours(params):
        parts = loss_parts(params, module, rows, noise, count, settings=settings, coreset_top_p=jnp.float32(0.9))
        return parts.loss, (parts.diffusion_loss, parts.next_token_loss, parts.keep_loss)

    passes = TransformerPasses(differentiable(model.module).clone(layer_loop="scan"))
    keep_weight = 0.0 if editing is None else editing.keep_weight
    reference = jax.jit(functools.partial(reference_loss, passes=passes, rows=rows, noise=noise, next_token_weight=0.7,
                                          count=count, keep_weight=keep_weight))
    (value, parts), grads = jax.value_and_grad(ours, has_aux=True)(model.params)
    (expected, expected_parts), expected_grads = jax.value_and_grad(reference, has_aux=True)(model.params)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    compared = 3 if editing is not None else 2  # without editing the loss has no keep term (ours reports 0)
    np.testing.assert_allclose(np.asarray(parts)[:compared], np.asarray(expected_parts)[:compared], rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(expected_grads))
    differences = jax.tree.leaves(jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads,
                                                         expected_grads))
    assert max(differences) / scale < 1e-4


def test_the_complement_masks_exactly_what_the_first_copy_left_and_each_block_at_least_once():
    maskable = jnp.asarray(np.random.RandomState(0).rand(64, 3, 8) < 0.7)
    noise = draw_noise(jax.random.key(0), maskable, min_ratio=1e-3, complementary=True)
    first, second = np.split(np.asarray(noise.masked), 2, axis=1)
    np.testing.assert_array_equal(first | second, np.asarray(maskable))
    assert not np.any(first & second)
    has = np.asarray(maskable).any(-1)
    assert np.all(first.any(-1)[has])
    np.testing.assert_allclose(np.asarray(noise.ratio)[:, 3:], 1 - np.asarray(noise.ratio)[:, :3], rtol=1e-6)


def test_without_editing_the_masks_are_drawn_as_before_and_editing_corrupts_the_same_positions():
    """Fraction 0 is today's draw bit for bit (resumption and the bundled recipe hold); with editing
    the corrupted set is the same, split between masks and substitutes at about r_edit, and uniform
    substitutes stay inside the given id ranges."""
    maskable = jnp.asarray(np.random.RandomState(0).rand(64, 3, 8) < 0.7)
    targets = jnp.asarray(np.random.RandomState(1).randint(20, 30, (64, 3, 8)), jnp.int32)
    plain = draw_noise(jax.random.key(4), maskable, min_ratio=1e-3, complementary=True)
    off = draw_noise(jax.random.key(4), maskable, min_ratio=1e-3, complementary=True, editing=Editing(0.0))
    assert off.substituted is None
    np.testing.assert_array_equal(np.asarray(off.masked), np.asarray(plain.masked))
    vocabulary = ((0, 5), (7, 9), (40, 41))
    edited = draw_noise(jax.random.key(4), maskable, min_ratio=1e-3, complementary=True,
                        editing=Editing(0.3, vocabulary=vocabulary))
    np.testing.assert_array_equal(np.asarray(edited.corrupted), np.asarray(plain.masked))
    substituted, masked = np.asarray(edited.substituted), np.asarray(edited.masked)
    assert not np.any(substituted & masked)
    assert abs(substituted.sum() / np.asarray(plain.masked).sum() - 0.3) < 0.05
    drawn = np.asarray(edited.substitutes)[substituted]
    assert set(np.unique(drawn)) == {0, 1, 2, 3, 4, 7, 8, 40}
    data = draw_noise(jax.random.key(4), maskable, min_ratio=1e-3, complementary=True,
                      editing=Editing(0.3, substitutes="data"), targets=targets)
    assert set(np.unique(np.asarray(data.substitutes))) <= set(np.unique(np.asarray(targets)[np.asarray(maskable)]))


def test_chunked_cross_entropy_has_the_value_and_gradient_of_the_whole_logits():
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(37, 16), jnp.float32)
    head = jnp.asarray(rng.randn(50, 16), jnp.float32)
    targets = jnp.asarray(rng.randint(0, 49, 37))

    def whole(hidden, head):
        return jnp.sum(cross_entropy_with(hidden @ head.T, targets, excluded=49))

    def chunked(hidden, head):
        return jnp.sum(chunked_cross_entropy(hidden, head, targets, excluded_token=49, chunk_rows=8).nll)

    value, grads = jax.value_and_grad(chunked, argnums=(0, 1))(hidden, head)
    expected, expected_grads = jax.value_and_grad(whole, argnums=(0, 1))(hidden, head)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [50, 151_936, 248_320, 10**8])
def test_the_cross_entropy_chunk_follows_the_vocabulary(vocab):
    """The most rows (a power of two, 8 to DEFAULT_CHUNK_ROWS) whose float32 logits fit CHUNK_LOGIT_BYTES."""
    rows = chunk_rows_for(vocab)
    assert rows & (rows - 1) == 0 and 8 <= rows <= DEFAULT_CHUNK_ROWS
    assert rows == 8 or rows * 4 * vocab <= CHUNK_LOGIT_BYTES
    assert rows == DEFAULT_CHUNK_ROWS or 2 * rows * 4 * vocab > CHUNK_LOGIT_BYTES


def cross_entropy_with(logits, targets, excluded):
    logits = logits.at[..., excluded].set(-jnp.inf)
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]


_PLAIN: dict = {}


@pytest.mark.parametrize("choice", ["full", "layer", "dots", "layer_offload"])
def test_remat_recomputes_the_layer_groups_to_the_same_loss_and_gradient(model, choice):
    rows = packed_rows()
    _, maskable = block_rows(rows, B)
    noise = draw_noise(jax.random.key(5), maskable, min_ratio=1e-3, complementary=True)
    count = Normalisers(jnp.float32(10.0), jnp.float32(10.0))
    settings = LossSettings(block_size=B, mask_token_id=MASK_ID, coreset=True)

    def gradient(remat):
        module = training_module(model.module, remat=remat)
        loss = lambda params: loss_parts(params, module, rows, noise, count, settings=settings,
                                         coreset_top_p=jnp.float32(0.9)).loss
        traced = str(jax.make_jaxpr(jax.grad(loss))(model.params))
        return jax.jit(jax.value_and_grad(loss))(model.params), traced

    if "none" not in _PLAIN:  # the reference, computed once for the three choices
        _PLAIN["none"] = gradient("none")
    ((plain, plain_grads), plain_trace), ((remat, remat_grads), remat_trace) = _PLAIN["none"], gradient(choice)
    # the switch reaches the program: the layer groups add rematerialised calls (the chunked
    # cross-entropy has its own in both)
    assert remat_trace.count("remat2[") > plain_trace.count("remat2[")
    assert ("MemorySpace.Host" in remat_trace) == (choice == "layer_offload")  # the layers' inputs go to host memory
    np.testing.assert_allclose(float(remat), float(plain), rtol=1e-6)
    # Recomputed activations are fused and rounded differently: a few elements of a leaf differ in
    # float32's last bits, so each leaf is compared at 1e-5 of its own scale.
    for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(plain_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_uniform_substitutes_come_from_the_tokenizers_ordinary_ids():
    """The trainer's vocabulary for "uniform" substitutes: every id below the model's vocabulary but
    the special ones (<|endoftext|>, <|im_start|>, <|im_end|>, <|mask|>, <|unk|> in the bundled
    tokenizer); <think> and </think> stay, as Qwen's tokenizers keep them in decoded text."""
    from clover_jax.core.bundled import bundled_model_path
    from clover_jax.core.config import CloverConfig
    from clover_jax.text.tokenizer import Tokenizer
    from clover_jax.training.trainer import substitute_vocabulary

    path = bundled_model_path()
    tokenizer, config = Tokenizer.from_pretrained(path), CloverConfig.from_pretrained(path)
    ranges = substitute_vocabulary(tokenizer, config)
    allowed = {index for start, stop in ranges for index in range(start, stop)}
    special = {tokenizer.token_to_id(token) for token in
               ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|unk|>")}
    assert allowed == set(range(min(len(tokenizer), config.vocab_size))) - special
    assert {tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")} <= allowed
