"""Where every array of a sharded train step lives (docs/parallelism.md, "Training on a mesh").

The rules on a (data, expert, tensor) mesh:

* the inference rules (`clover_jax.parallel.planner.inference_rules`): routed experts over the
  expert axis; attention and GDN heads, the shared expert and the vocabulary over the tensor axis,
  or over the expert axis when the mesh has no tensor axis;
* FSDP: every parameter, every optimizer leaf (AdamW's two moments) and a LoRA run's frozen base
  additionally split over the data axis, on the largest dimension the rules leave whole that
  divides (never a layer stack's leading `[groups]` axis, which the layer scan slices);
  XLA gathers a layer's weights where the layer runs and reduce-scatters their gradients;
* the batch: each micro-batch's rows over data x expert at the step's boundary; inside the
  model its rows split over the data axis, and each layer's work splits further over the expert
  axis by heads (attention, GDN, shared expert: the inference rules) and by experts;
* a LoRA adapter follows its weight: B [..., out, rank] as the weight's output axis, A
  [..., rank, in] as its input axis, then FSDP as above.

`TrainLayout` holds these shardings for one state, base and batch; `place` puts host arrays
there (from every process of a multi-process run alike).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from clover_jax.core.params import find_param
from clover_jax.core.quantization import QuantizedWeight, quantized_shardings
from clover_jax.core.tree_paths import get, key_names
from clover_jax.parallel.sharding import MeshSharding

# Where an offloaded base lives: page-locked host memory, which the chips read by DMA.
HOST_MEMORY = "pinned_host"

__all__ = ["HOST_MEMORY", "TrainLayout", "fsdp_spec", "layer_to_device", "leaf_spec", "place", "train_layout"]


def fsdp_spec(spec: PartitionSpec, shape: tuple[int, ...], data_axis: str, data_size: int, *,
              stacked: bool) -> PartitionSpec:
    """`spec` with `data_axis` added on the largest dimension it leaves whole that `data_size`
    divides (after the leading [groups] axis when `stacked`); unchanged when none does."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if data_size == 1 or data_axis in jax.tree_util.tree_leaves(entries):
        return PartitionSpec(*entries)
    candidates = [dim for dim in range(int(stacked), len(shape))
                  if entries[dim] is None and shape[dim] % data_size == 0 and shape[dim] >= data_size]
    if candidates:
        entries[max(candidates, key=lambda dim: shape[dim])] = data_axis
    return PartitionSpec(*entries)


def leaf_spec(mesh_sharding: MeshSharding, names: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
    """The rules' spec (before FSDP) of a parameter, LoRA factor or trained leaf at path `names`:
    a parameter's logical axes; a LoRA factor ("lora"/<weight path>/"a"|"b") its weight's output or
    input axis; "full"/<path> the parameter's; anything else (mask rows, counters) whole."""
    if names[:1] == ("lora",) and names[-1] in ("a", "b"):
        weight = _param_spec(mesh_sharding, names[1:-1])
        weight = tuple(weight) + (None,) * (len(shape) - len(weight))
        lead, out_axis, in_axis = weight[:len(shape) - 2], weight[len(shape) - 2], weight[len(shape) - 1]
        return PartitionSpec(*lead, None, in_axis) if names[-1] == "a" else PartitionSpec(*lead, out_axis, None)
    if names[:1] == ("full",):
        return _param_spec(mesh_sharding, names[1:])
    if find_param(names) is not None:
        return _param_spec(mesh_sharding, names)
    return PartitionSpec()


def _param_spec(mesh_sharding: MeshSharding, names: tuple[str, ...]) -> PartitionSpec:
    row = find_param(names)
    return PartitionSpec() if row is None else mesh_sharding.spec(row.leaf_axes)


def tree_shardings(mesh_sharding: MeshSharding, tree: Any, *, prefix: tuple[str, ...] = ()) -> Any:
    """NamedShardings for a pytree of parameters (or LoRA factors, or the frozen base with
    `QuantizedWeight`s) whose leaves have shapes: the rules' spec, then FSDP over the data axis."""
    data_axis = mesh_sharding.rules.batch
    data_size = mesh_sharding.axis_size(data_axis)

    def one(path, leaf):
        names = prefix + key_names(path)
        if isinstance(leaf, QuantizedWeight):
            float_shape = tuple(leaf.shape)
            spec = leaf_spec(mesh_sharding, names, float_shape)
            # FSDP never on the input axis: a shard of codes holds whole rows (`quantized_shardings`)
            spec = fsdp_spec(spec, float_shape[:-1], data_axis, data_size, stacked=names[:1] == ("groups",))
            return QuantizedWeight(*quantized_shardings(NamedSharding(mesh_sharding.mesh, spec), len(float_shape)))
        shape = tuple(leaf.shape)
        spec = leaf_spec(mesh_sharding, names, shape)
        stacked = "groups" in names[:2]
        return NamedSharding(mesh_sharding.mesh, fsdp_spec(spec, shape, data_axis, data_size, stacked=stacked))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))


class TrainLayout:
    """The shardings of one sharded train step: `state` (a `TrainState` of shardings), `frozen`
    (a LoRA run's base, or None), `rows` (a `TrainRows` of shardings) and `replicated`. Hashed
    by identity: one layout, one compiled step."""

    def __init__(self, mesh_sharding: MeshSharding, state: Any, frozen: Any, rows: Any):
        self.mesh_sharding = mesh_sharding
        self.state, self.frozen, self.rows = state, frozen, rows
        self.replicated = NamedSharding(mesh_sharding.mesh, PartitionSpec())

    @property
    def mesh(self):
        return self.mesh_sharding.mesh

    def batch_split(self) -> int:
        """Devices one micro-batch's rows split over (data x expert)."""
        mesh = self.mesh_sharding.mesh
        return math.prod(mesh.shape[axis] for axis in _row_axes(self.mesh_sharding))


