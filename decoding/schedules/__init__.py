"""Denoising schedules: which positions of a block are decided after a step.

Signature (one sequence's block; the decoder vmaps it over the batch):

    schedule(view: StepView, params: dict[str, jax.Array]) -> decided bool [block] | Decision

`StepView` holds, for every position j of the block, the block's token before the step, the
candidate token chosen this step with its confidence / top-1 minus top-2 margin / entropy,
which positions are decided (`decided`) and which hold prompt tokens (`fixed`, never changed),
their absolute positions, and per step the step number within the block, the block's number,
the step cap, the number of earlier steps that found the block full, the generation config's
threshold and a PRNG key. `params` are the schedule's parameters as traced scalars: a new value
never recompiles.

The result is the decided set after the step: positions that become decided take their
candidate token; decided positions that the result leaves out are remasked (a schedule may do
so); `fixed` positions stay decided whatever it says. A `Decision` can also replace decided
tokens by their candidates (`edit`) and keep a block open for more steps after its last mask
is filled (`keep_open`), as token-editing schedules do. On step `steps_cap` (counted from 1)
every remaining mask is filled with its candidate, so every block ends.

A schedule must be a pure JAX function of its arguments (it runs inside the jitted loop);
any Python callable with this signature can be passed as `schedule=`, with its parameters as
`schedule_params={...}` (any pytree of numbers). The named schedules (`BY_NAME`) are described,
with their sources, in docs/schedules.md.
"""

from decoding.schedules.confidence import (
    above_or_best,
    fast_dllm_factor,
    fast_dllm_threshold,
    fixed_k,
    low_confidence,
    margin,
)
from decoding.schedules.dream import ALGORITHMS as DREAM_ALGORITHMS, dream
from decoding.schedules.entropy import eb_sampler, entropy_bounded
from decoding.schedules.joint_threshold import joint_threshold
from decoding.schedules.registry import BY_NAME, FROM_CONFIG, FromConfig, NamedSchedule, Range, resolve, resolve_params
from decoding.schedules.view import Decision, StepView, as_decision, descending_order, most, top

__all__ = [
    "BY_NAME", "DREAM_ALGORITHMS", "FROM_CONFIG", "Decision", "FromConfig", "NamedSchedule", "Range", "StepView",
    "above_or_best", "as_decision", "descending_order", "dream", "eb_sampler", "entropy_bounded",
    "fast_dllm_factor", "fast_dllm_threshold", "fixed_k", "joint_threshold", "low_confidence", "margin", "most",
    "resolve", "resolve_params", "top",
]
