"""Gated DeltaNet token mixer (transformers' `Qwen3_5MoeGatedDeltaNet`) with Clover's block mode.

Causal rows (prefill, commits, autoregressive steps), docs/design.md §1:

    in_proj_qkv -> causal depthwise conv (kernel K, no bias) -> SiLU -> q | k | v
    beta = sigmoid(in_proj_b x);  g = -exp(A_log) * softplus(in_proj_a x + dt_bias)
    q, k L2-normalised, q scaled by key_dim ** -0.5; gated delta rule (float32 state)
    gated RMSNorm with z = in_proj_z x, then out_proj

Block rows (the denoising forward), docs/design.md §3, read the state without changing it:

    silu(causal conv over [conv state; block] + right-context conv over the following rows)
    memory readout m_i = Sᵀ (q̂_i / sqrt(dk));  block logits l_ij = exp(block_logit_scale) q̂_i · k̂_j
    memory logit μ = memory_logit_bias + block_size_calibration · ln(B)
    o_i = (e^μ m_i + Σ_j e^{l_ij} v_j) / (e^μ + Σ_j e^{l_ij})

A pass holds `num_causal` causal rows and then an optional block that reads the state left by
those rows, so a commit and the next block's first denoising step are one call. Given a
`RecordingGDN` state (`clover_jax.nn.rollback.recording`), the causal rows also record their
pre-convolution rows and the delta rule's per-row inputs, from which `clover_jax.nn.rollback`
restores the state at any of them (self-speculative decoding).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import linen as nn
from jax.sharding import PartitionSpec

from clover_jax.core.config import CloverConfig
from clover_jax.core.kernels import GDNRule, KernelChoice
from clover_jax.core.passes import PassMode
from clover_jax.core.ragged import (
    COMPACT_PLATFORMS,
    PagedBatch,
    RaggedMode,
    gather_rows,
    on_live,
    scatter_rows,
    slots_first,
)
from clover_jax.core.state import GDNRecord, GDNState, RecordingGDN, Rows
from clover_jax.core.streams import StreamMode
from clover_jax.nn.gated_delta import (
    chunked_gated_delta_rule,
    gated_delta_rule_with_block_states,
    recurrent_gated_delta_rule,
)
from clover_jax.nn.gdn_streams import two_stream_core
from clover_jax.nn.layers import GatedRMSNorm, Linear, l2_normalize, table_param
from clover_jax.nn.short_conv import causal_depthwise_conv, right_context_conv
from clover_jax.parallel.sharding import MeshSharding
from pallas_kernels.gdn_chunk_xla import slot_chunk_scan


def block_mode_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, state: jax.Array,
    block_logit_scale: jax.Array, memory_logit_bias: jax.Array, block_size_calibration: jax.Array,
    lengths: jax.Array | None = None,
) -> jax.Array:
    """Softmax over the block plus one memory slot read from the prefix state, all float32.

    query, key: L2-normalised, unscaled, [batch, block, value_heads, key_dim]
    value: [batch, block, value_heads, value_dim]; state: [batch, value_heads, key_dim, value_dim]
    the three Clover parameters: [value_heads]
    lengths: None (every row of the block is one), or int32 [batch]: each sequence's block size
    B, its rows past B padding that no row attends to (the serving engine's blocks of several sizes)
    returns [batch, block, value_heads, value_dim]
    """
    block = query.shape[1]
    key_dim = query.shape[-1]
    memory = jnp.einsum("bihk,bhkv->bihv", query / math.sqrt(key_dim), state, precision=jax.lax.Precision.HIGHEST)
    block_logits = jnp.exp(block_logit_scale)[:, None, None] * jnp.einsum(
        "bihk,bjhk->bhij", query, key, precision=jax.lax.Precision.HIGHEST)         # [b, h, i, j]
    if lengths is None:
        memory_logit = memory_logit_bias + block_size_calibration * math.log(block)   # [h]
        memory_logit = jnp.broadcast_to(memory_logit[None, :, None, None], block_logits.shape[:3] + (1,))
    else:
        size = jnp.maximum(lengths, 1).astype(jnp.float32)[:, None]
        memory_logit = (memory_logit_bias + block_size_calibration * jnp.log(size))[:, :, None, None]  # [b, h, 1, 1]
        memory_logit = jnp.broadcast_to(memory_logit, block_logits.shape[:3] + (1,))
        inside = jnp.arange(block)[None, :] < lengths[:, None]                           # [b, j]
        block_logits = jnp.where(inside[:, None, None, :], block_logits, -jnp.inf)
    logits = jnp.concatenate([memory_logit, block_logits], axis=-1)               # [b, h, i, 1 + j]
    weights = jax.nn.softmax(logits, axis=-1)
    return (jnp.einsum("bhi,bihv->bihv", weights[..., 0], memory)
            + jnp.einsum("bhij,bjhv->bihv", weights[..., 1:], value, precision=jax.lax.Precision.HIGHEST))


def gated_delta_rule(rule: GDNRule):
    """The function a resolved rule (`KernelChoice.gdn_rule`) names: (q, k, v, decay, beta,
    initial state) -> (outputs, final state), with the rule's chunk size and interpret flag."""
    if rule.kernel == "recurrent":  # one row, an autoregressive step: no chunk padding
        return recurrent_gated_delta_rule
    if rule.kernel == "pallas":
        from pallas_kernels import gdn_chunk  # imported on use: Pallas costs startup time on CPU

        return functools.partial(gdn_chunk, chunk_size=rule.chunk_size, interpret=rule.interpret)
    return functools.partial(chunked_gated_delta_rule, chunk_size=rule.chunk_size)


def gated_delta_rule_with_blocks(rule: GDNRule, block_size: int):
    """The function a training pass's rule (`KernelChoice.block_states_rule`) names: (q, k, v, decay,
    beta, resets) -> (outputs, states before each block), from a zero state, restarting where
    `resets` (bool [batch, blocks]) says; differentiable either way."""
    if rule.kernel == "pallas":
        from pallas_kernels import gdn_chunk_with_block_states

        def kernel(query, key, value, decay, beta, resets):
            out, _, states = gdn_chunk_with_block_states(query, key, value, decay, beta, block_size=block_size,
                                                         resets=resets, chunk_size=rule.chunk_size,
                                                         interpret=rule.interpret)
            return out, states

        return kernel
    return lambda *args: gated_delta_rule_with_block_states(*args[:5], block_size=block_size, resets=args[5])


def on_mesh(rule, mesh_sharding: MeshSharding, batch: int, key_heads: int, value_heads: int,
            block_states: bool = False):
    """`rule` (a gated-delta-rule kernel) run per device inside `shard_map`: XLA's partitioner
    cannot split a Pallas custom call, so the kernel sees its device's sequences and heads. Heads
    are split over the axis the rules give value heads when both head counts divide it; a key
    head's value heads are consecutive, so the shards keep their pairing."""
    batch_size = mesh_sharding.axis_size(mesh_sharding.rules.batch)
    batch_axis = mesh_sharding.rules.batch if batch_size > 1 and batch % batch_size == 0 else None
    heads_axis = mesh_sharding.rules.value_heads
    size = mesh_sharding.axis_size(heads_axis)
    heads_axis = heads_axis if size > 1 and key_heads % size == 0 and value_heads % size == 0 else None
    heads = PartitionSpec(batch_axis, None, heads_axis, None)
    per_token = PartitionSpec(batch_axis, None, heads_axis)
    state = PartitionSpec(batch_axis, heads_axis, None, None)
    if block_states:  # (q, k, v, decay, beta, resets) -> (outputs, states [b, blocks, h, dk, dv])
        in_specs = (heads, heads, heads, per_token, per_token, PartitionSpec(batch_axis, None))
        out_specs = (heads, PartitionSpec(batch_axis, None, heads_axis, None, None))
    else:
        in_specs, out_specs = (heads, heads, heads, per_token, per_token, state), (heads, state)
    return jax.shard_map(rule, mesh=mesh_sharding.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


class GatedDeltaNet(nn.Module):
    TABLE_SCOPE: ClassVar = (True, ("linear_attn",))  # its rows in the parameter table

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelChoice = KernelChoice()
    mesh_sharding: MeshSharding | None = None

    @nn.compact
    def __call__(self, x: jax.Array, stacked: GDNState | RecordingGDN, group, rows: Rows,
                 mode: PassMode) -> tuple[jax.Array, GDNState | RecordingGDN]:
        """x: [batch, tokens, hidden] -> ([batch, tokens, hidden], `stacked` with this layer's state
        advanced by the causal rows); mode: which leading rows are causal, the rest a block.

        stacked: this slot's GDN state for every group (leading [num_groups] axis); group: ours.
        A `RecordingGDN` comes back with our group's record filled from the causal rows.
        """
        config = self.config
        heads = config.linear_num_value_heads
        mixed = Linear(config, self.dtype, name="in_proj_qkv")(x)       # [b, t, conv_dim]
        gate = Linear(config, self.dtype, name="in_proj_z")(x)          # [b, t, value_dim]
        beta_logit = Linear(config, self.dtype, name="in_proj_b")(x)    # [b, t, value_heads]
        decay_logit = Linear(config, self.dtype, name="in_proj_a")(x)   # [b, t, value_heads]
        kernel = config.linear_conv_kernel_dim
        conv_weight, dt_bias, a_log = (table_param(self, config, name)
                                       for name in ("conv1d_weight", "dt_bias", "A_log"))
        # Clover block-mode parameters (docs/design.md §2; initialised to their defaults)
        right_weight, block_logit_scale, memory_logit_bias, block_size_calibration = (
            table_param(self, config, name) for name in ("conv1d_right_weight", "block_logit_scale",
                                                         "memory_logit_bias", "block_size_calibration"))

        def split_qkv(activated):
            query, key, value = jnp.split(activated, [config.linear_key_dim, 2 * config.linear_key_dim], axis=-1)
            query = l2_normalize(
                rearrange(query, "b t (h d) -> b t h d", d=config.linear_key_head_dim).astype(jnp.float32))
            key = l2_normalize(rearrange(key, "b t (h d) -> b t h d", d=config.linear_key_head_dim).astype(jnp.float32))
            return query, key, rearrange(value, "b t (h d) -> b t h d", d=config.linear_value_head_dim)

        repeat = lambda y: jnp.repeat(y, heads // config.linear_num_key_heads, axis=2)
        decay_of = lambda logit: -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
            logit.astype(jnp.float32) + dt_bias.astype(jnp.float32))
        block_mode = functools.partial(
            block_mode_attention, block_logit_scale=block_logit_scale.astype(jnp.float32),
            memory_logit_bias=memory_logit_bias.astype(jnp.float32),
            block_size_calibration=block_size_calibration.astype(jnp.float32))

        if isinstance(mode, StreamMode):  # a training pass: both streams, no state (clover_jax.core.streams)
            mixed = mixed.astype(self.dtype)
            rule = self.kernels.block_states_rule(mode.block_size)
            block_rule = gated_delta_rule_with_blocks(rule, mode.block_size)
            if rule.kernel == "pallas" and self.mesh_sharding is not None:
                block_rule = on_mesh(block_rule, self.mesh_sharding, x.shape[0], config.linear_num_key_heads, heads,
                                     block_states=True)
            core = two_stream_core(mixed, beta_logit, decay_logit, rows, mode, block_rule=block_rule,
                                   conv_weight=conv_weight,
                                   right_weight=right_weight, split_qkv=split_qkv, repeat=repeat, decay_of=decay_of,
                                   block_mode=block_mode)
            return self._output(core, gate), None

        # Rows before a sequence's start are padding: zero rows leave conv and recurrent state as if absent.
        mixed = jnp.where(rows.valid[..., None], mixed, 0).astype(self.dtype)
        if isinstance(mode, RaggedMode):  # the serving engine's pass (clover_jax.core.ragged): states in slots
            return self._ragged(mixed[0], gate, beta_logit[0], decay_logit[0], stacked, group, rows,
                                conv_weight=conv_weight, right_weight=right_weight, split_qkv=split_qkv,
                                repeat=repeat, decay_of=decay_of, block_mode=block_mode)
        causal, cores = mode.num_causal, []
        record = None
        if isinstance(stacked, RecordingGDN):
            stacked, record = stacked
            if record.key.shape[2] != causal:
                raise ValueError(f"the record holds {record.key.shape[2]} rows but the pass has {causal} causal rows")
        put = lambda all_groups, ours: jax.lax.dynamic_update_index_in_dim(
            all_groups, ours.astype(all_groups.dtype), group, 0)
        state = jax.tree_util.tree_map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, group, keepdims=False), stacked)

        if causal:
            window = jnp.concatenate([state.conv.astype(self.dtype), mixed[:, :causal]], axis=1)
            query, key, value = split_qkv(jax.nn.silu(causal_depthwise_conv(window, conv_weight)))
            beta = jax.nn.sigmoid(beta_logit[:, :causal])
            decay = decay_of(decay_logit[:, :causal])
            rule = gated_delta_rule(self.kernels.gdn_rule(causal))
            if self.kernels.gdn_rule(causal).kernel == "pallas" and self.mesh_sharding is not None:
                rule = on_mesh(rule, self.mesh_sharding, x.shape[0], config.linear_num_key_heads, heads)
            core, recurrent = rule(query * config.linear_key_head_dim ** -0.5, key, value, decay, beta,
                                   state.recurrent)
            if record is not None:
                record = jax.tree_util.tree_map(put, record,
                                                GDNRecord(window, state.recurrent, key, value, decay, beta))
            advanced = GDNState(conv=window[:, window.shape[1] - (kernel - 1):], recurrent=recurrent)
            if rows.committed is not None:  # sequences that skip this commit keep their state
                if record is not None:
                    raise ValueError("a recording pass appends its rows for every sequence")
                keep = rows.committed > 0
                advanced = jax.tree_util.tree_map(
                    lambda new, old: jnp.where(keep.reshape((-1,) + (1,) * (new.ndim - 1)), new, old.astype(new.dtype)),
                    advanced, state)
            state = advanced
            stacked = jax.tree_util.tree_map(put, stacked, state)
            cores.append(core)

        if x.shape[1] > causal:
            block = mixed[:, causal:]
            window = jnp.concatenate([state.conv.astype(self.dtype), block], axis=1)
            activated = jax.nn.silu(causal_depthwise_conv(window, conv_weight)
                                    + right_context_conv(block, right_weight))
            query, key, value = split_qkv(activated)
            cores.append(block_mode(repeat(query), repeat(key), value.astype(jnp.float32), state.recurrent))

        core = jnp.concatenate(cores, axis=1) if len(cores) > 1 else cores[0]
        return self._output(core, gate), stacked if record is None else RecordingGDN(stacked, record)

    def _ragged(self, mixed: jax.Array, gate: jax.Array, beta_logit: jax.Array, decay_logit: jax.Array,
                stacked: GDNState, group, batch: PagedBatch, *, conv_weight, right_weight, split_qkv, repeat,
                decay_of, block_mode) -> tuple[jax.Array, GDNState]:
        """A ragged pass: each slot's causal segment runs the gated delta rule from the slot's
        state (in chunks that start at the segment's first row, `slot_chunk_scan`) and, where it
        writes, advances the slot's conv window and recurrent state; then each slot's block rows
        run in block mode against the state its causal segment left.

        mixed: [T, conv_dim] (padding rows zero); gate: [1, T, value_dim]; beta_logit, decay_logit:
        [T, value_heads]; stacked: every group's slot states ([num_groups, S, ...] leaves)."""
        config = self.config
        kernel = config.linear_conv_kernel_dim
        state = jax.tree_util.tree_map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, group, keepdims=False), stacked)
        window_rows = kernel - 1

        # The causal conv of every row: rows of its own segment before it, then its slot's conv window.
        conv = mixed * conv_weight[:, window_rows]
        rows = jnp.arange(mixed.shape[0])
        for tap in range(window_rows):
            back = window_rows - tap                                               # rows back this tap reads
            inside = batch.offset >= back
            from_rows = gather_rows(mixed, jnp.where(inside, rows - back, mixed.shape[0]))
            from_window = state.conv[batch.slot, jnp.clip(window_rows - back + batch.offset, 0, window_rows - 1)]
            conv = conv + jnp.where(inside[:, None], from_rows, from_window.astype(mixed.dtype)) * conv_weight[:, tap]
        query, key, value = split_qkv(jax.nn.silu(conv)[None])
        beta, decay = jax.nn.sigmoid(beta_logit), decay_of(decay_logit)
        chunked = lambda values: gather_rows(values, batch.chunk_rows)
        count = jnp.sum(batch.chunk_rows[:, 0] < mixed.shape[0])  # chunks holding rows come first
        out, recurrent = slot_chunk_scan(chunked(query[0] * config.linear_key_head_dim ** -0.5), chunked(key[0]),
                                         chunked(value[0]), chunked(decay), chunked(beta), state.recurrent,
                                         chunk_slot=batch.chunk_slot, chunk_first=batch.chunk_first, count=count)
        core = scatter_rows(jnp.zeros((mixed.shape[0],) + out.shape[2:], jnp.float32), batch.chunk_rows, out)

        # Each writing slot's conv window after its segment: the last K-1 rows of [window; segment].
        advances = (batch.writes & (batch.causal_length > 0))[:, None]                        # [S, 1]
        offsets = batch.causal_length[:, None] - window_rows + jnp.arange(window_rows)[None, :]  # [S, K-1]
        from_rows = gather_rows(mixed, jnp.where(offsets >= 0, batch.causal_start[:, None] + offsets, mixed.shape[0]))
        from_window = jnp.take_along_axis(state.conv, jnp.clip(window_rows + offsets, 0, window_rows - 1)[..., None],
                                          axis=1)
        new_conv = jnp.where((offsets >= 0)[..., None], from_rows, from_window.astype(mixed.dtype))
        state = GDNState(conv=jnp.where(advances[..., None], new_conv, state.conv).astype(state.conv.dtype),
                         recurrent=jnp.where(advances[..., None, None], recurrent, state.recurrent))

        # Block rows: block mode against the state each slot's causal segment left (its block of B_s
        # rows padded to Bmax with zero rows, which the right-context conv reads as past the block).
        # On a CPU only the slots with a block run (`on_live`): a lone request's block is one slot's work.
        num_slots = batch.block_length.shape[0]
        order = slots_first(batch.block_length > 0)

        def blocks(width: int) -> jax.Array:
            chosen = order[:width] if width < num_slots else slice(None)
            block_rows = batch.block_rows[chosen]
            block = gather_rows(mixed, block_rows)                                             # [w, Bmax, ch]
            window = jnp.concatenate([state.conv[chosen].astype(mixed.dtype), block], axis=1)
            activated = jax.nn.silu(causal_depthwise_conv(window, conv_weight)
                                    + right_context_conv(block, right_weight))
            query, key, value = split_qkv(activated)
            block_core = block_mode(repeat(query), repeat(key), value.astype(jnp.float32), state.recurrent[chosen],
                                    lengths=batch.block_length[chosen])
            return scatter_rows(core, block_rows, block_core)

        core = on_live(jnp.sum(batch.block_length > 0), num_slots, blocks,
                       compact=self.kernels.platform in COMPACT_PLATFORMS, empty=core)
        put = lambda all_groups, ours: jax.lax.dynamic_update_index_in_dim(
            all_groups, ours.astype(all_groups.dtype), group, 0)
        return self._output(core[None], gate), jax.tree_util.tree_map(put, stacked, state)

    def _output(self, core: jax.Array, gate: jax.Array) -> jax.Array:
        """The gated RMSNorm with z, then `out_proj`. core: float32 [b, t, value_heads, value_dim];
        gate: [b, t, value_dim] -> [b, t, hidden]."""
        config = self.config
        gate = rearrange(gate, "b t (h d) -> b t h d", d=config.linear_value_head_dim)
        normed = GatedRMSNorm(config, self.dtype, name="norm")(core.astype(self.dtype), gate)
        return Linear(config, self.dtype, name="out_proj")(rearrange(normed, "b t h d -> b t (h d)"))
