"""Every named schedule on hand-made steps and on random steps against a plain NumPy reading of its
rule; the random rules against NumPy with the same uniform draws and statistically; parameter
checks; and each schedule end to end in `generate` (new parameter values never recompile)."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoding import GenerationConfig, generate, schedules
from decoding.block_loop import run_block_decoder
from decoding.schedules import Decision, StepView, resolve_params

KNOBS = {"tokens_per_step": 2, "margin_threshold": 0.3, "entropy_bound": 1.0, "threshold": 0.9}
SIZE = 8  # block size of the random steps


def view(confidence, *, decided=None, margin=None, entropy=None, fixed=None, threshold=0.9, tokens=None,
         candidates=None, step=0, post_fill_steps=0, key=0):
    size = len(confidence)
    as_bool = lambda x: jnp.asarray(x if x is not None else [False] * size)
    as_float = lambda x: jnp.asarray(x if x is not None else [0.0] * size, jnp.float32)
    positions = jnp.arange(size, dtype=jnp.int32)
    as_ids = lambda x: jnp.asarray(x, jnp.int32) if x is not None else positions
    return StepView(as_ids(tokens), as_ids(candidates), as_float(confidence), as_float(margin), as_float(entropy),
                    as_bool(decided), as_bool(fixed), positions, jnp.int32(step), jnp.int32(0), jnp.int32(size),
                    jnp.int32(post_fill_steps), jnp.float32(threshold), jax.random.key(key))


# ---------------------------------------------------------------------- NumPy readings of the rules
def by_score(scores, masked):
    """Masked positions, highest score first, ties by lower index."""
    return sorted((j for j in range(len(scores)) if masked[j]), key=lambda j: (-scores[j], j))


def np_low_confidence(p, masked, tau):
    fill = {j for j in range(len(p)) if masked[j] and p[j] > tau}
    return fill or set(by_score(p, masked)[:1])


def np_fast_dllm_threshold(p, masked, tau):
    return set(by_score(p, masked)[:1]) | {j for j in range(len(p)) if masked[j] and p[j] >= tau}


def np_fast_dllm_factor(p, masked, factor):
    ranked, n = by_score(p, masked), 0
    for i, j in enumerate(ranked, start=1):
        bound = np.float32(1) - np.float32(factor) / np.float32(i + 1)
        if i > 1 and not p[j] >= bound:
            break
        n = i
    return set(ranked[:n])


def np_eb_sampler(entropy, masked, gamma):
    ranked = by_score(-np.asarray(entropy), masked)
    taken, total = [], 0.0
    for j in ranked:
        if taken and not total <= gamma:
            break
        taken.append(j)
        total += float(entropy[j])
    return set(taken)


def np_dream(scores, masked, step, steps, eps, u=None, alg_temp=0.0, origin=False):
    t = np.linspace(1, eps, steps + 1)
    n = int(np.sum(masked))
    if origin:
        chance = 1.0 if step >= steps - 1 else 1 - t[step + 1] / t[step]
        return {j for j in range(len(masked)) if masked[j] and u[j] < chance}
    count = n if step >= steps - 1 else int(n * (1 - t[step + 1] / t[step]))
    if alg_temp > 0:  # Gumbel-top-k with the same uniforms
        scores = np.asarray(scores, np.float64) / alg_temp - np.log(-np.log(np.asarray(u, np.float64)))
    return set(by_score(scores, masked)[:count])


def decided_set(result) -> set:
    decided = result.decided if isinstance(result, Decision) else result
    return {int(j) for j in np.flatnonzero(np.asarray(decided))}


def random_steps(count: int, seed: int):
    """`count` random steps of a block of SIZE: confidences rounded to one decimal (so ties and
    values equal to a threshold are common), random masks (at least one), random entropies."""
    rng = np.random.default_rng(seed)
    p = np.round(rng.uniform(0.05, 1.0, (count, SIZE)), 1).astype(np.float32)
    decided = rng.uniform(size=(count, SIZE)) < 0.4
    decided[np.arange(count), rng.integers(0, SIZE, count)] = False
    entropy = np.round(rng.uniform(0.0, 0.5, (count, SIZE)), 2).astype(np.float32)
    margin = np.round(rng.uniform(0.0, 1.0, (count, SIZE)), 1).astype(np.float32)
    return p, decided, entropy, margin


def batched_view(p, decided, entropy, margin, *, step=None, keys=None, tokens=None, candidates=None, fixed=None,
                 post_fill_steps=None):
    count = p.shape[0]
    positions = jnp.broadcast_to(jnp.arange(SIZE, dtype=jnp.int32), (count, SIZE))
    zeros = jnp.zeros(count, jnp.int32)
    as_ids = lambda x: positions if x is None else jnp.asarray(x, jnp.int32)
    return StepView(as_ids(tokens), as_ids(candidates), jnp.asarray(p), jnp.asarray(margin), jnp.asarray(entropy),
                    jnp.asarray(decided), jnp.zeros_like(jnp.asarray(decided)) if fixed is None else jnp.asarray(fixed),
                    positions, zeros if step is None else jnp.asarray(step, jnp.int32), zeros,
                    jnp.full(count, SIZE, jnp.int32), zeros if post_fill_steps is None else
                    jnp.asarray(post_fill_steps, jnp.int32), jnp.zeros(count, jnp.float32),
                    jax.random.split(jax.random.key(0), count) if keys is None else keys)


def run_batched(rule, steps: StepView, params: dict):
    """The rule vmapped over steps and their parameters (one compile for all cases)."""
    return jax.device_get(jax.jit(jax.vmap(lambda v, q: schedules.as_decision(rule(v, q))))(steps, params))


# ---------------------------------------------------------------------- thresholds: > against >=
def test_confidences_equal_to_the_threshold_fill_only_under_fast_dllm_threshold():
    step = view([0.5, 0.5, 0.25])
    assert schedules.low_confidence(step, {"threshold": 0.5}).tolist() == [True, False, False]
    assert schedules.fast_dllm_threshold(step, {"threshold": 0.5}).tolist() == [True, True, False]
    # none above: LowConfidence and Fast-dLLM both take the most confident, the lowest index on ties
    assert schedules.low_confidence(view([0.3, 0.4, 0.4]), {"threshold": 0.5}).tolist() == [False, True, False]
    assert schedules.fast_dllm_threshold(view([0.3, 0.4, 0.4]), {"threshold": 0.5}).tolist() == [False, True, False]


def test_low_confidence_fills_above_threshold_or_the_most_confident_lowest_index():
    assert schedules.low_confidence(view([0.95, 0.2, 0.97, 0.5]), KNOBS).tolist() == [True, False, True, False]
    after = schedules.low_confidence(view([0.99, 0.6, 0.3, 0.6], decided=[True, False, False, False]), KNOBS)
    assert after.tolist() == [True, True, False, False]


@pytest.mark.parametrize("name, reading, knob", [
    ("low_confidence", np_low_confidence, "threshold"),
    ("fast_dllm_threshold", np_fast_dllm_threshold, "threshold"),
    ("fast_dllm_factor", np_fast_dllm_factor, "factor"),
])
def test_confidence_rules_equal_their_numpy_reading_on_random_steps(name, reading, knob):
    p, decided, entropy, margin = random_steps(300, seed=1)
    values = np.random.default_rng(2).choice([0.1, 0.5, 0.7, 0.8, 1.0], 300).astype(np.float32)
    if knob == "factor":
        values = np.random.default_rng(2).choice([0.0, 0.4, 1.0, 2.0, 20.0], 300).astype(np.float32)
    result = run_batched(schedules.BY_NAME[name].rule, batched_view(p, decided, entropy, margin), {knob: values})
    for c in range(300):
        expected = reading(p[c], ~decided[c], values[c]) | set(np.flatnonzero(decided[c]))
        assert decided_set(result.decided[c]) == expected, (name, p[c], decided[c], values[c])


def test_fast_dllm_factor_fills_the_leading_run_that_meets_its_bounds():
    # sorted 0.9 (forced), 0.75 >= 1 - 1/4 at i = 3? no: 0.75 is second, its bound is 1 - 1/3 = 0.667 -> passes;
    # third 0.7 < 1 - 1/4 = 0.75 stops the run; 0.95 later never counts
    assert schedules.fast_dllm_factor(view([0.7, 0.9, 0.75, 0.2]), {"factor": 1.0}).tolist() == [
        False, True, True, False]
    # exactly at the bound passes (>=): 0.75 third at bound 0.75
    assert schedules.fast_dllm_factor(view([0.75, 0.9, 0.8]), {"factor": 1.0}).tolist() == [True, True, True]
    # the first is always filled, however unconfident; the last alone failing is not filled (no Fast-dLLM quirk)
    assert schedules.fast_dllm_factor(view([0.1, 0.05]), {"factor": 1.0}).tolist() == [True, False]
    assert schedules.fast_dllm_factor(view([0.99, 0.6]), {"factor": 1.0}).tolist() == [True, False]


def test_fixed_k_fills_the_k_most_confident_masks():
    after = schedules.fixed_k(view([0.1, 0.8, 0.3, 0.8, 0.9], decided=[False, False, False, False, True]), KNOBS)
    assert after.tolist() == [False, True, False, True, True]


def test_margin_fills_wide_margins_or_the_widest():
    assert schedules.margin(view([0.5] * 3, margin=[0.4, 0.1, 0.35]), KNOBS).tolist() == [True, False, True]
    assert schedules.margin(view([0.5] * 3, margin=[0.1, 0.2, 0.05]), KNOBS).tolist() == [False, True, False]


# ---------------------------------------------------------------------- entropy
def test_entropy_bounded_fills_low_entropy_masks_within_the_budget():
    after = schedules.entropy_bounded(view([0.5] * 4, entropy=[0.6, 0.3, 2.0, 0.5]), KNOBS)
    assert after.tolist() == [False, True, False, True]  # 0.3 + 0.5 <= 1.0, then 0.6 would exceed it
    assert schedules.entropy_bounded(view([0.5] * 2, entropy=[3.0, 2.0]), KNOBS).tolist() == [False, True]


def test_eb_sampler_adds_while_the_entropy_already_taken_is_within_gamma():
    # ascending 0.05 (first), then 0.05 <= 0.15 -> take 0.1; 0.15 <= 0.15 -> take 0.3; 0.45 > 0.15 -> stop
    after = schedules.eb_sampler(view([0.5] * 5, entropy=[0.3, 0.05, 0.9, 0.1, 0.4]), {"gamma": 0.15})
    assert after.tolist() == [True, True, False, True, False]
    # gamma 0: the first, and the next only when the first had zero entropy; ties: lower index first
    assert schedules.eb_sampler(view([0.5] * 3, entropy=[0.2, 0.2, 0.2]), {"gamma": 0.0}).tolist() == [
        True, False, False]
    assert schedules.eb_sampler(view([0.5] * 3, entropy=[0.2, 0.0, 0.2]), {"gamma": 0.0}).tolist() == [
        True, True, False]


def test_eb_sampler_equals_its_numpy_reading_on_random_steps():
    p, decided, entropy, margin = random_steps(300, seed=3)
    gamma = np.random.default_rng(4).choice([0.0, 0.1, 0.15, 0.3, 1.0], 300).astype(np.float32)
    result = run_batched(schedules.eb_sampler, batched_view(p, decided, entropy, margin), {"gamma": gamma})
    for c in range(300):
        expected = np_eb_sampler(entropy[c], ~decided[c], gamma[c]) | set(np.flatnonzero(decided[c]))
        assert decided_set(result.decided[c]) == expected


# ---------------------------------------------------------------------- Dream
def dream_params(count, alg, steps, eps=1e-3, alg_temp=0.0):
    return {"alg": np.full(count, schedules.DREAM_ALGORITHMS.index(alg), np.int32),
            "steps": np.asarray(steps, np.int32), "eps": np.full(count, eps, np.float32),
            "alg_temp": np.full(count, alg_temp, np.float32)}


def test_dream_counts_follow_the_linspace_schedule_a_step_may_fill_nothing_and_the_last_fills_all():
    params = {"alg": np.int32(0), "steps": np.int32(8), "eps": np.float32(1e-3), "alg_temp": np.float32(0.0)}
    eight_masks = [0.9, 0.1, 0.5, 0.5, 0.3, 0.8, 0.2, 0.7]
    # step 0 of 8 with 8 masks: int(8 * 0.999/8) = 0 -> nothing
    assert not np.any(schedules.dream(view(eight_masks, step=0), params))
    # step 1: int(8 * (1 - t2/t1)) = int(1.14) = 1 -> the most confident
    assert np.flatnonzero(schedules.dream(view(eight_masks, step=1), params)).tolist() == [0]
    # step 7 (the last): every mask
    assert np.all(schedules.dream(view(eight_masks, step=7), params))
    # steps 2 at step 0: int(8 * 0.4995) = 3 highest p: 0.9, 0.8, 0.7 (tie rule irrelevant here)
    two = dict(params, steps=np.int32(2))
    assert np.flatnonzero(schedules.dream(view(eight_masks, step=0), two)).tolist() == [0, 5, 7]


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_greedy_algorithms_equal_their_numpy_reading(alg):
    p, decided, entropy, margin = random_steps(300, seed=5)
    rng = np.random.default_rng(6)
    steps, step = rng.integers(1, 9, 300), rng.integers(0, 8, 300)
    step = np.minimum(step, steps - 1)
    result = run_batched(schedules.dream, batched_view(p, decided, entropy, margin, step=step),
                         dream_params(300, alg, steps))
    scores = {"maskgit_plus": p, "topk_margin": margin, "entropy": -entropy}[alg]
    for c in range(300):
        expected = np_dream(scores[c], ~decided[c], int(step[c]), int(steps[c]), 1e-3) | set(np.flatnonzero(decided[c]))
        assert decided_set(result.decided[c]) == expected, (alg, c)


@pytest.mark.parametrize("alg, alg_temp", [("origin", 0.0), ("maskgit_plus", 0.5), ("entropy", 2.0)])
def test_dream_random_choices_equal_numpy_with_the_same_uniform_draws(alg, alg_temp):
    p, decided, entropy, margin = random_steps(200, seed=7)
    step = np.random.default_rng(8).integers(0, 4, 200)
    keys = jax.random.split(jax.random.key(9), 200)
    # the step's draws: uniform(view.key, [block]) in (0, 1)
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (SIZE,), jnp.float32,
                                                         minval=jnp.finfo(jnp.float32).tiny, maxval=1.0))(keys))
    result = run_batched(schedules.dream, batched_view(p, decided, entropy, margin, step=step, keys=keys),
                         dream_params(200, alg, np.full(200, 4), alg_temp=alg_temp))
    scores = -entropy if alg == "entropy" else p
    for c in range(200):
        expected = np_dream(scores[c], ~decided[c], int(step[c]), 4, 1e-3, u=u[c], alg_temp=alg_temp,
                            origin=alg == "origin") | set(np.flatnonzero(decided[c]))
        assert decided_set(result.decided[c]) == expected


def test_dream_alg_temp_draws_without_replacement_in_proportion_to_softmax_of_scores():
    """Two fills among six masks (step 0 of 2: int(6 * 0.4995) = 2), 6000 keys: each pair's
    frequency equals sequential sampling without replacement from softmax(p / alg_temp)."""
    p = np.array([0.9, 0.7, 0.6, 0.3, 0.2, 0.1, 0.5, 0.5], np.float32)
    decided = np.arange(SIZE) >= 6
    count, temperature = 6000, 0.25
    keys = jax.random.split(jax.random.key(1), count)
    steps = batched_view(np.tile(p, (count, 1)), np.tile(decided, (count, 1)), np.zeros((count, SIZE), np.float32),
                         np.zeros((count, SIZE), np.float32), keys=keys)
    filled = run_batched(schedules.dream, steps, dream_params(count, "maskgit_plus", np.full(count, 2),
                                                              alg_temp=temperature)).decided[:, :6]
    assert np.all(filled.sum(axis=1) == 2)
    weights = np.exp(p[:6] / temperature) / np.exp(p[:6] / temperature).sum()
    for a, b in itertools.combinations(range(6), 2):
        expected = weights[a] * weights[b] / (1 - weights[a]) + weights[b] * weights[a] / (1 - weights[b])
        seen = np.mean(filled[:, a] & filled[:, b])
        assert abs(seen - expected) < 0.02, ((a, b), seen, expected)


def test_dream_origin_fills_each_mask_independently_with_the_transfer_probability():
    count = 4000
    keys = jax.random.split(jax.random.key(2), count)
    steps = batched_view(np.full((count, SIZE), 0.5, np.float32), np.zeros((count, SIZE), bool),
                         np.zeros((count, SIZE), np.float32), np.zeros((count, SIZE), np.float32),
                         step=np.full(count, 1), keys=keys)
    decided = run_batched(schedules.dream, steps, dream_params(count, "origin", np.full(count, 4), eps=0.1)).decided
    t = np.linspace(1, 0.1, 5)
    chance = 1 - t[2] / t[1]
    assert np.all(np.abs(decided.mean(axis=0) - chance) < 0.03)
    # independent: the number filled per step is binomial(SIZE, chance)
    assert abs(decided.sum(axis=1).var() - SIZE * chance * (1 - chance)) < 0.15 * SIZE * chance * (1 - chance)


# ---------------------------------------------------------------------- JointThreshold
JOINT = {"threshold": 0.5, "edit_threshold": 0.9, "max_post_edit_steps": 3}


def test_joint_threshold_fills_masks_and_edits_decided_tokens_in_one_step():
    # positions: 0 prompt (fixed), 1 decided token 40 whose candidate 41 is confident -> edited,
    # 2 decided with candidate == token -> no edit, 3 decided with candidate at exactly edit_threshold -> no edit,
    # 4 mask p 0.6 > 0.5 -> filled, 5 mask p 0.5 -> not filled
    step = view([0.95, 0.95, 0.99, 0.9, 0.6, 0.5], decided=[True, True, True, True, False, False],
                fixed=[True, False, False, False, False, False], tokens=[7, 40, 42, 43, 127, 127],
                candidates=[8, 41, 42, 44, 50, 51])
    decision = schedules.joint_threshold(step, JOINT)
    assert decision.decided.tolist() == [True, True, True, True, True, False]
    assert decision.edit.tolist() == [False, True, False, False, False, False]


def test_joint_threshold_keeps_a_full_block_open_while_edits_change_it_within_the_budget():
    full = dict(decided=[True] * 3, tokens=[40, 41, 42])
    edits = view([0.95, 0.3, 0.3], candidates=[45, 41, 42], **full)
    still = view([0.95, 0.3, 0.3], candidates=[40, 41, 42], **full)
    for post_fill_steps, expect_edit, expect_open in [(0, True, True), (1, True, True), (2, True, False),
                                                      (3, False, False)]:
        decision = schedules.joint_threshold(edits._replace(post_fill_steps=jnp.int32(post_fill_steps)), JOINT)
        assert bool(decision.edit[0]) is expect_edit and bool(decision.keep_open) is expect_open, post_fill_steps
    assert not schedules.joint_threshold(still, JOINT).keep_open  # nothing changes: the block closes
    # the step that fills the last mask goes on to editing steps when the budget allows one
    last_mask = view([0.3, 0.3, 0.2], decided=[True, True, False], tokens=[40, 41, 127], candidates=[40, 41, 9])
    assert schedules.joint_threshold(last_mask, JOINT).keep_open
    assert not schedules.joint_threshold(last_mask, dict(JOINT, max_post_edit_steps=0)).keep_open


def np_joint_threshold(p, decided, fixed, tokens, candidates, post_fill_steps, *, threshold, edit_threshold, budget):
    """SGLang's JointThreshold step, read from its description: (decided after, edited, keep open)."""
    masked = ~decided
    has_mask = bool(masked.any())
    if has_mask:
        fill = np_low_confidence(p, masked, threshold)
    else:
        fill = set()
        if post_fill_steps + 1 > budget:
            return set(np.flatnonzero(decided)), set(), False
    edit = {j for j in range(len(p)) if decided[j] and not fixed[j] and candidates[j] != tokens[j]
            and p[j] > edit_threshold}
    keep = budget >= 1 if has_mask else (bool(edit) and post_fill_steps + 1 < budget)
    return set(np.flatnonzero(decided)) | fill, edit, keep


