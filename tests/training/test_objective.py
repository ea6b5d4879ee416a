"""The block-diffusion objective: masking, BD3-LM weighting, the layout generate uses, and training."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.nn.model import CloverTransformer
from clover_jax.training.batches import decodable_blocks, make_batch, prefix_width
from clover_jax.training.objective import (
    NoisyBlock,
    block_diffusion_loss,
    block_logits,
    corrupt_block,
    weighted_masked_cross_entropy,
)
from clover_jax.training.recipe import Recipe, batch_source, init_params, model_config
from clover_jax.training.task import Example
from clover_jax.training.trainer import TrainConfig, Trainer
from clover_jax.training.vocabulary import build_tokenizer, special_token_ids
from tests.conftest import MASK_ID

PAD = 0


def test_corruption_masks_only_maskable_positions_and_at_least_one_per_row():
    batch, block = 512, 8
    maskable = np.ones((batch, block), bool)
    maskable[:, :3] = False  # a prompt tail
    maskable[0, :] = [False] * 7 + [True]
    ids = jnp.arange(batch * block, dtype=jnp.int32).reshape(batch, block) % 100
    noisy = corrupt_block(jax.random.key(0), ids, jnp.asarray(maskable), mask_token_id=MASK_ID, min_ratio=0.02)
    masked = np.asarray(noisy.masked)
    assert not np.any(masked & ~maskable)
    assert np.all(masked.sum(-1) >= 1) and masked[0, 7]
    np.testing.assert_array_equal(np.asarray(noisy.ids), np.where(masked, MASK_ID, ids))
    ratio = np.asarray(noisy.ratio)
    assert ratio.min() >= 0.02 and ratio.max() <= 1.0
    # each maskable position is masked with probability t, plus one forced mask when none was drawn
    t = ratio[1:]
    expected = np.mean(t + (1 - t) ** 5 / 5)
    assert abs(masked[1:, 3:].mean() - expected) < 0.03


def test_loss_is_masked_cross_entropy_weighted_by_one_over_t_and_block_size():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32)
    targets = jnp.asarray([[1, 2, 3, 4], [5, 0, 1, 2]], jnp.int32)
    masked = jnp.asarray([[True, False, True, False], [False, False, False, True]])
    ratio = jnp.asarray([0.5, 0.25], jnp.float32)
    loss, parts = weighted_masked_cross_entropy(logits, targets, NoisyBlock(targets, masked, ratio))
    log_p = jax.nn.log_softmax(logits)
    nll = lambda b, j: -float(log_p[b, j, targets[b, j]])
    first = (nll(0, 0) + nll(0, 2)) / (0.5 * 4)
    second = nll(1, 3) / (0.25 * 4)
    assert float(loss) == pytest.approx((first + second) / 2, rel=1e-6)
    assert float(parts.cross_entropy) == pytest.approx((nll(0, 0) + nll(0, 2) + nll(1, 3)) / 3, rel=1e-6)


def test_batches_hold_absolutely_aligned_blocks_with_the_clean_prefix_before_them():
    prompt, response = list(range(10, 21)), list(range(30, 36))  # P = 11, R = 6: positions 11..16
    assert list(decodable_blocks(len(prompt), len(response), 4)) == [2, 3, 4]
    width = prefix_width(len(prompt), len(response), 4)
    assert width == 16
    sequence = prompt + response
    seen = set()
    rng = np.random.default_rng(0)
    for _ in range(30):
        batch = make_batch([Example(prompt, response)], 4, width, PAD, rng)
        first = width - int(batch.start[0])
        assert first % 4 == 0 and first // 4 in (2, 3, 4)
        seen.add(first // 4)
        np.testing.assert_array_equal(batch.prefix_ids[0, batch.start[0]:], sequence[:first])
        expected_block = (sequence + [PAD] * 8)[first:first + 4]
        np.testing.assert_array_equal(batch.block_ids[0], expected_block)
        np.testing.assert_array_equal(batch.maskable[0], np.arange(first, first + 4) >= len(prompt))
    assert seen == {2, 3, 4}  # the prompt-tail block (positions 8..11), a middle one, the last one


def test_training_pass_equals_the_models_denoising_forward(clover):
    """Left padding and alignment: each row of the training pass (prefix causal, then the block,
    in one call) gives the logits `CloverModel.denoise_logits` gives for that sequence alone."""
    rng = np.random.default_rng(0)
    examples = [Example(list(rng.integers(2, 120, length)), list(rng.integers(2, 120, 6))) for length in (3, 17)]
    # row 0: the prompt-tail block 0 after an empty prefix; row 1: block 2 after a 16-token prefix
    batch = make_batch(examples, 8, prefix_width(17, 6, 8), PAD, rng, block_indices=[0, 2])
    assert list(batch.start) == [16, 0]
    noisy = np.where(rng.random(batch.block_ids.shape) < 0.5, MASK_ID, batch.block_ids)
    run = jax.jit(block_logits, static_argnames=("module", "coreset"))
    logits = run(clover.module, clover.params, jnp.asarray(batch.prefix_ids), jnp.asarray(batch.start),
                 jnp.asarray(noisy), coreset=True, coreset_top_p=0.9)
    for row in range(len(examples)):
        prefix = batch.prefix_ids[row:row + 1, batch.start[row]:]
        alone = clover.denoise_logits(prefix, noisy[row:row + 1], coreset=True, coreset_top_p=0.9)
        np.testing.assert_allclose(logits[row], alone[0], atol=2e-4, rtol=0)


def test_every_clover_block_mode_parameter_gets_a_gradient(clover):
    rng = np.random.default_rng(1)
    examples = [Example(list(rng.integers(2, 120, 10)), list(rng.integers(2, 120, 7))) for _ in range(2)]
    batch = make_batch(examples, 8, prefix_width(10, 7, 8), PAD, rng)
    loss = lambda p: block_diffusion_loss(p, clover.module, batch, jax.random.key(0), MASK_ID)[0]
    grads = jax.jit(jax.grad(loss))(clover.params)
    for name in ("conv1d_right_weight", "block_logit_scale", "memory_logit_bias", "block_size_calibration"):
        for slot in ("layer_0", "layer_1", "layer_2"):
            grad = np.asarray(grads["groups"][slot]["linear_attn"][name])
            assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0, (slot, name)


@pytest.fixture(scope="module")
def tiny_trainer_setup():
    tokenizer = build_tokenizer()
    special = special_token_ids(tokenizer)
    recipe = Recipe(hidden_size=32, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    block_sizes=(8,), block_size_weights=(1.0,),
                    train=TrainConfig(steps=30, batch_size=8, learning_rate=1e-2, warmup_steps=2, log_every=1,
                                      checkpoint_every=2))
    config = model_config(recipe, special, tokenizer.get_vocab_size())
    trainer = Trainer(CloverTransformer(config, jnp.float32), recipe.train, special["<|mask|>"])
    params = init_params(config, 0)
    fresh = lambda: jax.tree.map(lambda x: x.copy(), params)  # training donates its state's buffers
    return recipe, fresh, trainer, batch_source(recipe, tokenizer, special["<|endoftext|>"])


def test_loss_decreases_over_a_few_steps_on_a_random_tiny_model(tiny_trainer_setup):
    recipe, fresh, trainer, batches = tiny_trainer_setup
    fixed = batches(0)
    state, history = trainer.fit(trainer.init_state(fresh()), lambda step: fixed, progress=False)
    losses = [record["loss"] for record in history]
    assert len(losses) == 30 and all(math.isfinite(loss) for loss in losses)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
    # both halves of the joint objective are learned
    for name in ("diffusion_loss", "next_token_cross_entropy"):
        part = [record[name] for record in history]
        assert np.mean(part[-5:]) < 0.6 * np.mean(part[:5]), name


def test_training_resumes_from_its_orbax_checkpoint(tiny_trainer_setup, tmp_path):
    recipe, fresh, trainer, batches = tiny_trainer_setup
    short = dataclasses.replace(trainer.config, steps=6)
    trainer.config = short
    try:
        straight, _ = trainer.fit(trainer.init_state(fresh()), batches, progress=False)

        class Interrupted(Exception):
            pass

        def interrupted_at_4(step):
            if step == 4:
                raise Interrupted
            return batches(step)

        with pytest.raises(Interrupted):
            trainer.fit(trainer.init_state(fresh()), interrupted_at_4, tmp_path, progress=False)
        resumed, history = trainer.fit(trainer.init_state(fresh()), batches, tmp_path, progress=False)
    finally:
        trainer.config = recipe.train
    assert [record["step"] for record in history] == [5, 6]
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
