"""The named schedules: each rule with its parameters, their defaults and allowed ranges, and the
resolution of a `generate` call's `schedule` / `schedule_params` into a rule and traced values."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from clover_jax.core.errors import MISSING_FIELD, UNKNOWN_FIELD, FieldError
from decoding.schedules.confidence import fast_dllm_factor, fast_dllm_threshold, fixed_k, low_confidence, margin
from decoding.schedules.dream import ALGORITHMS, dream
from decoding.schedules.entropy import eb_sampler, entropy_bounded
from decoding.schedules.joint_threshold import joint_threshold
from decoding.schedules.view import StepView

FROM_CONFIG = None  # a parameter default that means "the generation config's field of the same name"


@dataclasses.dataclass(frozen=True)
class FromConfig:
    """A parameter default read from another `GenerationConfig` field (e.g. Dream's `steps` from
    `block_size`)."""

    field: str


class Range(NamedTuple):
    """Allowed values of a numeric parameter: low/high bounds (None: unbounded), each open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


PROBABILITY = Range(0.0, 1.0, low_open=True)  # thresholds: (0, 1]
NON_NEGATIVE = Range(0.0)
AT_LEAST_ONE = Range(1)


@dataclasses.dataclass(frozen=True)
class NamedSchedule:
    """A schedule known by name: its rule, its parameters with their defaults (`FROM_CONFIG`:
    the `GenerationConfig` field of the same name; `FromConfig(field)`: another field), the
    allowed range of each numeric parameter, which are integers and, for text-valued
    parameters, the allowed values (passed to the rule as the int32 index into
    `choices[name]`)."""

    name: str
    rule: Callable[[StepView, Mapping[str, jax.Array]], Any]
    defaults: Mapping[str, Any]
    integers: tuple[str, ...] = ()
    choices: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    ranges: Mapping[str, Range] = dataclasses.field(default_factory=dict)


BY_NAME: dict[str, NamedSchedule] = {schedule.name: schedule for schedule in (
    NamedSchedule("low_confidence", low_confidence, {"threshold": FROM_CONFIG}, ranges={"threshold": PROBABILITY}),
    NamedSchedule("fast_dllm_threshold", fast_dllm_threshold, {"threshold": FROM_CONFIG},
                  ranges={"threshold": PROBABILITY}),
    NamedSchedule("fast_dllm_factor", fast_dllm_factor, {"factor": 1.0}, ranges={"factor": NON_NEGATIVE}),
    NamedSchedule("dream", dream, {"alg": "maskgit_plus", "steps": FromConfig("block_size"), "eps": 1e-3,
                                   "alg_temp": 0.0},
                  integers=("steps",), choices={"alg": ALGORITHMS},
                  ranges={"steps": AT_LEAST_ONE, "eps": Range(0.0, 1.0, low_open=True, high_open=True),
                          "alg_temp": NON_NEGATIVE}),
    NamedSchedule("eb_sampler", eb_sampler, {"gamma": 0.15}, ranges={"gamma": NON_NEGATIVE}),
    NamedSchedule("joint_threshold", joint_threshold,
                  {"threshold": 0.5, "edit_threshold": 0.9, "max_post_edit_steps": 16},
                  integers=("max_post_edit_steps",),
                  ranges={"threshold": PROBABILITY, "edit_threshold": Range(0.0, 1.0),
                          "max_post_edit_steps": NON_NEGATIVE}),
    NamedSchedule("fixed_k", fixed_k, {"tokens_per_step": FROM_CONFIG}, integers=("tokens_per_step",),
                  ranges={"tokens_per_step": AT_LEAST_ONE}),
    NamedSchedule("margin", margin, {"margin_threshold": FROM_CONFIG}, ranges={"margin_threshold": NON_NEGATIVE}),
    NamedSchedule("entropy_bounded", entropy_bounded, {"entropy_bound": FROM_CONFIG},
                  ranges={"entropy_bound": NON_NEGATIVE}),
)}


def resolve(schedule: "str | Callable") -> Callable:
    """A schedule name or function -> the rule function."""
    if isinstance(schedule, str):
        if schedule not in BY_NAME:
            raise FieldError("schedule", f"unknown schedule {schedule!r}; named schedules: {sorted(BY_NAME)}")
        return BY_NAME[schedule].rule
    if not callable(schedule):
        raise FieldError("schedule", f"schedule must be a name in {sorted(BY_NAME)} or a function, got {schedule!r}")
    return schedule


def resolve_params(schedule: "str | Callable", params: Mapping[str, Any] | None, config: Any = None) -> Any:
    """The traced parameters of one `generate` call: for a named schedule, its defaults (those
    read from the generation config taken from `config`, a `GenerationConfig`) updated with
    `params`, checked by name, type and range, text values encoded as indices; for a function,
    `params` as given (any pytree of numbers, converted to arrays; an empty dict when None).

    Returns a pytree of NumPy scalars/arrays (never Python numbers, so the jitted loop traces them).
    Raises FieldError (field "schedule" or "schedule_params"; the message names the schedule and the parameter).
    """
    if not isinstance(schedule, str):
        leaves = jax.tree_util.tree_leaves(params or {})
        bad = [leaf for leaf in leaves if not isinstance(leaf, (numbers.Number, np.ndarray, np.generic, jax.Array))]
        if bad:
            raise FieldError("schedule_params",
                             f"schedule_params of a schedule function must be numbers or arrays, got {bad[0]!r}")
        return jax.tree_util.tree_map(np.asarray, dict(params or {}))
    named = BY_NAME.get(schedule)
    if named is None:
        raise FieldError("schedule", f"unknown schedule {schedule!r}; named schedules: {sorted(BY_NAME)}")
    given = dict(params or {})
    unknown = sorted(set(given) - set(named.defaults))
    if unknown:
        raise FieldError("schedule_params", f"schedule {schedule!r} has no parameter {unknown}; its parameters: "
                         f"{sorted(named.defaults)}", code=UNKNOWN_FIELD)
    return {name: _checked(named, name, _value(named, name, given, config)) for name in named.defaults}


def _value(named: NamedSchedule, name: str, given: Mapping[str, Any], config: Any) -> Any:
    """The given value, else the default (read from `config` where the default says so)."""
    value = given.get(name, named.defaults[name])
    if value is FROM_CONFIG or isinstance(value, FromConfig):
        field = name if value is FROM_CONFIG else value.field
        if config is None:
            raise FieldError("schedule_params", f"schedule {named.name!r}: the default of {name} is the generation "
                                                f"config's {field}; pass a GenerationConfig or "
                                                f"schedule_params={{{name!r}: ...}}", code=MISSING_FIELD)
        value = getattr(config, field)
    return value


def _checked(named: NamedSchedule, name: str, value: Any) -> np.ndarray:
    """One parameter as a NumPy scalar, after its type and range checks."""
    where = f"schedule {named.name!r}: {name}"
    if name in named.choices:
        if not isinstance(value, str) or value not in named.choices[name]:
            raise FieldError("schedule_params", f"{where} must be one of {list(named.choices[name])}, got {value!r}")
        return np.int32(named.choices[name].index(value))
    if name in named.integers:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise FieldError("schedule_params", f"{where} must be an integer, got {value!r}")
        resolved = np.int32(value)
    else:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise FieldError("schedule_params", f"{where} must be a finite number, got {value!r}")
        resolved = np.float32(value)
    allowed = named.ranges.get(name)
    if allowed is not None and value not in allowed:
        raise FieldError("schedule_params", f"{where} must be {allowed}, got {value!r}")
    return resolved
