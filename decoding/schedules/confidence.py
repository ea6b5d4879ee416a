"""Rules that rank the masked positions of a block by confidence (or margin): LowConfidence,
Fast-dLLM's threshold and factor rules, fixed-k, margin.

Each takes `(view: StepView, params: {name: traced scalar})` and returns the decided set
bool [block] after the step (decided positions stay decided)."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from decoding.schedules.view import StepView, descending_order, in_order, leading_run, most, top


def above_or_best(view: StepView, scores: jax.Array, threshold) -> jax.Array:
    """Decide every mask whose score exceeds `threshold` (strictly); if none does, the best one."""
    masked = ~view.decided
    fill = masked & (scores > threshold)
    return view.decided | jnp.where(jnp.any(fill), fill, most(scores, masked))


def low_confidence(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """LowConfidence (SGLang, LLaDA2): fill every mask with confidence > threshold; if none, the
    most confident one (ties: the lowest index)."""
    return above_or_best(view, view.confidence, params["threshold"])


def fast_dllm_threshold(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fast-dLLM's threshold rule: the most confident mask always, and every other mask with
    confidence >= threshold (note >=, where LowConfidence has >)."""
    masked = ~view.decided
    return view.decided | (masked & (view.confidence >= params["threshold"])) | most(view.confidence, masked)


def fast_dllm_factor(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fast-dLLM's factor rule: with the masked confidences sorted in decreasing order p_(1) >=
    p_(2) >= ..., fill the first n, n the largest with p_(i) >= 1 - factor / (i + 1) for every
    i <= n (1-based), and at least one.

    Fast-dLLM's code also fills the last masked position when it alone fails its bound; this
    rule does not."""
    masked = ~view.decided
    order = descending_order(view.confidence, masked)
    i = jnp.arange(1, order.shape[0] + 1, dtype=jnp.float32)
    passes = (view.confidence[order] >= 1.0 - params["factor"] / (i + 1.0)) | (i == 1)
    return view.decided | (masked & in_order(leading_run(passes & masked[order]), order))


def fixed_k(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fill the `tokens_per_step` most confident masks (ties: lower index first)."""
    return view.decided | top(view.confidence, ~view.decided, params["tokens_per_step"])


def margin(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fill masks whose top-1 minus top-2 probability exceeds `margin_threshold`; else the widest."""
    return above_or_best(view, view.margin, params["margin_threshold"])