def test_joint_threshold_equals_its_numpy_reading_on_random_steps():
    count = 300
    p, decided, entropy, margin = random_steps(count, seed=11)
    rng = np.random.default_rng(12)
    decided[rng.uniform(size=count) < 0.4] = True  # many full blocks, in their editing phase
    fixed = decided & (np.arange(SIZE) < 2)
    tokens = rng.integers(20, 24, (count, SIZE))
    candidates = np.where(rng.uniform(size=(count, SIZE)) < 0.5, tokens, rng.integers(20, 24, (count, SIZE)))
    post = np.where(decided.all(axis=1), rng.integers(0, 5, count), 0)
    params = {"threshold": rng.choice([0.3, 0.5, 0.7], count).astype(np.float32),
              "edit_threshold": rng.choice([0.0, 0.5, 0.9], count).astype(np.float32),
              "max_post_edit_steps": rng.integers(0, 4, count).astype(np.int32)}
    steps = batched_view(p, decided, entropy, margin, tokens=tokens, candidates=candidates, fixed=fixed,
                         post_fill_steps=post)
    result = run_batched(schedules.joint_threshold, steps, params)
    for c in range(count):
        after, edit, keep = np_joint_threshold(p[c], decided[c], fixed[c], tokens[c], candidates[c], int(post[c]),
                                               threshold=params["threshold"][c],
                                               edit_threshold=params["edit_threshold"][c],
                                               budget=int(params["max_post_edit_steps"][c]))
        assert decided_set(result.decided[c]) == after
        assert set(np.flatnonzero(result.edit[c])) == edit
        assert bool(result.keep_open[c]) is keep


