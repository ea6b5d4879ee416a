"""The serving engine's served set compiled for an accelerator from this host (`clover-jax serve`'s
programs for a target, before any server starts there).

`decoding.engine.abstract_programs` lays out every program the engine of the given shapes can meet
(one ragged forward per token padding, the decisions, the slot writes, the GDN state copies) with
abstract arguments placed on the target's mesh; each is compiled by the target's own compiler, which
says what it needs per device and how long it took (`ProgramMemory.compile_seconds`). The sum of the
seconds is what `clover-jax serve --precompile` costs on that target with a cold cache, measured
from a 2-core host (`benchmarks/serve_compile.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

from clover_jax.api.compile.deviceless import compiled_memory, deviceless_kernels
from clover_jax.api.compile.program_memory import ProgramMemory
from decoding.modes import MODES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServedSetJob:
    """One model, format and mesh on one target, and the engine's settings: its served set to compile.
    Plain data, so it crosses into the compile subprocess as JSON.

    config: `CloverConfig` fields; quantize: a `QuantSpec` name or None; mesh: {"data", "expert",
    "tensor"} sizes; rules: `ShardingRules` fields; the rest as `Engine` takes them
    (`kv_cache_bytes` None: every slot at `max_context`, plus the prefix cache's budget)."""

    config: dict
    target: str
    quantize: str | None
    mesh: dict
    rules: dict
    max_running: int = 8
    max_context: int = 32768
    block_sizes: tuple[int, ...] = (32,)
    modes: tuple[str, ...] = MODES
    prefill_budget: int = 2048
    prefix_cache_bytes: int = 0
    kv_cache_bytes: int | None = None
    KIND: ClassVar[str] = "served_set"  # how the worker tells the jobs apart

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "ServedSetJob":
        return cls(**{**raw, "modes": tuple(raw["modes"]), "block_sizes": tuple(raw["block_sizes"])})


def compile_served_set(job: ServedSetJob) -> dict[str, ProgramMemory]:
    """Compile `job`'s served set in this process (which must have the target's compiler) and
    return each program's memory analysis and compile time, by the program's name."""
    import jax
    import jax.numpy as jnp

    from clover_jax.core.config import CloverConfig
    from clover_jax.core.quantization import QuantSpec
    from clover_jax.nn.model import CloverTransformer, TransformerPasses
    from clover_jax.parallel.sharding import MeshSharding, ShardingRules, make_mesh
    from clover_jax.parallel.targets import compile_only_devices, target
    from decoding.engine.abstract_programs import abstract_programs

    config = CloverConfig(**job.config)
    chosen = target(job.target)
    devices = compile_only_devices(chosen)
    mesh = make_mesh(**job.mesh, devices=devices)
    mesh_sharding = MeshSharding(mesh, config, ShardingRules(**job.rules))
    dtype = jnp.bfloat16
    params = mesh_sharding.abstract_params(dtype, QuantSpec.parse(job.quantize))
    passes = TransformerPasses(CloverTransformer(config, dtype, deviceless_kernels(chosen.platform), mesh_sharding))
    shapes, programs = abstract_programs(
        passes, params, config=config, dtype=dtype, mesh_sharding=mesh_sharding, modes=job.modes,
        block_sizes=job.block_sizes, max_running=job.max_running, max_context=job.max_context,
        prefill_budget=job.prefill_budget, prefix_cache_bytes=job.prefix_cache_bytes,
        kv_cache_bytes=job.kv_cache_bytes)
    results = {}
    for one in programs:
        def lower(one=one):
            # Mosaic's lowering of integer arithmetic asks the default device what it is
            with jax.default_device(devices[0]):
                return one.function.lower(*one.args, **one.static)

        results[one.program.name] = compiled_memory(lower)
        logger.info("%s on %s: %s", one.program.name, job.target, results[one.program.name])
    return results
