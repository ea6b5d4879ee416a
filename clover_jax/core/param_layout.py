"""The parameter pytree's shapes, computed from the config alone (from `clover_jax.core.params`).

The loader, the sharding rules and the memory planner need every parameter's shape without
tracing the model; `tests/clover_jax/core/test_param_layout.py` checks the table against
`jax.eval_shape` of the Flax modules' `init`, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from clover_jax.core.config import CloverConfig
from clover_jax.core.params import Shape, param_rows


def flat_layout(config: CloverConfig) -> dict[tuple[str, ...], Shape]:
    """{parameter path: shape} for every leaf, in the pytree's order; layer parameters carry a
    leading [num_groups] axis."""
    return {path: row.leaf_shape(config) for path, row in param_rows(config).items()}


def nested(flat: dict[tuple[str, ...], Any]) -> dict:
    """{path: leaf} -> the nested dict of the parameter pytree."""
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def param_layout(config: CloverConfig) -> dict:
    """Nested dict of parameter shapes; layer parameters carry a leading [num_groups] axis."""
    return nested(flat_layout(config))
