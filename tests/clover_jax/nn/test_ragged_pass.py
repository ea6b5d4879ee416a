"""The serving engine's ragged pass (clover_jax/core/ragged.py) against the one-sequence passes.

Slots at different points of their decode share one flat row of tokens, K/V in pages and GDN
states in slots: a prefill chunk, a block commit fused with the next block's denoising, an
autoregressive token, verification rows that leave the state as it was, a block alone (of
another size than the others), every one of them in one pass. Each slot's logits equal the
contiguous-state pass `generate` runs for that sequence alone (float32, to 2e-5 of the logit
scale: the ragged pass sums attention over pages and the gated delta rule over other chunks),
and the state each slot is left with is the one the next pass needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.core.ragged import SlotWork, chunk_shape, layout
from tests.conftest import MASK_ID

SLOTS, PAGE, PAGES_PER_SLOT = 4, 4, 16


class Pass(NamedTuple):
    logits: jax.Array
    state: Any


@pytest.fixture(scope="module")
def setup(clover):
    passes, params = clover.passes, clover.run_params
    config = clover.config
    coreset, top_p = config.moe_block_coreset_enabled, config.moe_block_coreset_top_p
    def ragged(ids, batch, state):  # (each slot's logit rows' logits [S, W, vocab], the state after the pass)
        out = passes.ragged(params, jnp.asarray(ids), batch, state, coreset=coreset, coreset_top_p=top_p)
        return Pass(passes.head_logits(params, out.hidden), out.state)

    run = jax.jit(ragged)
    # slot s holds pages 1 + s * 16 ...: a shuffled pool would do as well; page 0 is the padding rows'
    table = np.arange(1, 1 + SLOTS * PAGES_PER_SLOT).reshape(SLOTS, PAGES_PER_SLOT)[:, ::-1].copy()
    state = jax.jit(lambda: passes.new_paged_state(SLOTS, 1 + SLOTS * PAGES_PER_SLOT, PAGE))()
    return clover, run, table, state


def causal(model, ids: list[int]):
    """The causal logits of `ids` alone (the model's compiled forward): [len(ids), vocab]."""
    return model.forward(jnp.asarray([ids]))[0]


def denoised(model, prefix: list[int], block: list[int]):
    """`block` denoised after the prefix `prefix` alone (the model's compiled block mode): [B, vocab]."""
    return model.denoise_logits(jnp.asarray([prefix]), jnp.asarray([block]))[0]


def close(ragged, contiguous):
    """Equal to 2e-5 of the logit scale. The sums run in another order than the contiguous pass's, and
    XLA's CPU code orders them by the host's vector width: on an AVX-512 Xeon the first pass's 6-token
    prompt differs by 1.04e-5 of the scale (failing 1e-5 there, passing on AMD EPYC), every other
    comparison here by < 3e-6."""
    ragged, contiguous = np.asarray(ragged), np.asarray(contiguous)
    np.testing.assert_allclose(ragged, contiguous, rtol=0, atol=2e-5 * np.abs(contiguous).max())


def test_every_kind_of_segment_in_one_pass_equals_its_sequence_alone(setup):
    model, run, table, state = setup
    rng = np.random.RandomState(0)
    token = lambda n: rng.randint(2, MASK_ID, n).tolist()
    prompts = [token(n) for n in (13, 8, 21, 6)]
    # pass 1: every prompt prefilled (one chunk each; 21 rows cross two GDN chunks of 16)
    works = [SlotWork(s, 0, tuple(p), logit_rows=(len(p) - 1,)) for s, p in enumerate(prompts)]
    ids, batch = layout(works, num_tokens=64, page_table=table, max_block=8, logit_width=9, chunk=16)
    first = run(ids, batch, state)
    for slot, prompt in enumerate(prompts):
        close(first.logits[slot, 0], causal(model, prompt)[-1])
    # pass 2: slot 0 commits 3 rows and denoises a block of 8 after them; slot 1 runs a token; slot 2
    # verifies 5 rows (its state stays); slot 3 denoises a block of 4 (its block size, within Bmax 8)
    commit, block = token(3), [MASK_ID] * 5 + token(3)
    step, verify, small = token(1), token(5), [MASK_ID, 7, MASK_ID, MASK_ID]
    works = [SlotWork(0, len(prompts[0]), tuple(commit), tuple(block), True, tuple(range(3, 11))),
             SlotWork(1, len(prompts[1]), tuple(step), (), True, (0,)),
             SlotWork(2, len(prompts[2]), tuple(verify), (), False, tuple(range(5))),
             SlotWork(3, len(prompts[3]), (), tuple(small), True, tuple(range(4)))]
    ids, batch = layout(works, num_tokens=64, page_table=table, max_block=8, logit_width=9, chunk=16)
    second = run(ids, batch, first.state)
    close(second.logits[0, :8], denoised(model, prompts[0] + commit, block))
    close(second.logits[1, 0], causal(model, prompts[1] + step)[-1])
    close(second.logits[2, :5], causal(model, prompts[2] + verify)[-5:])
    close(second.logits[3, :4], denoised(model, prompts[3], small))
    # pass 3: slot 2 left as before its verification rows; slot 0 holds the commit, its block reads it
    works = [SlotWork(2, len(prompts[2]), tuple(verify[:1]), (), True, (0,)),
             SlotWork(0, len(prompts[0]) + 3, (), tuple(block), True, tuple(range(8)))]
    ids, batch = layout(works, num_tokens=64, page_table=table, max_block=8, logit_width=9, chunk=16)
    third = run(ids, batch, second.state)
    close(third.logits[2, 0], causal(model, prompts[2] + verify[:1])[-1])
    close(third.logits[0, :8], denoised(model, prompts[0] + commit, block))


def test_padding_rows_and_padding_chunks_change_nothing(setup):
    model, run, table, state = setup
    ids, batch = layout([SlotWork(1, 0, (5, 6, 7), logit_rows=(2,))], num_tokens=64, page_table=table, max_block=8,
                        logit_width=9, chunk=16)
    out = run(ids, batch, state)
    ids, batch = layout([], num_tokens=64, page_table=table, max_block=8, logit_width=9, chunk=16)
    padded = run(ids, batch, out.state)
    for name, layer in out.state.layers.items():
        if hasattr(layer, "recurrent"):
            for before, after in zip(layer, padded.state.layers[name], strict=True):
                np.testing.assert_array_equal(before, after)
        else:  # pages: only the trash page (0) is written by padding rows
            np.testing.assert_array_equal(layer.key[:, 1:], padded.state.layers[name].key[:, 1:])


def test_layout_refuses_work_that_does_not_fit():
    table = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match="does not fit"):
        layout([SlotWork(0, 0, tuple(range(20)))], num_tokens=16, page_table=table, max_block=8, logit_width=9,
               chunk=16)
    with pytest.raises(ValueError, match="appears twice"):
        layout([SlotWork(0, 0, (1,)), SlotWork(0, 1, (2,))], num_tokens=16, page_table=table, max_block=8,
               logit_width=9, chunk=16)
    with pytest.raises(ValueError, match="does not fit"):
        layout([SlotWork(1, 0, (), tuple(range(9)))], num_tokens=16, page_table=table, max_block=8, logit_width=9,
               chunk=16)
    assert chunk_shape(16, 4, 64) == (5, 16) and chunk_shape(256, 4, 64) == (8, 64)


