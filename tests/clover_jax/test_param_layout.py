"""The config-only parameter table equals what the Flax modules declare."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.config import CloverConfig
from clover_jax.model import param_shapes
from clover_jax.param_layout import param_layout


def test_param_layout_equals_traced_module_shapes(qwen36_checkpoint, tied_checkpoint):
    for path in (qwen36_checkpoint, tied_checkpoint):
        config = CloverConfig.from_pretrained(path)
        traced = jax.tree.map(lambda leaf: tuple(leaf.shape), param_shapes(config, jnp.float32))
        assert param_layout(config) == traced
