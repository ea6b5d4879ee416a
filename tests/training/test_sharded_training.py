"""The train step on a mesh of 8 fake CPU devices computes what one device computes: the loss and
every gradient (full fine-tuning and LoRA) for meshes (1,8,1), (2,2,2), (4,2,1); the same loss
curve through the trainer's loop; and the same curve from two processes joined by
`jax.distributed`. The model is TWO_GROUPS (QWEN36_LIKE's widths, two scanned layer groups);
float32 throughout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.checkpoints import TWO_GROUPS, add_clover_tensors, write_hf_checkpoint
from tests.conftest import FAST_COMPILE_FLAGS, MASK_ID
from tests.training import sharded_train_run

SCRIPT = sharded_train_run.__file__
MESHES = ["1,8,1", "2,2,2", "4,2,1"]
# Each run compiles its programs once; the loop (three steps) runs on one device and on (2,2,2) only.
# The LoRA run on the mesh keeps its base's layers in host memory (`offload_base`, with "layer" remat):
# the same gradients as one device with neither.
RUNS = ["one+curve", "one+lora", "1,8,1", "2,2,2+curve", "4,2,1", "2,2,2+lora+offload"]


def _environment(devices: int) -> dict:
    environment = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}",
                       JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    environment["PYTHONPATH"] = os.pathsep.join([os.getcwd(), environment.get("PYTHONPATH", "")])
    return environment


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    backbone = write_hf_checkpoint(tmp_path_factory.mktemp("two_groups"), TWO_GROUPS, seed=0)
    return add_clover_tensors(backbone, str(tmp_path_factory.mktemp("two_groups_clover")), mask_token_id=MASK_ID)


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("train_mesh") / "runs")
    command = [sys.executable, SCRIPT, checkpoint, out] + [f"--run={run}" for run in RUNS]
    subprocess.run(command, check=True, env=_environment(8), timeout=900)
    arrays = np.load(out + ".npz")
    results = {run: {key.split("|", 1)[1]: arrays[key] for key in arrays.files if key.split("|", 1)[0] == run}
               for run in RUNS}
    with open(out + ".json") as handle:
        return results, json.load(handle)


def assert_same_gradients(got: dict, want: dict, rtol: float = 0.0) -> None:
    names = sorted(name for name in want if name.startswith("grad/"))
    assert names and sorted(name for name in got if name.startswith("grad/")) == names
    for name in names:
        scale = max(float(np.max(np.abs(want[name]))), 1e-12)
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-5 * scale, err_msg=name)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


@pytest.mark.parametrize("mesh", MESHES)
def test_the_loss_and_every_gradient_on_a_mesh_equal_one_device(runs, mesh):
    results, _ = runs
    want = results["one+curve"]
    assert np.any(want["grad/['groups']['layer_0']['mlp']['experts_gate_up_proj']"])  # the experts are trained
    assert_same_gradients(results[mesh if mesh != "2,2,2" else "2,2,2+curve"], want)


def test_a_lora_run_on_a_mesh_has_one_devices_gradients(runs):
    results, axes = runs
    # rtol as test_loss's remat comparison: the recomputed layers reorder float32 sums (measured: one
    # adapter's gradient 1.008e-5 of its largest value off with atol alone)
    assert_same_gradients(results["2,2,2+lora+offload"], results["one+lora"], rtol=1e-5)
    assert any("lora" in name and "experts_gate_up_proj" in name for name in results["one+lora"])
    # an adapter follows its weight: an expert's B over the expert axis, and FSDP over data
    lora_axes = axes["2,2,2+lora+offload"]
    b = next(axes for name, axes in lora_axes.items() if name.startswith("[0]['lora']")
             and "experts_gate_up_proj" in name and name.endswith("['b']"))
    assert b[1] == "expert" and "data" in b
    # offloaded: the stacked matrices in host memory, the per-layer vectors and the tables on the chips
    memory = lora_axes["frozen memory"]
    assert memory["['groups']['layer_0']['mlp']['experts_gate_up_proj']"] == "pinned_host"
    assert memory["['groups']['layer_0']['linear_attn']['in_proj_qkv']['weight']"] == "pinned_host"
    assert memory["['groups']['layer_0']['input_layernorm']['weight']"] == "device"
    assert memory["['embed_tokens']['embedding']"] == "device"


def test_the_trainers_loop_on_a_mesh_follows_one_devices_loss_curve(runs):
    results, _ = runs
    one, mesh = results["one+curve"], results["2,2,2+curve"]
    assert len(one["curve"]) == 3 and one["curve"][-1] < one["curve"][0]
    np.testing.assert_allclose(mesh["curve"], one["curve"], rtol=1e-5)
    np.testing.assert_allclose(mesh["grad_norms"], one["grad_norms"], rtol=1e-4)
    # AdamW's first steps move each weight by about the learning rate (1e-3) whatever its gradient's
    # size, so the parameters agree to a small part of one step
    for name in (name for name in one if name.startswith("param/")):
        np.testing.assert_allclose(mesh[name], one[name], rtol=0, atol=2e-4, err_msg=name)


def test_every_parameter_and_moment_is_split_over_the_data_axis_as_well(runs):
    _, axes = runs
    mixed = axes["2,2,2+curve"]
    params = {name[3:]: spec for name, spec in mixed.items() if name.startswith("[0]")}
    moments = {name.split(".mu", 1)[1]: spec for name, spec in mixed.items() if ".mu[" in name}
    assert moments == params  # AdamW's moments lie where their parameters do
    assert params["['groups']['layer_0']['mlp']['experts_gate_up_proj']"][:2] == [None, "expert"]
    assert "data" in params["['groups']['layer_0']['mlp']['experts_gate_up_proj']"]
    assert params["['embed_tokens']['embedding']"] == ["tensor", "data"]
    # the layer stack's [groups] axis is never split: the layer scan slices it
    assert all(spec[0] is None for name, spec in params.items() if name.startswith("['groups']"))
    split = [name for name, spec in params.items() if "data" in spec]
    assert len(split) > 0.7 * len(params), sorted(set(params) - set(split))


def test_two_processes_train_the_same_loss_curve(checkpoint, runs, tmp_path):
    results, _ = runs
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path / "two")
    command = [sys.executable, SCRIPT, checkpoint, out, "--run=2,2,2+curve+nograds", "--processes=2", f"--port={port}"]
    processes = [subprocess.Popen(command + [f"--process={i}"], env=_environment(4)) for i in range(2)]
    for process in processes:
        assert process.wait(timeout=900) == 0
    for i in range(2):
        curve = np.load(f"{out}.{i}.npz")["2,2,2+curve+nograds|curve"]
        np.testing.assert_allclose(curve, results["one+curve"]["curve"], rtol=1e-5)


def test_bad_meshes_are_refused_before_anything_is_computed():
    import jax

    from clover_jax.core.config import CloverConfig
    from clover_jax.core.errors import FieldError
    from clover_jax.training import trainer
    from clover_jax.training.config import FinetuneConfig

    with pytest.raises(FieldError, match="three positive device counts"):
        FinetuneConfig(mesh=(2, 4))
    with pytest.raises(FieldError, match=r"batch_size / grad_accum_steps\) must divide over the mesh's data x "
                                         r"expert = 2 x 4"):
        FinetuneConfig(mesh="2,4,1", batch_size=4)
    assert FinetuneConfig(mesh={"data": 2, "expert": 4}, batch_size=8).mesh == (2, 4, 1)
    with pytest.raises(FieldError, match="mesh=.2, 1, 1.: mesh data=2 × expert=1 × tensor=1 = 2 devices, but 1"):
        trainer.training_mesh(FinetuneConfig(mesh=(2, 1, 1), batch_size=2))
    mesh = trainer.training_mesh(FinetuneConfig(mesh=(1, 1, 1)))
    config = CloverConfig.from_dict(dict(TWO_GROUPS, model_type="clover_moe", mask_token_id=MASK_ID))
    assert trainer.training_mesh_sharding(mesh, config).mesh is mesh
    three = jax.sharding.AbstractMesh((1, 3, 1), ("data", "expert", "tensor"))
    with pytest.raises(FieldError, match="num_experts=8 does not divide over the mesh axis 'expert' of size 3"):
        trainer.training_mesh_sharding(three, config)
