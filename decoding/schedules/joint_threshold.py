"""LLaDA2.1's JointThreshold (SGLang `dllm/algorithm/joint_threshold.py`): mask-to-token fills
and token-to-token edits in the same step, then editing-only steps after the block is full."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from decoding.schedules.view import Decision, StepView, most


def joint_threshold(view: StepView, params: Mapping[str, jax.Array]) -> Decision:
    """Masks: fill those with confidence > `threshold`, else the most confident one. Edits: a
    decided non-prompt position whose candidate differs from its token and has confidence >
    `edit_threshold` takes the candidate. Once the block has no mask, up to
    `max_post_edit_steps` more steps that only edit; the block closes after a step that changes
    nothing, or after the last of those steps.

    In SGLang the step after the last allowed edit step still runs a forward pass and discards
    it; here the block closes without it."""
    masked = ~view.decided
    has_mask = jnp.any(masked)
    fill = masked & (view.confidence > params["threshold"])
    fill = jnp.where(jnp.any(fill), fill, most(view.confidence, masked))
    post_edit_step = view.post_fill_steps + 1  # this step's number among the editing-only steps
    budget = params["max_post_edit_steps"]
    edit = view.decided & ~view.fixed & (view.candidates != view.tokens) & \
        (view.confidence > params["edit_threshold"]) & (has_mask | (post_edit_step <= budget))
    keep_open = jnp.where(has_mask, budget >= 1, jnp.any(edit) & (post_edit_step < budget))
    return Decision(view.decided | fill, edit, keep_open)
