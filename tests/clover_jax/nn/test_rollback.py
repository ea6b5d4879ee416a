"""A recording causal pass rolled back to its first k rows equals a fresh causal pass over the
prefix and those k rows only (docs/design.md §8), for every k, on every layer type."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from clover_jax import CloverModel
from clover_jax.core.state import GDNState, KVCache, RecordingGDN, empty_state
from clover_jax.model.clover_model import run_pass
from clover_jax.nn.model import CloverTransformer, TransformerPasses
from clover_jax.nn.rollback import recording, rolled_back
from tests.conftest import token_ids

PREFIX = 11  # longest prompt of the batch (others are left-padded)
ROWS = 6     # rows of the recording pass: the batch keeps 0, 1, ..., ROWS of them, one k per sequence
NEXT = 4     # a fused pass after the rollback: 1 causal row, then NEXT - 1 block rows
# float32 rounding only: the fresh pass chunks its rows differently (as test_block_mode's state checks)
STATE = dict(atol=5e-5, rtol=1e-5)
LOGITS = dict(atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tied(tied_checkpoint):
    return CloverModel.from_pretrained(tied_checkpoint, progress=False)


def passes_and_params(model: CloverModel, layer_loop: str):
    if layer_loop == model.module.layer_loop:
        return model.passes, model.run_params
    passes = TransformerPasses(CloverTransformer(model.config, model.dtype, layer_loop=layer_loop))
    return passes, model.params  # the scanned loop runs on stacked parameters


def causal(passes, params, ids, state, coreset: bool = False):
    return run_pass(passes, params, ids, state, num_causal=ids.shape[1], logits_from=0, coreset=coreset,
                    coreset_top_p=np.float32(1.0))


@pytest.mark.parametrize("which, layer_loop", [("clover", "unrolled"), ("clover", "scan"), ("tied", "unrolled")])
def test_rollback_to_every_row_equals_a_fresh_causal_pass(request, which, layer_loop):
    model = request.getfixturevalue(which)
    config = model.config
    passes, params = passes_and_params(model, layer_loop)
    batch = ROWS + 1
    keep = np.arange(batch, dtype=np.int32)           # sequence b keeps b rows
    start = np.array([b % 3 for b in range(batch)], np.int32)  # left padding on most sequences
    vocab = config.vocab_size - 1
    prefix = token_ids(batch, PREFIX, vocab, seed=1)
    drafts = token_ids(batch, ROWS, vocab, seed=2)
    following = token_ids(batch, NEXT, vocab, seed=3)
    capacity = PREFIX + ROWS + NEXT

    # Prefix, a recording pass over ROWS drafted rows, then each sequence rolled back to its own k.
    state = causal(passes, params, prefix, empty_state(config, batch, capacity, model.dtype, start)).state
    verified = causal(passes, params, drafts, recording(state, config, ROWS)).state
    assert all(isinstance(layer, RecordingGDN) for layer in verified.layers.values()
               if not isinstance(layer, KVCache))
    rolled = jax.jit(rolled_back, static_argnums=(2, 3))(verified, keep, ROWS, passes.module.kernels)

    # Fresh: the prefix and the first k drafts only, left-padded by the ROWS - k rows not kept.
    fresh_ids = np.zeros((batch, PREFIX + ROWS), np.int32)
    fresh_start = start + ROWS - keep
    for b in range(batch):
        kept = np.concatenate([prefix[b, start[b]:], drafts[b, :keep[b]]])
        fresh_ids[b, fresh_start[b]:] = kept
    fresh = causal(passes, params, fresh_ids, empty_state(config, batch, capacity, model.dtype, fresh_start)).state

    np.testing.assert_array_equal(rolled.length, PREFIX + keep)
    for name, ours in rolled.layers.items():
        theirs = fresh.layers[name]
        if isinstance(ours, KVCache):
            for b in range(batch):  # each sequence's real rows, wherever its padding put them
                mine = slice(start[b], PREFIX + keep[b])
                reference = slice(fresh_start[b], PREFIX + ROWS)
                for ours_leaf, theirs_leaf in zip(ours, theirs, strict=True):
                    np.testing.assert_allclose(ours_leaf[:, b, mine], theirs_leaf[:, b, reference],
                                               **STATE, err_msg=f"{name} sequence {b}")
        else:
            assert isinstance(ours, GDNState)
            np.testing.assert_allclose(ours.conv, theirs.conv, **STATE, err_msg=name)
            np.testing.assert_allclose(ours.recurrent, theirs.recurrent, **STATE, err_msg=name)

    # What the next pass sees: rolled-back rows are masked and overwritten, per sequence. One
    # causal row appended at each sequence's own fill, then block rows reading the prefix.
    after = lambda state: run_pass(passes, params, following, state, num_causal=1, logits_from=0, coreset=True,
                                   coreset_top_p=np.float32(0.9))
    after_rolled, after_fresh = after(rolled), after(fresh)
    np.testing.assert_allclose(after_rolled.logits, after_fresh.logits, **LOGITS)
    np.testing.assert_array_equal(after_rolled.state.length, PREFIX + keep + 1)


def test_a_record_of_the_wrong_length_is_refused(clover):
    state = empty_state(clover.config, 1, 8, clover.dtype)
    with pytest.raises(ValueError, match="the record holds 3 rows but the pass has 2 causal rows"):
        causal(clover.passes, clover.run_params, np.zeros((1, 2), np.int32), recording(state, clover.config, 3))
