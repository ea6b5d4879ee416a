"""Logical axis names for every parameter and state array, and the one rules object that maps
them to the mesh axes `data`, `expert` and `tensor`.

Each array dimension has a logical name (`batch`, `experts`, `q_heads`, `kv_heads`,
`value_heads`, `mlp`, `vocab`, or None for "never sharded"); a parameter's names are its row's
`axes` in the parameter table (`clover_jax.core.params`). `ShardingRules` maps a logical
name to a mesh axis; `MeshSharding` applies the rules to a config and a mesh:

* a dimension is sharded only when its *unit count* divides evenly (`q_heads` counts attention
  heads, not the `heads × 2 × head_dim` rows that hold them), so a shard always holds whole
  heads; heads fewer than (or not divisible by) the tensor axis are replicated, not refused —
  Clover has 2 K/V heads;
* experts that do not divide over the expert axis, and a batch that does not divide over the
  data axis, are refused: replicating them would silently multiply memory or work.

Parallelism: routed experts are expert-parallel inside `shard_map` (see `clover_jax.nn.moe`);
attention and GDN heads and the shared expert are tensor-parallel through these annotations,
with XLA's SPMD partitioner inserting the collectives; the batch is data-parallel.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout, nested
from clover_jax.core.params import find_param
from clover_jax.core.quantization import QuantizedWeight, QuantSpec, quantized_shardings
from clover_jax.core.ragged import KVPages, PagedState
from clover_jax.core.state import GDNState, KVCache, ModelState

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "expert", "tensor")


def param_logical_axes(path: tuple[str, ...]) -> tuple[str | None, ...]:
    """Logical axis names of the parameter at `path` (as in `clover_jax.core.param_layout`); layer
    parameters lead with "layers", their [num_groups] axis, which is never sharded."""
    row = find_param(path)
    if row is None:
        raise KeyError(f"no logical axes for parameter {'/'.join(path)}")
    return row.leaf_axes


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None: replicated). Change a field to change the strategy,
    e.g. `ShardingRules(vocab=None)` keeps the embedding and LM head whole on every device."""

    batch: str | None = "data"
    experts: str | None = "expert"
    q_heads: str | None = "tensor"
    kv_heads: str | None = "tensor"
    value_heads: str | None = "tensor"
    mlp: str | None = "tensor"
    vocab: str | None = "tensor"

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None or logical == "layers":
            return None
        return getattr(self, logical)


