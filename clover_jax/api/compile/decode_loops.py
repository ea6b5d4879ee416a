"""The decoding loops compiled for an accelerator from this host, and the compiler's bytes for each.

Deviceless ahead-of-time compilation (docs/compiling.md): the loops `generate` runs — block
diffusion, autoregressive, self-speculative — are laid out for a request shape
(`decoding.layouts.placeholder_calls`), their parameters and inputs made abstract
(`jax.ShapeDtypeStruct` with the shardings of the target's mesh; nothing is allocated), and
compiled by the target's own compiler (TPU: libtpu, with Mosaic for the Pallas kernels; GPU:
XLA's CUDA compiler, with Triton for them). `memory_analysis()` then gives the bytes one device
holds: arguments, temporaries, outputs, aliased. A program that does not fit is refused by the
compiler (RESOURCE_EXHAUSTED), which is reported as the program's error.

The compilers are loaded only in a subprocess (`worker.compile_in_subprocess`): they print start-up
noise, hold hundreds of MB, and would otherwise make the calling process's `jax.devices()` try a TPU
runtime (`clover_jax.parallel.compilers`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from clover_jax.api.compile.deviceless import compiled_memory, deviceless_kernels
from clover_jax.api.compile.program_memory import ProgramMemory
from decoding.modes import MODES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One model, format and mesh on one target: the decoding loops to compile. Plain data, so
    it crosses into the compile subprocess as JSON.

    config: `CloverConfig` fields; quantize: a `QuantSpec` name or None; mesh: {"data", "expert",
    "tensor"} sizes; rules: `ShardingRules` fields; context_length: prompt + response positions
    (the prompt takes half); modes: which loops.
    """

    config: dict
    target: str
    quantize: str | None
    mesh: dict
    rules: dict
    context_length: int
    batch: int = 1
    block_size: int = 32
    chunk_size: int = 2048
    modes: tuple[str, ...] = MODES
    KIND: ClassVar[str] = "decode_loops"  # how the worker tells the jobs apart

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> "CompileJob":
        return cls(**{**raw, "modes": tuple(raw["modes"])})


def compile_job(job: CompileJob) -> dict[str, ProgramMemory]:
    """Compile `job`'s loops in this process (which must have the target's compiler; see the
    module docstring) and return each one's memory analysis."""
    import jax
    import jax.numpy as jnp

    from clover_jax.core.config import CloverConfig
    from clover_jax.core.quantization import QuantSpec
    from clover_jax.nn.model import CloverTransformer, TransformerPasses
    from clover_jax.parallel.sharding import MeshSharding, ShardingRules, make_mesh
    from clover_jax.parallel.targets import compile_only_devices, target
    from decoding.generation_config import GenerationConfig
    from decoding.layouts import placeholder_calls

    config = CloverConfig(**job.config)
    chosen = target(job.target)
    mesh = make_mesh(**job.mesh, devices=compile_only_devices(chosen))
    mesh_sharding = MeshSharding(mesh, config, ShardingRules(**job.rules))
    dtype = jnp.bfloat16
    params = mesh_sharding.abstract_params(dtype, QuantSpec.parse(job.quantize))
    passes = TransformerPasses(CloverTransformer(config, dtype, deviceless_kernels(chosen.platform), mesh_sharding))
    prompt_length = job.context_length // 2
    generation = GenerationConfig.for_model_type(config.model_type).replace(
        max_new_tokens=job.context_length - prompt_length, block_size=job.block_size).with_token_ids(config)
    calls = placeholder_calls(passes, params, generation, job.batch, prompt_length, job.chunk_size, job.modes)

    def abstract(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct) or not hasattr(leaf, "shape"):
            return leaf
        batched = leaf.ndim >= 1 and leaf.shape[0] == job.batch
        sharding = (mesh_sharding.batch_sharding(job.batch, leaf.ndim) if batched
                    else mesh_sharding.sharding((None,) * leaf.ndim))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    results = {}
    for mode, call in calls.items():
        args = jax.tree_util.tree_map(abstract, call.args)
        results[mode] = compiled_memory(lambda call=call, args=args: call.program.jitted.lower(*args))
        logger.info("%s %s on %s: %s", mode, job.quantize or "bfloat16", job.target, results[mode])
    return results