def test_the_pallas_kernel_over_pages_equals_the_xla_rule_in_the_pass(setup):
    """The same pass with the paged attention kernel (`KernelChoice.pages="pallas"`, interpreted on
    CPU) and with the plain-JAX rule: logits and pages to float rounding."""
    import dataclasses

    from clover_jax.nn.model import TransformerPasses

    model, run, table, state = setup
    config = model.config
    kernel = TransformerPasses(model.module.clone(kernels=dataclasses.replace(model.kernels, pages="pallas")))
    def ragged(ids, batch, state):
        out = kernel.ragged(model.run_params, jnp.asarray(ids), batch, state, coreset=config.moe_block_coreset_enabled,
                            coreset_top_p=config.moe_block_coreset_top_p)
        return Pass(kernel.head_logits(model.run_params, out.hidden), out.state)

    run_kernel = jax.jit(ragged)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(2, MASK_ID, n).tolist() for n in (13, 8)]
    works = [SlotWork(s, 0, tuple(p), logit_rows=(len(p) - 1,)) for s, p in enumerate(prompts)]
    ids, batch = layout(works, num_tokens=64, page_table=table, max_block=8, logit_width=9, chunk=16)
    first = run(ids, batch, state)
    works = [SlotWork(0, 13, (5, 6, 7), tuple([MASK_ID] * 8), True, tuple(range(3, 11))),
             SlotWork(1, 8, (9,), (), True, (0,))]
    ids, batch = layout(works, num_tokens=64, page_table=table, max_block=8, logit_width=9, chunk=16)
    plain, pallas = run(ids, batch, first.state), run_kernel(ids, batch, first.state)
    close(pallas.logits[0, :8], plain.logits[0, :8])
    close(pallas.logits[1, :1], plain.logits[1, :1])


