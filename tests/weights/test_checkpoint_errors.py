"""Every bad-checkpoint case of docs/design.md §2 is a clear error that names the tensor and/or the file."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from clover_jax import CloverModel
from clover_jax.core.config import CloverConfig
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
    with pytest.raises(CheckpointError,
                       match="model-00002-of-00002.safetensors is listed in the index but does not exist"):
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


# ---------------------------------------------------------------------- index files
INDEX = "model.safetensors.index.json"


def sharded_copy(fused_checkpoint: str, tmp_path) -> str:
    import shutil

    return str(shutil.copytree(fused_checkpoint, tmp_path / "fused"))


def edit_index(directory: str, edit) -> None:
    path = os.path.join(directory, INDEX)
    with open(path) as handle:
        index = json.load(handle)
    with open(path, "w") as handle:
        json.dump(edit(index), handle)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "sub/../../outside.safetensors",
                                   "sub/../model-00001-of-00002.safetensors", "OUTSIDE_ABSOLUTE", ""])
def test_index_entries_outside_the_checkpoint_are_refused_before_any_file_is_opened(
        fused_checkpoint, tmp_path, monkeypatch, entry):
    import shutil

    from weights import checkpoint_files

    directory = sharded_copy(fused_checkpoint, tmp_path)
    outside = tmp_path / "outside.safetensors"  # a real shard, so that opening it would succeed
    shutil.copyfile(os.path.join(directory, "model-00001-of-00002.safetensors"), outside)
    entry = str(outside) if entry == "OUTSIDE_ABSOLUTE" else entry

    def move_one(index):
        name = next(n for n, f in index["weight_map"].items() if f == "model-00001-of-00002.safetensors")
        index["weight_map"][name] = entry
        return index

    edit_index(directory, move_one)
    monkeypatch.setattr(checkpoint_files, "safe_open", lambda *a, **k: pytest.fail("a file was opened"))
    with pytest.raises(CheckpointError, match=r"absolute paths and '\.\.' are refused"):
        load(directory)


@pytest.mark.parametrize("content, message", [
    ("[]", "needs an object with a 'weight_map'"),
    ('{"metadata": {}}', "needs an object with a 'weight_map'"),
    ('{"weight_map": ["model-00001-of-00002.safetensors"]}', "weight_map must be an object of tensor name -> file"),
    ('{"weight_map": {"model.norm.weight": 1}}', "weight_map must be an object of tensor name -> file"),
    ('{"weight_map": {"model.norm.weight": null}}', "weight_map must be an object of tensor name -> file"),
    ('{"weight_map": {', "is not valid JSON"),
    (b'{"weight_map": {"\xff": "a"}}', "is not valid JSON"),
])
def test_a_malformed_index_is_a_checkpoint_error(fused_checkpoint, tmp_path, content, message):
    directory = sharded_copy(fused_checkpoint, tmp_path)
    path = os.path.join(directory, INDEX)
    with open(path, "wb") as handle:
        handle.write(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError, match=message):
        load(directory)


def test_symlinked_shards_load_as_in_the_hub_cache(fused_checkpoint, tmp_path):
    """The Hub cache keeps each file once under blobs/ and links snapshots/<commit>/<name> to
    ../../blobs/<hash>; such a snapshot loads exactly like the plain directory."""
    import hashlib
    import shutil

    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in os.listdir(fused_checkpoint):
        source = os.path.join(fused_checkpoint, name)
        with open(source, "rb") as handle:
            blob = hashlib.sha256(handle.read()).hexdigest()
        shutil.copyfile(source, repo / "blobs" / blob)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / name)
    assert all(os.path.islink(snapshot / name) for name in os.listdir(snapshot))
    expected, _ = load(fused_checkpoint)
    params, _ = load(str(snapshot))
    flat = lambda tree: jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), (_, reference) in zip(flat(params), flat(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(reference), err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------- non-finite weights
@pytest.mark.parametrize("value, counts", [(np.nan, "2 NaN and 0 Inf"), (-np.inf, "0 NaN and 2 Inf")])
def test_non_finite_weights_are_refused_naming_the_tensor_before_compute(checkpoint_copy, compilations, value,
                                                                       counts):
    def damage(tensors):
        tensors[A_TENSOR][3, 5] = value
        tensors[A_TENSOR][7, 0] = value

    rewrite(checkpoint_copy, damage)
    with pytest.raises(CheckpointError, match=rf"tensor {A_TENSOR} in {WEIGHTS} holds {counts} of 4096 values, "
                                              r"the first at index \(3, 5\).*check_finite=False") as error:
        CloverModel.from_pretrained(checkpoint_copy, progress=False)
    assert "\n" not in str(error.value) and compilations == []
    params, _ = load(checkpoint_copy, check_finite=False)  # the documented switch
    layer = np.asarray(params["groups"]["layer_1"]["linear_attn"]["in_proj_z"]["weight"][0])
    assert not np.isfinite(layer[3, 5]) and np.isfinite(np.delete(layer.reshape(-1), [3 * 64 + 5, 7 * 64])).all()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_value_that_overflows_the_requested_dtype_is_refused(checkpoint_copy):
    rewrite(checkpoint_copy, lambda tensors: tensors[A_TENSOR].__setitem__((0, 1), 1e6))  # float16 max: 65504
    with pytest.raises(CheckpointError, match=rf"{A_TENSOR} in {WEIGHTS} \(read as float16 from F32\) holds 0 NaN "
                                              r"and 1 Inf of 4096 values, the first at index \(0, 1\)"):
        load(checkpoint_copy, dtype="float16")
    load(checkpoint_copy, dtype="bfloat16")  # within bfloat16's range


def test_a_non_finite_expert_slice_of_a_fused_tensor_is_named(fused_checkpoint, tmp_path):
    directory = sharded_copy(fused_checkpoint, tmp_path)
    name = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    with open(os.path.join(directory, INDEX)) as handle:
        file = os.path.join(directory, json.load(handle)["weight_map"][name])
    tensors = load_file(file)
    tensors[name][5, 40, 3] = np.inf  # expert 5, an up_proj row (rows 32..63)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=rf"tensor {name}\[5, 32:64\] in model-0000\d-of-00002.safetensors "
                                              r"holds 0 NaN and 1 Inf of 2048 values, the first at index \(8, 3\)"):
        load(directory)


def test_the_sliced_reader_of_sharded_loading_checks_each_slice(checkpoint_copy):
    """`read_sharded` (each device's slice read on its own) with a one-device sharding."""
    from weights.checkpoint_files import CheckpointFiles
    from weights.loader import _match_tensors
    from weights.name_table import expected_placements
    from weights.sharded_reads import read_sharded

    rewrite(checkpoint_copy, lambda tensors: tensors[A_TENSOR].__setitem__((2, 2), np.nan))
    config = CloverConfig.from_pretrained(checkpoint_copy)
    placements = expected_placements(config)
    path = placements[A_TENSOR].path
    names = [name for name, placement in placements.items() if placement.path == path]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with CheckpointFiles(checkpoint_copy) as files:
        sources, _ = _match_tensors(files, config, placements, {}, False)
        parts = [(placements[name], sources.get(name)) for name in names]
        shape = (config.num_groups,) + placements[A_TENSOR].shape
        with pytest.raises(CheckpointError, match=rf"tensor {A_TENSOR} in {WEIGHTS} holds 1 NaN"):
            read_sharded(files, shape, np.dtype(np.float32), sharding, parts)
        array, _ = read_sharded(files, shape, np.dtype(np.float32), sharding, parts, check_finite=False)
    assert np.isnan(np.asarray(array)[0, 2, 2])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_finite_check_agrees_with_numpy_on_host_and_on_device(dtype):
    """The host reading of the bits, and the on-device reduction accelerators use, against
    numpy's isfinite in float32, for every special value and random normals."""
    import ml_dtypes

    from weights.finite_check import _all_finite_on_device, all_finite

    numpy_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    clean = np.random.RandomState(0).randn(3, 1000).astype(numpy_dtype)
    tiny = np.array([np.finfo(np.float32).tiny, -0.0, 0.0], np.float32).astype(numpy_dtype)
    cases = [clean, tiny, np.array([], numpy_dtype)]
    for special in (np.nan, -np.nan, np.inf, -np.inf):
        damaged = clean.copy()
        damaged[2, 999] = special
        cases.append(damaged)
    for array in cases:
        expected = bool(np.isfinite(array.astype(np.float32)).all())
        assert all_finite(array) == expected
        assert all_finite(array[:, ::3] if array.ndim == 2 else array) == bool(
            np.isfinite((array[:, ::3] if array.ndim == 2 else array).astype(np.float32)).all())
        assert bool(_all_finite_on_device(jax.numpy.asarray(array))) == expected
