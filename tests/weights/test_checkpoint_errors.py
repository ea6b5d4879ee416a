"""Every bad-checkpoint case of spec §2 is a clear error that names the tensor and/or the file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clover_jax import CloverModel
from clover_jax.config import CloverConfig
from weights import CheckpointError, load_params

WEIGHTS = "model.safetensors"
A_TENSOR = "model.layers.1.linear_attn.in_proj_z.weight"


def rewrite(directory: str, edit) -> None:
    tensors = load_file(os.path.join(directory, WEIGHTS))
    edit(tensors)
    save_file(tensors, os.path.join(directory, WEIGHTS))


def load(directory: str, **kwargs):
    return load_params(directory, CloverConfig.from_pretrained(directory), progress=False, **kwargs)


def test_missing_tensors_are_all_listed(checkpoint_copy):
    gone = [A_TENSOR, "model.layers.6.mlp.experts.3.up_proj.weight"]
    rewrite(checkpoint_copy, lambda tensors: [tensors.pop(name) for name in gone])
    with pytest.raises(CheckpointError, match="2 missing tensor") as error:
        load(checkpoint_copy)
    assert all(name in str(error.value) for name in gone)


def test_unexpected_tensors_are_all_listed_with_their_file(checkpoint_copy):
    extra = ["model.layers.0.linear_attn.surprise.weight", "model.final_bias"]
    rewrite(checkpoint_copy, lambda tensors: tensors.update({name: np.zeros(3, np.float32) for name in extra}))
    with pytest.raises(CheckpointError, match="2 unexpected tensor") as error:
        load(checkpoint_copy)
    assert all(f"{name} (in {WEIGHTS})" in str(error.value) for name in extra)
    assert "name_map" in str(error.value)


def test_wrong_shape_names_tensor_file_and_both_shapes_before_reading_data(checkpoint_copy, monkeypatch):
    from weights.checkpoint_files import CheckpointFiles

    rewrite(checkpoint_copy, lambda tensors: tensors.update({A_TENSOR: np.zeros((64, 60), np.float32)}))
    reads = []
    monkeypatch.setattr(CheckpointFiles, "read", lambda self, name, index=(): reads.append(name))
    with pytest.raises(CheckpointError, match=rf"{A_TENSOR} in {WEIGHTS} has shape \(64, 60\), expected \(64, 64\)"):
        load(checkpoint_copy)
    assert reads == []


def test_wrong_fused_expert_shape_is_refused(fused_checkpoint, tmp_path):
    import shutil

    target = shutil.copytree(fused_checkpoint, tmp_path / "fused")
    index = json.loads((target / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.2.mlp.experts.down_proj"
    file = target / index["weight_map"][name]
    tensors = load_file(str(file))
    tensors[name] = tensors[name][:, :, :-1].copy()
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(8, 64, 31\), expected \(8, 64, 32\)"):
        load(str(target))


def test_integer_dtype_is_refused(checkpoint_copy):
    rewrite(checkpoint_copy, lambda tensors: tensors.update({A_TENSOR: np.zeros((64, 64), np.int8)}))
    with pytest.raises(CheckpointError, match=rf"{A_TENSOR} in {WEIGHTS} has dtype I8"):
        load(checkpoint_copy)


def test_truncated_file_is_refused_before_reading_data(checkpoint_copy):
    path = os.path.join(checkpoint_copy, WEIGHTS)
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS} is truncated"):
        load(checkpoint_copy)


def test_corrupt_header_names_the_file(checkpoint_copy):
    path = os.path.join(checkpoint_copy, WEIGHTS)
    with open(path, "r+b") as handle:
        handle.seek(8)
        handle.write(b"\x00garbage{{{")
    with pytest.raises(CheckpointError, match=rf"{WEIGHTS} is truncated or corrupt"):
        load(checkpoint_copy)


def test_missing_weights_file_is_refused(checkpoint_copy):
    os.remove(os.path.join(checkpoint_copy, WEIGHTS))
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load(checkpoint_copy)


def test_index_pointing_at_a_missing_shard_names_it(fused_checkpoint, tmp_path):
    import shutil

    target = shutil.copytree(fused_checkpoint, tmp_path / "fused")
    os.remove(target / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is listed in the index but does not exist"):
        load(str(target))


def test_tensor_given_by_both_expert_layouts_is_refused(checkpoint_copy):
    def add_fused(tensors):
        tensors["model.layers.0.mlp.experts.down_proj"] = np.zeros((8, 64, 32), np.float32)

    rewrite(checkpoint_copy, add_fused)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts.0.down_proj.weight is given twice"):
        load(checkpoint_copy)


def test_renamed_tensor_loads_with_name_map(checkpoint_copy, clover_model):
    renamed = "model.layers.1.linear_attn.gate_proj.weight"
    rewrite(checkpoint_copy, lambda tensors: tensors.update({renamed: tensors.pop(A_TENSOR)}))
    with pytest.raises(CheckpointError, match=renamed):
        load(checkpoint_copy)
    model = CloverModel.from_pretrained(checkpoint_copy, name_map={renamed: A_TENSOR}, progress=False)
    ids = np.arange(12, dtype=np.int32)[None]
    np.testing.assert_array_equal(model.forward(ids), clover_model.forward(ids))


def test_name_map_naming_an_absent_tensor_is_refused(checkpoint_copy):
    with pytest.raises(CheckpointError, match="does not have: \\['model.typo'\\]"):
        load(checkpoint_copy, name_map={"model.typo": A_TENSOR})


def test_non_float_dtype_is_refused(qwen36_checkpoint):
    with pytest.raises(ValueError, match="dtype int8 is not a float dtype"):
        load(qwen36_checkpoint, dtype="int8")