# ---------------------------------------------------------------------- parameters
@pytest.mark.parametrize("schedule, params, message", [
    ("low_confidence", {"threshold": 0.0}, r"'low_confidence': threshold must be in \(0, 1\], got 0.0"),
    ("fast_dllm_threshold", {"threshold": 1.5}, r"'fast_dllm_threshold': threshold must be in \(0, 1\]"),
    ("fast_dllm_factor", {"factor": -1.0}, r"'fast_dllm_factor': factor must be >= 0"),
    ("dream", {"steps": 0}, r"'dream': steps must be >= 1"),
    ("dream", {"steps": 2.5}, r"'dream': steps must be an integer"),
    ("dream", {"eps": 1.0}, r"'dream': eps must be in \(0, 1\)"),
    ("dream", {"alg_temp": -0.1}, r"'dream': alg_temp must be >= 0"),
    ("dream", {"alg": "random"}, r"'dream': alg must be one of \['maskgit_plus', 'topk_margin', 'entropy', 'origin'\]"),
    ("eb_sampler", {"gamma": -1}, r"'eb_sampler': gamma must be >= 0"),
    ("eb_sampler", {"gamma": math.nan}, r"'eb_sampler': gamma must be a finite number"),
    ("joint_threshold", {"max_post_edit_steps": -1}, r"'joint_threshold': max_post_edit_steps must be >= 0"),
    ("joint_threshold", {"edit_threshold": 1.2}, r"'joint_threshold': edit_threshold must be in \[0, 1\]"),
    ("joint_threshold", {"threshold": True}, r"'joint_threshold': threshold must be a finite number"),
    ("fixed_k", {"tokens_per_step": 0}, r"'fixed_k': tokens_per_step must be >= 1"),
    ("dream", {"step": 4}, r"schedule 'dream' has no parameter \['step'\]"),
])
def test_bad_schedule_params_are_refused_naming_schedule_and_parameter(schedule, params, message):
    with pytest.raises(ValueError, match=message):
        resolve_params(schedule, params, GenerationConfig(block_size=8))


