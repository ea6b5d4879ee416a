"""A fine-tuning run's train step compiled for an accelerator from this host, and the compiler's bytes.

Beside the decoding loops (`decode_loops`; docs/compiling.md): the real step — every layer,
the clean and noisy streams (with the complementary copy, three streams of rows), the loss from
hidden states, the backward pass and the AdamW update — with abstract sharded arguments
(`clover_jax.training.abstract_step`), compiled by the target's compiler in the compile
subprocess; `memory_analysis()` gives one chip's bytes as a `ProgramMemory`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from clover_jax.api.compile.deviceless import compiled_memory, deviceless_kernels
from clover_jax.api.compile.program_memory import ProgramMemory

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
    KIND: ClassVar[str] = "train_step"  # how the worker tells the jobs apart

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

    def lower():
        step = abstract_step(config, finetune, mesh_sharding, deviceless_kernels(chosen.platform),
                             block_size=job.block_size, compute_dtype=finetune.param_dtype or "bfloat16")
        return step.jitted.lower(*step.args)

    memory = compiled_memory(lower, host=True)
    logger.info("train_step %s r%s seq %d on %s: %s", finetune.method, finetune.lora_rank, finetune.seq_len,
                job.target, memory)
    return {TRAIN_PROGRAM: memory}
