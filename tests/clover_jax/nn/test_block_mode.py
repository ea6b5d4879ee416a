"""Clover block mode (docs/design.md §3, §5) against the naive loop reference, and its structural properties."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clover_jax.model.clover_model as clover_model_module
from clover_jax.nn.gdn import block_mode_attention
from tests.conftest import MASK_ID, token_ids
from tests.reference_model import NaiveClover

BLOCK = 8
TOLERANCE = 1e-4


def block_ids(seed: int, batch: int = 2) -> np.ndarray:
    """A block with decided tokens and masks in between, different per sequence."""
    ids = token_ids(batch, BLOCK, MASK_ID, seed=seed)  # ids below the mask id
    ids[0, [1, 2, 5, 7]] = MASK_ID
    if batch > 1:
        ids[1, [0, 3, 4]] = MASK_ID
    return ids


@pytest.mark.parametrize("prefix_length", [0, 3, 70])  # none, a few, more than one GDN chunk
@pytest.mark.parametrize("coreset", [True, False])
def test_denoise_logits_match_naive_reference(clover, prefix_length, coreset):
    prefix = token_ids(2, prefix_length, MASK_ID, seed=10 + prefix_length)
    block = block_ids(seed=prefix_length)
    state = clover.init_state(2, prefix_length + BLOCK)
    if prefix_length:
        _, state = clover.extend(state, prefix, logits="none")
    out = clover.denoise(state, block, coreset=coreset)
    np.testing.assert_array_equal(out.logits, clover.denoise_logits(prefix, block, coreset=coreset))

    reference = NaiveClover(clover.config, clover.params)
    top_p = clover.config.moe_block_coreset_top_p if coreset else None
    for sequence in range(2):
        naive_state = reference.prefill(prefix[sequence])
        reference.min_margin = np.inf  # judge the block's decisions (routing, coreset cut)
        logits, distinct = reference.denoise(naive_state, block[sequence], prefix_length, top_p)
        assert reference.min_margin > 1e-5  # far from ties, so float32 and float64 decide alike
        np.testing.assert_allclose(out.logits[sequence], logits, atol=TOLERANCE, rtol=0)
        assert list(np.asarray(out.distinct_experts[:, sequence])) == distinct


def test_zero_right_conv_equals_no_right_branch(clover_model):
    """The backbone checkpoint has no Clover tensors: conv1d_right takes its zero default."""
    assert not np.any(np.asarray(clover_model.params["groups"]["layer_0"]["linear_attn"]["conv1d_right_weight"]))
    prefix, block = token_ids(1, 5, 127, seed=3), block_ids(seed=4, batch=1)
    ours = clover_model.denoise_logits(prefix, block, coreset=False)
    reference = NaiveClover(clover_model.config, clover_model.params, right_branch=False)
    logits, _ = reference.denoise(reference.prefill(prefix[0]), block[0], 5)
    np.testing.assert_allclose(ours[0], logits, atol=TOLERANCE, rtol=0)


def test_block_attention_with_empty_state_and_defaults_is_softmax_with_a_null_slot():
    rng = np.random.RandomState(0)
    batch, block, heads, key_dim, value_dim = 2, 6, 3, 16, 16  # dot_product_attention wants equal dims
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    query = jnp.asarray(unit(rng.randn(batch, block, heads, key_dim)), jnp.float32)
    key = jnp.asarray(unit(rng.randn(batch, block, heads, key_dim)), jnp.float32)
    value = jnp.asarray(rng.randn(batch, block, heads, value_dim), jnp.float32)
    defaults = (jnp.full((heads,), math.log(math.sqrt(key_dim))), jnp.zeros(heads), jnp.zeros(heads))
    ours = block_mode_attention(query, key, value, jnp.zeros((batch, heads, key_dim, value_dim)), *defaults)
    # A null slot: a key giving logit 0 and a zero value, in plain bidirectional softmax attention.
    null_key = jnp.concatenate([jnp.zeros((batch, 1, heads, key_dim)), key], axis=1)
    null_value = jnp.concatenate([jnp.zeros((batch, 1, heads, value_dim)), value], axis=1)
    expected = jax.nn.dot_product_attention(query, null_key, null_value, scale=math.sqrt(key_dim))
    np.testing.assert_allclose(ours, expected, atol=1e-6)


def test_prefix_rows_do_not_see_block_tokens_and_block_rows_see_later_ones(clover):
    prefix = token_ids(1, 12, MASK_ID, seed=5)
    first, second = block_ids(seed=6, batch=1), block_ids(seed=6, batch=1)
    second[0, -1] = (second[0, -1] + 1) % MASK_ID  # change only the last block token
    state = clover.init_state(1, 12 + BLOCK)

    def one_pass(block):  # 12 causal rows then the block, logits for every row
        ids = jnp.asarray(np.concatenate([prefix, block], axis=1))
        return clover_model_module.run_pass(clover.passes, clover.params, ids, state, num_causal=12,
                                            logits_from=0, coreset=True, coreset_top_p=jnp.float32(0.9)).logits

    a, b = one_pass(first), one_pass(second)
    np.testing.assert_array_equal(a[:, :12], b[:, :12])
    assert np.max(np.abs(a[0, 12] - b[0, 12])) > 1e-3  # the first block row sees the last token


def test_prefill_then_commit_equals_one_longer_prefill(clover):
    prefix, block = token_ids(2, 5, MASK_ID, seed=7), token_ids(2, BLOCK, MASK_ID, seed=8)
    in_turn = clover.init_state(2, 16)
    _, in_turn = clover.extend(in_turn, prefix, logits="none")
    _, in_turn = clover.extend(in_turn, block, logits="none")
    _, at_once = clover.extend(clover.init_state(2, 16), np.concatenate([prefix, block], axis=1), logits="none")
    assert int(in_turn.length) == int(at_once.length) == 13
    # Float32 rounding differs between the two ways of cutting the rows (GDN chunks of 5 + 8 vs 13
    # rows, matmuls of other shapes); through eight random layers it reaches 2e-5 here.
    for left, right in zip(jax.tree.leaves(in_turn), jax.tree.leaves(at_once), strict=True):
        np.testing.assert_allclose(left, right, atol=5e-5, rtol=1e-5)


def test_fused_commit_and_denoise_equals_doing_both_in_turn(clover):
    prefix, decided, nxt = token_ids(2, 8, MASK_ID, seed=9), token_ids(2, BLOCK, MASK_ID, seed=10), block_ids(11)
    state = clover.init_state(2, 8 + 2 * BLOCK)
    _, state = clover.extend(state, prefix, logits="none")
    fused, fused_state = clover.commit_and_denoise(state, decided, nxt)
    _, committed = clover.extend(state, decided, logits="none")
    separate = clover.denoise(committed, nxt)
    np.testing.assert_allclose(fused.logits, separate.logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(fused.distinct_experts, separate.distinct_experts)
    for left, right in zip(jax.tree.leaves(fused_state), jax.tree.leaves(committed), strict=True):
        np.testing.assert_allclose(left, right, atol=1e-5, rtol=1e-5)


def test_denoising_steps_do_not_recompile(clover):
    state = clover.init_state(2, 32)
    clover.denoise(state, block_ids(0))  # compile once for (batch 2, block 8, capacity 32)
    compiled = lambda: (clover_model_module.run_denoise._cache_size(), clover_model_module.run_causal._cache_size())
    for step in range(3):
        _, state = clover.extend(state, token_ids(2, 4, MASK_ID, seed=step), logits="none")
        for block_seed in range(3):
            clover.denoise(state, block_ids(block_seed + step), coreset_top_p=0.5 + 0.1 * block_seed)
        if step == 0:
            before = compiled()  # the denoising pass and the 4-token causal pass
    assert compiled() == before


def test_clover_tensors_load_and_defaults_are_logged(clover, clover_checkpoint, qwen36_checkpoint, caplog):
    from safetensors.numpy import load_file

    from clover_jax import CloverModel
    from weights import CheckpointError

    stored = load_file(f"{clover_checkpoint}/model.safetensors")
    linear = clover.params["groups"]["layer_1"]["linear_attn"]
    np.testing.assert_array_equal(linear["conv1d_right_weight"][1],
                                  stored["model.layers.5.linear_attn.conv1d_right.weight"][:, 0])
    np.testing.assert_array_equal(linear["memory_logit_bias"][0],
                                  stored["model.layers.1.linear_attn.memory_logit_bias"])

    with caplog.at_level("INFO"):
        base = CloverModel.from_pretrained(qwen36_checkpoint, progress=False)
    assert "24 Clover block-mode tensors are absent" in caplog.text  # 4 tensors x 6 GDN layers
    np.testing.assert_allclose(base.params["groups"]["layer_2"]["linear_attn"]["block_logit_scale"],
                               math.log(math.sqrt(base.config.linear_key_head_dim)), rtol=1e-6)
    with pytest.raises(CheckpointError, match="model.layers.0.linear_attn.conv1d_right.weight.*strict=True"):
        CloverModel.from_pretrained(qwen36_checkpoint, strict=True, progress=False)
