"""Each schedule on hand-made steps, a remasking schedule end to end, and the per-block step cap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from decoding import generate, schedules
from decoding.schedules import StepView

KNOBS = {"tokens_per_step": 2, "margin_threshold": 0.3, "entropy_bound": 1.0, "threshold": 0.9}


def view(confidence, decided=None, margin=None, entropy=None, fixed=None, threshold=0.9):
    size = len(confidence)
    as_bool = lambda x: jnp.asarray(x if x is not None else [False] * size)
    as_float = lambda x: jnp.asarray(x if x is not None else [0.0] * size, jnp.float32)
    positions = jnp.arange(size, dtype=jnp.int32)
    return StepView(positions, positions, as_float(confidence), as_float(margin), as_float(entropy),
                    as_bool(decided), as_bool(fixed), positions, jnp.int32(0), jnp.int32(0), jnp.int32(size),
                    jnp.int32(0), jnp.float32(threshold), jax.random.key(0))


def test_low_confidence_fills_above_threshold_or_the_most_confident_lowest_index():
    assert schedules.low_confidence(view([0.95, 0.2, 0.97, 0.5]), KNOBS).tolist() == [True, False, True, False]
    # none above: the most confident mask, ties to the lower index; decided positions stay
    after = schedules.low_confidence(view([0.99, 0.6, 0.3, 0.6], decided=[True, False, False, False]), KNOBS)
    assert after.tolist() == [True, True, False, False]


def test_fixed_k_fills_the_k_most_confident_masks():
    after = schedules.fixed_k(view([0.1, 0.8, 0.3, 0.8, 0.9], decided=[False, False, False, False, True]), KNOBS)
    assert after.tolist() == [False, True, False, True, True]


def test_margin_fills_wide_margins_or_the_widest():
    assert schedules.margin(view([0.5] * 3, margin=[0.4, 0.1, 0.35]), KNOBS).tolist() == [True, False, True]
    assert schedules.margin(view([0.5] * 3, margin=[0.1, 0.2, 0.05]), KNOBS).tolist() == [False, True, False]


def test_entropy_bounded_fills_low_entropy_masks_within_the_budget():
    after = schedules.entropy_bounded(view([0.5] * 4, entropy=[0.6, 0.3, 2.0, 0.5]), KNOBS)
    assert after.tolist() == [False, True, False, True]  # 0.3 + 0.5 <= 1.0, then 0.6 would exceed it
    assert schedules.entropy_bounded(view([0.5] * 2, entropy=[3.0, 2.0]), KNOBS).tolist() == [False, True]


def remask_then_fill(step: StepView, knobs) -> jax.Array:
    """Never finishes on its own: the first step leaves its least confident mask, every later step
    fills it and remasks the least confident decided (non-prompt) position instead."""
    positions = jnp.arange(step.decided.shape[0])
    revisable = step.decided & ~step.fixed
    worst = lambda eligible: positions == jnp.argmin(jnp.where(eligible, step.confidence, jnp.inf))
    held_back = jnp.where(jnp.any(revisable), worst(revisable), worst(~step.decided))
    return ~held_back


def test_a_remasking_schedule_runs_and_the_step_cap_ends_every_block(peaked, controls_config):
    config = controls_config.replace(schedule=remask_then_fill, max_steps_per_block=3, max_new_tokens=12)
    out = generate(peaked, [list(range(20, 31))], config, return_trajectory=True)
    assert out.steps_per_block[0] and all(steps == 3 for steps in out.steps_per_block[0][1:])
    assert len(out.sequences[0]) == 12 or out.sequences[0][-1] == 1
    assert 127 not in out.sequences[0]  # no mask token survives a block


def test_every_named_schedule_decodes(peaked, controls_config):
    for name in ("fixed_k", "margin", "entropy_bounded"):
        out = generate(peaked, [list(range(20, 31))], controls_config, schedule=name, max_new_tokens=10)
        assert 0 < len(out.sequences[0]) <= 10 and 127 not in out.sequences[0]
        if name == "fixed_k":  # two masks per step: a block of 8 with a 3-token prompt tail takes 3 steps
            assert out.steps_per_block[0][0] == 3
