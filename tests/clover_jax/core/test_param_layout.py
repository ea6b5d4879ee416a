"""The parameter table (`clover_jax.core.params`) equals what the Flax modules declare, and what is
derived from it (layout, logical axes, parameter counts) is whole and consistent."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout, param_layout
from clover_jax.core.params import PARAMS, param_rows, parameter_counts
from clover_jax.nn.model import param_shapes
from clover_jax.parallel.sharding import param_logical_axes
from tests.checkpoints import TIED_ONE_TO_ONE


@pytest.fixture(scope="module")
def configs(qwen36_checkpoint, tied_checkpoint, clover_checkpoint) -> list[CloverConfig]:
    """The test checkpoints' configs and Clover-35B-A3B's (the roofline's)."""
    from benchmarks.roofline import MODEL

    return [CloverConfig.from_pretrained(path) for path in (qwen36_checkpoint, tied_checkpoint, clover_checkpoint)] \
        + [MODEL]


def _traced(config: CloverConfig) -> dict:
    return jax.tree.map(lambda leaf: tuple(leaf.shape), param_shapes(config, jnp.float32))


def test_param_layout_equals_traced_module_shapes(configs):
    for config in configs:
        assert param_layout(config) == _traced(config)


def test_every_leaf_has_one_logical_axis_per_dimension(configs):
    for config in configs:
        for path, shape in flat_layout(config).items():
            axes = param_logical_axes(path)
            assert len(axes) == len(shape), path
            assert (axes[0] == "layers") == (path[0] == "groups"), path


def test_every_row_is_used_and_named_once():
    paths = [row.path for row in PARAMS]
    assert len(paths) == len(set(paths))
    names = [name for row in PARAMS for name in row.checkpoint]
    assert len(names) == len(set(names))
    untied = CloverConfig.from_dict(dict(TIED_ONE_TO_ONE, model_type="qwen3_5_moe_text", tie_word_embeddings=False))
    assert {row.path for row in param_rows(untied).values()} == set(paths)  # GDN and attention layers, an LM head


def test_the_tied_config_has_no_lm_head(tied_checkpoint):
    config = CloverConfig.from_pretrained(tied_checkpoint)
    assert config.tie_word_embeddings and ("lm_head",) not in flat_layout(config)


def test_parameter_counts_match_the_traced_tree_and_the_arithmetic(configs):
    for config in configs:
        leaves = jax.tree.leaves(param_shapes(config, jnp.float32))
        total = sum(math.prod(leaf.shape) for leaf in leaves)
        hidden, layers = config.hidden_size, config.num_hidden_layers
        routed = layers * config.num_experts * 3 * config.moe_intermediate_size * hidden
        embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
        assert parameter_counts(config) == {
            "total": total, "routed_experts": routed, "embeddings": embeddings,
            "active_per_token": total - routed + routed * config.num_experts_per_tok // config.num_experts}

