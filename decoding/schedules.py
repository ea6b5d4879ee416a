"""Denoising schedules: which positions of a block are decided after a step.

Signature (one sequence's block; the decoder vmaps it over the batch):

    schedule(view: StepView, params: dict[str, jax.Array]) -> decided bool [block] | Decision

`StepView` holds, for every position j of the block, the block's token before the step, the
candidate token chosen this step with its confidence / top-1 minus top-2 margin / entropy,
which positions are decided (`decided`) and which hold prompt tokens (`fixed`, never changed),
their absolute positions, and per step the step number within the block, the block's number,
the step cap and a PRNG key. `params` are the schedule's parameters as traced scalars: a new
value never recompiles.

The result is the decided set after the step: positions that become decided take their
candidate token; decided positions that the result leaves out are remasked (a schedule may do
so); `fixed` positions stay decided whatever it says. A `Decision` can also replace decided
tokens by their candidates (`edit`) and keep a block open for more steps after its last mask
is filled (`keep_open`), as token-editing schedules do. On step `steps_cap` (counted from 1)
every remaining mask is filled with its candidate, so every block ends.

A schedule must be a pure JAX function of its arguments (it runs inside the jitted loop);
any Python callable with this signature can be passed as `schedule=`, with its parameters as
`schedule_params={...}` (any pytree of numbers).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class StepView(NamedTuple):
    """What a schedule sees of one sequence's block at one denoising step."""

    tokens: jax.Array           # int32 [block]: the block before this step (the mask id where masked)
    candidates: jax.Array       # int32 [block]: the token chosen this step at every position
    confidence: jax.Array       # float32 [block]: its probability under the processed distribution
    margin: jax.Array           # float32 [block]: top-1 minus top-2 probability
    entropy: jax.Array          # float32 [block]: -Σ p log p of the processed distribution (nats)
    decided: jax.Array          # bool [block]: not masked before this step (prompt positions included)
    fixed: jax.Array            # bool [block]: prompt positions (never changed)
    positions: jax.Array        # int32 [block]: absolute positions in the sequence (0 = first prompt token)
    step: jax.Array             # int32 []: steps already taken in this block (0 at its first step)
    block_index: jax.Array      # int32 []: the sequence's decoded block number (0 = its first decoded block)
    steps_cap: jax.Array        # int32 []: on step steps_cap (1-based) every remaining mask is filled
    post_fill_steps: jax.Array  # int32 []: steps taken since the block had no mask (0 while masks remain)
    threshold: jax.Array        # float32 []: the generation config's threshold τ
    key: jax.Array              # PRNG key of this step (per sequence, block and step)

    @property
    def masked(self) -> jax.Array:
        return ~self.decided


class Decision(NamedTuple):
    """decided: bool [block], the decided set after the step; edit: bool [block], decided
    positions whose token is replaced by its candidate; keep_open: bool [], run another step on
    this block even if it has no mask left."""

    decided: jax.Array
    edit: jax.Array
    keep_open: jax.Array


def as_decision(result: "jax.Array | Decision") -> Decision:
    """A schedule's result as a `Decision` (a bool array edits nothing and closes a full block)."""
    if isinstance(result, Decision):
        return result
    return Decision(result, jnp.zeros_like(result), jnp.bool_(False))


# ---------------------------------------------------------------------- helpers
def _most(scores: jax.Array, eligible: jax.Array) -> jax.Array:
    """One-hot of the eligible position with the largest score (ties: the lowest index)."""
    best = jnp.argmax(jnp.where(eligible, scores, -jnp.inf))
    return (jnp.arange(scores.shape[0]) == best) & jnp.any(eligible)


def _above_or_best(view: StepView, scores: jax.Array, threshold) -> jax.Array:
    """Decide every mask whose score exceeds `threshold`; if none does, the best one."""
    masked = ~view.decided
    fill = masked & (scores > threshold)
    return view.decided | jnp.where(jnp.any(fill), fill, _most(scores, masked))


