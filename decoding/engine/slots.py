"""Slots: the batch axis of an engine lane, and the programs that write, gather and prefill them.

A lane's device state is a pytree whose every leaf has one slot axis: axis 1 for the prefix
state's layers (`[groups, slots, ...]`, `clover_jax.core.state`), axis 0 for everything else
(`ModelState.length` and `start` included: a lane's fill is per slot). `slot_axes` names it for
each leaf, so one `put_slots` joins requests into any lane and one `take_slots` resizes any lane.

The engine's programs are plain `jax.jit` (JAX's persistent compilation cache keeps them across
processes) rather than `clover_jax.core.executable_cache.persistent_jit`, whose per-call work
(describing every argument's pytree) would be paid on every step of a lane, every few milliseconds.

Prefill (`prefill_chunk`) runs a prompt's causal passes on a one-sequence *staging* state with
the lane's capacity, chunk by chunk: the engine interleaves those chunks with the lanes' steps,
so a long prompt never stalls the requests already decoding. A prompt is cut into chunks whose
lengths are `unit` times a power of two, at most `chunk` (`chunk_plan`), so the compiled chunk
shapes form a small fixed set, and nothing is padded but the first `unit` rows.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.passes import ModelPasses
from clover_jax.core.state import KVCache, ModelState
from decoding.controls import choose, per_sequence_axes


def slot_axes(tree: Any) -> Any:
    """The slot axis of every leaf of a lane's state (see the module docstring)."""
    def axes(node):
        if isinstance(node, ModelState):
            return ModelState(0, 0, jax.tree_util.tree_map(lambda _: 1, node.layers))
        return jax.tree_util.tree_map(lambda _: 0, node)

    return jax.tree_util.tree_map(axes, tree, is_leaf=lambda node: isinstance(node, ModelState))


def one_slot(state: ModelState) -> ModelState:
    """A staging state as one slot of a lane: its `length` with the slot axis ([1])."""
    return state if state.length.shape == (1,) else state._replace(length=jnp.reshape(state.length, (1,)))


def stack_entries(entries: list) -> tuple[Any, tuple, tuple]:
    """Entries of one slot each (the lane's pytree, every leaf with a slot axis of 1) as the
    arguments of `put_slots`: (their tree structure, their leaves, which leaves are NumPy). NumPy
    leaves (a request's controls, schedule, progress, ...) are stacked here on the host, so a join
    of k requests transfers each leaf once rather than k times; device leaves (prefix states,
    logits, keys) stay as tuples of k arrays and are stacked inside `put_slots`."""
    flat = [jax.tree_util.tree_flatten(entry) for entry in entries]
    treedef = flat[0][1]
    axes = jax.tree_util.tree_leaves(slot_axes(entries[0]))
    leaves, on_host = [], []
    for position, axis in enumerate(axes):
        values = [leaves_of[position] for leaves_of, _ in flat]
        host = all(isinstance(value, (np.ndarray, np.generic)) for value in values)
        leaves.append(np.concatenate(values, axis=axis) if host else tuple(values))
        on_host.append(host)
    return treedef, tuple(leaves), tuple(on_host)


@functools.partial(jax.jit, static_argnames=("treedef", "on_host"), donate_argnames=("slots",))
def put_slots(slots: Any, indices: jax.Array, treedef: Any, leaves: tuple, on_host: tuple) -> Any:
    """`slots` with slot `indices[j]` (int32 [k]) replaced by entry j of `stack_entries`' output.
    An entry's K/V caches may hold fewer rows than the lane's: they fill the slot's first rows, and
    the rows after them (past the request's fill) are never read. An index may repeat with the
    same entry (a join padded to a power of two).

    The engine passes entries whose caches `at_rows` brought to the lane's rows, so a program
    depends on the lane's shape (slots, rows) and the padded count k alone: ⌈log2(slots)⌉ + 1 per
    lane shape, whatever cache buckets the joining requests' staging states had and in whatever
    order they come (unpadded entries still join, with a program per combination of their rows)."""
    axes = jax.tree_util.tree_leaves(slot_axes(treedef.unflatten([0] * treedef.num_leaves)))

    def stacked(leaf, host, axis):
        if host:
            return jnp.asarray(leaf)
        shape = np.max([value.shape for value in leaf], axis=0)
        return jnp.concatenate([_padded(value, shape) for value in leaf], axis=axis)

    entries = treedef.unflatten([stacked(leaf, host, axis)
                                 for leaf, host, axis in zip(leaves, on_host, axes, strict=True)])

    def put(full, some, axis):
        shape = list(full.shape)
        shape[axis] = some.shape[axis]
        where = (slice(None),) * axis + (indices,)
        return full.at[where].set(_padded(some, shape).astype(full.dtype))

    return jax.tree_util.tree_map(put, slots, entries, slot_axes(slots))


def _padded(value: jax.Array, shape) -> jax.Array:
    """`value` padded at the end of each axis to `shape` (zeros; no axis is cut)."""
    return jnp.pad(value, [(0, int(size) - now) for size, now in zip(shape, value.shape, strict=True)]) \
        if tuple(value.shape) != tuple(shape) else value


@functools.partial(jax.jit, static_argnames=("capacity",))
def take_slots(slots: Any, indices: jax.Array, capacity: int) -> Any:
    """A lane of `len(indices)` slots of `capacity` cache rows: slot i is `slots`' slot `indices[i]`
    (int32 [new slots]), its K/V caches cut or padded to `capacity` rows (the engine never cuts a
    row a request still needs)."""
    def take(node, axis):
        return jnp.take(node, indices, axis=axis)

    taken = jax.tree_util.tree_map(take, slots, slot_axes(slots))
    return jax.tree_util.tree_map(lambda node: _with_rows(node, capacity) if isinstance(node, ModelState) else node,
                                  taken, is_leaf=lambda node: isinstance(node, ModelState))


