"""Gated grouped-query attention of the full-attention layers (transformers' `Qwen3_5MoeAttention`).

`q_proj` yields `2 * heads * head_dim` features: per head the first `head_dim` are the query,
the next `head_dim` the output gate. q and k pass a zero-centred RMSNorm over `head_dim`, then
partial RoPE; the attention output is multiplied by `sigmoid(gate)` before `o_proj`.

One pass handles `num_causal` causal rows followed by an optional block (spec §3):
  * causal rows append their K/V to the cache and attend causally to it;
  * block rows attend to the whole prefix in the cache (after the causal rows) and
    bidirectionally to each other; their K/V are not written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import linen as nn

from clover_jax.config import CloverConfig
from clover_jax.layers import Linear, RMSNorm
from clover_jax.rope import apply_partial_rope, rope_angles
from clover_jax.state import KVCache, Rows


def attention_over_segments(query: jax.Array, segments: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Softmax attention over several key/value segments at once, as if they were concatenated.

    query: [batch, q_tokens, heads, head_dim]; each segment is (key, value, allowed) with
    key, value: [batch, kv_tokens, kv_heads, head_dim] and allowed: bool [batch, q_tokens, kv_tokens].
    Key/value heads serve consecutive query heads. Scores, max and sums are float32.
    returns [batch, q_tokens, heads, head_dim]
    """
    num_kv_heads = segments[0][0].shape[2]
    grouped = rearrange(query, "b t (k g) d -> b t k g d", k=num_kv_heads)
    scale = query.shape[-1] ** -0.5
    scores = []
    for key, _, allowed in segments:
        score = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=jnp.float32) * scale
        scores.append(jnp.where(allowed[:, None, None], score, -jnp.inf))
    peak = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)[..., None]
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = [jnp.exp(s - peak) for s in scores]
    total = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
    # A padding row may see no key at all: it gets zeros, not NaN, because NaN values would
    # poison later rows through 0 * NaN even where the padding is masked out.
    total = jnp.where(total > 0, total, 1.0)
    out = sum(jnp.einsum("bkgts,bskd->btkgd", (w / total).astype(value.dtype), value)
              for w, (_, value, _) in zip(weights, segments))
    return rearrange(out, "b t k g d -> b t (k g) d")


class GatedAttention(nn.Module):
    config: CloverConfig
    dtype: jnp.dtype = jnp.float32
    num_causal: int = 0  # leading rows that are causal and appended; the rest form a block

    @nn.compact
    def __call__(self, x: jax.Array, cache: KVCache, rows: Rows) -> tuple[jax.Array, KVCache]:
        """x: [batch, tokens, hidden] -> ([batch, tokens, hidden], cache with the causal rows appended)."""
        config = self.config
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        split_heads = lambda y, h: rearrange(y, "b t (h d) -> b t h d", h=h)
        query, gate = jnp.split(split_heads(Linear(2 * heads * head_dim, self.dtype, name="q_proj")(x), heads), 2, -1)
        key = split_heads(Linear(kv_heads * head_dim, self.dtype, name="k_proj")(x), kv_heads)
        value = split_heads(Linear(kv_heads * head_dim, self.dtype, name="v_proj")(x), kv_heads)
        query = RMSNorm(config.rms_norm_eps, self.dtype, name="q_norm")(query)
        key = RMSNorm(config.rms_norm_eps, self.dtype, name="k_norm")(key)
        cos, sin = rope_angles(rows.positions, config.rotary_dim, config.rope_theta)
        query, key = apply_partial_rope(query, cos, sin), apply_partial_rope(key, cos, sin)

        causal = self.num_causal
        if causal:
            write = lambda buffer, new: jax.lax.dynamic_update_slice_in_dim(
                buffer, new.astype(buffer.dtype), rows.length, axis=1)
            cache = KVCache(write(cache.key, key[:, :causal]), write(cache.value, value[:, :causal]))
        filled = rows.length + causal
        cache_index = jnp.arange(cache.key.shape[1])
        row_index = rows.length + jnp.arange(x.shape[1])
        after_start = cache_index[None, None, :] >= rows.start[:, None, None]
        is_causal_row = (jnp.arange(x.shape[1]) < causal)[None, :, None]
        # causal row i sees cache rows start..length+i; block rows see the whole filled prefix.
        upto = jnp.where(is_causal_row, cache_index[None, None, :] <= row_index[None, :, None],
                         cache_index[None, None, :] < filled)
        segments = [(cache.key, cache.value, after_start & upto)]
        block_rows = x.shape[1] - causal
        if block_rows:
            block_allowed = jnp.broadcast_to(~is_causal_row, (x.shape[0], x.shape[1], block_rows))
            segments.append((key[:, causal:], value[:, causal:], block_allowed))
        out = attention_over_segments(query, segments)
        out = rearrange(out, "b t h d -> b t (h d)") * jax.nn.sigmoid(rearrange(gate, "b t h d -> b t (h d)"))
        return Linear(config.hidden_size, self.dtype, name="o_proj")(out), cache
