"""A Gated DeltaNet layer's training pass: the clean stream and the noisy blocks in one call.

Each noisy block gets exactly what a denoising forward of that block after its example's clean
prefix gets (docs/design.md §3), computed for every block at once:

* the causal conv of a noisy row reads the *clean* stream's last K−1 pre-conv rows before its
  block (zeros before the example's first row; for B < K−1 they reach back over several blocks)
  and the noisy rows of its own block; the right-context branch reads its block's noisy rows only;
* the memory readout reads the recurrent state after the clean row before its block: the clean
  stream runs the chunked rule with chunks that end on block boundaries (the XLA rule
  `gated_delta_rule_with_block_states`, or the Pallas kernel `gdn_chunk_with_block_states` where
  the kernel choice says so), so every block boundary is a chunk boundary and its state is exact;
* the clean stream itself is the causal pass of §1, every example starting from zero state and
  a zero conv window (`clover_jax.core.streams`).

The conv and the block-mode attention are the decoding pass's own functions, applied to the
gathered windows and states, so both passes compute the same thing the same way.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from clover_jax.core.streams import StreamMode, Streams
from clover_jax.nn.short_conv import causal_depthwise_conv, right_context_conv


def causal_conv_with_resets(rows: jax.Array, weight: jax.Array, segment: jax.Array) -> jax.Array:
    """`causal_depthwise_conv`, each example starting from a zero
    window. rows: [b, L, channels]; weight: [channels, K]; segment: int [b, L] -> [b, L, channels]."""
    kernel = weight.shape[-1]
    length = rows.shape[1]

    def back(shift: int) -> jax.Array:
        """Row p - shift where it belongs to row p's example, else zeros."""
        if shift == 0:
            return rows
        moved = jnp.pad(rows, ((0, 0), (shift, 0), (0, 0)))[:, :length]
        same = jnp.pad(segment, ((0, 0), (shift, 0)), constant_values=-1)[:, :length] == segment
        return jnp.where(same[..., None], moved, 0).astype(rows.dtype)

    # Tap j reads row p - (K-1-j), summed in the order the decoding conv sums its window.
    return sum(back(kernel - 1 - j) * weight[:, j] for j in range(kernel))


def noisy_windows(clean: jax.Array, noisy: jax.Array, streams: Streams, block_size: int, kernel: int) -> jax.Array:
    """The conv window of every noisy block: the clean stream's K−1 rows before the block (zeros
    outside its example), then the block's noisy rows.

    clean: [b, L, channels]; noisy: [b, N, B, channels] -> [b, N, K-1 + B, channels]
    """
    before = streams.block_index[:, :, None] * block_size - (kernel - 1) + jnp.arange(kernel - 1)  # [b, N, K-1]
    inside = before >= 0
    safe = jnp.where(inside, before, 0)
    batch, blocks = safe.shape[:2]
    rows = jnp.take_along_axis(clean, safe.reshape(batch, -1)[..., None], axis=1).reshape(
        batch, blocks, kernel - 1, clean.shape[-1])
    same = inside & (jnp.take_along_axis(streams.segment, safe.reshape(batch, -1), axis=1).reshape(safe.shape)
                     == streams.block_segment[:, :, None])
    return jnp.concatenate([jnp.where(same[..., None], rows, 0).astype(noisy.dtype), noisy], axis=2)


def two_stream_core(
    mixed: jax.Array,
    beta_logit: jax.Array,
    decay_logit: jax.Array,
    streams: Streams,
    mode: StreamMode,
    *,
    block_rule: Callable,
    conv_weight: jax.Array,
    right_weight: jax.Array,
    split_qkv: Callable,
    repeat: Callable,
    decay_of: Callable,
    block_mode: Callable,
) -> jax.Array:
    """The token mixer's core output for both streams, before the gated norm.

    mixed: [b, L + N*B, conv_dim] (`in_proj_qkv`, model dtype); beta_logit, decay_logit:
    [b, L + N*B, value_heads]; block_rule: the gated delta rule with the state before every block
    (`gdn.gated_delta_rule_with_blocks`: (q, k, v, decay, beta, resets) -> (outputs, states));
    the other callables are the layer's own (`GatedDeltaNet`): the q/k/v split
    with L2 norms, the key-head repeat, the log decay g, the block-mode attention with its
    parameters. returns float32 [b, L + N*B, value_heads, value_dim]
    """
    batch, length = streams.segment.shape
    block_size, blocks = mode.block_size, streams.num_blocks
    kernel = conv_weight.shape[-1]
    clean = mixed[:, :length]
    noisy = mixed[:, length:].reshape(batch, blocks, block_size, mixed.shape[-1])

    # The clean stream: the causal pass, restarting at each example, with the state at every block start.
    query, key, value = split_qkv(jax.nn.silu(causal_conv_with_resets(clean, conv_weight, streams.segment)))
    decay = decay_of(decay_logit[:, :length])
    resets = streams.example_starts()[:, ::block_size]
    clean_core, states = block_rule(query * query.shape[-1] ** -0.5, key, value, decay,
                                    jax.nn.sigmoid(beta_logit[:, :length]), resets)

    if not blocks:  # next-token training: the clean stream alone
        return clean_core
    # The noisy blocks: block mode against the clean prefix of their example.
    windows = noisy_windows(clean, noisy, streams, block_size, kernel).reshape(batch * blocks, -1, mixed.shape[-1])
    flat_noisy = noisy.reshape(batch * blocks, block_size, -1)
    activated = jax.nn.silu(causal_depthwise_conv(windows, conv_weight) + right_context_conv(flat_noisy, right_weight))
    query, key, value = split_qkv(activated)
    memory = jnp.take_along_axis(states, streams.block_index[:, :, None, None, None], axis=1)
    noisy_core = block_mode(repeat(query), repeat(key), value.astype(jnp.float32),
                            memory.reshape((batch * blocks,) + memory.shape[2:]))
    noisy_core = noisy_core.reshape(batch, blocks * block_size, *noisy_core.shape[2:])
    return jnp.concatenate([clean_core, noisy_core], axis=1)
