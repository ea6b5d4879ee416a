"""The gated delta rule of Gated DeltaNet, chunked (for prefill and commits) and per token.

Per value head, with a float32 state `S ∈ R^{key_dim × value_dim}`:

    S ← exp(g_t) S
    S ← S + k_t (beta_t (v_t − Sᵀ k_t))ᵀ
    o_t = Sᵀ q_t

Inputs follow transformers' `torch_chunk_gated_delta_rule` with `use_qk_l2norm_in_kernel`
already applied by the caller: `query` is L2-normalised and scaled by `key_dim ** -0.5`,
`key` is L2-normalised. Each of the key heads serves `value_heads / key_heads` consecutive
value heads.

The chunked form turns the per-token recurrence into matmuls inside chunks of 64 tokens
(the "UT transform": the inverse of a unit lower-triangular matrix replaces the chain of delta
updates) and a `lax.scan` carries the state from chunk to chunk, so memory is linear in the length.
That scan lives beside the Pallas kernel (`pallas_kernels.gdn_chunk_xla`), whose oracle and
backward pass it is; this module is the model's entry to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_chunk_size import CHUNK_SIZE, chunk_for_blocks
from pallas_kernels.gdn_chunk_xla import chunk_scan, float32_inputs, gdn_chunk_xla, unit_lower_inverse

__all__ = ["chunked_gated_delta_rule", "gated_delta_rule_with_block_states", "recurrent_gated_delta_rule",
           "recurrent_gated_delta_step", "unit_lower_inverse"]

_EXACT = jax.lax.Precision.HIGHEST  # the recurrent state stays float32 on TPU too


def chunked_gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule.

    query, key: [batch, tokens, key_heads, key_dim]
    value:      [batch, tokens, value_heads, value_dim]
    decay:      [batch, tokens, value_heads]  (log-space g, <= 0)
    beta:       [batch, tokens, value_heads]
    initial_state: float32 [batch, value_heads, key_dim, value_dim] or None (zeros)
    returns (float32 [batch, tokens, value_heads, value_dim], float32 final state)
    """
    out, state, _ = chunk_scan(*float32_inputs(query, key, value, decay, beta, initial_state),
                               chunk_size=chunk_size)
    return out, state


def gated_delta_rule_with_block_states(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    *,
    block_size: int,
    resets: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The chunked rule over rows of packed examples, with the state at every block boundary.

    Arguments as `chunked_gated_delta_rule` (tokens a multiple of `block_size`, starting from a
    zero state); resets: bool [batch, tokens // block_size], the blocks where an example starts,
    before which the state restarts from zeros. Block boundaries are chunk boundaries (a chunk is
    one block, or 64 rows when a block is a multiple of 64: `chunk_for_blocks`), so each state is exact.
    returns (float32 outputs [batch, tokens, value_heads, value_dim],
             float32 states before each block [batch, blocks, value_heads, key_dim, value_dim])
    """
    out, _, before = gdn_chunk_xla(query, key, value, decay, beta, block_size=block_size, resets=resets,
                                   chunk_size=CHUNK_SIZE if chunk_for_blocks(block_size) else block_size)
    return out, before


def recurrent_gated_delta_step(
    state: jax.Array, query: jax.Array, key: jax.Array, value: jax.Array, decay: jax.Array, beta: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token of the rule for all value heads (key heads already repeated).

    state: float32 [batch, value_heads, key_dim, value_dim]; query, key: [batch, value_heads, key_dim];
    value: [batch, value_heads, value_dim]; decay, beta: [batch, value_heads]
    returns (new state, output [batch, value_heads, value_dim])
    """
    state = state * jnp.exp(decay)[..., None, None]
    remembered = jnp.einsum("bhkv,bhk->bhv", state, key, precision=_EXACT)
    delta = (value - remembered) * beta[..., None]
    state = state + jnp.einsum("bhk,bhv->bhkv", key, delta, precision=_EXACT)
    return state, jnp.einsum("bhkv,bhk->bhv", state, query, precision=_EXACT)


def recurrent_gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token form; same arguments and results as :func:`chunked_gated_delta_rule`."""
    query, key, value, decay, beta, state = float32_inputs(query, key, value, decay, beta, initial_state)
    token_major = lambda x: jnp.moveaxis(x, 1, 0)
    step = lambda state, token: recurrent_gated_delta_step(state, *token)
    state, out = jax.lax.scan(step, state, tuple(map(token_major, (query, key, value, decay, beta))))
    return jnp.moveaxis(out, 0, 1), state
