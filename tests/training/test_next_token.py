"""The next-token objective on the causal pass, and the joint objective that adds it to block diffusion."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from clover_jax.training.batches import make_batch, prefix_width
from clover_jax.training.next_token import next_token_loss
from clover_jax.training.objective import block_diffusion_loss, joint_loss
from clover_jax.training.task import Example
from tests.conftest import MASK_ID

PAD = 0
BLOCK_MODE = ("conv1d_right_weight", "block_logit_scale", "memory_logit_bias", "block_size_calibration")


def examples(seed: int) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [Example(list(rng.integers(2, 120, p)), list(rng.integers(2, 120, r))) for p, r in ((9, 7), (14, 5))]


def test_clean_sequences_are_left_padded_with_their_response_rows_marked():
    prompt, response = [11, 12, 13], [21, 22]
    batch = make_batch([Example(prompt, response)], 4, 4, PAD, np.random.default_rng(0), seq_width=8)
    np.testing.assert_array_equal(batch.sequence_ids[0], [PAD, PAD, PAD, 11, 12, 13, 21, 22])
    assert int(batch.sequence_start[0]) == 3
    np.testing.assert_array_equal(batch.is_response[0], [False] * 6 + [True] * 2)
    with pytest.raises(ValueError, match="5 tokens; the sequence width is 4"):
        make_batch([Example(prompt, response)], 4, 4, PAD, np.random.default_rng(0), seq_width=4)


def test_next_token_loss_is_the_cross_entropy_of_causal_forward_logits_on_response_tokens(clover):
    """Left padding and the shift: the loss equals a float64 cross-entropy of `CloverModel.forward`
    run on each conversation alone, over the response tokens (each predicted by the row before)."""
    data = examples(0)
    batch = make_batch(data, 8, prefix_width(14, 7, 8), PAD, np.random.default_rng(0), seq_width=24)
    parts = jax.jit(next_token_loss, static_argnames="module")(
        clover.params, clover.module, batch.sequence_ids, batch.sequence_start, batch.is_response)
    nll, hits = [], []
    for prompt, response in data:
        logits = np.asarray(clover.forward(np.asarray([prompt + response])), np.float64)[0]
        for offset, target in enumerate(response):
            row = logits[len(prompt) + offset - 1]
            log_z = np.log(np.sum(np.exp(row - row.max()))) + row.max()
            nll.append(log_z - row[target])
            hits.append(np.argmax(row) == target)
    assert float(parts.cross_entropy) == pytest.approx(np.mean(nll), rel=1e-4)
    assert float(parts.accuracy) == pytest.approx(np.mean(hits))


def test_joint_loss_adds_the_weighted_next_token_loss_and_every_parameter_gets_a_gradient(clover):
    batch = make_batch(examples(1), 8, prefix_width(14, 7, 8), PAD, np.random.default_rng(1), seq_width=24)
    key, weight = jax.random.key(0), 0.7

    def losses(params):
        joint, parts = joint_loss(params, clover.module, batch, key, MASK_ID, next_token_weight=weight)
        diffusion = block_diffusion_loss(params, clover.module, batch, key, MASK_ID)[0]
        causal = next_token_loss(params, clover.module, batch.sequence_ids, batch.sequence_start,
                                 batch.is_response).cross_entropy
        return joint, parts, diffusion, causal

    joint, parts, diffusion, causal = jax.jit(losses)(clover.params)
    assert float(joint) == pytest.approx(float(diffusion) + weight * float(causal), rel=1e-5)
    assert float(parts.diffusion_loss) == pytest.approx(float(diffusion), rel=1e-6)

    grads, causal_grads = jax.jit(lambda p: (jax.grad(lambda q: losses(q)[0])(p),
                                             jax.grad(lambda q: losses(q)[3])(p)))(clover.params)
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
        grad = np.asarray(grad)
        assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0, jax.tree_util.keystr(path)
    # The causal pass reaches the backbone and head, never the block-mode tensors.
    assert np.abs(np.asarray(causal_grads["lm_head"])).max() > 0
    for slot in ("layer_0", "layer_1", "layer_2"):
        for name in BLOCK_MODE:
            assert not np.any(np.asarray(causal_grads["groups"][slot]["linear_attn"][name])), (slot, name)