def test_defaults_come_from_the_spec_table_and_the_generation_config():
    config = GenerationConfig(block_size=16, threshold=0.8)
    assert resolve_params("dream", None, config) == {"alg": 0, "steps": 16, "eps": np.float32(1e-3), "alg_temp": 0.0}
    assert resolve_params("fast_dllm_threshold", None, config) == {"threshold": np.float32(0.8)}
    assert resolve_params("fast_dllm_factor", None, config) == {"factor": 1.0}
    assert resolve_params("eb_sampler", None, config) == {"gamma": np.float32(0.15)}
    assert resolve_params("joint_threshold", None, config) == {"threshold": 0.5, "edit_threshold": np.float32(0.9),
                                                               "max_post_edit_steps": 16}
    assert resolve_params("dream", {"alg": "origin"}, config)["alg"] == 3


def test_bad_schedule_params_are_refused_before_the_decoder_runs(peaked, controls_config, monkeypatch):
    import decoding.layouts

    def never(*args, **kwargs):
        raise AssertionError("the decoder ran")

    monkeypatch.setattr(decoding.layouts, "run_block_decoder", never)
    with pytest.raises(ValueError, match="'dream': eps must be in"):
        generate(peaked, [[20, 21, 22]], controls_config, schedule="dream", schedule_params={"eps": 0.0})


