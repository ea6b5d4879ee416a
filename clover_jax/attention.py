"""Gated grouped-query attention of the full-attention layers (transformers' `Qwen3_5MoeAttention`).

`q_proj` yields `2 * heads * head_dim` features: per head the first `head_dim` are the query,
the next `head_dim` the output gate. q and k pass a zero-centred RMSNorm over `head_dim`, then
partial RoPE; the attention output is multiplied by `sigmoid(gate)` before `o_proj`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import linen as nn

from clover_jax.config import CloverConfig
from clover_jax.layers import Linear, RMSNorm
from clover_jax.rope import apply_partial_rope, rope_angles


def grouped_attention(query: jax.Array, key: jax.Array, value: jax.Array, allowed: jax.Array) -> jax.Array:
    """Softmax attention with key/value heads shared by consecutive query heads.

    query: [batch, q_tokens, heads, head_dim]; key, value: [batch, kv_tokens, kv_heads, head_dim]
    allowed: bool [batch, q_tokens, kv_tokens]; returns [batch, q_tokens, heads, head_dim]
    Scores and softmax are float32.
    """
    num_kv_heads = key.shape[2]
    query = rearrange(query, "b t (k g) d -> b t k g d", k=num_kv_heads)
    scores = jnp.einsum("btkgd,bskd->bkgts", query, key, preferred_element_type=jnp.float32)
    scores = scores * query.shape[-1] ** -0.5
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, value)
    return rearrange(out, "b t k g d -> b t (k g) d")


class GatedAttention(nn.Module):
    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Causal attention over the tokens of `x`.

        x: [batch, tokens, hidden]; positions: int [batch, tokens] -> [batch, tokens, hidden]
        """
        config = self.config
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        query_and_gate = Linear(2 * heads * head_dim, self.dtype, name="q_proj")(x)
        query_and_gate = rearrange(query_and_gate, "b t (h d) -> b t h d", h=heads)
        query, gate = jnp.split(query_and_gate, 2, axis=-1)
        key = rearrange(Linear(kv_heads * head_dim, self.dtype, name="k_proj")(x), "b t (h d) -> b t h d", h=kv_heads)
        value = rearrange(Linear(kv_heads * head_dim, self.dtype, name="v_proj")(x), "b t (h d) -> b t h d", h=kv_heads)
        query = RMSNorm(config.rms_norm_eps, self.dtype, name="q_norm")(query)
        key = RMSNorm(config.rms_norm_eps, self.dtype, name="k_norm")(key)

        cos, sin = rope_angles(positions, config.rotary_dim, config.rope_theta)
        query, key = apply_partial_rope(query, cos, sin), apply_partial_rope(key, cos, sin)

        allowed = positions[:, None, :] <= positions[:, :, None]  # causal
        out = grouped_attention(query, key, value, allowed)
        out = rearrange(out, "b t h d -> b t (h d)") * jax.nn.sigmoid(rearrange(gate, "b t h d -> b t (h d)"))
        return Linear(config.hidden_size, self.dtype, name="o_proj")(out)
