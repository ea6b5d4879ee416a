"""Oracle for `gdn_chunk`: the gated delta rule one token at a time, as the recurrence is written.

Per value head h (reading key head h // (value_heads // key_heads)), with float32 state S:

    S ← exp(g_t) S;   S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ;   o_t = Sᵀ q_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_EXACT = jax.lax.Precision.HIGHEST


def gdn_chunk_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Same arguments and results as `gdn_chunk` (without its tiling options).

    query, key: [batch, tokens, key_heads, key_dim]; value: [batch, tokens, value_heads, value_dim]
    decay, beta: [batch, tokens, value_heads]; initial_state: float32 [batch, value_heads, key_dim, value_dim]
    returns (float32 [batch, tokens, value_heads, value_dim], float32 final state)
    """
    batch, _, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[2:]
    serve_value_heads = lambda x: jnp.repeat(x.astype(jnp.float32), value_heads // key_heads, axis=2)
    state = (jnp.zeros((batch, value_heads, key_dim, value_dim), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))

    def one_token(state, token):
        q, k, v, g, b = token  # q, k: [batch, heads, key_dim]; v: [batch, heads, value_dim]; g, b: [batch, heads]
        state = state * jnp.exp(g)[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", state, k, precision=_EXACT)
        written = b[..., None] * (v - remembered)
        state = state + jnp.einsum("bhk,bhv->bhkv", k, written, precision=_EXACT)
        return state, jnp.einsum("bhkv,bhk->bhv", state, q, precision=_EXACT)

    tokens_first = lambda x: jnp.moveaxis(x, 1, 0)
    inputs = (serve_value_heads(query), serve_value_heads(key), value.astype(jnp.float32),
              decay.astype(jnp.float32), beta.astype(jnp.float32))
    state, out = jax.lax.scan(one_token, state, tuple(map(tokens_first, inputs)))
    return tokens_first(out), state