# ---------------------------------------------------------------------- end to end
PROMPT = list(range(20, 31))  # 11 tokens: one block of prefix, a 3-token tail opening the first decoded block


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
    out = generate(peaked, [PROMPT], config, return_trajectory=True)
    assert out.steps_per_block[0] and all(steps == 3 for steps in out.steps_per_block[0][1:])
    assert len(out.sequences[0]) == 12 or out.sequences[0][-1] == 1
    assert 127 not in out.sequences[0]  # no mask token survives a block


def test_fixed_k_margin_and_entropy_bounded_decode(peaked, controls_config):
    for name in ("fixed_k", "margin", "entropy_bounded"):
        out = generate(peaked, [PROMPT], controls_config, schedule=name, max_new_tokens=10)
        assert 0 < len(out.sequences[0]) <= 10 and 127 not in out.sequences[0]
        if name == "fixed_k":  # two masks per step: a block of 8 with a 3-token prompt tail takes 3 steps
            assert out.steps_per_block[0][0] == 3


def test_dream_takes_exactly_its_steps_per_block_and_new_parameter_values_never_recompile(peaked, controls_config):
    out = generate(peaked, [PROMPT], controls_config, schedule="dream", schedule_params={"steps": 4})
    compiled = run_block_decoder._cache_size()
    assert out.steps_per_block[0] and all(steps == 4 for steps in out.steps_per_block[0])
    assert 127 not in out.sequences[0]
    for params in ({"steps": 2, "alg": "entropy"}, {"steps": 3, "alg": "origin", "eps": 0.2},
                   {"steps": 5, "alg": "topk_margin", "alg_temp": 0.5}):
        out = generate(peaked, [PROMPT], controls_config, schedule="dream", schedule_params=params,
                       key=jax.random.key(3))
        # origin may fill all masks early by chance; the others never do before their last step
        assert all(steps == params["steps"] for steps in out.steps_per_block[0]) or params["alg"] == "origin"
        assert all(steps <= params["steps"] for steps in out.steps_per_block[0])
    assert run_block_decoder._cache_size() == compiled
    again = generate(peaked, [PROMPT], controls_config, schedule="dream", schedule_params=params, key=jax.random.key(3))
    assert again.sequences == out.sequences  # random choices are fixed by the key


