"""Orbax conversion: bit-exact round trip, loading into mesh shardings, atomicity, clear errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from clover_jax.core.config import CloverConfig
from tests.conftest import read_config
from weights import (
    CheckpointError,
    convert_to_orbax,
    is_orbax_checkpoint,
    load_orbax_params,
    load_params,
    orbax_checkpoint,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def converted(clover_checkpoint, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("orbax") / "clover")
    convert_to_orbax(clover_checkpoint, out, progress=False)
    return out


def flat(tree) -> dict:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_bit_equal(actual: dict, expected: dict) -> None:
    actual, expected = flat(actual), flat(expected)
    assert actual.keys() == expected.keys()
    for name, leaf in expected.items():
        assert actual[name].dtype == leaf.dtype, name
        np.testing.assert_array_equal(np.asarray(actual[name]).view(np.uint8), np.asarray(leaf).view(np.uint8),
                                      err_msg=name)


def load(directory: str, **kwargs):
    return load_orbax_params(directory, CloverConfig.from_pretrained(directory), progress=False, **kwargs)


def test_round_trip_is_bit_equal_to_loading_the_hf_checkpoint(clover_checkpoint, converted):
    expected, _ = load_params(clover_checkpoint, CloverConfig.from_pretrained(clover_checkpoint), progress=False)
    params, report = load(converted)
    assert_bit_equal(params, expected)
    assert report.dtype == "float32" and report.tensors_read == len(jax.tree.leaves(expected))
    assert read_config(converted) == read_config(clover_checkpoint)  # self-contained: config copied
    manifest = orbax_checkpoint.read_manifest(converted)
    assert manifest.num_parameters == sum(leaf.size for leaf in jax.tree.leaves(expected))
    assert "model.safetensors" not in os.listdir(converted)
    assert is_orbax_checkpoint(converted) and not is_orbax_checkpoint(clover_checkpoint)
    siblings = os.listdir(os.path.dirname(converted))
    assert siblings == ["clover"], f"temporary directories left behind: {siblings}"


def test_dtype_is_cast_while_restoring_like_the_hf_loader(clover_checkpoint, converted):
    expected, _ = load_params(clover_checkpoint, CloverConfig.from_pretrained(clover_checkpoint),
                              dtype=ml_dtypes.bfloat16, progress=False)
    params, report = load(converted, dtype="bfloat16")
    assert report.dtype == "bfloat16"
    assert_bit_equal(params, expected)


SHARDED_LOAD = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from clover_jax.core.config import CloverConfig
    from weights import load_orbax_params, load_params

    orbax_dir, hf_dir = sys.argv[1:]
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    def sharding_for(path, shape):  # the last axis over "model", the leading axis over "data"
        spec = [None] * len(shape)
        if shape[-1] % 4 == 0:
            spec[-1] = "model"
        if len(shape) > 1 and shape[0] % 2 == 0:
            spec[0] = "data"
        return NamedSharding(mesh, P(*spec))

    config = CloverConfig.from_pretrained(orbax_dir)
    params, _ = load_orbax_params(orbax_dir, config, sharding_for=sharding_for, progress=False)
    expected, _ = load_params(hf_dir, config, progress=False)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    split = 0
    for (path, leaf), reference in zip(leaves, jax.tree.leaves(expected)):
        wanted = sharding_for(tuple(k.key for k in path), leaf.shape)
        assert leaf.sharding == wanted, (path, leaf.sharding, wanted)
        for shard in leaf.addressable_shards:
            assert shard.data.shape == wanted.shard_shape(leaf.shape), path
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(reference)[shard.index])
        split += wanted.shard_shape(leaf.shape) != leaf.shape
    assert split > len(leaves) // 2, split
    print("sharded leaves:", split, "of", len(leaves))
""")


