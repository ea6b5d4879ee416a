"""Will it fit? The arithmetic half of `clover_jax.plan`: bytes per device for each weight format
on the mesh a target allows, plus the state for a context and batch.

Weight bytes are exact: every parameter's shape (`param_layout`) times its stored width
(bfloat16 2 bytes; int8 1 byte + a bfloat16 scale per output row; int4 half a byte + a bfloat16
scale per group), divided by the devices its sharding spreads it over (`MeshSharding`, the same
rules the loader applies). State and activations come from `clover_jax.parallel.memory.estimate_memory`,
split as the mesh splits the axes they grow with. The compiler's own figures, when asked for, are added by
`clover_jax.api.plan` (which compiles the decoding loops for the target) and then decide `fits`.

The mesh for inference: routed experts split over as many devices as divide them (expert
parallelism), the rest of the devices over the batch; on that same expert axis the dense weights
(embedding, LM head, attention and GDN heads, shared expert) are split by their heads or rows
(`inference_rules`), so that no device holds a whole copy of what is not an expert.

Targets are names from `clover_jax.parallel.targets` ("v6e-1", "v5e-8", "H200", ...) or, as
before, a list of jax devices or device-kind names from `DEVICE_MEMORY` ("TPU v6e", "H200").
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout
from clover_jax.core.quantization import QuantSpec
from clover_jax.parallel.memory import estimate_memory
from clover_jax.parallel.sharding import MESH_AXES, MeshSharding, ShardingRules, param_logical_axes
from clover_jax.parallel.targets import Target, target as named_target

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
    """One weight format on one mesh. Bytes are per device. `compiled` is None unless the plan
    compiled its programs: then {program name, e.g. "diffusion"} → the compiler's bytes or its error
    (`clover_jax.api.compile.program_memory.ProgramMemory`), and `fits` follows it.
    Load it with `CloverModel.from_pretrained(path, mesh=make_mesh(**option.mesh), rules=option.rules,
    quantize=option.quantize)`."""

    weights: str             # "bfloat16", "int8 experts", ...
    mesh: dict               # {"data": 1, "expert": n, "tensor": 1}
    weight_bytes: int        # per device
    state_bytes: int         # per device: K/V cache + GDN state + activations (arithmetic estimate)
    device_bytes: int        # memory of one device a program may use
    fits: bool
    quantize: QuantSpec | None = None  # what to pass as `CloverModel.from_pretrained(quantize=...)`
    rules: ShardingRules = ShardingRules()
    compiled: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        """The arithmetic estimate of one device's bytes."""
        return self.weight_bytes + self.state_bytes

    def notes(self) -> str:
        """What follows the option's row in a printed plan (a train step's choices, `TrainOption`)."""
        return ""

    @property
    def compiled_bytes(self) -> int | None:
        """The compiler's bytes for the largest of the compiled loops, or None (not compiled, or refused)."""
        if not self.compiled or any(memory.error for memory in self.compiled.values()):
            return None
        return max(memory.total_bytes for memory in self.compiled.values())


@dataclasses.dataclass(frozen=True)
class Plan:
    options: list[Option]
    recommendation: Option | None
    reason: str
    target: str = ""

    def __str__(self) -> str:
        compiled = any(option.compiled is not None for option in self.options)
        header = f"{'weights':<28} {'mesh (d,e,t)':<13} {'weights/dev':>12} {'state/dev':>10} {'estimate':>10}"
        lines = [header + (f" {'compiled':>10}" if compiled else "") + f" {'fits':>5}"]
        for option in self.options:
            mesh = ",".join(str(option.mesh[axis]) for axis in MESH_AXES)
            line = (f"{option.weights:<28} {mesh:<13} {option.weight_bytes / GIB:>9.2f}GiB "
                    f"{option.state_bytes / GIB:>7.2f}GiB {option.total_bytes / GIB:>7.2f}GiB")
            if compiled:
                line += f" {_compiled_cell(option):>10}"
            line += f" {'yes' if option.fits else 'no':>5}" + option.notes()
            lines.append(line)
            errors: dict[str, list[str]] = {}
            for mode, memory in (option.compiled or {}).items():
                if memory.error:
                    errors.setdefault(memory.error, []).append(mode)
            lines += [f"    {', '.join(modes)}: {error}" for error, modes in errors.items()]
        return "\n".join(lines + [self.reason])


def _compiled_cell(option: Option) -> str:
    if option.compiled is None:
        return "-"
    if option.compiled_bytes is None:
        return "refused"
    return f"{option.compiled_bytes / GIB:.2f}GiB"


def describe_format(dtype: str, spec: QuantSpec | None) -> str:
    if spec is None:
        return dtype
    name = f"int{spec.bits} experts" + (f" (g{spec.group_size})" if spec.bits == 4 else "")
    return name + (" + dense" if spec.dense else "")


