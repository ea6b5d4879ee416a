"""The model on a mesh of 8 fake CPU devices equals the single-device model (logits, denoise
logits, generated tokens), one process or two joined by `jax.distributed`. The model has
QWEN36_LIKE's widths in two groups of (GDN, attention) (`TWO_GROUPS`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.checkpoints import TWO_GROUPS, add_clover_tensors, write_hf_checkpoint
from tests.clover_jax.parallel import sharded_run
from tests.conftest import FAST_COMPILE_FLAGS, MASK_ID

SCRIPT = sharded_run.__file__
# "@inference": the planner's rules, the dense weights split over the expert axis (2 x 4 here).
MESHES = ["1,8,1", "2,2,2", "1,1,8", "2,4,1@inference"]
# Meshes whose logits are compared but whose decoding loop is not compiled (each loop costs a compile
# of ~10 s on 8 fake devices): decoding on a mesh runs on 1,8,1, 2,2,2 (float and int4), in two
# processes below, and in the serving engine on 1,4,2 (tests/decoding/test_engine_mesh.py).
LOGITS_ONLY = ["1,1,8", "2,4,1@inference"]
QUANTIZED = "2,2,2+int4-g16"


def _environment(devices: int) -> dict:
    environment = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE_FLAGS}",
                       JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    environment["PYTHONPATH"] = os.pathsep.join([os.getcwd(), environment.get("PYTHONPATH", "")])
    return environment


@pytest.fixture(scope="module")
def clover_checkpoint(tmp_path_factory) -> str:
    """Every program compiles once per mesh here, so the model is the smallest that still has two
    groups and both layer types (the compile time grows with the layers: XLA:CPU runs them unrolled)."""
    backbone = write_hf_checkpoint(tmp_path_factory.mktemp("two_groups"), TWO_GROUPS, seed=0)
    return add_clover_tensors(backbone, str(tmp_path_factory.mktemp("two_groups_clover")), mask_token_id=MASK_ID)


@pytest.fixture(scope="module")
def clover(clover_checkpoint):
    from clover_jax import CloverModel

    return CloverModel.from_pretrained(clover_checkpoint, progress=False)


@pytest.fixture(scope="module")
def single_device(clover):
    return sharded_run.results(clover)


@pytest.fixture(scope="module")
def on_meshes(clover_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mesh") / "results.json")
    command = ([sys.executable, SCRIPT, clover_checkpoint, out] + [f"--mesh={mesh}" for mesh in MESHES + [QUANTIZED]]
               + [f"--logits-only={mesh}" for mesh in LOGITS_ONLY])
    subprocess.run(command, check=True, env=_environment(8), timeout=900)
    with open(out) as handle:
        return json.load(handle)


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_results_equal_single_device(mesh, on_meshes, single_device):
    result = on_meshes[mesh]
    np.testing.assert_allclose(result["forward"], single_device["forward"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(result["denoise"], single_device["denoise"], atol=2e-5, rtol=1e-5)
    if mesh in LOGITS_ONLY:
        assert result["sequences"] is None
    else:
        assert result["sequences"] == single_device["sequences"]
        assert result["nfe"] == single_device["nfe"]


def test_quantised_loading_on_a_mesh_equals_one_device(on_meshes, clover_checkpoint):
    from clover_jax import CloverModel

    alone = sharded_run.results(CloverModel.from_pretrained(clover_checkpoint, progress=False, quantize="int4-g16"))
    result = on_meshes[QUANTIZED]
    np.testing.assert_allclose(result["forward"], alone["forward"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(result["denoise"], alone["denoise"], atol=2e-5, rtol=1e-5)
    assert result["sequences"] == alone["sequences"]


def test_parameters_are_sharded_as_the_rules_say(on_meshes, clover):
    config = clover.config
    experts = on_meshes["1,8,1"]["shard_shapes"]["groups/layer_0/mlp/experts_gate_up_proj"]
    assert experts[1] == config.num_experts // 8                       # expert-parallel
    mixed = on_meshes["2,2,2"]["shard_shapes"]
    assert mixed["groups/layer_1/self_attn/q_proj/weight"][1] == 2 * config.num_attention_heads * config.head_dim // 2
    assert mixed["groups/layer_1/self_attn/k_proj/weight"][1] == config.num_key_value_heads * config.head_dim // 2
    assert mixed["groups/layer_0/linear_attn/in_proj_z/weight"][1] == config.linear_value_dim // 2
    tensor = on_meshes["1,1,8"]["shard_shapes"]
    # 4 query heads and 2 K/V heads do not split 8 ways: replicated, not refused.
    assert tensor["groups/layer_1/self_attn/q_proj/weight"][1] == 2 * config.num_attention_heads * config.head_dim
    assert tensor["groups/layer_0/mlp/shared_expert/gate_proj/weight"][1] == config.shared_expert_intermediate_size // 8
    assert tensor["embed_tokens/embedding"][0] == config.vocab_size // 8


# Mesh axis of each dimension of each parameter on the (data 2, expert 2, tensor 2) mesh, written out
# by hand: experts over "expert", heads and the shared expert's hidden units over "tensor", the
# vocabulary over "tensor"; layer parameters lead with their [num_groups] axis, never split.
MIXED_MESH_AXES = {
    "embed_tokens/embedding": ["tensor", None],
    "norm/weight": [None],
    "lm_head": ["tensor", None],
    "input_layernorm/weight": [None, None],
    "post_attention_layernorm/weight": [None, None],
    "mlp/gate": [None, None, None],
    "mlp/experts_gate_up_proj": [None, "expert", None, None],
    "mlp/experts_down_proj": [None, "expert", None, None],
    "mlp/shared_expert/gate_proj/weight": [None, "tensor", None],
    "mlp/shared_expert/up_proj/weight": [None, "tensor", None],
    "mlp/shared_expert/down_proj/weight": [None, None, "tensor"],
    "mlp/shared_expert_gate/weight": [None, None, None],
    "linear_attn/in_proj_qkv/weight": [None, None, None],  # q|k|v rows: a contiguous split would mix them
    "linear_attn/in_proj_z/weight": [None, "tensor", None],
    "linear_attn/in_proj_b/weight": [None, "tensor", None],
    "linear_attn/in_proj_a/weight": [None, "tensor", None],
    "linear_attn/conv1d_weight": [None, None, None],
    "linear_attn/conv1d_right_weight": [None, None, None],
    "linear_attn/dt_bias": [None, "tensor"],
    "linear_attn/A_log": [None, "tensor"],
    "linear_attn/block_logit_scale": [None, "tensor"],
    "linear_attn/memory_logit_bias": [None, "tensor"],
    "linear_attn/block_size_calibration": [None, "tensor"],
    "linear_attn/norm/weight": [None, None],
    "linear_attn/out_proj/weight": [None, None, "tensor"],
    "self_attn/q_proj/weight": [None, "tensor", None],
    "self_attn/k_proj/weight": [None, "tensor", None],
    "self_attn/v_proj/weight": [None, "tensor", None],
    "self_attn/o_proj/weight": [None, None, "tensor"],
    "self_attn/q_norm/weight": [None, None],
    "self_attn/k_norm/weight": [None, None],
}
# On (1, 1, 8): 4 query heads, 2 K/V heads and 4 value heads do not split 8 ways and stay whole;
# the shared expert's 48 hidden units and the 128-token vocabulary split. Everything else is whole.
TENSOR_MESH_SPLIT = {
    "embed_tokens/embedding": ["tensor", None],
    "lm_head": ["tensor", None],
    "mlp/shared_expert/gate_proj/weight": [None, "tensor", None],
    "mlp/shared_expert/up_proj/weight": [None, "tensor", None],
    "mlp/shared_expert/down_proj/weight": [None, None, "tensor"],
}
# On (1, 8, 1): only the routed experts split.
EXPERT_MESH_SPLIT = {
    "mlp/experts_gate_up_proj": [None, "expert", None, None],
    "mlp/experts_down_proj": [None, "expert", None, None],
}

# The planner's rules on (2, 4, 1) (`inference_rules`): what the mixed mesh splits over "tensor" splits
# over "expert" instead, except the 2 K/V heads, which do not divide 4; nothing splits over "data".
INFERENCE_MESH_AXES = {**{key: ["expert" if axis == "tensor" else axis for axis in axes]
                          for key, axes in MIXED_MESH_AXES.items()},
                       "self_attn/k_proj/weight": [None, None, None], "self_attn/v_proj/weight": [None, None, None]}


def _by_parameter(mesh_axes: dict) -> dict:
    """{path inside a layer (or from the root): mesh axes}, the same for every slot of the group."""
    by_parameter = {}
    for path, axes in mesh_axes.items():
        key = path.split("/", 2)[2] if path.startswith("groups/") else path
        assert by_parameter.setdefault(key, axes) == axes, path
    return by_parameter


def test_each_parameter_dimension_is_split_over_the_mesh_axis_written_here(on_meshes):
    mixed = _by_parameter(on_meshes["2,2,2"]["mesh_axes"])
    assert mixed == MIXED_MESH_AXES
    tensor = _by_parameter(on_meshes["1,1,8"]["mesh_axes"])
    assert tensor.keys() == MIXED_MESH_AXES.keys()
    assert tensor == {key: TENSOR_MESH_SPLIT.get(key, [None] * len(axes)) for key, axes in MIXED_MESH_AXES.items()}
    expert = _by_parameter(on_meshes["1,8,1"]["mesh_axes"])
    assert expert == {key: EXPERT_MESH_SPLIT.get(key, [None] * len(axes)) for key, axes in MIXED_MESH_AXES.items()}
    assert _by_parameter(on_meshes["2,4,1@inference"]["mesh_axes"]) == INFERENCE_MESH_AXES


def test_two_processes_each_read_their_shards_and_agree(clover_checkpoint, tmp_path, single_device):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path / "results.json")
    processes = [subprocess.Popen([sys.executable, SCRIPT, clover_checkpoint, out, "--mesh=1,8,1",
                                   f"--process={i}", "--processes=2", f"--port={port}"], env=_environment(4))
                 for i in range(2)]
    for process in processes:
        assert process.wait(timeout=900) == 0
    reports = []
    for i in range(2):
        with open(f"{out}.{i}") as handle:
            reports.append(json.load(handle)["1,8,1"])
    checkpoint_bytes = sum(os.path.getsize(os.path.join(clover_checkpoint, name))
                           for name in os.listdir(clover_checkpoint) if name.endswith(".safetensors"))
    for report in reports:
        assert report["sequences"] == single_device["sequences"]
        np.testing.assert_allclose(report["forward"], single_device["forward"], atol=2e-5, rtol=1e-5)
        # Each process read its four devices' experts, not all eight: well under the whole checkpoint.
        assert report["bytes_read"] < 0.75 * checkpoint_bytes


def test_bad_meshes_are_refused_before_loading(clover_checkpoint, clover):
    import jax

    from clover_jax import MeshSharding, make_mesh

    with pytest.raises(ValueError, match="do not divide|devices"):
        make_mesh(2, 1, 1)  # one device here
    mesh = make_mesh(1, 1, 1)
    mesh_sharding = MeshSharding(mesh, clover.config)
    assert mesh_sharding.spec(("batch", "experts")) == jax.sharding.PartitionSpec(None, None)
    with pytest.raises(ValueError, match="num_experts=8 does not divide"):
        MeshSharding(jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 3).reshape(1, 3, 1)[:, :3],
                                       ("data", "expert", "tensor")), clover.config)
