"""config.json parsing: the three accepted shapes, and clear errors for the rest."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from clover_jax.core.config import CloverConfig, ConfigError
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
    assert flat.mask_token_id is None and flat.moe_block_coreset_enabled  # docs/design.md §2 default
    assert flat.group_pattern == ("linear_attention",) * 3 + ("full_attention",) and flat.num_groups == 2
    assert flat.rotary_dim == 8 and flat.eos_token_id == (1,)


def test_the_text_model_fields_of_any_config_shape_come_from_the_one_reader(qwen36_checkpoint, tmp_path):
    from clover_jax.core.config import read_text_model_fields

    flat = read_config(qwen36_checkpoint)
    assert read_text_model_fields(qwen36_checkpoint) == flat
    text = {key: value for key, value in flat.items() if key != "eos_token_id"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text,
                                                      "eos_token_id": flat["eos_token_id"]}))
    assert read_text_model_fields(tmp_path) == flat  # the wrapper's top-level EOS joins the text fields
    with pytest.raises(ConfigError, match="no config.json in"):
        read_text_model_fields(tmp_path / "absent")


def test_unknown_model_type_is_named(qwen36_checkpoint):
    raw = read_config(qwen36_checkpoint) | {"model_type": "llama"}
    with pytest.raises(ConfigError, match="model_type='llama'.*accepts"):
        CloverConfig.from_dict(raw)


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"linear_num_key_heads": 3}, "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ({"layer_types": ["linear_attention"] * 7}, "layer_types has 7 entries but num_hidden_layers=8"),
    ({"layer_types": ["linear_attention"] * 7 + ["sliding_attention"]},
     "unknown layer types \\['sliding_attention'\\]"),
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


# ---------------------------------------------------------------------- hostile config.json
NAN, HUGE = "__nan__", "__huge__"  # spelled as JSON's NaN and as 1e400 (which parses to inf)


def write_config(directory, raw) -> str:
    text = json.dumps(raw).replace(f'"{NAN}"', "NaN").replace(f'"{HUGE}"', "1e400")
    (directory / "config.json").write_text(text)
    return str(directory)


def without(raw: dict, *names: str) -> dict:
    return {key: value for key, value in raw.items() if key not in names}


def wrapped(raw: dict, **text_changes) -> dict:
    return {"model_type": "qwen3_5_moe", "text_config": raw | text_changes}


@pytest.mark.parametrize("edit, message", [
    (lambda raw: [raw], r"must hold a JSON object \{...\}, got a list"),
    (lambda raw: raw | {"tie_word_embeddings": "false"}, r'tie_word_embeddings must be true or false, got "false"'),
    (lambda raw: raw | {"moe_block_coreset_enabled": 1}, r"moe_block_coreset_enabled must be true or false, got 1"),
    (lambda raw: raw | {"hidden_size": "96"}, r'hidden_size must be an integer, got "96"'),
    (lambda raw: raw | {"num_experts": True}, r"num_experts must be an integer, got true"),
    (lambda raw: raw | {"head_dim": 32.0}, r"head_dim must be an integer, got 32.0"),
    (lambda raw: raw | {"max_position_embeddings": False}, r"max_position_embeddings must be an integer, got false"),
    (lambda raw: raw | {"eos_token_id": [1, None]}, r"eos_token_id must be a token id .* got \[1, null\]"),
    (lambda raw: raw | {"eos_token_id": "1"}, r'eos_token_id must be a token id .* got "1"'),
    (lambda raw: raw | {"mask_token_id": "127"}, r'mask_token_id must be an integer, got "127"'),
    (lambda raw: raw | {"rope_parameters": dict(raw["rope_parameters"], rope_theta=NAN)},
     r"rope_parameters.rope_theta must be a finite number, got NaN"),
    (lambda raw: raw | {"rope_parameters": dict(raw["rope_parameters"], rope_theta=-1.0)},
     r"rope_parameters.rope_theta must be a number > 0, got -1.0"),
    (lambda raw: without(raw, "rope_parameters") | {"rope_theta": HUGE},
     r"rope_theta must be a finite number, got Inf"),
    (lambda raw: without(raw, "rope_parameters") | {"rope_theta": 0}, r"rope_theta must be a number > 0, got 0"),
    (lambda raw: raw | {"rope_parameters": []}, r"rope_parameters must be an object \{...\}, got \[\]"),
    (lambda raw: raw | {"rms_norm_eps": NAN}, r"rms_norm_eps must be a finite number, got NaN"),
    (lambda raw: raw | {"rms_norm_eps": 0.0}, r"rms_norm_eps must be a number > 0, got 0.0"),
    (lambda raw: raw | {"rms_norm_eps": "1e-6"}, r'rms_norm_eps must be a finite number, got "1e-6"'),
    (lambda raw: raw | {"rope_parameters": dict(raw["rope_parameters"], partial_rotary_factor="0.25")},
     r'partial_rotary_factor must be a finite number, got "0.25"'),
    (lambda raw: without(raw, "layer_types") | {"full_attention_interval": 0},
     r"full_attention_interval must be a positive integer, got 0"),
    (lambda raw: without(raw, "layer_types") | {"full_attention_interval": "4"},
     r'full_attention_interval must be an integer, got "4"'),
    (lambda raw: raw | {"layer_types": "linear_attention"}, r'layer_types must be a list of strings'),
    (lambda raw: raw | {"layer_types": raw["layer_types"][:-1] + [None]}, r"layer_types must be a list of strings"),
    (lambda raw: raw | {"hidden_act": ["silu"]}, r'hidden_act must be a string, got \["silu"\]'),
    (lambda raw: {"model_type": "qwen3_5_moe", "text_config": [raw]}, r"needs a 'text_config' object, got \[\{"),
    (lambda raw: wrapped(raw, hidden_size="64"), r'text_config.hidden_size must be an integer, got "64"'),
    (lambda raw: wrapped(raw, rope_parameters=dict(raw["rope_parameters"], rope_theta=NAN)),
     r"text_config.rope_parameters.rope_theta must be a finite number, got NaN"),
])
def test_wrong_json_types_are_config_errors_naming_the_field(qwen36_checkpoint, tmp_path, edit, message):
    directory = write_config(tmp_path, edit(read_config(qwen36_checkpoint)))
    with pytest.raises(ConfigError, match=message) as error:
        CloverConfig.from_pretrained(directory)
    assert "config.json" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("content, message", [
    (b'{"model_type": "clover_moe",', "is not valid JSON"),
    (b'{"model_type": "\xff\xfe"}', "is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON"),
    (b"null", "must hold a JSON object"),
    (b'{"hidden_size": ' + b"9" * 5000 + b"}", "is not valid JSON"),
])
def test_unreadable_config_json_is_a_config_error(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        CloverConfig.from_pretrained(tmp_path)


def test_a_bad_config_is_refused_before_any_weight_file_is_opened(checkpoint_copy, monkeypatch):
    from clover_jax import CloverModel
    from weights import checkpoint_files

    raw = read_config(checkpoint_copy) | {"tie_word_embeddings": "false"}
    write_config(Path(checkpoint_copy), raw)
    monkeypatch.setattr(checkpoint_files.CheckpointFiles, "__init__", lambda *a: pytest.fail("weights were opened"))
    with pytest.raises(ConfigError, match="tie_word_embeddings must be true or false"):
        CloverModel.from_pretrained(checkpoint_copy, progress=False)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": True}, "vocab_size must be a positive integer, got true"),
    ({"rope_theta": float("nan")}, "rope_theta must be a finite number > 0, got NaN"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number > 0, got Infinity"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number > 0"),
    ({"partial_rotary_factor": float("nan")}, "partial_rotary_factor must be a finite number"),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false"'),
    ({"layer_types": (None,) * 8}, "layer_types must be a list of strings"),
])
def test_direct_construction_is_checked_like_config_json(qwen36_checkpoint, change, message):
    with pytest.raises(ConfigError, match=message):
        CloverConfig.from_pretrained(qwen36_checkpoint).replace(**change)