def weight_bytes_per_device(config: CloverConfig, dtype: str, spec: QuantSpec | None,
                            mesh_sharding: MeshSharding) -> int:
    """Exact bytes of the parameters one device holds."""
    itemsize = np.dtype(dtype).itemsize
    total = 0
    for path, shape in flat_layout(config).items():
        quantized = spec is not None and spec.applies_to(path)
        stored = spec.stored_bytes(shape) if quantized else math.prod(shape) * itemsize
        spec_axes = tuple(mesh_sharding.spec(param_logical_axes(path))) + (None,) * len(shape)
        # a quantised weight's input axis is never split (`quantization.quantized_shardings`)
        spec_axes = spec_axes[:len(shape) - 1] if quantized else spec_axes
        split = math.prod(mesh_sharding.axis_size(axis) for axis in spec_axes if axis is not None)
        total += stored // split
    return total


def expert_mesh(config: CloverConfig, num_devices: int) -> dict:
    """The default mesh for inference: experts over as many devices as divide them, the rest data."""
    expert = max(d for d in range(1, num_devices + 1) if num_devices % d == 0 and config.num_experts % d == 0)
    return {"data": num_devices // expert, "expert": expert, "tensor": 1}


def inference_rules(mesh_shape: dict) -> ShardingRules:
    """Sharding rules for an inference mesh: on a mesh without a tensor axis, the dense weights'
    heads, rows and vocabulary are split over the expert axis (XLA gathers them where a layer
    needs them whole), so that no device keeps a full copy of what is not an expert."""
    if mesh_shape["tensor"] > 1 or mesh_shape["expert"] == 1:
        return ShardingRules()
    return ShardingRules(q_heads="expert", kv_heads="expert", value_heads="expert", mlp="expert", vocab="expert")


def resolve_target(target: "str | Target | Sequence | None") -> tuple[Target | None, int, int, str]:
    """(named target or None, device count, usable bytes per device, description)."""
    if isinstance(target, str):
        target = named_target(target)
    if isinstance(target, Target):
        return target, target.chips, target.usable_bytes, target.describe()
    devices = list(jax.devices() if target is None else target)
    if not devices:
        raise ValueError("plan() needs a target name or at least one device")
    count, device_bytes, kind = _device_memory(devices)
    return None, count, device_bytes, f"{count} × {kind} ({device_bytes / GIB:.0f} GiB)"


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


def estimate(config: CloverConfig, target: "str | Target | Sequence | None" = None, context_length: int = 32768,
             batch: int = 1, block_size: int = 32, chunk_size: int = 2048) -> Plan:
    """Bytes per device of every weight format on the mesh the target allows, and the best that fits
    by this arithmetic (`clover_jax.plan` adds the compiler's figures on request)."""
    if context_length < 1 or batch < 1:
        raise ValueError(f"context_length and batch must be >= 1, got {context_length} and {batch}")
    _, count, device_bytes, where = resolve_target(target)
    mesh_shape = expert_mesh(config, count)
    rules = inference_rules(mesh_shape)
    mesh_sharding = MeshSharding(AbstractMesh(tuple(mesh_shape[a] for a in MESH_AXES), MESH_AXES), config, rules)
    state = estimate_memory(config, batch, context_length, "bfloat16", chunk_size, block_size, mesh_sharding)
    state_bytes = state.kv_cache + state.gdn_state + state.activations
    options = []
    layout = flat_layout(config)
    for dtype, spec in FORMATS:
        if spec is not None:
            try:
                spec = spec.fitted(layout)
            except ValueError:
                continue  # this config's input widths do not split into int4 groups
        weights = weight_bytes_per_device(config, dtype, spec, mesh_sharding)
        options.append(Option(describe_format(dtype, spec), dict(mesh_shape), weights, state_bytes, device_bytes,
                              weights + state_bytes <= HEADROOM * device_bytes, spec, rules))
    return decide(options, where, context_length, batch)


def decide(options: list[Option], where: str, context_length: int, batch: int) -> Plan:
    """The plan of these options: the first that fits is recommended, with the reason in words."""
    chosen = next((option for option in options if option.fits), None)
    by = lambda option: "by the compiler" if option.compiled is not None else "estimated"
    if chosen is None:
        smallest = min(options, key=lambda option: option.total_bytes)
        reason = (f"nothing fits on {where}: the smallest, {smallest.weights}, needs "
                  f"{smallest.weight_bytes / GIB:.1f} GiB weights + {smallest.state_bytes / GIB:.1f} GiB state per "
                  "device; use more devices, a shorter context or a smaller batch")
    else:
        needed = chosen.compiled_bytes if chosen.compiled is not None else chosen.total_bytes
        reason = (f"{chosen.weights} on {where}: {chosen.weight_bytes / GIB:.1f} GiB weights + "
                  f"{chosen.state_bytes / GIB:.1f} GiB state per device (context {context_length}, batch {batch}); "
                  f"{needed / GIB:.1f} GiB of {chosen.device_bytes / GIB:.1f} GiB per device {by(chosen)}")
    return Plan(options, chosen, reason, where)
