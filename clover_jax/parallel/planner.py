"""Will it fit? `plan(path_or_config, devices)`: bytes per device for each weight format and the
mesh the devices allow, plus the state for a context and batch, and a recommendation.

Weight bytes are exact: every parameter's shape (`param_layout`) times its stored width
(bfloat16 2 bytes; int8 1 byte + a bfloat16 scale per output row; int4 half a byte + a bfloat16
scale per group), divided by the devices its sharding spreads it over (`MeshSharding`, the same
rules the loader applies). State and activations come from `clover_jax.parallel.memory.estimate_memory`
and are split over the data axis.

Devices are jax devices or names from `DEVICE_MEMORY` ("TPU v6e", "TPU v5e", "H200", ...).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh

from clover_jax.core.config import CloverConfig
from clover_jax.parallel.memory import estimate_memory
from clover_jax.core.param_layout import flat_layout
from clover_jax.core.quantization import QuantSpec
from clover_jax.parallel.sharding import MESH_AXES, MeshSharding, ShardingRules, param_logical_axes

GIB = 2**30
# High-bandwidth memory per chip, by device kind (jax's `device_kind` or a short name).
DEVICE_MEMORY = {
    "TPU v5e": 16 * 2**30, "TPU v5 lite": 16 * 2**30, "TPU v6e": 32 * 2**30, "TPU v6 lite": 32 * 2**30,
    "TPU v4": 32 * 2**30, "TPU v5p": 95 * 2**30, "H100": 80 * 10**9, "NVIDIA H100 80GB HBM3": 80 * 10**9,
    "H200": 141 * 10**9,
    "NVIDIA H200": 141 * 10**9, "A100": 80 * 10**9, "NVIDIA A100-SXM4-80GB": 80 * 10**9,
}
# Formats tried best first; the recommendation is the first that fits.
FORMATS = (("bfloat16", None), ("bfloat16", QuantSpec(8)), ("bfloat16", QuantSpec(4)),
           ("bfloat16", QuantSpec(4, dense=True)))
HEADROOM = 0.9  # leave a tenth of each device to the runtime and fragmentation


@dataclasses.dataclass(frozen=True)
class Option:
    weights: str             # "bfloat16", "int8 experts", ...
    mesh: dict               # {"data": 1, "expert": n, "tensor": 1}
    weight_bytes: int        # per device
    state_bytes: int         # per device: K/V cache + GDN state + activations
    device_bytes: int        # memory of one device
    fits: bool
    quantize: QuantSpec | None = None  # what to pass as `CloverModel.from_pretrained(quantize=...)`

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    options: list[Option]
    recommendation: Option | None
    reason: str

    def __str__(self) -> str:
        lines = [f"{'weights':<22} {'mesh (d,e,t)':<13} {'weights/dev':>12} {'state/dev':>10} {'fits':>5}"]
        for option in self.options:
            mesh = ",".join(str(option.mesh[axis]) for axis in MESH_AXES)
            lines.append(f"{option.weights:<22} {mesh:<13} {option.weight_bytes / GIB:>10.2f}GiB "
                         f"{option.state_bytes / GIB:>8.2f}GiB {'yes' if option.fits else 'no':>5}")
        return "\n".join(lines + [self.reason])


def describe_format(dtype: str, spec: QuantSpec | None) -> str:
    if spec is None:
        return dtype
    name = f"int{spec.bits} experts" + (f" (g{spec.group_size})" if spec.bits == 4 else "")
    return name + (" + dense" if spec.dense else "")


def weight_bytes_per_device(config: CloverConfig, dtype: str, spec: QuantSpec | None, mesh_sharding: MeshSharding) -> int:
    """Exact bytes of the parameters one device holds."""
    itemsize = np.dtype(dtype).itemsize
    total = 0
    for path, shape in flat_layout(config).items():
        stored = spec.stored_bytes(shape) if spec is not None and spec.applies_to(path) else math.prod(shape) * itemsize
        spec_axes = mesh_sharding.spec(param_logical_axes(path))
        split = math.prod(mesh_sharding.axis_size(axis) for axis in spec_axes if axis is not None)
        total += stored // split
    return total


def expert_mesh(config: CloverConfig, num_devices: int) -> dict:
    """The default mesh for inference: experts over as many devices as divide them, the rest data."""
    expert = max(d for d in range(1, num_devices + 1) if num_devices % d == 0 and config.num_experts % d == 0)
    return {"data": num_devices // expert, "expert": expert, "tensor": 1}


def _device_memory(devices) -> tuple[int, int, str]:
    """(count, bytes per device, kind) of a homogeneous device list."""
    kinds = [d if isinstance(d, str) else d.device_kind for d in devices]
    kind = kinds[0]
    if any(k != kind for k in kinds):
        raise ValueError(f"plan() needs devices of one kind, got {sorted(set(kinds))}")
    if kind in DEVICE_MEMORY:
        return len(kinds), int(DEVICE_MEMORY[kind]), kind
    device = devices[0]
    stats = device.memory_stats() if not isinstance(device, str) and hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return len(kinds), int(stats["bytes_limit"]), kind
    if not isinstance(device, str) and device.platform == "cpu":
        return len(kinds), int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // len(kinds), "cpu"
    raise ValueError(f"unknown memory size of device kind {kind!r}; name one of {sorted(DEVICE_MEMORY)}")


def plan(path_or_config: "str | os.PathLike | CloverConfig", devices: Sequence | None = None,
         context_length: int = 32768, batch: int = 1, block_size: int = 32, chunk_size: int = 2048) -> Plan:
    """Bytes per device of every weight format on the mesh `devices` allow, and the best that fits."""
    config = path_or_config if isinstance(path_or_config, CloverConfig) else CloverConfig.from_pretrained(path_or_config)
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("plan() needs at least one device")
    count, device_bytes, kind = _device_memory(devices)
    mesh_shape = expert_mesh(config, count)
    mesh_sharding = MeshSharding(AbstractMesh(tuple(mesh_shape[a] for a in MESH_AXES), MESH_AXES), config, ShardingRules())
    state = estimate_memory(config, batch, context_length, "bfloat16", chunk_size, block_size)
    data = mesh_shape["data"]
    state_bytes = -(-(state.kv_cache + state.gdn_state + state.activations) // min(data, batch))
    options = []
    for dtype, spec in FORMATS:
        if spec is not None and spec.bits == 4 and any(
                shape[-1] % spec.group_size for path, shape in flat_layout(config).items() if spec.applies_to(path)):
            continue  # this config's input dimensions do not split into the int4 groups
        weights = weight_bytes_per_device(config, dtype, spec, mesh_sharding)
        options.append(Option(describe_format(dtype, spec), dict(mesh_shape), weights, state_bytes, device_bytes,
                              weights + state_bytes <= HEADROOM * device_bytes, spec))
    chosen = next((option for option in options if option.fits), None)
    where = f"{count} × {kind} ({device_bytes / GIB:.0f} GiB)"
    if chosen is None:
        smallest = min(options, key=lambda option: option.total_bytes)
        reason = (f"nothing fits on {where}: the smallest, {smallest.weights}, needs "
                  f"{smallest.weight_bytes / GIB:.1f} GiB weights + {smallest.state_bytes / GIB:.1f} GiB state per device; "
                  "use more devices, a shorter context or a smaller batch")
    else:
        reason = (f"{chosen.weights} on {where}: {chosen.weight_bytes / GIB:.1f} GiB weights + "
                  f"{chosen.state_bytes / GIB:.1f} GiB state per device (context {context_length}, batch {batch})")
    return Plan(options, chosen, reason)
