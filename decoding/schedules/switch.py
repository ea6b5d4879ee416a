"""`ScheduleSwitch`: several named schedules behind one schedule function, picked by a traced index.

A compiled decoder takes its schedule as a static argument, so each schedule is its own program.
A switch is one static schedule that runs whichever named rule its parameters select, so
decoders that must serve many schedules compile once: a sweep's grid (`decoding.research`) and
the serving engine (`decoding.engine`), whose batched requests each bring their own schedule.
Under `vmap` with one index per sequence, every branch runs and each sequence takes its own.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from decoding.schedules.registry import BY_NAME, resolve, resolve_params
from decoding.schedules.view import as_decision


class ScheduleSwitch:
    """One schedule function that runs any of several named schedules, chosen by a traced index:
    `params = switch.params(name, given, config)` selects `name` with its parameters. Every choice
    shares one compiled decoder per block size; the decisions are those of the named rule itself."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(dict.fromkeys(names))
        for name in self.names:
            resolve(name)
        self.__name__ = "switch(" + ", ".join(self.names) + ")"

    def __call__(self, view, params):
        branches = [lambda v, p, name=name: as_decision(BY_NAME[name].rule(v, p[name])) for name in self.names]
        return jax.lax.switch(params["index"], branches, view, params)

    def params(self, name: str, given: Mapping[str, Any] | None, config: Any) -> dict:
        """The parameters that select `name` with `given` (its other schedules at their defaults);
        config: the `GenerationConfig` the defaults are read from."""
        if name not in self.names:
            raise ValueError(f"schedule {name!r} is not one of this switch's {list(self.names)}")
        return {"index": np.int32(self.names.index(name)),
                **{other: resolve_params(other, given if other == name else None, config) for other in self.names}}

    def __eq__(self, other) -> bool:
        return isinstance(other, ScheduleSwitch) and other.names == self.names

    def __hash__(self) -> int:
        return hash(("ScheduleSwitch", self.names))
