"""What every deviceless compile shares: the kernels a target's compiler can build without the
device, the memory analysis of a compiled program as a `ProgramMemory`, and the line of a
compiler's refusal that says why."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from clover_jax.api.compile.program_memory import ProgramMemory

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


def compiled_memory(lower: Callable[[], Any], *, host: bool = False) -> ProgramMemory:
    """Compile what `lower()` lowers (a `jax.stages.Lowered`) and read one device's bytes, or keep the
    compiler's refusal (RESOURCE_EXHAUSTED, Mosaic errors) as the result. host: count the host memory
    the program's arguments and temporaries take (an offloading train step)."""
    started = time.perf_counter()
    try:
        compiled = lower().compile()
        analysis = compiled.memory_analysis()
        host_bytes = analysis.host_argument_size_in_bytes + analysis.host_temp_size_in_bytes if host else 0
        return ProgramMemory(analysis.argument_size_in_bytes, analysis.temp_size_in_bytes,
                             analysis.output_size_in_bytes, analysis.alias_size_in_bytes,
                             compile_seconds=time.perf_counter() - started,
                             kernel_calls=kernel_calls(compiled.as_text()), host_bytes=host_bytes)
    except Exception as error:  # the compiler's refusal is the result
        return ProgramMemory(error=compiler_error(error), compile_seconds=time.perf_counter() - started)
