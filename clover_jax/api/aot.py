"""Compile the decoding loops for an accelerator from this host, and read the compiler's bytes.

Deviceless ahead-of-time compilation (docs/compiling.md): the loops `generate` runs — block
diffusion, autoregressive, self-speculative — are laid out for a request shape
(`decoding.layouts.placeholder_calls`), their parameters and inputs made abstract
(`jax.ShapeDtypeStruct` with the shardings of the target's mesh; nothing is allocated), and
compiled by the target's own compiler (TPU: libtpu, with Mosaic for the Pallas kernels; GPU:
XLA's CUDA compiler, with Triton for them). `memory_analysis()` then gives the bytes one device
holds: arguments, temporaries, outputs, aliased. A program that does not fit is refused by the
compiler (RESOURCE_EXHAUSTED), which is reported as the program's error.

The compilers are loaded only in a subprocess (`compile_in_subprocess`, running this module's
`main`): they print start-up noise, hold hundreds of MB, and would otherwise make the calling
process's `jax.devices()` try a TPU runtime (`clover_jax.parallel.compilers`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
from typing import Any, Sequence

from decoding.modes import MODES

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """What the compiler says one program needs per device (bytes), or why it refused it."""

    argument_bytes: int = 0
    temp_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    error: str | None = None
    compile_seconds: float = 0.0
    kernel_calls: int = 0  # Pallas kernels (Mosaic on TPU, Triton on GPU) in the compiled program
    host_bytes: int = 0  # host memory the program's arguments and temporaries take per device (offloading)


    @property
    def total_bytes(self) -> int:
        """Peak bytes one device holds for the program: arguments, temporaries and the outputs
        that do not reuse an argument's buffer."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


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
        started = time.perf_counter()
        args = jax.tree_util.tree_map(abstract, call.args)
        try:
            compiled = call.program.jitted.lower(*args).compile()
            analysis = compiled.memory_analysis()
            results[mode] = ProgramMemory(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes,
                                          analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
                                          compile_seconds=time.perf_counter() - started,
                                          kernel_calls=kernel_calls(compiled.as_text()))
        except Exception as error:  # the compiler's refusal is the result (RESOURCE_EXHAUSTED, Mosaic errors)
            results[mode] = ProgramMemory(error=compiler_error(error), compile_seconds=time.perf_counter() - started)
        logger.info("%s %s on %s: %s", mode, job.quantize or "bfloat16", job.target, results[mode])
    return results


# The custom-call targets a Pallas kernel compiles to: Mosaic on TPU, Triton on GPU.
KERNEL_CALL_TARGETS = ('custom_call_target="tpu_custom_call"', 'custom_call_target="__gpu$xla.gpu.triton"')


def kernel_calls(hlo_text: str) -> int:
    """How many Pallas kernel calls a compiled program's HLO text holds (each call site once)."""
    return sum(hlo_text.count(marker) for marker in KERNEL_CALL_TARGETS)


def deviceless_kernels(platform: str):
    """The kernels `impl="auto"` runs on `platform`, as far as a compiler without the device can
    build them: on GPU, attention takes the online softmax instead of cuDNN's fused attention,
    whose graph cuDNN builds on the device (the deviceless compile stops at "cuDNN not found").
    Every other choice — the Pallas GDN kernel, the grouped expert matmuls — is the device's own."""
    from clover_jax.core.kernels import choose_kernels

    kernels = choose_kernels("auto", platform)
    return dataclasses.replace(kernels, attention="online_softmax") if platform == "gpu" else kernels


def compiler_error(error: Exception) -> str:
    """The line of a compiler exception that says what went wrong (XLA's messages run long)."""
    text = f"{type(error).__name__}: {error}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("RESOURCE_EXHAUSTED", "Mosaic", "INTERNAL", "INVALID_ARGUMENT", "UNIMPLEMENTED"):
        for line in lines:
            if marker in line:
                return line[:1000]
    return lines[0][:1000] if lines else type(error).__name__


def compile_in_subprocess(jobs: Sequence[Any], timeout: float | None = None) -> list[dict[str, ProgramMemory]]:
    """`compile_job` for each job, in one fresh process that has the compilers on its path
    (`clover_jax.parallel.compilers`). Raises RuntimeError naming what is missing or what failed."""
    from clover_jax.parallel.compilers import compilers_dir, subprocess_environment

    payload = json.dumps([job.to_json() for job in jobs])
    process = subprocess.run([sys.executable, "-m", "clover_jax.api.aot"], input=payload, capture_output=True,
                             text=True, env=subprocess_environment(), timeout=timeout)
    if process.returncode != 0:
        tail = "\n".join(process.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the compile subprocess failed (exit {process.returncode}); are the compilers "
                           f"installed (python -m clover_jax.parallel.compilers install → {compilers_dir()})?\n{tail}")
    raw = json.loads(process.stdout.strip().splitlines()[-1])
    return [{mode: ProgramMemory(**memory) for mode, memory in result.items()} for result in raw]


def main() -> int:
    """Subprocess entry: a JSON list of jobs on stdin, a JSON list of results on the last stdout line."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from clover_jax.api.train_aot import TrainCompileJob, compile_train_job

    results = []
    for raw in json.loads(sys.stdin.read()):
        # a job with "task": "train" is a train step's (`train_aot`); any other, the decoding loops'
        compiled = (compile_train_job(TrainCompileJob.from_json(raw)) if raw.get("task") == "train"
                    else compile_job(CompileJob.from_json(raw)))
        results.append({mode: dataclasses.asdict(memory) for mode, memory in compiled.items()})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