def make_mesh(data: int = 1, expert: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, expert, tensor) mesh over `devices` (default: all). One size may be -1: the rest."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, expert, tensor]
    if sizes.count(-1) > 1 or any(size == 0 or size < -1 for size in sizes):
        raise ValueError(f"mesh sizes must be positive, with at most one -1; got data={data}, "
                         f"expert={expert}, tensor={tensor}")
    known = math.prod(size for size in sizes if size != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices do not divide into data × expert × tensor with the "
                             f"fixed sizes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh data={sizes[0]} × expert={sizes[1]} × tensor={sizes[2]} = {math.prod(sizes)} "
                         f"devices, but {len(devices)} are available")
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class MeshSharding:
    """Rules applied to one config and one mesh; hashable, so it can be a static module field."""

    mesh: Mesh
    config: CloverConfig
    rules: ShardingRules = ShardingRules()

    def __post_init__(self):
        missing = {axis for axis in dataclasses.astuple(self.rules) if axis is not None} - set(self.mesh.axis_names)
        if missing:
            raise ValueError(f"sharding rules name mesh axes {sorted(missing)} that the mesh "
                             f"{dict(self.mesh.shape)} does not have")
        experts = self.axis_size(self.rules.experts)
        if self.config.num_experts % experts:
            raise ValueError(f"num_experts={self.config.num_experts} does not divide over the mesh axis "
                             f"'{self.rules.experts}' of size {experts}; choose an expert axis size that "
                             f"divides {self.config.num_experts}")

    def axis_size(self, axis: str | None) -> int:
        return 1 if axis is None else self.mesh.shape[axis]

    def _units(self, logical: str) -> int:
        config = self.config
        return {"experts": config.num_experts, "q_heads": config.num_attention_heads,
                "kv_heads": config.num_key_value_heads, "value_heads": config.linear_num_value_heads,
                "mlp": config.shared_expert_intermediate_size, "vocab": config.vocab_size}[logical]

    def spec(self, logical_axes: tuple[str | None, ...], batch: int | None = None) -> PartitionSpec:
        """PartitionSpec for logical axes; a dimension whose units do not divide is replicated
        (refused for `batch`)."""
        entries = []
        for logical in logical_axes:
            axis = self.rules.mesh_axis(logical)
            size = self.axis_size(axis)
            if axis is None or size == 1:
                entries.append(None)
                continue
            if logical == "batch":
                if batch is not None and batch % size:
                    raise ValueError(f"batch {batch} does not divide over the mesh axis '{axis}' of size {size}; "
                                     f"use a batch that is a multiple of {size}")
                entries.append(axis)
                continue
            units = self._units(logical)
            if units % size:
                logger.debug("%s: %d units do not divide over '%s' (%d); replicated", logical, units, axis, size)
                entries.append(None)
            else:
                entries.append(axis)
        return PartitionSpec(*entries)

    def sharding(self, logical_axes: tuple[str | None, ...], batch: int | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, batch))

    def param_sharding(self, path: tuple[str, ...], shape: tuple[int, ...] | None = None) -> NamedSharding:
        """Sharding of the parameter at `path` (usable as `weights.load_params(sharding_for=...)`)."""
        return self.sharding(param_logical_axes(path))

    def param_shardings(self) -> dict[tuple[str, ...], NamedSharding]:
        return {path: self.param_sharding(path) for path in flat_layout(self.config)}

    def state_shardings(self, state: ModelState) -> ModelState:
        """Shardings for a `ModelState` (a pytree of the same structure)."""
        batch = state.start.shape[0]
        layers = {}
        for name, layer in state.layers.items():
            if isinstance(layer, KVCache):
                cache = self.sharding(("layers", "batch", None, "kv_heads", None), batch)
                layers[name] = KVCache(cache, cache)
            else:
                layers[name] = GDNState(conv=self.sharding(("layers", "batch", None, None), batch),
                                        recurrent=self.sharding(("layers", "batch", "value_heads", None, None), batch))
        return ModelState(length=self.sharding(()), start=self.sharding(("batch",), batch), layers=layers)

    def paged_state_shardings(self, state: PagedState) -> PagedState:
        """Shardings for the serving engine's `PagedState` (a pytree of the same structure): pages
        and slot states over the heads' axis, slots and pages whole on every device."""
        layers = {}
        for name, layer in state.layers.items():
            if isinstance(layer, KVPages):
                pages = self.sharding(("layers", None, "kv_heads", None, None))
                layers[name] = KVPages(pages, pages)
            else:
                layers[name] = GDNState(conv=self.sharding(("layers", None, None, None)),
                                        recurrent=self.sharding(("layers", None, "value_heads", None, None)))
        return PagedState(layers)

    def replicated(self) -> NamedSharding:
        """Whole on every device (the engine's per-slot decoding state)."""
        return NamedSharding(self.mesh, PartitionSpec())

    def abstract_params(self, dtype: Any, quantize: "QuantSpec | None" = None) -> dict:
        """The parameter pytree as `jax.ShapeDtypeStruct`s in `dtype`, each with its sharding, and
        the weights `quantize` applies to as `QuantizedWeight`s of values and scales: what
        compiling a program for this mesh needs, without allocating anything."""
        layout = flat_layout(self.config)
        spec = None if quantize is None else quantize.fitted(layout)
        leaves = {}
        for path, shape in layout.items():
            sharding = self.param_sharding(path)
            if spec is not None and spec.applies_to(path):
                values_shape, scales_shape = spec.stored_shapes(shape)
                values_dtype, scales_dtype = spec.stored_dtypes()
                values_sharding, scales_sharding = quantized_shardings(sharding, len(shape))
                leaves[path] = QuantizedWeight(
                    jax.ShapeDtypeStruct(values_shape, values_dtype, sharding=values_sharding),
                    jax.ShapeDtypeStruct(scales_shape, scales_dtype, sharding=scales_sharding))
            else:
                leaves[path] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        return nested(leaves)

    def batch_sharding(self, batch: int, rank: int) -> NamedSharding:
        """Sharding of a [batch, ...] input of `rank` dimensions: batch over the data axis."""
        return self.sharding(("batch",) + (None,) * (rank - 1), batch)


def constrain_state(state: ModelState, mesh_sharding: MeshSharding | None) -> ModelState:
    """Inside jit: pin a state to its shardings (a no-op on one device)."""
    if mesh_sharding is None:
        return state
    return jax.lax.with_sharding_constraint(state, mesh_sharding.state_shardings(state))


def constrain_paged_state(state: PagedState, mesh_sharding: MeshSharding | None) -> PagedState:
    """Inside jit: pin the serving engine's paged state to its shardings (a no-op on one device)."""
    if mesh_sharding is None:
        return state
    return jax.lax.with_sharding_constraint(state, mesh_sharding.paged_state_shardings(state))


def constrain_batch(array: Any, mesh_sharding: MeshSharding | None) -> Any:
    """Inside jit: pin a [batch, ...] array to the data axis (a no-op on one device)."""
    if mesh_sharding is None:
        return array
    return jax.lax.with_sharding_constraint(array, mesh_sharding.batch_sharding(array.shape[0], array.ndim))

