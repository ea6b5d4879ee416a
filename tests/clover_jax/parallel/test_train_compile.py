"""`clover_jax.plan(task="train", compile=True)` runs the real TPU and GPU compilers on the whole
train step (both streams with the complementary copy, loss, backward, AdamW) of a reduced-depth
model (SMALL's widths, one layer group of GDN + attention: the layers are scanned, so depth adds
no compile time), and the compiler's bytes decide. The step at Clover-35B's size, and its
temporaries at 4,096 and 8,192 tokens, are `benchmarks/train_compile.py`'s."""

from __future__ import annotations

import dataclasses
import math

import pytest

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout
from clover_jax.training.config import FinetuneConfig
from tests.clover_jax.parallel.test_compile_targets import SMALL

ONE_GROUP = dict(SMALL, num_hidden_layers=2)
# what the SMALL step compiles at (one length: the search for longer ones is `make bench`'s)
NO_SEARCH = dict(seq_lens=(), remat_choices=("full",))
SEQ_LEN = 64


@pytest.fixture(scope="module")
def compiled():
    """Full fine-tuning (float32 master, AdamW) on v6e-1 and on H200x2, each step compiled once. (A
    LoRA step's routed experts run `jax.lax.ragged_dot`, which the TPU compiler turns into a Mosaic
    kernel of its own: the kernel count below would not tell whether ours are in the program.)"""
    import clover_jax

    config = CloverConfig.from_dict(ONE_GROUP)
    # Rows of two blocks: the TPU compile time grows with the row (v6e-1: 103 s at 256 tokens, 34 s at
    # 64; H200x2: 62 s, 49 s), while the step's parts — both streams, the loss, the backward pass,
    # AdamW, the kernels — are the same at every length.
    full = FinetuneConfig(method="full", batch_size=2, seq_len=SEQ_LEN, block_size=32)
    # H200x2 on the mesh the user names (experts split over both GPUs: the expert-parallel dispatch
    # inside shard_map, with the kernels); the planner's own first choice would be data (2, 1, 1)
    meshes = {"v6e-1": None, "H200x2": (1, 2, 1)}
    return {name: clover_jax.plan(config, name, task="train", config=dataclasses.replace(full, mesh=mesh),
                                  compile=True, **NO_SEARCH)
            for name, mesh in meshes.items()}


@pytest.mark.parametrize("name", ["v6e-1", "H200x2"])
def test_the_train_step_compiles_for_the_target_and_the_compiler_decides(compiled, name):
    from clover_jax.parallel.planner import HEADROOM

    plan = compiled[name]
    (option,) = plan.options
    memory = option.compiled["train_step"]
    assert memory.error is None, memory.error
    assert memory.total_bytes == memory.argument_bytes + memory.temp_bytes + memory.output_bytes - memory.alias_bytes
    # the step's arguments hold at least the weights it reads (the arithmetic's exact bytes)
    assert memory.argument_bytes >= option.weight_bytes > 0
    assert option.fits == (memory.total_bytes <= HEADROOM * option.device_bytes) and option.fits
    assert option.remat == "full" and option.max_seq_len == SEQ_LEN
    assert plan.recommendation is option and "by the compiler" in plan.reason
    expected_mesh = {"v6e-1": {"data": 1, "expert": 1, "tensor": 1}, "H200x2": {"data": 1, "expert": 2, "tensor": 1}}
    assert option.mesh == expected_mesh[name]


@pytest.mark.parametrize("name", ["v6e-1", "H200x2"])
def test_the_compiled_train_step_runs_the_pallas_kernels(compiled, name):
    memory = compiled[name].options[0].compiled["train_step"]
    assert memory.error is None and memory.kernel_calls >= 2, memory.kernel_calls


def test_a_plan_without_the_compiler_counts_parameters_and_optimizer_state():
    import clover_jax
    from clover_jax.core.config import CLOVER_35B_A3B

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    full = clover_jax.plan(config, "v5p-64", task="train", config=FinetuneConfig(method="full", batch_size=64,
                                                                                  seq_len=4096, block_size=32))
    (option,) = full.options
    assert option.mesh == {"data": 32, "expert": 1, "tensor": 1}  # the planner's first mesh
    assert option.compiled is None and option.remat == "none"
    # float32 master, split 32 ways (every parameter over the 32 data chips)
    parameters = sum(math.prod(shape) for shape in flat_layout(config).values())
    assert parameters * 4 / 32 <= option.weight_bytes < parameters * 4 / 32 * 1.3
    assert option.state_bytes == 3 * option.weight_bytes
    with pytest.raises(ValueError, match="task='bake' is not one of"):
        clover_jax.plan(config, "v5p-64", task="bake")


