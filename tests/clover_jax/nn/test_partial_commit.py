"""A fused commit + denoise pass in which each sequence commits or not (`commit=` bool [batch]),
the serving engine's step: each sequence equals its own pass alone — `commit_and_denoise` where
it commits, `denoise` where it does not (its state then exactly as it was) — at its own fill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import MASK_ID

BLOCK, CAPACITY = 8, 64


@pytest.fixture(scope="module")
def model(small_clover_checkpoint):
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(small_clover_checkpoint, progress=False)


def single(model, prefix: list[int]):
    state = model.init_state(1, CAPACITY)
    if prefix:
        _, state = model.extend(state, [prefix], logits="none")
    return state


def test_each_sequence_commits_or_denoises_as_alone(model):
    passes, params = model.passes, model.run_params
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(7, 100, n).tolist() for n in (16, 8, 24, 0)]
    singles = [single(model, prefix) for prefix in prefixes]
    # one batch holding each sequence's state at its own fill
    state = singles[0]._replace(
        length=jnp.asarray([len(p) for p in prefixes], jnp.int32), start=jnp.zeros(len(prefixes), jnp.int32),
        layers=jax.tree_util.tree_map(lambda *leaves: jnp.concatenate(leaves, axis=1), *[s.layers for s in singles]))
    committed = rng.integers(7, 100, (4, BLOCK)).astype(np.int32)
    blocks = np.full((4, BLOCK), MASK_ID, np.int32)
    blocks[:, :3] = rng.integers(7, 100, (4, 3))
    commit = np.array([True, False, True, False])
    run = jax.jit(lambda c, b, s, m: passes.commit_and_denoise(params, c, b, s, coreset=True, coreset_top_p=0.9,
                                                               commit=m))
    out = run(committed, blocks, state, commit)
    np.testing.assert_array_equal(out.state.length, [24, 8, 32, 0])
    for i, alone_state in enumerate(singles):
        if commit[i]:
            alone, expected_state = model.commit_and_denoise(alone_state, committed[i:i + 1], blocks[i:i + 1],
                                                             coreset=True, coreset_top_p=0.9)
        else:
            alone, expected_state = model.denoise(alone_state, blocks[i:i + 1], coreset=True, coreset_top_p=0.9), \
                alone_state
        # the batch's rows are the single sequence's to float rounding (XLA picks kernels per shape)
        np.testing.assert_allclose(out.logits[i], alone.logits[0], rtol=1e-5, atol=1e-5)
        filled = int(out.state.length[i])
        for name, layer in out.state.layers.items():
            for field, got, want in zip(layer._fields, layer, expected_state.layers[name], strict=True):
                got, want = np.asarray(got)[:, i], np.asarray(want)[:, 0]
                if field in ("key", "value"):  # rows past the fill are never read
                    got, want = got[:, :filled], want[:, :filled]
                if commit[i]:
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name}.{field}")
                else:  # a sequence that does not commit keeps its state exactly
                    np.testing.assert_array_equal(got, want, err_msg=f"{name}.{field}")
