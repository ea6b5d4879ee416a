"""`GenerationConfig` under hostile input: wrong JSON types in the checkpoint's files, and
non-finite or huge values, are one-line errors naming the field, raised before anything runs."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest

import decoding.layouts as layouts_module  # where generate finds the compiled loops
from clover_jax.core.config import ConfigError
from decoding import GenerationConfig, generate
from decoding.generation_config import MAX_BLOCK_COUNT, MAX_INT32, json_reader

NAN = "__nan__"  # spelled as JSON's NaN


def checkpoint_with(directory, clover_checkpoint, generation=None, tokenizer=None) -> str:
    """A directory with the clover checkpoint's config.json and the given small files (no weights:
    GenerationConfig reads none)."""
    shutil.copyfile(f"{clover_checkpoint}/config.json", directory / "config.json")
    for name, content in (("generation_config.json", generation), ("tokenizer.json", tokenizer)):
        if content is not None:
            text = content if isinstance(content, (str, bytes)) else json.dumps(content).replace(f'"{NAN}"', "NaN")
            (directory / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(directory)


def test_every_field_has_a_json_reader():
    readers = {field.name: json_reader(field) for field in dataclasses.fields(GenerationConfig)}
    assert readers["do_sample"] == "boolean" and readers["top_k"] == "integer" and readers["top_p"] == "number"
    assert readers["eos_token_id"] == "ids" and readers["schedule"] == "string"
    assert readers["schedule_params"] == "mapping" and readers["max_steps_per_block"] == "integer"


def test_a_well_typed_generation_config_json_is_read_and_unused_fields_ignored(clover_checkpoint, tmp_path):
    stored = {"do_sample": True, "temperature": 0.7, "top_k": 20, "block_size": 16, "eos_token_id": [1, 2],
              "schedule_params": None, "pad_token_id": "ignored", "transformers_version": "5.23.0"}
    config = GenerationConfig.from_pretrained(checkpoint_with(tmp_path, clover_checkpoint, stored))
    assert (config.do_sample, config.temperature, config.top_k, config.block_size, config.eos_token_id) == \
        (True, 0.7, 20, 16, (1, 2))


@pytest.mark.parametrize("stored, message", [
    ([{"do_sample": True}], r"must hold a JSON object \{...\}, got a list"),
    ({"do_sample": "false"}, r'do_sample must be true or false, got "false"'),
    ({"coreset": 0}, r"coreset must be true or false, got 0"),
    ({"block_size": "32"}, r'block_size must be an integer, got "32"'),
    ({"top_k": True}, r"top_k must be an integer, got true"),
    ({"max_new_tokens": 256.0}, r"max_new_tokens must be an integer, got 256.0"),
    ({"eos_token_id": [1, None]}, r"eos_token_id must be a token id .* got \[1, null\]"),
    ({"eos_token_id": {"id": 1}}, r'eos_token_id must be a token id .* got \{"id": 1\}'),
    ({"mask_token_id": "127"}, r'mask_token_id must be an integer, got "127"'),
    ({"temperature": NAN}, r"temperature must be a finite number, got NaN"),
    ({"threshold": "0.9"}, r'threshold must be a finite number, got "0.9"'),
    ({"schedule": ["low_confidence"]}, r'schedule must be a string, got \["low_confidence"\]'),
    ({"schedule_params": []}, r"schedule_params must be an object \{...\}, got \[\]"),
    ({"block_size": 0}, r"generation_config.json: block_size must be an integer >= 1"),
    ({"block_size": MAX_BLOCK_COUNT + 1}, rf"generation_config.json: block_size must be an integer >= 1 and "
                                          rf"<= {MAX_BLOCK_COUNT}"),
    ('{"do_sample": tru', r"is not valid JSON"),
    (b'{"do_sample": "\xff"}', r"is not valid JSON"),
])
def test_wrong_json_in_generation_config_json_is_a_config_error_naming_the_field(clover_checkpoint, tmp_path, stored,
                                                                                 message):
    directory = checkpoint_with(tmp_path, clover_checkpoint, stored)
    with pytest.raises(ConfigError, match=message) as error:
        GenerationConfig.from_pretrained(directory)
    assert "generation_config.json" in str(error.value) and "\n" not in str(error.value)


def test_config_json_is_read_by_the_one_typed_reader(clover_checkpoint, tmp_path):
    directory = checkpoint_with(tmp_path, clover_checkpoint)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json must hold a JSON object"):
        GenerationConfig.from_pretrained(directory)
    raw = json.loads(open(f"{clover_checkpoint}/config.json").read()) | {"eos_token_id": [1, None]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"eos_token_id must be a token id"):
        GenerationConfig.from_pretrained(directory)


@pytest.mark.parametrize("tokenizer, message", [
    ([], "must hold a JSON object"),
    ({"model": {"vocab": {"<think>": "3"}}, "added_tokens": []}, r'the id of <think> must be an integer >= 0, got "3"'),
    ({"added_tokens": [{"content": "</think>", "id": None}]}, r"the id of </think> must be an integer >= 0, got null"),
    ({"added_tokens": {"content": "</think>"}}, r"added_tokens must be a list of objects"),
])
def test_think_ids_from_a_malformed_tokenizer_json_are_config_errors(clover_checkpoint, tmp_path, tokenizer, message):
    directory = checkpoint_with(tmp_path, clover_checkpoint, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=message):
        GenerationConfig.from_pretrained(directory)


@pytest.mark.parametrize("field", ["threshold", "temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty", "dllm_length_penalty", "dllm_think_end_bias",
                                   "margin_threshold", "entropy_bound", "coreset_top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be a finite number, got (nan|inf|-inf)$"):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("block_size", MAX_BLOCK_COUNT + 1), ("max_steps_per_block", 2**40), ("tokens_per_step", 10**30),
    ("max_new_tokens", MAX_INT32 + 1), ("top_k", 2**63), ("dllm_length_penalty_start", 2**31),
    ("dllm_think_end_window", 10**20), ("mask_token_id", 2**31), ("think_end_token_id", -1),
    ("eos_token_id", [1, 2**31]), ("eos_token_id", -2),
])
def test_huge_or_negative_integers_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be an (integer|int)"):
        GenerationConfig(**{field: value})


def test_the_upper_bounds_themselves_are_accepted():
    config = GenerationConfig(block_size=MAX_BLOCK_COUNT, max_steps_per_block=MAX_BLOCK_COUNT,
                              tokens_per_step=MAX_BLOCK_COUNT, max_new_tokens=MAX_INT32, top_k=MAX_INT32,
                              eos_token_id=[MAX_INT32], mask_token_id=0)
    assert config.block_size == MAX_BLOCK_COUNT and config.eos_token_id == (MAX_INT32,)


@pytest.mark.parametrize("field, value, message", [
    ("do_sample", "false", "do_sample must be True or False, got 'false'"),
    ("coreset", "yes", "coreset must be True or False, got 'yes'"),
    ("eos_token_id", 1.5, "eos_token_id must be an int or a list of ints"),
    ("eos_token_id", "12", "eos_token_id must be an int or a list of ints"),
    ("schedule", ["low_confidence"], "schedule must be one of"),
    ("block_alignment", ["prompt"], "block_alignment must be 'absolute' or 'prompt'"),
    ("mask_token_id", "5", "mask_token_id must be an integer"),
])
def test_values_of_the_wrong_python_type_are_value_errors_not_type_errors(field, value, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize("overrides, message", [
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number"),
    ({"max_steps_per_block": 2**40}, "max_steps_per_block must be an integer >= 1 and <= 1048576"),
    ({"tokens_per_step": 10**30}, "tokens_per_step must be an integer >= 1 and <= 1048576"),
    ({"do_sample": "false"}, "do_sample must be True or False"),
])
def test_generate_refuses_them_before_compute(peaked, controls_config, monkeypatch, overrides, message):
    calls = []
    monkeypatch.setattr(layouts_module, "run_block_decoder", lambda *args: calls.append(args))
    with pytest.raises(ValueError, match=message):
        generate(peaked, [[1, 2]], controls_config, **overrides)
    assert calls == []


def test_special_token_ids_come_from_generation_config_then_config_json_then_the_tokenizer(clover_checkpoint, tmp_path):
    from clover_jax.core.config import CloverConfig
    from decoding.generation_config import resolve_token_ids

    tokenizer = {"added_tokens": [{"content": "<think>", "id": 20}, {"content": "</think>", "id": 21}]}
    directory = checkpoint_with(tmp_path, clover_checkpoint, {"mask_token_id": 9, "think_end_token_id": 30}, tokenizer)
    model_config = CloverConfig.from_pretrained(directory)
    loaded = GenerationConfig.from_pretrained(directory)
    assert (loaded.mask_token_id, loaded.eos_token_id) == (9, model_config.eos_token_id)
    assert (loaded.think_start_token_id, loaded.think_end_token_id) == (20, 30)
    assert resolve_token_ids({}, model_config) == {
        "eos_token_id": model_config.eos_token_id, "mask_token_id": model_config.mask_token_id,
        "think_start_token_id": None, "think_end_token_id": None}
    completed = GenerationConfig.for_model_type("clover_moe").with_token_ids(model_config, directory)
    assert (completed.mask_token_id, completed.think_start_token_id) == (model_config.mask_token_id, 20)