def test_on_live_runs_the_smallest_width_that_holds_the_count():
    from clover_jax.core.ragged import live_widths, on_live

    assert live_widths(1) == (0, 1) and live_widths(16) == (0, 1, 16) and live_widths(18) == (0, 1, 18)
    chosen = jax.jit(lambda count: on_live(count, 18, lambda width: jnp.int32(width), compact=True,
                                           empty=jnp.int32(-1)))
    assert [int(chosen(jnp.int32(count))) for count in (0, 1, 2, 5, 18)] == [-1, 1, 18, 18, 18]
    # no empty result: a count of 0 runs the smallest width; not compact: the whole size alone
    assert int(jax.jit(lambda c: on_live(c, 18, lambda width: jnp.int32(width), compact=True))(jnp.int32(0))) == 1
    assert int(jax.jit(lambda c: on_live(c, 18, lambda width: jnp.int32(width), compact=False))(jnp.int32(1))) == 18


def test_a_pass_computed_at_the_live_width_equals_the_whole_width(setup, monkeypatch):
    """On a CPU the pass runs its attention tiles, GDN blocks and coreset routes at a width bounded
    by the work it holds (`on_live`); the same pass at the full width gives the same logits and state."""
    from clover_jax.nn import attention, gdn, moe

    model, run, table, state = setup
    config = model.config
    rng = np.random.RandomState(2)
    prompt = rng.randint(2, MASK_ID, 11).tolist()
    works = [SlotWork(2, 0, tuple(prompt[:8]), tuple(prompt[8:]) + (MASK_ID,) * 5, True, tuple(range(8, 16)))]
    ids, batch = layout(works, num_tokens=32, page_table=table, max_block=8, logit_width=9, chunk=16)
    live = run(ids, batch, state)
    for module in (attention, gdn, moe):
        monkeypatch.setattr(module, "COMPACT_PLATFORMS", ())
    passes, params = model.passes, model.run_params

    @jax.jit
    def whole(ids, batch, state):
        out = passes.ragged(params, jnp.asarray(ids), batch, state, coreset=config.moe_block_coreset_enabled,
                            coreset_top_p=config.moe_block_coreset_top_p)
        return Pass(passes.head_logits(params, out.hidden), out.state)

    full = whole(ids, batch, state)
    close(live.logits[2, :8], full.logits[2, :8])
    for name, layer in live.state.layers.items():
        for ours, theirs in zip(layer, full.state.layers[name], strict=True):
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0,
                                       atol=1e-5 * max(1.0, float(np.abs(np.asarray(theirs)).max())))
