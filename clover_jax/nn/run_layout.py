"""The run layouts of the parameters: how a loaded model holds its layer groups while it runs.

The canonical ("stacked") layout keeps each parameter of a layer group as one array with a leading
`[num_groups]` axis (what `jax.lax.scan` runs over, what checkpoints and sharding rules describe).
The "unrolled" layout, used on the CPU (`clover_jax.nn.model.layer_loop_for`), holds each group's
parameters as their own arrays and, for large routed experts, each expert as its own buffer, so
that a one-row pass reads the chosen expert in place instead of copying it out of the stack.
`unstack_groups` and `stack_groups` convert between the two without copying on the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.params import ROUTED_EXPERT_PATHS
from clover_jax.core.passes import Params
from clover_jax.nn.expert_dispatch import stacked

# Below this many bytes per expert (its slices of every routed-expert stack of a layer) the CPU
# layout keeps the stacks: copying so small an expert costs nothing measurable (the bundled
# model's 72 KB experts decoded at the same speed either way), while each expert held apart adds
# a branch per layer to every one-row program (compile time: +0.5 s for the bundled model's
# autoregressive step, +5.7 s for the medium model's 8 layers of 32 experts of 3 MB).
PER_EXPERT_MIN_BYTES = 1 << 20


def unstack_groups(params: Params, per_expert_min_bytes: int = PER_EXPERT_MIN_BYTES) -> Params:
    """The "unrolled" layout: `params["groups"]` becomes a tuple of per-group trees without the
    group axis, each leaf its own array; a layer's routed-expert stacks become tuples of
    per-expert weights (`clover_jax.nn.expert_dispatch.per_expert`) when they are held on one CPU
    device and one expert's weights reach `per_expert_min_bytes`.

    A leaf on one CPU device is split on the host: each slice of the stacked buffer is handed to
    `device_put`, which adopts aligned host memory without copying, so the pieces share the
    stacked buffer (no copy, no compiled program); other leaves are sliced by XLA (a copy), and
    their expert stacks stay stacked.
    """
    if isinstance(params["groups"], tuple):
        return params
    leaves, treedef = jax.tree_util.tree_flatten(params["groups"])
    per_group = [[] for _ in range(leaves[0].shape[0])]
    for leaf in leaves:
        on_host = _host_view(leaf)
        for group, slices in enumerate(per_group):
            slices.append(jax.device_put(on_host[group], leaf.sharding) if on_host is not None else leaf[group])
    groups = tuple(jax.tree_util.tree_unflatten(treedef, slices) for slices in per_group)
    split = functools.partial(_split_experts, min_bytes=per_expert_min_bytes)
    return {**params, "groups": tuple(_map_expert_stacks(group, split) for group in groups)}


def _split_experts(stacks: list, min_bytes: int) -> list:
    """One layer's expert stacks (arrays or `QuantizedWeight`s) as tuples of per-expert values
    sharing their host buffers, or unchanged (a leaf not held on one CPU device, or experts of
    fewer than `min_bytes`)."""
    flat = [jax.tree_util.tree_flatten(stack) for stack in stacks]
    views = [[_host_view(leaf) for leaf in leaves] for leaves, _ in flat]
    if any(view is None for per_stack in views for view in per_stack):
        return stacks
    if sum(view[0].nbytes for per_stack in views for view in per_stack) < min_bytes:
        return stacks
    return [tuple(jax.tree_util.tree_unflatten(treedef, [jax.device_put(view[expert], leaf.sharding)
                                                        for view, leaf in zip(per_stack, leaves, strict=True)])
                  for expert in range(leaves[0].shape[0]))
            for (leaves, treedef), per_stack in zip(flat, views, strict=True)]


def _map_expert_stacks(group: dict, transform) -> dict:
    """`group` (one group's tree: {layer_k: {...}}) with each layer's routed-expert stacks replaced
    by `transform(stacks)` (a list in `ROUTED_EXPERT_PATHS` order, and one back)."""
    def found(tree, path):
        for name in path:
            if not isinstance(tree, dict) or name not in tree:
                return None
            tree = tree[name]
        return tree

    def replaced(tree, path, value):
        return value if not path else {**tree, path[0]: replaced(tree[path[0]], path[1:], value)}

    group = dict(group)
    for slot, layer in group.items():
        stacks = {path: found(layer, path) for path in ROUTED_EXPERT_PATHS}
        paths = [path for path, stack in stacks.items() if stack is not None]
        if paths:
            for path, value in zip(paths, transform([stacks[path] for path in paths]), strict=True):
                layer = replaced(layer, path, value)
            group[slot] = layer
    return group


def _host_view(leaf) -> "np.ndarray | None":
    """A NumPy view of a leaf held on one CPU device (no copy), or None (inside a trace, elsewhere)."""
    if isinstance(leaf, jax.core.Tracer):
        return None
    if not isinstance(leaf, jax.Array):
        return np.asarray(leaf)
    devices = leaf.sharding.device_set
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return None
    return np.asarray(leaf)


def stack_groups(params: Params) -> Params:
    """The canonical ("stacked") layout from either layout."""
    if not isinstance(params["groups"], tuple):
        return params
    groups = [_map_expert_stacks(group, lambda stacks: [stacked(stack) for stack in stacks])
              for group in params["groups"]]
    return {**params, "groups": jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *groups)}
