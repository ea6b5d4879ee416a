"""`weights.writer.save_params`: the loader's name table inverted, checked by round trips."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from clover_jax import CloverConfig, CloverModel
from weights.writer import config_dict, save_params


def _leaves(params) -> dict:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}


def _assert_same_params(first, second) -> None:
    a, b = _leaves(first), _leaves(second)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_clover_checkpoint_round_trips_strictly(clover, tmp_path):
    save_params(clover.params, clover.config, tmp_path)
    again = CloverModel.from_pretrained(tmp_path, strict=True, progress=False)
    _assert_same_params(clover.params, again.params)
    assert again.config == clover.config.replace(checkpoint_dtype="float32")


def test_written_tensors_equal_save_pretrained_names_and_values(clover, clover_checkpoint, tmp_path):
    """The writer's names are what transformers' save_pretrained wrote (plus the Clover tensors
    that tests/checkpoints.py added), tensor for tensor."""
    save_params(clover.params, clover.config, tmp_path)
    source = load_file(os.path.join(clover_checkpoint, "model.safetensors"))
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert sorted(written) == sorted(source)
    for name, tensor in source.items():
        np.testing.assert_array_equal(written[name], tensor, err_msg=name)


def test_tied_base_checkpoint_round_trips_without_lm_head(tied_checkpoint, tmp_path):
    model = CloverModel.from_pretrained(tied_checkpoint, progress=False)
    save_params(model.params, model.config, tmp_path)
    source = load_file(os.path.join(tied_checkpoint, "model.safetensors"))
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "lm_head.weight" not in written
    assert sorted(written) == sorted(name for name in source if name != "lm_head.weight")
    again = CloverModel.from_pretrained(tmp_path, progress=False)
    _assert_same_params(model.params, again.params)
    assert again.config.model_type == "qwen3_5_moe_text" and again.config.tie_word_embeddings


def test_bfloat16_checkpoint_holds_the_rounded_parameters(clover, tmp_path):
    save_params(clover.params, clover.config, tmp_path, dtype="bfloat16")
    again = CloverModel.from_pretrained(tmp_path, strict=True, progress=False)
    assert again.dtype == np.dtype("bfloat16") and again.config.checkpoint_dtype == "bfloat16"
    rounded = jax.tree.map(lambda x: np.asarray(x).astype("bfloat16"), clover.params)
    _assert_same_params(rounded, again.params)


def test_config_dict_parses_back_to_the_same_config(clover):
    parsed = CloverConfig.from_dict(config_dict(clover.config, "float32"))
    assert parsed == clover.config.replace(checkpoint_dtype="float32")


def test_params_that_do_not_fit_the_config_are_refused(clover, tmp_path):
    params = jax.tree.map(lambda x: x, clover.params)
    del params["norm"]
    params["embed_tokens"]["embedding"] = params["embed_tokens"]["embedding"][:, :8]
    with pytest.raises(ValueError, match=r"missing norm/weight.*embed_tokens/embedding has shape"):
        save_params(params, clover.config, tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        save_params(clover.params, clover.config, tmp_path, dtype="int8")


def test_base_checkpoint_refuses_trained_block_mode_parameters(clover_model, tmp_path):
    params = jax.tree.map(lambda x: x, clover_model.params)
    gdn = dict(params["groups"]["layer_0"]["linear_attn"])
    gdn["memory_logit_bias"] = gdn["memory_logit_bias"] + 1.0
    params["groups"]["layer_0"] = dict(params["groups"]["layer_0"], linear_attn=gdn)
    with pytest.raises(ValueError, match="memory_logit_bias differs from its default"):
        save_params(params, clover_model.config, tmp_path)
