"""Compiling for accelerators from this CPU host: the named targets, the compilers kept off the
import path, and `clover_jax.plan(..., compile=True)` running the real TPU and GPU compilers on
the whole decoder (three loops, two layer groups, a small mesh)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from clover_jax.core.config import CLOVER_35B_A3B, CloverConfig
from clover_jax.parallel.targets import TARGETS, target

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Two layer groups of (GDN, attention) with the kernels' real tile sizes (heads of 128, hidden a
# multiple of 128) but few of them, so that each loop compiles in seconds (measured: 7 s for the
# autoregressive loop on a v5e; 17 s with groups of 3 GDN + 1 attention layers).
SMALL = dict(
    model_type="clover_moe", vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    num_experts=16, num_experts_per_tok=4, full_attention_interval=2, mask_token_id=4095, eos_token_id=[4094],
    max_position_embeddings=131072, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)


def test_the_named_targets_are_the_machines_users_have():
    assert list(TARGETS) == ["v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v5p-8", "v5p-64", "H100", "H200"]
    assert (target("v6e-1").platform, target("v6e-1").chips, target("v6e-1").topology) == ("tpu", 1, "v6e:2x2")
    assert target("v5e-8").topology == "v5e:2x4"
    eight = target("H200x8")
    assert (eight.platform, eight.chips, eight.topology, eight.gpu_spec) == ("gpu", 8, "1x1x8", "h200.txtpb")
    with pytest.raises(ValueError, match="unknown target 'v7-1'; expected one of v5e-1"):
        target("v7-1")


def test_a_gpu_program_gets_the_pool_jax_preallocates(monkeypatch):
    h200 = target("H200")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert h200.usable_bytes == int(0.75 * h200.memory_bytes)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert h200.usable_bytes == int(0.95 * h200.memory_bytes)
    assert target("v6e-1").usable_bytes == target("v6e-1").memory_bytes


def test_the_gpu_descriptions_state_the_memory_the_targets_use():
    from clover_jax.parallel.targets import gpu_target_config

    for name in ("H100", "H200"):
        text = gpu_target_config(target(name))
        assert f"device_memory_size: {target(name).memory_bytes}" in text
        assert "cuda_compute_capability {\n    major: 9\n  }" in text


def test_the_compilers_sit_off_the_import_path_so_importing_and_decoding_stay_quiet():
    """With the compilers installed, a plain process (no JAX_PLATFORMS) imports clover_jax, lists
    its devices and decodes on the CPU without a line on stderr and without loading a TPU or CUDA
    runtime; the compile subprocess's environment finds both compilers."""
    from clover_jax.parallel.compilers import compilers_dir, installed, subprocess_environment

    assert installed(), f"python -m clover_jax.parallel.compilers install (make test does) → {compilers_dir()}"
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("JAX_", "XLA_"))}
    environment["CLOVER_JAX_CACHE_DIR"] = ""
    script = ("import importlib.util, clover_jax, jax; from clover_jax import CloverModel; "
              "from decoding import generate\n"
              "model = CloverModel.from_pretrained(clover_jax.bundled_model_path(), progress=False)\n"
              "out = generate(model, [[10, 11, 12]], max_new_tokens=8)\n"
              "print(jax.default_backend(), importlib.util.find_spec('libtpu') is None, "
              "importlib.util.find_spec('jax_cuda12_plugin') is None, len(out.sequences[0]) > 0)")
    plain = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["cpu", "True", "True", "True"]
    assert plain.stderr == ""
    probe = "import importlib.util; print(importlib.util.find_spec('libtpu') is not None, " \
            "importlib.util.find_spec('jax_cuda12_plugin') is not None)"
    compile_side = subprocess.run([sys.executable, "-c", probe], env=subprocess_environment(environment),
                                  capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert compile_side.stdout.split() == ["True", "True"]


def test_plan_arithmetic_shards_what_is_not_an_expert_on_an_expert_mesh():
    import clover_jax
    from clover_jax.parallel.planner import inference_rules

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    eight = clover_jax.plan(config, "v5e-8", context_length=8192)
    one = clover_jax.plan(config, "v5e-1", context_length=8192)
    bf16 = eight.options[0]
    assert bf16.mesh == {"data": 1, "expert": 8, "tensor": 1} and bf16.rules == inference_rules(bf16.mesh)
    assert bf16.rules.vocab == "expert" and bf16.rules.experts == "expert"
    # Every weight splits 8 ways but the GDN input projection (q|k|v rows), the 2 K/V heads, the
    # norms, the routers and the convolutions: 1.2 GB of 69 GB stay whole.
    assert one.options[0].weight_bytes / 8 < bf16.weight_bytes < one.options[0].weight_bytes / 7
    assert all(option.compiled is None for option in eight.options)


BF16, INT4 = "bfloat16", "int4 experts (g128)"


# Compiled here: TPU v5e-4 (expert axis 4, the dense weights split over it) in bfloat16 (megablox),
# the three loops, and in int4 experts (our kernel, dequantising per tile), the block-diffusion loop;
# two H200s in bfloat16, the block-diffusion loop (the GPU's int4 kernel compiles in
# tests/pallas_kernels/test_compile.py; every loop, format and target at full size in `make bench`).
# The GPU compiler takes about twice as long per loop (Triton and ptxas).
THREE = ("diffusion", "autoregressive", "self_speculative")
COMPILED = {"v5e-4": {BF16: THREE, INT4: ("diffusion",)}, "H200x2": {BF16: ("diffusion",)}}


@pytest.fixture(scope="module")
def compiled_plans(tmp_path_factory):
    """The small model planned with the compilers for each target and format of COMPILED (one plan
    per format: its loops), at a context of 256 (one prefill chunk and 4 blocks, as 4096 was: one
    v5e-4 format's three loops took 85 s to compile there, 60 s at 1024, 45 s here; the loops and
    the kernels in them are the same at every length)."""
    import clover_jax

    config = CloverConfig.from_dict(SMALL)
    # The loops share most of their kernels; with XLA's kernel cache the GPU compiler builds each
    # once (LLVM and ptxas per kernel) instead of once per loop: three H200 loops took 92 s without
    # it, 53 s with it, and the compiler reported the same bytes and kernel calls.
    cache = tmp_path_factory.mktemp("gpu_kernels") / "kernels"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_kernel_cache_file={cache}".strip())
        return {name: {weights: clover_jax.plan(config, name, context_length=256, batch=2, compile=True,
                                                formats=[weights], modes=modes)
                       for weights, modes in formats.items()}
                for name, formats in COMPILED.items()}


@pytest.mark.parametrize("name", ["v5e-4", "H200x2"])
def test_plan_compiles_the_loops_for_the_target_and_the_compiler_decides(compiled_plans, name):
    from clover_jax.parallel.planner import HEADROOM

    assert "autoregressive" in COMPILED["v5e-4"][BF16] and "self_speculative" in COMPILED["v5e-4"][BF16]
    for weights, plan in compiled_plans[name].items():
        assert [option.weights for option in plan.options] == [BF16, "int8 experts", INT4, INT4 + " + dense"]
        for option in plan.options:
            if option.weights != weights:
                assert option.compiled is None  # not asked for: the arithmetic's verdict stands
                continue
            assert set(option.compiled) == set(COMPILED[name][weights])
            for mode, memory in option.compiled.items():
                assert memory.error is None, (option.weights, mode, memory.error)
                # the Pallas kernels (GDN; grouped expert matmuls) are in the compiled program, not only lowered
                assert memory.kernel_calls >= 2, (option.weights, mode, memory.kernel_calls)
                # the weights are arguments: the compiler holds at least the arithmetic's exact bytes per device
                assert memory.argument_bytes >= option.weight_bytes > 0
                assert memory.total_bytes == (memory.argument_bytes + memory.temp_bytes + memory.output_bytes
                                              - memory.alias_bytes)
            assert option.fits == (option.compiled_bytes <= HEADROOM * option.device_bytes)
        assert plan.recommendation is plan.options[0] and "compiled" in str(plan)
        # bfloat16's fit decided by the compiler; a plan compiling int4 alone keeps the arithmetic's verdict on it
        assert ("by the compiler" in plan.reason) == (weights == BF16), plan.reason


def test_quantised_experts_need_no_more_temporaries_than_bfloat16(compiled_plans):
    """The quantised experts are read in place (dequantised per tile inside the kernel): no loop of
    the int4 format holds a dequantised copy of an expert stack among its temporaries."""
    plans = compiled_plans["v5e-4"]
    int4, bf16 = plans[INT4].options[2], plans[BF16].options[0]
    assert (int4.weights, bf16.weights) == (INT4, BF16) and int4.compiled
    for mode, memory in int4.compiled.items():
        assert memory.temp_bytes <= 1.1 * bf16.compiled[mode].temp_bytes, mode


def test_a_format_the_compiler_refuses_is_reported_and_never_recommended():
    """On one v5e chip the small model's weights fit, but 128 sequences of 65,536 positions do not:
    the TPU compiler says RESOURCE_EXHAUSTED, and the plan says so instead of recommending it."""
    import clover_jax

    plan = clover_jax.plan(CloverConfig.from_dict(SMALL), "v5e-1", context_length=65536, batch=128, compile=True,
                           modes=("autoregressive",), formats=[BF16])
    bf16 = plan.options[0]
    error = bf16.compiled["autoregressive"].error
    assert error is not None and "RESOURCE_EXHAUSTED" in error, error
    assert not bf16.fits and bf16.compiled_bytes is None
    assert plan.recommendation is not bf16
    assert f"autoregressive: {error}" in str(plan)


def test_plan_compiles_only_formats_whose_weights_fit_and_follows_the_compiler(monkeypatch):
    """The plan's side of compiling, with the compiler's answers written here: which jobs it asks
    for, and `fits` and the recommendation from the answers, not from the arithmetic."""
    import clover_jax
    from clover_jax.api import plan as plan_module
    from clover_jax.api.compile.program_memory import ProgramMemory

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    jobs = []

    def compiler(asked, timeout=None):
        jobs.extend(asked)
        answers = {"int4": ProgramMemory(error="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm"),
                   "int4+dense": ProgramMemory(argument_bytes=19 * 2**30, temp_bytes=2 * 2**30)}
        return [{mode: answers[job.quantize.replace("-g128", "")] for mode in job.modes} for job in asked]

    monkeypatch.setattr(plan_module, "compile_in_subprocess", compiler)
    plan = clover_jax.plan(config, "v6e-1", context_length=32768, compile=True)
    # bf16 (64.6 GiB) and int8 (34.6 GiB) weights alone exceed the chip's 31.25 GiB: not compiled
    assert [job.quantize for job in jobs] == ["int4-g128", "int4-g128+dense"]
    assert all(job.target == "v6e-1" and job.context_length == 32768 and job.mesh == {"data": 1, "expert": 1,
               "tensor": 1} for job in jobs)
    bf16, int8, int4, dense = plan.options
    assert "not compiled: the weights alone" in bf16.compiled["diffusion"].error and not bf16.fits
    assert not int8.fits
    assert int4.fits is False and int4.compiled_bytes is None  # the arithmetic said it fits; the compiler did not
    assert dense.fits and plan.recommendation is dense
    assert dense.compiled_bytes == 21 * 2**30


def test_compile_needs_a_named_target(monkeypatch):
    import clover_jax
    from clover_jax.api import plan as plan_module

    monkeypatch.setattr(plan_module, "compile_in_subprocess", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match="compile=True needs a named target"):
        clover_jax.plan(CloverConfig.from_dict(SMALL), ["TPU v5e"], compile=True)


def test_plan_reads_only_config_json_of_a_hub_id(monkeypatch, tmp_path):
    """A Hub id resolves to its config.json alone (no weights downloaded)."""
    import json

    import clover_jax
    from clover_jax.api import plan as plan_module

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    asked = []

    def resolve(path, revision=None, require=(), weights=False):
        asked.append((path, revision, tuple(require), weights))
        return tmp_path

    monkeypatch.setattr(plan_module, "resolve_checkpoint", resolve)
    plan = clover_jax.plan("org/clover-small", "v6e-1", context_length=1024, revision="main")
    assert asked == [("org/clover-small", "main", ("config.json",), False)]
    assert plan.recommendation.weights == "bfloat16"


def test_a_compile_job_crosses_into_the_subprocess_as_json():
    from clover_jax.api.compile.decode_loops import CompileJob

    job = CompileJob(dataclasses.asdict(CloverConfig.from_dict(SMALL)), "v6e-1", "int4", {"data": 1, "expert": 1,
                     "tensor": 1}, {}, 4096, modes=("diffusion",))
    import json

    crossed = CompileJob.from_json(json.loads(json.dumps(job.to_json())))
    assert CloverConfig(**crossed.config) == CloverConfig(**job.config)
    assert dataclasses.replace(crossed, config=job.config) == job
