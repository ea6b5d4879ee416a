"""config.json parsing: the three accepted shapes, and clear errors for the rest."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from clover_jax.config import CloverConfig, ConfigError
from tests.conftest import read_config


def clover_dict(qwen36_checkpoint) -> dict:
    raw = read_config(qwen36_checkpoint)
    raw.update(model_type="clover_moe", mask_token_id=127, moe_block_coreset_top_p=0.8)
    return raw


def test_three_config_shapes_describe_the_same_backbone(qwen36_checkpoint, fused_checkpoint):
    flat = CloverConfig.from_pretrained(qwen36_checkpoint)
    wrapped = CloverConfig.from_pretrained(fused_checkpoint)
    clover = CloverConfig.from_dict(clover_dict(qwen36_checkpoint))
    backbone = lambda c: {k: v for k, v in dataclasses.asdict(c).items()
                          if k not in ("model_type", "mask_token_id", "moe_block_coreset_top_p")}
    assert backbone(flat) == backbone(wrapped) == backbone(clover)
    assert (flat.model_type, wrapped.model_type, clover.model_type) == ("qwen3_5_moe_text", "qwen3_5_moe", "clover_moe")
    assert clover.mask_token_id == 127 and clover.moe_block_coreset_top_p == 0.8
    assert flat.mask_token_id is None and flat.moe_block_coreset_enabled  # spec §2 default
    assert flat.group_pattern == ("linear_attention",) * 3 + ("full_attention",) and flat.num_groups == 2
    assert flat.rotary_dim == 8 and flat.eos_token_id == (1,)


def test_unknown_model_type_is_named(qwen36_checkpoint):
    raw = read_config(qwen36_checkpoint) | {"model_type": "llama"}
    with pytest.raises(ConfigError, match="model_type='llama'.*accepts"):
        CloverConfig.from_dict(raw)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"linear_num_key_heads": 3}, "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"layer_types": ["linear_attention"] * 7}, "layer_types has 7 entries but num_hidden_layers=8"),
    ({"layer_types": ["linear_attention"] * 7 + ["sliding_attention"]}, "unknown layer types \\['sliding_attention'\\]"),
    ({"mask_token_id": 128}, "mask_token_id=128 is outside the vocabulary"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type='yarn' is not supported"),
    ({"moe_block_coreset_top_p": 0.0}, "moe_block_coreset_top_p must be in \\(0, 1\\]"),
    ({"num_experts": 0}, "num_experts must be a positive integer"),
])
def test_inconsistent_fields_are_refused(qwen36_checkpoint, change, message):
    with pytest.raises(ConfigError, match=message):
        CloverConfig.from_dict(read_config(qwen36_checkpoint) | change)


def test_missing_required_field_is_named(qwen36_checkpoint):
    raw = read_config(qwen36_checkpoint)
    del raw["num_experts"]
    with pytest.raises(ConfigError, match="lacks required fields \\['num_experts'\\]"):
        CloverConfig.from_dict(raw)


def test_unknown_config_json_field_is_logged_and_unknown_override_refused(qwen36_checkpoint, caplog):
    with caplog.at_level(logging.WARNING):
        config = CloverConfig.from_dict(read_config(qwen36_checkpoint) | {"my_new_field": 1})
    assert "my_new_field" in caplog.text
    with pytest.raises(ConfigError, match="unknown config fields \\['num_layers'\\]"):
        config.replace(num_layers=3)
    assert config.replace(moe_block_coreset_top_p=0.5).moe_block_coreset_top_p == 0.5