def _row_axes(mesh_sharding: MeshSharding) -> tuple[str, ...]:
    axes = (mesh_sharding.rules.batch, mesh_sharding.rules.experts)
    return tuple(axis for axis in axes if axis is not None and mesh_sharding.axis_size(axis) > 1)


def train_layout(mesh_sharding: MeshSharding, state: Any, rows: Any, frozen: Any = None, *,
                 offload_base: bool = False) -> TrainLayout:
    """The layout of a train state (`state.TrainState`; arrays or `jax.ShapeDtypeStruct`s), a
    batch of `TrainRows` and a LoRA run's frozen base. The optimizer state's parameter-shaped
    leaves (AdamW's moments) take their parameter's sharding; its counters are replicated.
    `offload_base`: the base's stacked layers (`groups`) in host memory, same split."""
    replicated = NamedSharding(mesh_sharding.mesh, PartitionSpec())
    params = tree_shardings(mesh_sharding, state.params)
    by_shape = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        by_shape.setdefault(tuple(leaf.shape), []).append((key_names(path), leaf))
    param_paths = {key_names(path): sharding for path, sharding in jax.tree_util.tree_flatten_with_path(params)[0]}

    def optimizer_leaf(path, leaf):
        names = key_names(path)
        # optax's state nests each moment as a copy of the params tree: the param's path is a suffix
        for start in range(len(names)):
            if names[start:] in param_paths and tuple(leaf.shape) == tuple(get(state.params, names[start:]).shape):
                return param_paths[names[start:]]
        return replicated

    opt_state = jax.tree_util.tree_map_with_path(optimizer_leaf, state.opt_state)
    row_spec = lambda leaf: NamedSharding(mesh_sharding.mesh, PartitionSpec(_row_axes(mesh_sharding) or None,
                                                                            *(None,) * (leaf.ndim - 1)))
    layout_state = state._replace(step=replicated, params=params, opt_state=opt_state)
    layout_frozen = None if frozen is None else tree_shardings(mesh_sharding, frozen)
    if offload_base and layout_frozen is not None:
        layout_frozen = {name: _in_host_memory(frozen[name], tree) if name == "groups" else tree
                         for name, tree in layout_frozen.items()}
    return TrainLayout(mesh_sharding, layout_state, layout_frozen, jax.tree_util.tree_map(row_spec, rows))


def layer_to_device(mesh_sharding: MeshSharding, slot: str, params: dict) -> dict:
    """One decoder layer's parameters as a pass runs them (the scan's slices of the stacks, LoRA
    factors beside them) with every base parameter copied to device memory in the split it has in
    host memory (`tree_shardings`; a no-op for those already on the chips).

    No optimization barrier after the copy: one lets the TPU compiler gather the FSDP-split expert
    stacks only on the chips (without it, it gathers some in host memory: more host bytes), and at
    8 layers that helped (v5e-8, 4,096 tokens: 17.43 -> 15.57 GiB a chip), but every 40-layer step
    measured was larger with it: v5e-8 (8, 1, 1) 16.33 -> 18.73 GiB, (4, 2, 1) with remat
    "layer_offload" 14.09 -> 14.66 GiB (the limit is 14.40), v6e-1 QLoRA 18.25 -> 18.61 GB."""
    prefix = ("groups", slot)

    def one(path, leaf):
        names = prefix + key_names(path)
        if find_param(names) is None:  # a LoRA factor (trained, on the chips already)
            return leaf
        stacked = jax.tree_util.tree_map(lambda part: jax.ShapeDtypeStruct((1,) + part.shape, part.dtype), leaf)
        sharding = tree_shardings(mesh_sharding, stacked, prefix=names)
        return jax.tree_util.tree_map(
            lambda part, placed: jax.device_put(part, NamedSharding(placed.mesh, PartitionSpec(*placed.spec[1:]),
                                                                    memory_kind="device")), leaf, sharding)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))


def _in_host_memory(stacks: Any, shardings: Any) -> Any:
    """The shardings of the stacked matrices ([groups, ..., rows, columns], rows a multiple of 8) in
    host memory. The rest — vectors per layer ([groups, dim]: norms, decay rates) and single-row
    matrices (the shared expert's gate [groups, 1, hidden]) — stays on the chips: a TPU copies host
    memory in whole tiles of packed rows (8 rows hold any packing down to int4; "Sublane slicing
    size must be multiple of element packing factor" otherwise), and they are kilobytes."""
    def one(leaf, sharding):
        offloaded = len(leaf.shape) >= 3 and leaf.shape[-2] % 8 == 0
        return sharding.with_memory_kind(HOST_MEMORY) if offloaded else sharding

    return jax.tree_util.tree_map(one, stacks, shardings)


def place(tree: Any, shardings: Any) -> Any:
    """Host (or single-device) arrays put on their shardings; every process passes the whole
    array and keeps the shards of its own devices (`jax.make_array_from_callback`)."""
    def one(leaf, sharding):
        host = np.asarray(jax.device_get(leaf))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(one, tree, shardings)
