"""Decoding: LowConfidence block diffusion (docs/design.md §4), autoregressive and self-speculative
modes, in jitted loops.

The names below are imported on first use, so that light modules (`decoding.modes`,
`decoding.generation_config`) can be imported without jax, as the CLI does before its arguments
are checked.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "GenerateOutput": "decoding.outputs",
    "GenerationConfig": "decoding.generation_config",
    "Mode": "decoding.modes",
    "generate": "decoding.generation",
    "schedules": None,  # the subpackage
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from decoding import schedules as schedules
    from decoding.generation import generate as generate
    from decoding.generation_config import GenerationConfig as GenerationConfig
    from decoding.modes import Mode as Mode
    from decoding.outputs import GenerateOutput as GenerateOutput


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decoding' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f"decoding.{name}") if module is None else getattr(
        importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
