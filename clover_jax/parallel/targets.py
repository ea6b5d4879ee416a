"""The accelerators clover-jax compiles for by name, from any host (docs/compiling.md).

A `Target` is what the compilers need to know about a machine: the platform, how many chips,
their layout (a TPU topology, or a GPU device description) and the memory one chip gives a
program. `compile_only_devices(target)` returns devices that compile but never run (JAX's
deviceless ahead-of-time compilation, `jax.experimental.topologies`): TPU devices from the
`libtpu` of the installed jax, GPU devices from the CUDA plugin with the description files in
`gpu_targets/` (H100 and H200, sm_90). Making them loads those compilers into the process, so
clover-jax does it only in its compile subprocess (`clover_jax.api.compile.worker`).

Memory a program may use, per chip (`Target.usable_bytes`): TPU: the HBM the TPU runtime
reports as available (v5e 16 GiB, v6e 31.25 GiB, v5p 95.74 GiB); GPU: the fraction of the
device JAX preallocates (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 unless set), since a program
cannot use more than the pool JAX takes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

GIB = 2**30
GPU_TARGETS_DIR = Path(__file__).resolve().parent / "gpu_targets"
DEFAULT_GPU_MEMORY_FRACTION = 0.75  # JAX's preallocation default on GPUs


@dataclasses.dataclass(frozen=True)
class Target:
    """A named accelerator machine. `topology`: the TPU topology the chips are taken from
    (`v6e:2x2`; the smallest named layout, of which `v6e-1` takes one chip), or for GPUs the
    `slices x hosts x devices` string with `gpu_spec` the device description file."""

    name: str
    platform: str          # "tpu" | "gpu"
    chips: int
    device_kind: str       # as jax names it ("TPU v6 lite", "NVIDIA H200")
    memory_bytes: int      # HBM per chip, as the runtime reports it
    topology: str
    gpu_spec: str | None = None

    @property
    def usable_bytes(self) -> int:
        """Bytes one chip gives a program: all of it on TPU; JAX's preallocated pool on GPU."""
        if self.platform == "gpu":
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_GPU_MEMORY_FRACTION))
            return int(self.memory_bytes * fraction)
        return self.memory_bytes

    def describe(self) -> str:
        return f"{self.name} ({self.chips} × {self.device_kind}, {self.memory_bytes / GIB:.1f} GiB each)"


def _tpu(name: str, chips: int, kind: str, memory: int, topology: str) -> Target:
    return Target(name, "tpu", chips, kind, memory, topology)


def _gpu(name: str, chips: int, kind: str, memory: int, spec: str) -> Target:
    return Target(name, "gpu", chips, kind, memory, f"1x1x{chips}", spec)


_V5E, _V6E, _V5P = 16 * GIB, int(31.25 * GIB), int(95.74 * GIB)
_H100, _H200 = 84_978_434_048, 150_754_820_096  # as in gpu_targets/*.txtpb (device_memory_size)

TARGETS: dict[str, Target] = {target.name: target for target in (
    _tpu("v5e-1", 1, "TPU v5 lite", _V5E, "v5e:2x2"),
    _tpu("v5e-4", 4, "TPU v5 lite", _V5E, "v5e:2x2"),
    _tpu("v5e-8", 8, "TPU v5 lite", _V5E, "v5e:2x4"),
    _tpu("v6e-1", 1, "TPU v6 lite", _V6E, "v6e:2x2"),
    _tpu("v6e-4", 4, "TPU v6 lite", _V6E, "v6e:2x2"),
    _tpu("v6e-8", 8, "TPU v6 lite", _V6E, "v6e:2x4"),
    _tpu("v5p-8", 4, "TPU v5", _V5P, "v5p:2x2x1"),  # v5p-8: 8 TensorCores, 4 chips (one device each)
    _tpu("v5p-64", 32, "TPU v5", _V5P, "v5p:4x4x2"),  # v5p-64: 64 TensorCores, 32 chips
    _gpu("H100", 1, "NVIDIA H100 80GB HBM3", _H100, "h100.txtpb"),
    _gpu("H200", 1, "NVIDIA H200", _H200, "h200.txtpb"),
)}
_GPU_COUNT = re.compile(r"^(H100|H200)x([1-9][0-9]*)$")


def target(name: str) -> Target:
    """The named target: one of `TARGETS`, or `H100xN` / `H200xN` for N GPUs of one host."""
    if name in TARGETS:
        return TARGETS[name]
    match = _GPU_COUNT.match(name)
    if match:
        one = TARGETS[match.group(1)]
        chips = int(match.group(2))
        return dataclasses.replace(one, name=name, chips=chips, topology=f"1x1x{chips}")
    raise ValueError(f"unknown target {name!r}; expected one of {', '.join(TARGETS)} (or H100xN / H200xN "
                     "for N GPUs)")


def gpu_target_config(target: Target) -> str:
    """The GpuTargetConfigProto text of a GPU target."""
    return (GPU_TARGETS_DIR / target.gpu_spec).read_text()


def compile_only_devices(target: Target) -> list:
    """`target.chips` devices that compile for the target without being present.

    Loads the target's compiler into this process: call it only where that is wanted (the compile
    subprocess). TPU needs `libtpu`, GPU the CUDA plugin and ptxas (`clover_jax.parallel.compilers`).
    """
    from jax.experimental import topologies

    if target.platform == "tpu":
        devices = topologies.get_topology_desc(topology_name=target.topology, platform="tpu").devices
    else:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver here to check against
        devices = topologies.get_topology_desc(platform="cuda", topology_name=target.topology,
                                               target_config=gpu_target_config(target),
                                               topology=target.topology).devices
    if len(devices) < target.chips:
        raise ValueError(f"topology {target.topology} has {len(devices)} devices, fewer than {target.name}'s "
                         f"{target.chips}")
    return list(devices[:target.chips])
