"""The causal prefix held as state (docs/design.md §3), and where the rows of a pass sit in it.

A `ModelState` has a static capacity (the K/V cache length) and a traced fill `length`, so
one compiled pass serves every prefix length up to the capacity. Sequences of a batch share
the cache index space; sequence `b` starts at cache index `start[b]` (left padding that
lines up blocks across a batch), and its RoPE position of cache index `c` is `c - start[b]`.
Rows before `start[b]` leave the state exactly as if absent. `length` is one fill for the
whole batch, or one per sequence (int32 [batch]) once a rollback (`clover_jax.nn.rollback`) has
kept a different number of rows for each; a pass then writes each sequence's rows at its own fill.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.config import CloverConfig


def slot_name(slot: int) -> str:
    """Name of the `slot`-th layer inside a scanned layer group."""
    return f"layer_{slot}"


class GDNState(NamedTuple):
    """conv: [batch, K-1, conv_dim] (model dtype), the last K-1 pre-convolution rows;
    recurrent: float32 [batch, value_heads, key_dim, value_dim]."""

    conv: jax.Array
    recurrent: jax.Array


class KVCache(NamedTuple):
    """key, value: [batch, capacity, kv_heads, head_dim]; keys are stored already rotated."""

    key: jax.Array
    value: jax.Array


class GDNRecord(NamedTuple):
    """What a causal pass of T rows leaves so that a GDN layer's state can be restored at any of
    its rows (`clover_jax.nn.rollback`); every leaf has a leading [num_groups] axis.

    window: [batch, K-1 + T, conv_dim] (model dtype), the conv state before the pass, then the
    pass's pre-convolution rows; initial: float32 [batch, value_heads, key_dim, value_dim], the
    recurrent state before the pass; key: float32 [batch, T, key_heads, key_dim] (L2-normalised);
    value: float32 [batch, T, value_heads, value_dim]; decay, beta: float32 [batch, T, value_heads]
    — the gated delta rule's inputs, row by row.
    """

    window: jax.Array
    initial: jax.Array
    key: jax.Array
    value: jax.Array
    decay: jax.Array
    beta: jax.Array


class RecordingGDN(NamedTuple):
    """A GDN layer's state in a recording pass: the state, advanced as by any causal pass, and
    the record that pass fills (`clover_jax.nn.rollback.recording`)."""

    state: GDNState
    record: GDNRecord


class ModelState(NamedTuple):
    """length: int32 [] (cache rows filled) or int32 [batch] (each sequence's own fill, see the
    module docstring); start: int32 [batch], first real row of each sequence;
    layers: {slot name: GDNState | KVCache}, every leaf with a leading [num_groups] axis
    (a GDN layer is a `RecordingGDN` inside a recording pass)."""

    length: jax.Array
    start: jax.Array
    layers: dict[str, Any]

    @property
    def capacity(self) -> int:
        for layer in self.layers.values():
            if isinstance(layer, KVCache):
                return layer.key.shape[2]
        return 2**31 - 1  # no attention layer: GDN state has no length limit

    @property
    def batch(self) -> int:
        return self.start.shape[0]


class Rows(NamedTuple):
    """Where the `tokens` rows of one pass sit: cache index `length + i` for row i.

    length: int32 [] or [batch], as `ModelState.length`; positions: int32 [batch, tokens] RoPE
    positions; valid: bool [batch, tokens] (False before start); committed: None when every
    sequence appends all the pass's causal rows, else int32 [batch], the causal rows each sequence
    appends (all or none of them, see `rows_for`).
    """

    length: jax.Array
    start: jax.Array
    positions: jax.Array
    valid: jax.Array
    committed: jax.Array | None = None


def rows_for(state: ModelState, num_tokens: int, num_causal: int = 0, commit: jax.Array | None = None) -> Rows:
    """The rows of a pass of `num_tokens` rows whose first `num_causal` are causal.

    commit: None, or bool [batch]: which sequences append the causal rows. A sequence that does
    not leaves its state as it is; its causal rows are computed and discarded, and its block rows
    sit right after its prefix, where the causal rows would have gone (`length` becomes per sequence).
    """
    offsets = jnp.arange(num_tokens, dtype=jnp.int32)
    committed = None
    length = state.length
    if commit is not None:
        length = jnp.broadcast_to(state.length, commit.shape)
        committed = jnp.where(commit, num_causal, 0).astype(jnp.int32)
        offsets = jnp.where(offsets < num_causal, offsets, offsets - (num_causal - committed)[:, None])
    cache_index = jnp.reshape(length, (-1, 1)) + offsets  # [1 or b, t]
    positions = cache_index - state.start[:, None]
    return Rows(length, state.start, jnp.maximum(positions, 0), positions >= 0, committed)


def empty_state(config: CloverConfig, batch: int, capacity: int, dtype, start=None) -> ModelState:
    """A state with nothing in it; `start` (int [batch]) marks left padding, default none."""
    groups = config.num_groups
    layers = {}
    for slot, layer_type in enumerate(config.group_pattern):
        if layer_type == "linear_attention":
            layers[slot_name(slot)] = GDNState(
                conv=jnp.zeros((groups, batch, config.linear_conv_kernel_dim - 1, config.conv_dim), dtype),
                recurrent=jnp.zeros((groups, batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                     config.linear_value_head_dim), jnp.float32))
        else:
            shape = (groups, batch, capacity, config.num_key_value_heads, config.head_dim)
            layers[slot_name(slot)] = KVCache(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype))
    start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    return ModelState(length=jnp.zeros((), jnp.int32), start=start, layers=layers)
