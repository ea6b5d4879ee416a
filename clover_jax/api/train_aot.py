"""Compile a fine-tuning run's train step for an accelerator from this host, and read the compiler's bytes.

The training half of `clover_jax.api.aot` (docs/compiling.md): the real step — every layer,
the clean and noisy streams (with the complementary copy, three streams of rows), the loss from
hidden states, the backward pass and the AdamW update — with abstract sharded arguments
(`clover_jax.training.abstract_step`), compiled by the target's compiler in the compile
subprocess; `memory_analysis()` gives one chip's bytes as a `ProgramMemory`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from clover_jax.api.aot import ProgramMemory, compiler_error, deviceless_kernels, kernel_calls

logger = logging.getLogger(__name__)

TRAIN_PROGRAM = "train_step"


@dataclasses.dataclass(frozen=True)
class TrainCompileJob:
    """One fine-tuning run's step on one target and mesh. Plain data (crosses into the compile
    subprocess as JSON). config: `CloverConfig` fields; finetune: `FinetuneConfig` fields (without
    the mesh); mesh: {"data", "expert", "tensor"}; rules: `ShardingRules` fields."""

    config: dict
    target: str
    finetune: dict
    mesh: dict
    rules: dict
    block_size: int = 32
    task: str = "train"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "TrainCompileJob":
        finetune = {key: tuple(value) if isinstance(value, list) else value for key, value in raw["finetune"].items()}
        return cls(**{**raw, "finetune": finetune})


def compile_train_job(job: TrainCompileJob) -> dict[str, ProgramMemory]:
    """Compile `job`'s step in this process (which must have the target's compiler) and return
    {"train_step": its memory analysis, or the compiler's refusal}."""
    from clover_jax.core.config import CloverConfig
    from clover_jax.parallel.sharding import MeshSharding, ShardingRules, make_mesh
    from clover_jax.parallel.targets import compile_only_devices, target
    from clover_jax.training.abstract_step import abstract_step
    from clover_jax.training.config import FinetuneConfig

    config = CloverConfig(**job.config)
    chosen = target(job.target)
    mesh = make_mesh(**job.mesh, devices=compile_only_devices(chosen))
    mesh_sharding = MeshSharding(mesh, config, ShardingRules(**job.rules))
    finetune = FinetuneConfig(**job.finetune)
    started = time.perf_counter()
    try:
        step = abstract_step(config, finetune, mesh_sharding, deviceless_kernels(chosen.platform),
                             block_size=job.block_size, compute_dtype=finetune.param_dtype or "bfloat16")
        compiled = step.jitted.lower(*step.args).compile()
        analysis = compiled.memory_analysis()
        memory = ProgramMemory(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes,
                               analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
                               compile_seconds=time.perf_counter() - started,
                               kernel_calls=kernel_calls(compiled.as_text()),
                               host_bytes=analysis.host_argument_size_in_bytes + analysis.host_temp_size_in_bytes)
    except Exception as error:  # the compiler's refusal is the result (RESOURCE_EXHAUSTED, Mosaic errors)
        memory = ProgramMemory(error=compiler_error(error), compile_seconds=time.perf_counter() - started)
    logger.info("train_step %s r%s seq %d on %s: %s", finetune.method, finetune.lora_rank, finetune.seq_len,
                job.target, memory)
    return {TRAIN_PROGRAM: memory}
