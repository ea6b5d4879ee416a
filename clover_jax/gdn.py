"""Gated DeltaNet token mixer (transformers' `Qwen3_5MoeGatedDeltaNet`), causal mode.

    in_proj_qkv -> causal depthwise conv (kernel K, no bias) -> SiLU -> q | k | v
    beta = sigmoid(in_proj_b x);  g = -exp(A_log) * softplus(in_proj_a x + dt_bias)
    q, k L2-normalised, q scaled by key_dim ** -0.5; gated delta rule (float32 state)
    gated RMSNorm with z = in_proj_z x, then out_proj

The layer carries a state across calls — the last K−1 pre-convolution rows and the recurrent
state — so a prefill, a commit and a single decoding step are the same code.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import linen as nn

from clover_jax.config import CloverConfig
from clover_jax.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule
from clover_jax.layers import GatedRMSNorm, Linear, l2_normalize


class GDNState(NamedTuple):
    """conv: [batch, K-1, conv_dim] (model dtype); recurrent: float32 [batch, value_heads, key_dim, value_dim]."""

    conv: jax.Array
    recurrent: jax.Array


def empty_gdn_state(config: CloverConfig, batch: int, dtype) -> GDNState:
    return GDNState(
        conv=jnp.zeros((batch, config.linear_conv_kernel_dim - 1, config.conv_dim), dtype),
        recurrent=jnp.zeros((batch, config.linear_num_value_heads, config.linear_key_head_dim,
                             config.linear_value_head_dim), jnp.float32),
    )


def causal_depthwise_conv(window: jax.Array, weight: jax.Array) -> jax.Array:
    """Depthwise convolution of each channel over the last K rows up to each position.

    window: [batch, K-1 + tokens, channels] (the previous K-1 rows, then the new rows)
    weight: [channels, K]
    returns [batch, tokens, channels]; row i is Σ_j weight[:, j] · window[i + j]
    """
    kernel = weight.shape[-1]
    num_tokens = window.shape[1] - (kernel - 1)
    return sum(window[:, j:j + num_tokens] * weight[:, j] for j in range(kernel))


class GatedDeltaNet(nn.Module):
    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, state: GDNState | None = None) -> tuple[jax.Array, GDNState]:
        """x: [batch, tokens, hidden] -> ([batch, tokens, hidden], state after these tokens)."""
        config = self.config
        batch = x.shape[0]
        if state is None:
            state = empty_gdn_state(config, batch, self.dtype)

        mixed = Linear(config.conv_dim, self.dtype, name="in_proj_qkv")(x)       # [b, t, conv_dim]
        gate = Linear(config.linear_value_dim, self.dtype, name="in_proj_z")(x)  # [b, t, value_dim]
        beta_logit = Linear(config.linear_num_value_heads, self.dtype, name="in_proj_b")(x)
        decay_logit = Linear(config.linear_num_value_heads, self.dtype, name="in_proj_a")(x)
        conv_weight = self.param("conv1d_weight", nn.initializers.normal(0.1),
                                 (config.conv_dim, config.linear_conv_kernel_dim), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (config.linear_num_value_heads,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (config.linear_num_value_heads,), self.dtype)

        window = jnp.concatenate([state.conv.astype(self.dtype), mixed], axis=1)
        new_conv_state = window[:, window.shape[1] - (config.linear_conv_kernel_dim - 1):]
        activated = jax.nn.silu(causal_depthwise_conv(window, conv_weight))

        query, key, value = jnp.split(activated, [config.linear_key_dim, 2 * config.linear_key_dim], axis=-1)
        query = rearrange(query, "b t (h d) -> b t h d", d=config.linear_key_head_dim)
        key = rearrange(key, "b t (h d) -> b t h d", d=config.linear_key_head_dim)
        value = rearrange(value, "b t (h d) -> b t h d", d=config.linear_value_head_dim)
        query = l2_normalize(query.astype(jnp.float32)) * config.linear_key_head_dim ** -0.5
        key = l2_normalize(key.astype(jnp.float32))

        beta = jax.nn.sigmoid(beta_logit)
        decay = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
            decay_logit.astype(jnp.float32) + dt_bias.astype(jnp.float32))

        rule = recurrent_gated_delta_rule if x.shape[1] == 1 else chunked_gated_delta_rule
        core, recurrent = rule(query, key, value, decay, beta, state.recurrent)

        gate = rearrange(gate, "b t (h d) -> b t h d", d=config.linear_value_head_dim)
        normed = GatedRMSNorm(config.rms_norm_eps, self.dtype, name="norm")(core.astype(self.dtype), gate)
        out = Linear(config.hidden_size, self.dtype, name="out_proj")(rearrange(normed, "b t h d -> b t (h d)"))
        return out, GDNState(conv=new_conv_state, recurrent=recurrent)