def _with_rows(state: ModelState, capacity: int) -> ModelState:
    """`state` with its K/V caches ([groups, slots, rows, ...]) cut or zero-padded to `capacity` rows."""
    layers = {}
    for name, layer in state.layers.items():
        if isinstance(layer, KVCache):
            rows = layer.key.shape[2]
            cut = lambda a, rows=rows: a[:, :, :capacity] if rows >= capacity else jnp.pad(
                a, [(0, 0), (0, 0), (0, capacity - rows)] + [(0, 0)] * (a.ndim - 3))
            layer = KVCache(cut(layer.key), cut(layer.value))
        layers[name] = layer
    return state._replace(layers=layers)


def cache_rows(state: ModelState) -> int | None:
    """The rows of a prefix state's K/V caches (None: it has none, a GDN-only model)."""
    for layer in state.layers.values():
        if isinstance(layer, KVCache):
            return layer.key.shape[2]
    return None


@functools.partial(jax.jit, static_argnames=("capacity",))
def pad_rows(state: ModelState, capacity: int) -> ModelState:
    """A one-slot prefix state (a staging state as `one_slot` makes it) with its K/V caches
    zero-padded at the end to `capacity` rows; the rows it held keep their places. One program per
    (staging bucket, lane rows) with the bucket below the rows: b(b - 1)/2 for b cache buckets."""
    return _with_rows(state, capacity)


def at_rows(entry: Any, capacity: int) -> Any:
    """A join's entry (one slot of a lane's pytree) with its prefix state's K/V caches at the
    lane's `capacity` rows (`pad_rows` where it holds fewer; NumPy leaves untouched), so that
    `put_slots` compiles one program per lane shape and joining count, not one per combination of
    the joining requests' cache buckets. Padding to the lane's rows rather than to the largest
    bucket among the joining entries: the join's program then depends on no entry at all (padding
    to the largest would still key it by that bucket, one program per lane shape, count and smaller
    bucket), and `put_slots` writes each slot's full rows either way (it pads inside); the cost is
    one copy of each padded entry at the lane's rows, all k of them alive while `put_slots` stacks
    them: a join of k requests into a lane of R rows briefly holds about 2k slots of R rows of
    K/V (the copies and their stack) beside the lane. ValueError for an entry holding more rows
    than the lane (the lane must grow first)."""
    def fit(node):
        if not isinstance(node, ModelState):
            return node
        rows = cache_rows(node)
        if rows is None or rows == capacity:
            return node
        if rows > capacity:
            raise ValueError(f"an entry of {rows} cache rows cannot join a lane of {capacity} rows")
        return pad_rows(node, capacity)

    return jax.tree_util.tree_map(fit, entry, is_leaf=lambda node: isinstance(node, ModelState))


def capacity_bucket(rows: int, max_context: int, smallest: int = 64) -> int:
    """Cache rows for a lane whose requests need up to `rows`: the next power of two (at least
    `smallest`), or `max_context` above it. A lane's step reads its whole cache when it is short
    (`clover_jax.nn.online_attention` reads up to 1024 keys in one block; fused attention reads
    all), so a lane holds about what its requests need, not the model's whole context."""
    return min(max(smallest, 1 << max(rows - 1, 0).bit_length()), max(max_context, rows))


def chunk_plan(length: int, unit: int, chunk: int) -> tuple[int, list[int]]:
    """How to prefill `length` tokens: (left padding, chunk lengths in order).

    The padding brings the length to a multiple of `unit`; every chunk is `unit` times a power of
    two and at most `chunk` (a multiple of `unit`): whole chunks first, then the binary digits of the
    rest, largest first. So at most log2(chunk / unit) + 1 shapes ever compile.
    """
    if length <= 0:
        return 0, []
    padding = (-length) % unit
    units, per_chunk = (length + padding) // unit, max(1, chunk // unit)
    sizes = [per_chunk * unit] * (units // per_chunk)
    rest = units % per_chunk
    sizes += [(1 << bit) * unit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]
    return padding, sizes


@functools.partial(jax.jit, static_argnames=("passes", "capacity"))
def empty_staging(passes: ModelPasses, capacity: int, start: jax.Array) -> ModelState:
    """A one-sequence prefix state of `capacity` rows, `start` (int32 [1]) rows of left padding."""
    return passes.new_state(1, capacity, start)


@functools.partial(jax.jit, static_argnames=("passes",), donate_argnames=("state",))
def prefill_chunk(passes: ModelPasses, params: Any, ids: jax.Array, state: ModelState) -> tuple[jax.Array, ModelState]:
    """Append one chunk (int32 [1, n]) to a staging state; returns (the last row's logits float32
    [1, vocab], the state)."""
    out = passes.causal(params, ids, state, logits_from=ids.shape[1] - 1)
    return out.logits[:, -1], out.state


def per_slot_choice(controls, sampling: jax.Array, sample: bool):
    """choose(processed [S, rows, V], keys [S]) -> Choice [S, rows] for a lane whose slots each
    decode greedily or by sampling (`sampling`: bool [S]; `sample`: some slot samples, else every
    slot takes the greedy choice alone). controls: [S] each."""
    def choose_rows(processed, keys):
        greedy = jax.vmap(lambda rows: choose(rows, controls, False, None))(processed)
        if not sample:
            return greedy
        sampled = jax.vmap(lambda rows, key, c: choose(rows, c, True, key),
                           in_axes=(0, 0, per_sequence_axes(controls)))(processed, keys, controls)
        return jax.tree_util.tree_map(lambda g, s: jnp.where(sampling[:, None], s, g), greedy, sampled)
    return choose_rows
