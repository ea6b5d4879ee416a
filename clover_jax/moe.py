"""Sparse MoE block (transformers' `Qwen3_5MoeSparseMoeBlock`).

Router `softmax(W_gate x)` in float32 over all experts, top-k, weights renormalised to sum 1;
routed experts `down(silu(gate(x)) * up(x))`; a shared expert scaled by
`sigmoid(shared_expert_gate x)` is added.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from clover_jax.config import CloverConfig
from clover_jax.expert_dispatch import routed_expert_mlp
from clover_jax.layers import Linear, default_init


def route_top_k(router_logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """float32 [tokens, experts] -> (expert ids int [tokens, top_k], weights float32 summing to 1)."""
    probabilities = jax.nn.softmax(router_logits, axis=-1)
    weights, expert_ids = jax.lax.top_k(probabilities, top_k)
    return expert_ids, weights / jnp.sum(weights, axis=-1, keepdims=True)


class SharedExpert(nn.Module):
    intermediate_size: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = x.shape[-1]
        gate = Linear(self.intermediate_size, self.dtype, name="gate_proj")(x)
        up = Linear(self.intermediate_size, self.dtype, name="up_proj")(x)
        return Linear(hidden, self.dtype, name="down_proj")(jax.nn.silu(gate) * up)


class SparseMoE(nn.Module):
    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, tokens, hidden] -> [batch, tokens, hidden]."""
        config = self.config
        batch, num_tokens, hidden = x.shape
        tokens = x.reshape(batch * num_tokens, hidden).astype(self.dtype)

        router = self.param("gate", default_init, (config.num_experts, hidden), self.dtype)
        router_logits = jnp.einsum("th,eh->te", tokens, router, preferred_element_type=jnp.float32)
        expert_ids, expert_weights = route_top_k(router_logits, config.num_experts_per_tok)

        gate_up_proj = self.param("experts_gate_up_proj", default_init,
                                  (config.num_experts, hidden, 2 * config.moe_intermediate_size), self.dtype)
        down_proj = self.param("experts_down_proj", default_init,
                               (config.num_experts, config.moe_intermediate_size, hidden), self.dtype)
        routed = routed_expert_mlp(tokens, expert_ids, expert_weights, gate_up_proj, down_proj)

        shared = SharedExpert(config.shared_expert_intermediate_size, self.dtype, name="shared_expert")(tokens)
        shared_gate = Linear(1, self.dtype, name="shared_expert_gate")(tokens)
        out = routed + jax.nn.sigmoid(shared_gate) * shared
        return out.reshape(batch, num_tokens, hidden)