# ---------------------------------------------------------------------- the schedules
def low_confidence(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """LowConfidence: fill every mask with confidence > threshold; if none, the most confident one."""
    return _above_or_best(view, view.confidence, params["threshold"])


def fixed_k(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fill the `tokens_per_step` most confident masks (ties: lower index first)."""
    masked = ~view.decided
    order = jnp.argsort(jnp.where(masked, -view.confidence, jnp.inf), stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return view.decided | (masked & (rank < params["tokens_per_step"]))


def margin(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fill masks whose top-1 minus top-2 probability exceeds `margin_threshold`; else the widest."""
    return _above_or_best(view, view.margin, params["margin_threshold"])


def entropy_bounded(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Fill masks in order of increasing entropy while their summed entropy stays within
    `entropy_bound` nats (at least one per step)."""
    masked = ~view.decided
    order = jnp.argsort(jnp.where(masked, view.entropy, jnp.inf), stable=True)
    sorted_entropy = jnp.where(masked[order], view.entropy[order], jnp.inf)
    within = (jnp.cumsum(sorted_entropy) <= params["entropy_bound"]) | (jnp.arange(order.shape[0]) == 0)
    fill = jnp.zeros_like(masked).at[order].set(within) & masked
    return view.decided | fill


# ---------------------------------------------------------------------- registry
FROM_CONFIG = None  # a parameter default that means "the generation config's field of the same name"


@dataclasses.dataclass(frozen=True)
class NamedSchedule:
    """A schedule known by name: its rule, its parameters with their defaults (`FROM_CONFIG`:
    the `GenerationConfig` field of the same name) and, for text-valued parameters, the allowed
    values (passed to the rule as the int32 index into `choices[name]`)."""

    name: str
    rule: Callable[[StepView, Mapping[str, jax.Array]], Any]
    defaults: Mapping[str, Any]
    integers: tuple[str, ...] = ()
    choices: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


BY_NAME: dict[str, NamedSchedule] = {schedule.name: schedule for schedule in (
    NamedSchedule("low_confidence", low_confidence, {"threshold": FROM_CONFIG}),
    NamedSchedule("fixed_k", fixed_k, {"tokens_per_step": FROM_CONFIG}, integers=("tokens_per_step",)),
    NamedSchedule("margin", margin, {"margin_threshold": FROM_CONFIG}),
    NamedSchedule("entropy_bounded", entropy_bounded, {"entropy_bound": FROM_CONFIG}),
)}


def resolve(schedule: "str | Callable") -> Callable:
    """A schedule name or function -> the rule function."""
    if isinstance(schedule, str):
        if schedule not in BY_NAME:
            raise ValueError(f"unknown schedule {schedule!r}; named schedules: {sorted(BY_NAME)}")
        return BY_NAME[schedule].rule
    if not callable(schedule):
        raise ValueError(f"schedule must be a name in {sorted(BY_NAME)} or a function, got {schedule!r}")
    return schedule


def resolve_params(schedule: "str | Callable", params: Mapping[str, Any] | None, config: Any = None) -> Any:
    """The traced parameters of one `generate` call: for a named schedule, its defaults (those
    marked `FROM_CONFIG` read from `config`, a `GenerationConfig`) updated with `params`,
    checked by name and type, text values encoded as indices; for a function, `params` as given
    (any pytree of numbers, converted to arrays; an empty dict when None).

    Returns a pytree of NumPy scalars/arrays (never Python numbers, so the jitted loop traces them).
    """
    if not isinstance(schedule, str):
        leaves = jax.tree_util.tree_leaves(params or {})
        bad = [leaf for leaf in leaves if not isinstance(leaf, (numbers.Number, np.ndarray, np.generic, jax.Array))]
        if bad:
            raise ValueError(f"schedule_params of a schedule function must be numbers or arrays, got {bad[0]!r}")
        return jax.tree_util.tree_map(np.asarray, dict(params or {}))
    named = BY_NAME.get(schedule)
    if named is None:
        raise ValueError(f"unknown schedule {schedule!r}; named schedules: {sorted(BY_NAME)}")
    given = dict(params or {})
    unknown = sorted(set(given) - set(named.defaults))
    if unknown:
        raise ValueError(f"schedule {schedule!r} has no parameter {unknown}; its parameters: {sorted(named.defaults)}")
    resolved = {}
    for name, default in named.defaults.items():
        value = given.get(name, default)
        if value is FROM_CONFIG:
            value = getattr(config, name)
        if name in named.choices:
            if value not in named.choices[name]:
                raise ValueError(f"schedule {schedule!r}: {name} must be one of {list(named.choices[name])}, "
                                 f"got {value!r}")
            resolved[name] = np.int32(named.choices[name].index(value))
        elif name in named.integers:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"schedule {schedule!r}: {name} must be an integer, got {value!r}")
            resolved[name] = np.int32(value)
        else:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not np.isfinite(value):
                raise ValueError(f"schedule {schedule!r}: {name} must be a finite number, got {value!r}")
            resolved[name] = np.float32(value)
    return resolved