def test_joint_threshold_runs_one_editing_step_after_each_full_block_when_nothing_changes(peaked, controls_config):
    """With edit_threshold 1.0 no edit is ever possible (p > 1), so the editing phase is one step
    that changes nothing: the same tokens, one more step per block than with no editing phase."""
    base = generate(peaked, [PROMPT], controls_config, schedule="joint_threshold",
                    schedule_params={"edit_threshold": 1.0, "max_post_edit_steps": 0})
    edit = generate(peaked, [PROMPT], controls_config, schedule="joint_threshold",
                    schedule_params={"edit_threshold": 1.0})
    assert edit.sequences == base.sequences and 127 not in base.sequences[0]
    assert edit.steps_per_block[0] == [steps + 1 for steps in base.steps_per_block[0]]
    assert edit.nfe[0] == base.nfe[0] + len(base.steps_per_block[0])
    editing = generate(peaked, [PROMPT], controls_config, schedule="joint_threshold",
                       schedule_params={"edit_threshold": 0.0, "max_post_edit_steps": 2})
    assert 127 not in editing.sequences[0]
    assert all(steps <= controls_config.steps_cap + 2 for steps in editing.steps_per_block[0])


@pytest.mark.parametrize("name, everything", [
    ("fast_dllm_threshold", {"threshold": 1e-6}),
    ("fast_dllm_factor", {"factor": 100.0}),
    ("eb_sampler", {"gamma": 1e9}),
])
def test_confidence_and_entropy_schedules_decode_and_fill_a_block_at_once_when_everything_passes(
        peaked, controls_config, name, everything):
    out = generate(peaked, [PROMPT], controls_config, schedule=name)
    assert 0 < len(out.sequences[0]) <= controls_config.max_new_tokens and 127 not in out.sequences[0]
    at_once = generate(peaked, [PROMPT], controls_config, schedule=name, schedule_params=everything)
    assert at_once.steps_per_block[0] == [1] * len(at_once.steps_per_block[0])
