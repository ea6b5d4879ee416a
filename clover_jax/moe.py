"""Sparse MoE block (transformers' `Qwen3_5MoeSparseMoeBlock`).

Router `softmax(W_gate x)` in float32 over all experts, top-k, weights renormalised to sum 1;
routed experts `down(silu(gate(x)) * up(x))`; a shared expert scaled by
`sigmoid(shared_expert_gate x)` is added.

Causal rows always route plainly; block rows (a denoising forward) route within the block's
coreset (spec §5) when it is enabled. All rows then share one grouped expert computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from clover_jax.config import CloverConfig
from clover_jax.coreset import coreset_mask, distinct_experts, route_within
from clover_jax.expert_dispatch import routed_expert_mlp
from clover_jax.layers import Linear, default_init


def route_top_k(probabilities: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Router probabilities float32 [..., experts] -> (expert ids int [..., top_k], weights summing to 1)."""
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
    num_causal: int = 0   # leading rows routed plainly; the rest are a block
    coreset: bool = False  # route the block rows within their coreset

    @nn.compact
    def __call__(self, x: jax.Array, coreset_top_p: jax.Array | float = 1.0) -> tuple[jax.Array, jax.Array]:
        """x: [batch, tokens, hidden] -> ([batch, tokens, hidden], distinct experts of the block rows, int32 [batch])."""
        config = self.config
        batch, num_tokens, hidden = x.shape
        top_k, causal = config.num_experts_per_tok, self.num_causal
        x = x.astype(self.dtype)

        router = self.param("gate", default_init, (config.num_experts, hidden), self.dtype)
        router_logits = jnp.einsum("bth,eh->bte", x, router, preferred_element_type=jnp.float32)
        probabilities = jax.nn.softmax(router_logits, axis=-1)
        expert_ids, expert_weights = route_top_k(probabilities, top_k)
        distinct = jnp.zeros((batch,), jnp.int32)
        if num_tokens > causal:
            block_probabilities = probabilities[:, causal:]
            if self.coreset:
                allowed = coreset_mask(block_probabilities, top_k, coreset_top_p)
                block_ids, block_weights = route_within(block_probabilities, allowed, top_k)
                expert_ids = expert_ids.at[:, causal:].set(block_ids)
                expert_weights = expert_weights.at[:, causal:].set(block_weights)
            distinct = distinct_experts(expert_ids[:, causal:], expert_weights[:, causal:], config.num_experts)

        gate_up_proj = self.param("experts_gate_up_proj", default_init,
                                  (config.num_experts, 2 * config.moe_intermediate_size, hidden), self.dtype)
        down_proj = self.param("experts_down_proj", default_init,
                               (config.num_experts, hidden, config.moe_intermediate_size), self.dtype)
        tokens = x.reshape(batch * num_tokens, hidden)
        routed = routed_expert_mlp(tokens, expert_ids.reshape(batch * num_tokens, top_k),
                                   expert_weights.reshape(batch * num_tokens, top_k), gate_up_proj, down_proj)

        shared = SharedExpert(config.shared_expert_intermediate_size, self.dtype, name="shared_expert")(tokens)
        shared_gate = Linear(1, self.dtype, name="shared_expert_gate")(tokens)
        out = routed + jax.nn.sigmoid(shared_gate) * shared
        return out.reshape(batch, num_tokens, hidden), distinct
