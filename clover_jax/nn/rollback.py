"""Rolling a causal pass back to any of its rows, without re-running the model (docs/design.md §8).

Self-speculative decoding appends a drafted block causally to verify it, then keeps only the
rows it accepted — a different number for each sequence of a batch. A *recording* pass is a
causal pass over `recording(state, config, rows)`: the same layer code as every causal pass,
which also leaves, per GDN layer, what restoring its state at any of its rows needs.
`rolled_back(state, keep, rows)` then gives each sequence the state of a causal pass over its
first `keep` rows only:

* attention: nothing to undo in the cache. The sequence's fill (`ModelState.length`, now one
  per sequence) becomes `keep` rows past the pass's start; rows beyond it are masked from every
  later query and overwritten by the next pass.
* GDN conv state: the last K-1 pre-convolution rows up to `keep`, a slice of the recorded
  window (the conv state before the pass, then the pass's rows).
* GDN recurrent state: the chunked delta rule rerun from the recorded initial state over the
  recorded per-row key, value, decay and beta, with the rows from `keep` on made inert (decay 0
  keeps the state, beta 0 writes nothing). No projection, convolution or MoE runs again.

Why per-row inputs and not per-row states: a recurrent state holds value_heads × key_dim ×
value_dim floats — 2 MiB per layer for Clover-35B (32 × 128 × 128) — so keeping one per row of
a 32-row pass would take 64 MiB per GDN layer and sequence (1.9 GiB over its 30 GDN layers),
while the inputs take key_heads·key_dim + value_heads·(value_dim + 2) floats a row (24 KiB),
and rerunning the rule over B ≤ 64 rows is one chunk of it per layer: a few einsums over
[B, key_dim] × [B, value_dim] per head, against the projections and experts of a whole pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.core.config import CloverConfig
from clover_jax.core.kernels import KernelChoice
from clover_jax.core.state import GDNRecord, GDNState, ModelState, RecordingGDN
from clover_jax.nn.gated_delta import chunked_gated_delta_rule


def recording(state: ModelState, config: CloverConfig, rows: int) -> ModelState:
    """`state` with an empty record in every GDN layer, for a causal pass of `rows` rows."""
    layers = {}
    for name, layer in state.layers.items():
        if not isinstance(layer, GDNState):
            layers[name] = layer
            continue
        groups, batch, conv_rows, conv_dim = layer.conv.shape
        heads = config.linear_num_value_heads
        zeros = lambda *shape, dtype=jnp.float32, lead=(groups, batch): jnp.zeros(lead + shape, dtype)
        layers[name] = RecordingGDN(layer, GDNRecord(
            window=zeros(conv_rows + rows, conv_dim, dtype=layer.conv.dtype),
            initial=jnp.zeros_like(layer.recurrent),
            key=zeros(rows, config.linear_num_key_heads, config.linear_key_head_dim),
            value=zeros(rows, heads, config.linear_value_head_dim),
            decay=zeros(rows, heads), beta=zeros(rows, heads)))
    return state._replace(layers=layers)


def rolled_back(state: ModelState, keep: jax.Array, rows: int, kernels: KernelChoice) -> ModelState:
    """The state after a recording pass of `rows` causal rows, restored per sequence to its first
    `keep` rows (int [batch], each in 0..rows). `length` comes back per sequence (int32 [batch]).
    kernels: the model's choice, whose GDN rule chunked the recording pass: the rerun chunks alike."""
    keep = jnp.asarray(keep, jnp.int32)
    layers = {name: _restored(layer.record, keep, kernels) if isinstance(layer, RecordingGDN) else layer
              for name, layer in state.layers.items()}
    length = jnp.broadcast_to(state.length, keep.shape) - rows + keep
    return ModelState(length=length, start=state.start, layers=layers)


def _restored(record: GDNRecord, keep: jax.Array, kernels: KernelChoice) -> GDNState:
    """One GDN slot (all groups) at `keep` rows of its recording pass."""
    rows = record.key.shape[2]
    conv_rows = record.window.shape[2] - rows
    index = keep[:, None] + jnp.arange(conv_rows)                                  # [b, K-1]
    conv = jnp.take_along_axis(record.window, index[None, :, :, None], axis=2)     # [groups, b, K-1, conv_dim]
    live = (jnp.arange(rows)[None, :] < keep[:, None])[None, :, :, None]           # [1, b, rows, 1]
    decay, beta = jnp.where(live, record.decay, 0.0), jnp.where(live, record.beta, 0.0)
    chunk = kernels.gdn_rule(rows).chunk_size  # as the recording pass chunked its rows

    def final_state(key, value, decay, beta, initial):
        return chunked_gated_delta_rule(key, key, value, decay, beta, initial, chunk_size=chunk)[1]

    recurrent = jax.vmap(final_state)(record.key, record.value, decay, beta, record.initial)
    return GDNState(conv=conv, recurrent=recurrent)