def test_the_planner_tries_data_first_then_experts_then_the_base_in_host_memory(monkeypatch):
    """The order of meshes, remats and base placements the planner compiles, and which it reports,
    with the compiler's answers given (each compile here would take minutes at Clover-35B's size)."""
    import clover_jax
    from clover_jax.api import train_plan
    from clover_jax.api.compile.program_memory import ProgramMemory
    from clover_jax.core.config import CLOVER_35B_A3B

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    run = FinetuneConfig(method="lora", lora_rank=16, batch_size=8, seq_len=4096, block_size=32)
    assert train_plan.train_meshes(config, 8, run) == [{"data": 8, "expert": 1, "tensor": 1},
                                                        {"data": 4, "expert": 2, "tensor": 1},
                                                        {"data": 1, "expert": 8, "tensor": 1}]
    assert train_plan.train_meshes(config, 16, run) == [{"data": 8, "expert": 1, "tensor": 2},
                                                         {"data": 4, "expert": 2, "tensor": 2},
                                                         {"data": 1, "expert": 8, "tensor": 2}]
    assert train_plan.train_meshes(config, 8, dataclasses.replace(run, mesh=(2, 4, 1))) == [
        {"data": 2, "expert": 4, "tensor": 1}]
    assert train_plan.train_meshes(config, 1, run) == [{"data": 1, "expert": 1, "tensor": 1}]

    def answers(table):
        compiled = []

        def compile_in_subprocess(jobs):
            (job,) = jobs
            key = (job.mesh["data"], job.finetune["remat"], job.finetune["seq_len"])
            key += ("host",) if job.finetune["offload_base"] else ()
            compiled.append(key)
            gb = table.get(key)
            memory = ProgramMemory(error="RESOURCE_EXHAUSTED: out of memory") if gb is None else \
                ProgramMemory(int(gb * 1e9), 0, 0, 0, host_bytes=int(8.6e9) if "host" in key else 0)
            return [{"train_step": memory}]

        monkeypatch.setattr(train_plan, "compile_in_subprocess", compile_in_subprocess)
        return compiled

    # H200x8 counts 113.07 GB per GPU: 90% is 101.8 GB
    compiled = answers({(8, "none", 4096): 150, (8, "full", 4096): 120, (8, "layer", 4096): 44, (8, "layer", 8192): 90})
    plan = clover_jax.plan(config, "H200x8", task="train", config=run, compile=True, seq_lens=(8192, 16384))
    assert compiled == [(8, "none", 4096), (8, "full", 4096), (8, "layer", 4096), (8, "layer", 8192),
                        (8, "layer", 16384)]
    (option,) = plan.options
    assert plan.recommendation is option and option.mesh["data"] == 8 and option.remat == "layer"
    assert option.max_seq_len == 8192

    # nothing fits with the base on the chips: its layers in host memory, mesh by mesh, remat "layer"
    # then "layer_offload" (the layers' inputs in host memory too)
    on_chips = [(8, "none", 4096), (8, "full", 4096), (8, "layer", 4096),
                (4, "none", 4096), (4, "full", 4096), (4, "layer", 4096),
                (1, "none", 4096), (1, "full", 4096), (1, "layer", 4096)]
    compiled = answers({(8, "layer", 4096): 130, (1, "full", 4096): 120, (1, "layer", 4096): 110,
                        (8, "layer", 4096, "host"): 60})
    plan = clover_jax.plan(config, "H200x8", task="train", config=run, compile=True, seq_lens=())
    assert compiled == on_chips + [(8, "layer", 4096, "host")]
    (option,) = plan.options
    assert plan.recommendation is option and option.offload_base and option.remat == "layer"
    assert "layers in host memory" in option.weights and "8.0 GiB of host memory per chip" in plan.reason
    # on the chips by arithmetic: the embedding's and the LM head's share, not the layers'
    assert option.weight_bytes == 2 * config.vocab_size * config.hidden_size * 2 // 8

    # the next remat, then the next mesh (the v5e-8 LoRA row fits so: (4, 2, 1), "layer_offload")
    compiled = answers({(8, "layer", 4096): 130, (8, "layer", 4096, "host"): 105,
                        (8, "layer_offload", 4096, "host"): 105,
                        (4, "layer", 4096, "host"): 104, (4, "layer_offload", 4096, "host"): 90})
    plan = clover_jax.plan(config, "H200x8", task="train", config=run, compile=True, seq_lens=())
    assert compiled == on_chips + [(8, "layer", 4096, "host"), (8, "layer_offload", 4096, "host"),
                                   (4, "layer", 4096, "host"), (4, "layer_offload", 4096, "host")]
    (option,) = plan.options
    assert plan.recommendation is option and option.remat == "layer_offload"
    assert option.mesh == {"data": 4, "expert": 2, "tensor": 1}

    # and when that does not fit either, the smallest of all is reported
    compiled = answers({(8, "layer", 4096): 130, (1, "full", 4096): 120, (1, "layer", 4096): 110})
    plan = clover_jax.plan(config, "H200x8", task="train", config=run, compile=True, seq_lens=())
    assert compiled == on_chips + [(8, "layer", 4096, "host"), (8, "layer_offload", 4096, "host"),
                                   (4, "layer", 4096, "host"), (4, "layer_offload", 4096, "host"),
                                   (1, "layer", 4096, "host"), (1, "layer_offload", 4096, "host")]
    (option,) = plan.options
    assert plan.recommendation is None and "does not fit" in plan.reason
    assert option.mesh == {"data": 1, "expert": 8, "tensor": 1} and option.remat == "layer"
    assert option.compiled["train_step"].total_bytes == 110e9 and not option.offload_base
    # a full fine-tuning trains its parameters: nothing is offloaded
    compiled = answers({})
    clover_jax.plan(config, "H200x8", task="train", config=dataclasses.replace(run, method="full"), compile=True,
                    seq_lens=())
    assert not any("host" in key for key in compiled)
