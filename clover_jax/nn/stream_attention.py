"""Full attention over a training pass's two streams (`clover_jax.core.streams`).

Queries are every row of both streams, keys are of two kinds, folded into one float32 softmax
with `online_attention`'s running sums:

* the clean stream's keys: a clean row sees its example's rows up to itself (causal); a noisy
  row of block k sees its example's clean rows before k (the prefix `denoise_logits` holds);
* a noisy block's own keys: each noisy row sees every row of its block (bidirectional), never
  another block's — computed block by block, so this part costs `N·B²`, not `(N·B)²`.

The clean part is one masked product over all keys ([rows, L] scores per head): what a small
model trained on CPU needs. A kernel with a backward pass that never holds the scores is the
scale work (docs/training.md, "what fits where").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from clover_jax.nn.online_attention import Running, absorb


def two_stream_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, clean_length: int,
                         block_size: int, clean_mask: jax.Array) -> jax.Array:
    """query: [b, L + N*B, heads, head_dim]; key, value: [b, L + N*B, kv_heads, head_dim] (rotated);
    clean_mask: bool [b, L + N*B, L] (`Streams.clean_attention_mask`) -> [b, L + N*B, heads, head_dim].
    Key/value heads serve consecutive query heads; a row that sees no key gets zeros."""
    batch, rows, _, head_dim = query.shape
    kv_heads = key.shape[2]
    blocks = (rows - clean_length) // block_size
    grouped = rearrange(query, "b t (k g) d -> b t k g d", k=kv_heads) * head_dim ** -0.5
    group = grouped.shape[3]
    running = Running(jnp.full((batch, kv_heads, group, rows), -jnp.inf, jnp.float32),
                      jnp.zeros((batch, kv_heads, group, rows), jnp.float32),
                      jnp.zeros((batch, kv_heads, group, rows, head_dim), jnp.float32))
    running = absorb(running, grouped, key[:, :clean_length], value[:, :clean_length], clean_mask)
    if blocks:
        running = _absorb_own_blocks(running, grouped, key, value, clean_length=clean_length, block_size=block_size)
    out = running.weighted / jnp.where(running.total > 0, running.total, 1.0)[..., None]
    return rearrange(out, "b k g t d -> b t (k g) d").astype(query.dtype)


def _absorb_own_blocks(running: Running, grouped: jax.Array, key: jax.Array, value: jax.Array, *, clean_length: int,
                       block_size: int) -> Running:
    """`running` with each noisy row's own block absorbed (every row of the block)."""
    batch = grouped.shape[0]
    blocks = (grouped.shape[1] - clean_length) // block_size

    # Each noisy block's own keys: its rows become a batch of their own.
    per_block = lambda x: rearrange(x[:, clean_length:], "b (n c) ... -> (b n) c ...", c=block_size)
    noisy_stats = lambda x: rearrange(x[..., clean_length:], "b k g (n c) -> (b n) k g c", c=block_size)
    noisy = Running(noisy_stats(running.peak), noisy_stats(running.total),
                    rearrange(running.weighted[..., clean_length:, :], "b k g (n c) d -> (b n) k g c d",
                              c=block_size))
    noisy = absorb(noisy, per_block(grouped), per_block(key), per_block(value),
                   jnp.ones((batch * blocks, block_size, block_size), bool))
    back = lambda x: rearrange(x, "(b n) k g c ... -> b k g (n c) ...", b=batch)
    clean = lambda x: x[:, :, :, :clean_length]
    return Running(*(jnp.concatenate([clean(whole), back(part)], axis=3)
                     for whole, part in zip(running, noisy, strict=True)))