def test_loading_into_a_mesh_places_each_shard_on_its_device(clover_checkpoint, converted):
    """8 fake CPU devices need a fresh process (XLA_FLAGS is read when the backend starts)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    completed = subprocess.run([sys.executable, "-c", SHARDED_LOAD, converted, clover_checkpoint], env=env,
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "sharded leaves:" in completed.stdout


@pytest.mark.parametrize("failing_step", ["_fsync_tree", "_move_into_place", "_write_durably"])
def test_a_failed_conversion_leaves_nothing_behind(clover_checkpoint, tmp_path, monkeypatch, failing_step):
    """The save fails after the parameters are written: before the rename, during it, or at the manifest."""
    def fail(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(orbax_checkpoint, failing_step, fail)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_to_orbax(clover_checkpoint, out, progress=False)
    assert os.listdir(tmp_path) == []


def test_a_killed_conversion_leaves_a_directory_that_refuses_to_load(clover_checkpoint, tmp_path, monkeypatch):
    """A kill between the rename and the manifest (no cleanup runs): parameters, but no marker."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(orbax_checkpoint, "_write_durably", killed)
    monkeypatch.setattr(orbax_checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        convert_to_orbax(clover_checkpoint, out, progress=False)
    monkeypatch.undo()
    assert is_orbax_checkpoint(out) and os.path.isdir(os.path.join(out, "params"))
    with pytest.raises(CheckpointError, match=r"conversion was interrupted; rerun convert_to_orbax\(.*overwrite=True"):
        load(out)


def test_a_partial_manifest_is_refused(converted, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(converted, copy)
    manifest = os.path.join(copy, orbax_checkpoint.MANIFEST)
    with open(manifest) as handle:
        text = handle.read()
    with open(manifest, "w") as handle:
        handle.write(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="incomplete or corrupt.*conversion was interrupted"):
        load(copy)


def test_the_staging_directory_of_a_killed_conversion_is_refused(converted, tmp_path):
    staging = str(tmp_path / ".out.converting-abc123")
    shutil.copytree(converted, staging, ignore=shutil.ignore_patterns(orbax_checkpoint.MANIFEST))
    with pytest.raises(CheckpointError, match="conversion was interrupted"):
        load_orbax_params(staging, CloverConfig.from_pretrained(converted), progress=False)


def test_overwrite_replaces_an_earlier_conversion_and_nothing_else(clover_checkpoint, converted, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert_to_orbax(clover_checkpoint, out, progress=False)
    with pytest.raises(FileExistsError, match="not an earlier convert_to_orbax result"):
        convert_to_orbax(clover_checkpoint, out, progress=False, overwrite=True)
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"

    # An earlier conversion, reached through a symlink: replaced where the link points.
    previous = tmp_path / "previous"
    shutil.copytree(converted, previous)
    (previous / "stale.txt").write_text("from the earlier conversion")
    (tmp_path / "link").symlink_to(previous)
    convert_to_orbax(clover_checkpoint, tmp_path / "link", progress=False, overwrite=True)
    assert not (previous / "stale.txt").exists() and (tmp_path / "link").is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["link", "out", "previous"]
    load(str(previous))


def tree_state(root) -> dict:
    """Every entry under `root`: a link's target, a file's bytes, or "dir"."""
    state = {}
    for directory, subdirectories, files in os.walk(root):
        for name in subdirectories + files:
            path = os.path.join(directory, name)
            state[os.path.relpath(path, root)] = (
                "link:" + os.readlink(path) if os.path.islink(path) else
                "dir" if os.path.isdir(path) else open(path, "rb").read())
    return state


@pytest.mark.parametrize("where", ["the source", "a symlink to the source", "params inside it", "deep inside it",
                                   "a symlink to a path inside it", "its parent", "a symlink to its parent"])
def test_an_output_that_is_the_source_holds_it_or_lies_inside_it_is_refused_before_anything_is_written(
        checkpoint_copy, tmp_path, monkeypatch, where):
    source = tmp_path / "copy"
    assert str(source) == checkpoint_copy
    outputs = {"the source": source, "a symlink to the source": tmp_path / "link",
               "params inside it": source / "params", "deep inside it": source / "a" / "b" / "c",
               "a symlink to a path inside it": tmp_path / "inner", "its parent": tmp_path,
               "a symlink to its parent": source / "up"}
    (tmp_path / "link").symlink_to(source)
    (tmp_path / "inner").symlink_to(source / "sub")
    (source / "up").symlink_to(tmp_path)
    before = tree_state(tmp_path)
    monkeypatch.setattr(orbax_checkpoint, "load_params", lambda *args, **kwargs: pytest.fail("the source was read"))
    with pytest.raises(ValueError, match="the source checkpoint"):
        convert_to_orbax(checkpoint_copy, outputs[where], progress=False, overwrite=True)
    assert tree_state(tmp_path) == before


def test_a_conversion_removes_the_staging_an_interrupted_one_left(clover_checkpoint, tmp_path, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(orbax_checkpoint, "_fsync_tree", killed)  # killed while writing: no cleanup runs
    monkeypatch.setattr(orbax_checkpoint.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(KeyboardInterrupt):
        convert_to_orbax(clover_checkpoint, tmp_path / "out", progress=False)
    monkeypatch.undo()
    [left] = os.listdir(tmp_path)
    match = re.fullmatch(rf"\.out\.converting-{os.getpid()}-(?P<host>[\w.]+)-\w+", left)
    assert match and os.listdir(tmp_path / left) != []
    # as if another process had been killed: its id is now free
    finished = subprocess.Popen([sys.executable, "-c", ""])
    finished.wait()
    host, dead = match["host"], finished.pid
    stale = tmp_path / left.replace(f"-{os.getpid()}-", f"-{dead}-")
    os.rename(tmp_path / left, stale)
    (tmp_path / f".out.replaced-{dead}-{host}-abc" / "old").mkdir(parents=True)  # an output moved aside
    kept = [f".out.converting-{os.getppid()}-{host}-abc",  # its process still runs
            f".out.converting-{dead}-elsewhere-abc",        # another host's: cannot tell
            f".other.converting-{dead}-{host}-abc"]          # another output's
    for name in kept:
        (tmp_path / name).mkdir()
    convert_to_orbax(clover_checkpoint, tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["out"] + kept)
    load(str(tmp_path / "out"))


def test_non_finite_parameters_are_refused_by_conversion_and_by_loading(checkpoint_copy, tmp_path, compilations):
    from safetensors.numpy import load_file, save_file

    weights_file = os.path.join(checkpoint_copy, "model.safetensors")
    tensors = load_file(weights_file)
    tensors["model.layers.1.linear_attn.in_proj_z.weight"][3, 5] = np.nan
    save_file(tensors, weights_file)
    out = tmp_path / "nan"
    with pytest.raises(CheckpointError, match="in_proj_z.weight in model.safetensors holds 1 NaN"):
        convert_to_orbax(checkpoint_copy, out, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["copy"]
    convert_to_orbax(checkpoint_copy, out, progress=False, check_finite=False)
    compilations.clear()
    with pytest.raises(CheckpointError, match=r"parameter groups/layer_1/linear_attn/in_proj_z/weight in .*/params "
                                              r"holds 1 NaN and 0 Inf of 8192 values, the first at index \(0, 3, 5\)"):
        load(str(out))
    assert compilations == []
    params, _ = load(str(out), check_finite=False)
    assert np.isnan(np.asarray(params["groups"]["layer_1"]["linear_attn"]["in_proj_z"]["weight"])[0, 3, 5])


def test_an_empty_directory_is_filled_and_the_source_is_never_replaced(clover_checkpoint, tmp_path):
    (tmp_path / "empty").mkdir()
    convert_to_orbax(clover_checkpoint, tmp_path / "empty", progress=False)
    assert is_orbax_checkpoint(tmp_path / "empty")
    with pytest.raises(ValueError, match="would replace the source checkpoint"):
        convert_to_orbax(clover_checkpoint, clover_checkpoint, progress=False, overwrite=True)
    with pytest.raises(ValueError, match="would replace the source checkpoint"):
        convert_to_orbax(clover_checkpoint, os.path.dirname(clover_checkpoint), progress=False, overwrite=True)


def test_bad_directories_are_clear_errors(clover_checkpoint, tmp_path):
    config = CloverConfig.from_pretrained(clover_checkpoint)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_orbax_params(tmp_path / "nowhere", config)
    with pytest.raises(CheckpointError, match="not an Orbax checkpoint written by convert_to_orbax"):
        load_orbax_params(clover_checkpoint, config)
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_to_orbax(tmp_path / "nowhere", tmp_path / "out", progress=False)


def test_a_tree_that_does_not_fit_the_config_is_listed_before_reading_data(converted, monkeypatch):
    raw = read_config(converted)
    raw.update(moe_intermediate_size=16, tie_word_embeddings=True)
    reads = []
    monkeypatch.setattr(orbax_checkpoint, "_restore", lambda *args: reads.append(args))
    with pytest.raises(CheckpointError, match="does not fit") as error:
        load_orbax_params(converted, CloverConfig.from_dict(raw), progress=False)
    message = str(error.value)
    assert "1 unexpected parameter(s): ['lm_head']" in message
    assert "groups/layer_0/mlp/experts_down_proj has shape (2, 8, 64, 32), expected (2, 8, 64, 16)" in message
    assert reads == []


def test_a_manifest_that_disagrees_with_the_parameters_is_refused(converted, tmp_path):
    copy = str(tmp_path / "copy")
    shutil.copytree(converted, copy)
    path = os.path.join(copy, orbax_checkpoint.MANIFEST)
    with open(path) as handle:
        fields = json.load(handle)
    fields["num_parameters"] += 1
    with open(path, "w") as handle:
        json.dump(fields, handle)
    with pytest.raises(CheckpointError, match="records"):
        load(copy)


def test_clover_model_loads_an_orbax_directory_like_the_hf_one(converted, clover):
    from clover_jax import CloverModel

    model = CloverModel.from_pretrained(converted, progress=False)
    assert model.config == clover.config
    ids = np.arange(12, dtype=np.int32).reshape(1, 12)
    np.testing.assert_array_equal(model.forward(ids), clover.forward(ids))
    with pytest.raises(ValueError, match="name_map applies to safetensors"):
        CloverModel.from_pretrained(converted, progress=False, name_map={"a": "b"})


def test_a_quantised_conversion_loads_without_quantising_again(clover_checkpoint, tmp_path, monkeypatch):
    from clover_jax import CloverModel
    from clover_jax.core.quantization import QuantizedWeight
    from weights import loader

    out = tmp_path / "int4"
    manifest = convert_to_orbax(clover_checkpoint, out, progress=False, quantize="int4")
    assert manifest.quantization == "int4-g16"  # the group plain "int4" took: 64 and 32 hold pairs of 16, not of 128
    expected = CloverModel.from_pretrained(clover_checkpoint, progress=False, quantize="int4")
    monkeypatch.setattr(loader, "quantize_weight", lambda *a: pytest.fail("quantised again while loading"))
    loaded = CloverModel.from_pretrained(out, progress=False)
    is_quantized = lambda leaf: isinstance(leaf, QuantizedWeight)
    assert is_quantized(loaded.params["groups"]["layer_0"]["mlp"]["experts_gate_up_proj"])
    assert jax.tree.structure(loaded.params, is_leaf=is_quantized) == jax.tree.structure(expected.params,
                                                                                        is_leaf=is_quantized)
    for ours, theirs in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
