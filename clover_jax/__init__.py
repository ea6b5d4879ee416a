"""clover-jax: a JAX/Flax implementation of Clover-35B-A3B-Preview and its Qwen3.5-MoE backbone.

The names below are imported on first use, so `import clover_jax` (and the `clover-jax` command,
which checks its arguments first) does not pay for importing jax until something needs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "CloverModel": "clover_jax.model.clover_model",
    "Tokenizer": "clover_jax.text.tokenizer",
    "CloverConfig": "clover_jax.core.config",
    "ConfigError": "clover_jax.core.config",
    "choose_kernels": "clover_jax.core.kernels",
    "bundled_model_path": "clover_jax.core.bundled",
    "plan": "clover_jax.api.plan",
    "QuantSpec": "clover_jax.core.quantization",
    "MeshSharding": "clover_jax.parallel.sharding",
    "ShardingRules": "clover_jax.parallel.sharding",
    "make_mesh": "clover_jax.parallel.sharding",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    # `as` marks each name as re-exported (__all__ is built from _EXPORTS at run time)
    from clover_jax.api.plan import plan as plan
    from clover_jax.core.bundled import bundled_model_path as bundled_model_path
    from clover_jax.core.config import CloverConfig as CloverConfig, ConfigError as ConfigError
    from clover_jax.core.kernels import choose_kernels as choose_kernels
    from clover_jax.core.quantization import QuantSpec as QuantSpec
    from clover_jax.model.clover_model import CloverModel as CloverModel
    from clover_jax.parallel.sharding import (
        MeshSharding as MeshSharding,
        ShardingRules as ShardingRules,
        make_mesh as make_mesh,
    )
    from clover_jax.text.tokenizer import Tokenizer as Tokenizer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'clover_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
