"""The decoder stack: embedding, layer groups scanned with `nn.scan`, final norm, LM head.

Layers come in groups that repeat the config's layer pattern — for Qwen3.6 (3 GDN + 1 full
attention) × 10 — and the groups are scanned, so compile time does not grow with depth.
Every parameter under `groups` therefore has a leading `[num_groups]` axis, and layer `i` of
the checkpoint is slot `i % len(pattern)` of group `i // len(pattern)`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from clover_jax.attention import GatedAttention
from clover_jax.config import CloverConfig
from clover_jax.gdn import GatedDeltaNet
from clover_jax.layers import RMSNorm, default_init
from clover_jax.moe import SparseMoE

Params = dict[str, Any]


def slot_name(slot: int) -> str:
    """Name of the `slot`-th layer inside a scanned group."""
    return f"layer_{slot}"


class DecoderLayer(nn.Module):
    config: CloverConfig
    layer_type: str
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden: jax.Array, positions: jax.Array, state: Any) -> tuple[jax.Array, Any]:
        """hidden: [batch, tokens, hidden_size] -> (same shape, the mixer's state after these tokens)."""
        config = self.config
        mixed = RMSNorm(config.rms_norm_eps, self.dtype, name="input_layernorm")(hidden)
        if self.layer_type == "linear_attention":
            mixed, state = GatedDeltaNet(config, self.dtype, name="linear_attn")(mixed, state)
        else:
            mixed = GatedAttention(config, self.dtype, name="self_attn")(mixed, positions)
        hidden = hidden + mixed
        feed_forward = RMSNorm(config.rms_norm_eps, self.dtype, name="post_attention_layernorm")(hidden)
        return hidden + SparseMoE(config, self.dtype, name="mlp")(feed_forward), state


class LayerGroup(nn.Module):
    """One repetition of the layer pattern; the unit that `nn.scan` stacks."""

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden: jax.Array, group_state: Any, positions: jax.Array) -> tuple[jax.Array, Any]:
        new_state = {}
        for slot, layer_type in enumerate(self.config.group_pattern):
            name = slot_name(slot)
            layer_state = None if group_state is None else group_state[name]
            hidden, new_state[name] = DecoderLayer(self.config, layer_type, self.dtype, name=name)(
                hidden, positions, layer_state)
        return hidden, new_state


class CloverTransformer(nn.Module):
    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, positions: jax.Array, state: Any = None) -> tuple[jax.Array, Any]:
        """Causal pass.

        input_ids, positions: int [batch, tokens]; state: per-group layer states stacked on a
        leading [num_groups] axis, or None for an empty prefix.
        returns (float32 logits [batch, tokens, vocab], the state after these tokens)
        """
        config = self.config
        embed = nn.Embed(config.vocab_size, config.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         embedding_init=default_init, name="embed_tokens")
        hidden = embed(input_ids)
        groups = nn.scan(LayerGroup, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(0, nn.broadcast), length=config.num_groups)
        hidden, state = groups(config, self.dtype, name="groups")(hidden, state, positions)
        hidden = RMSNorm(config.rms_norm_eps, self.dtype, name="norm")(hidden)
        if config.tie_word_embeddings:
            head = embed.embedding
        else:
            head = self.param("lm_head", default_init, (config.vocab_size, config.hidden_size), self.dtype)
        logits = jnp.einsum("bth,vh->btv", hidden, head, preferred_element_type=jnp.float32)
        return logits, state


def param_shapes(config: CloverConfig, dtype) -> Params:
    """The parameter pytree as `jax.ShapeDtypeStruct`s, without allocating anything."""
    module = CloverTransformer(config, dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(module.init, jax.random.key(0), ids, ids)["params"]


def init_params(config: CloverConfig, dtype, seed: int = 0) -> Params:
    """Random parameters (for tests and benchmarks on random weights)."""
    module = CloverTransformer(config, dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.jit(module.init)(jax.random.key(seed), ids, ids)["params"]
