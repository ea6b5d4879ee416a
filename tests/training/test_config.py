"""`FinetuneConfig` checks each field once, with errors that carry it; `clover-jax train`'s flags map onto it."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from clover_jax.api.cli import train as train_command
from clover_jax.core.errors import FieldError
from clover_jax.training import FinetuneConfig


@pytest.mark.parametrize("field, value, code", [
    ("steps", 0, "invalid_value"),
    ("batch_size", 2.5, "invalid_type"),
    ("grad_accum_steps", 3, "invalid_value"),       # batch_size 8 is not a multiple of 3
    ("block_size", (16, 16), "invalid_value"),
    ("seq_len", 100, "invalid_value"),              # not a multiple of the block size 32
    ("loss_weighting", "sqrt_t", "invalid_value"),
    ("min_mask_ratio", 0.5, "invalid_value"),
    ("learning_rate", 0.0, "invalid_value"),
    ("param_dtype", "float16", "invalid_value"),
    ("remat", "some", "invalid_value"),
    ("method", "dora", "unsupported_value"),
    ("quantize", "int4", "unsupported_value"),      # a quantised base is for method="lora"
    ("lora_rank", 0, "invalid_value"),
    ("lora_targets", ("attention", "mlp"), "invalid_value"),
    ("generation_config", [1], "invalid_type"),
    ("offload_base", "yes", "invalid_type"),
    ("offload_base", True, "unsupported_value"),    # method "full": its parameters are trained
    ("edit_fraction", 1.0, "invalid_value"),
    ("edit_substitutes", "model", "unsupported_value"),
    ("edit_keep_weight", 0.5, "invalid_value"),       # the keep term without editing
])
def test_a_bad_field_is_refused_naming_it(field, value, code):
    values = {"block_size": 32} if field == "seq_len" else {}
    with pytest.raises(FieldError) as caught:
        FinetuneConfig(**{**values, field: value})
    assert caught.value.field == field and caught.value.code == code
    assert f"FinetuneConfig.{field}" in str(caught.value)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_an_offloaded_base_needs_a_remat_that_copies_each_layer_again(remat):
    with pytest.raises(FieldError, match="would keep every layer's copy") as caught:
        FinetuneConfig(method="lora", offload_base=True, remat=remat)
    assert caught.value.field == "offload_base"
    assert FinetuneConfig(method="lora", offload_base=True, remat="layer").offload_base


def test_defaults_follow_the_complementary_copy():
    assert FinetuneConfig().weighting == "uniform" and FinetuneConfig().mask_ratio_floor == 1e-3
    alone = FinetuneConfig(complementary=False)
    assert alone.weighting == "inverse_t" and alone.mask_ratio_floor == 0.02
    assert FinetuneConfig(block_size=(4, 8)).block_weights(32) == (1.0, 1.0)
    assert FinetuneConfig().block_sizes(16) == (16,)


def test_every_field_is_a_flag_and_the_flags_build_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    train_command.add_parser(parser.add_subparsers(dest="command"))
    overrides = tmp_path / "generation.json"
    overrides.write_text(json.dumps({"threshold": 0.8}))
    args = parser.parse_args([
        "train", "--model", "m", "--data", "a.jsonl", "b.jsonl", "--out", "o", "--steps", "7", "--block-size",
        "4,8,16", "--block-size-weights", "1,2,1", "--seq-len", "64", "--no-complementary", "--learning-rate",
        "3e-4", "--max-noisy-blocks", "1", "--generation-config", str(overrides), "--eval-every", "none",
        "--lora-targets", "attention,gdn", "--edit-fraction", "0.3", "--edit-substitutes", "data",
        "--edit-keep-weight", "0.1"])
    config = train_command.config_from_flags(args)
    assert config == FinetuneConfig(steps=7, block_size=(4, 8, 16), block_size_weights=(1.0, 2.0, 1.0), seq_len=64,
                                    complementary=False, learning_rate=3e-4, max_noisy_blocks=1,
                                    generation_config={"threshold": 0.8}, lora_targets=("attention", "gdn"),
                                    edit_fraction=0.3, edit_substitutes="data", edit_keep_weight=0.1)
    flags = {action.dest for action in parser._subparsers._group_actions[0].choices["train"]._actions}
    assert {field.name for field in dataclasses.fields(FinetuneConfig)} <= flags
    with pytest.raises(FieldError) as caught:
        train_command.config_from_flags(parser.parse_args(["train", "--model", "m", "--data", "a", "--out", "o",
                                                            "--steps", "many"]))
    assert caught.value.field == "steps"
