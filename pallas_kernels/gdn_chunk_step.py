"""One chunk of the gated delta rule on tiles already loaded into a kernel (registers or VMEM).

Written only with ops that both Pallas backends lower: 2-D arrays, iota masks, sums along one
axis, exp, and 2-D `dot_general`. Per-token scalars arrive as rows `[1, chunk]`; the column
form `[chunk, 1]` is made with a masked sum against the identity, because neither backend
transposes such thin arrays reliably.

With `cum_i = Σ_{j≤i} g_j` inside the chunk, the chunk's tokens update the state together:

    A      = strictly_lower((β k) kᵀ ⊙ exp(cum_i − cum_j))
    U      = (I + A)^-1 (β v),  W = (I + A)^-1 (β k ⊙ exp(cum))     (the UT transform)
    δ      = U − W S                                                 (what the chunk writes)
    out    = (q ⊙ exp(cum)) S + lower(q kᵀ ⊙ exp(cum_i − cum_j)) δ
    S_next = exp(cum_last) S + (k ⊙ exp(cum_last − cum))ᵀ δ

which is `clover_jax.nn.gated_delta.chunked_gated_delta_rule` for one chunk of one value tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_A_BT = (((1,), (1,)), ((), ()))   # a @ bᵀ
_AT_B = (((0,), (0,)), ((), ()))   # aᵀ @ b
_A_B = (((1,), (0,)), ((), ()))    # a @ b


def _dot(a, b, dims, precision):
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def unit_lower_inverse(strictly_lower: jax.Array, identity: jax.Array, precision) -> jax.Array:
    """(I + N)^-1 of a strictly lower-triangular N [chunk, chunk] by matmuls only.

    N is nilpotent, so (I + N)^-1 = (I − N)(I + N²)(I + N⁴)…: log2(chunk) − 1 squarings, each on
    the matrix unit rather than a chunk-long chain of row substitutions.
    """
    size = strictly_lower.shape[0]
    inverse, power = identity - strictly_lower, strictly_lower
    reach = 2
    while reach < size:
        power = _dot(power, power, _A_B, precision)
        inverse = _dot(inverse, identity + power, _A_B, precision)
        reach *= 2
    return inverse


def gdn_chunk_step(state, query, key, value, decay_row, beta_row, *, precision):
    """Advance the state by one chunk and return the chunk's outputs.

    state:  float32 [key_dim, value_block]
    query, key: float32 [chunk, key_dim]  (query L2-normalised and scaled, key L2-normalised)
    value:  float32 [chunk, value_block]
    decay_row, beta_row: float32 [1, chunk]  (log-space g <= 0, and beta, of each token)
    returns (float32 state [key_dim, value_block], float32 out [chunk, value_block])
    """
    chunk = query.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    diagonal, causal, strictly_causal = row == col, col <= row, col < row
    identity = jnp.where(diagonal, 1.0, 0.0)
    as_column = lambda r: jnp.sum(jnp.where(diagonal, r, 0.0), axis=1, keepdims=True)  # [1,c] -> [c,1]
    as_row = lambda c: jnp.sum(jnp.where(diagonal, c, 0.0), axis=0, keepdims=True)     # [c,1] -> [1,c]

    cumulative = jnp.sum(jnp.where(causal, decay_row, 0.0), axis=1, keepdims=True)  # [c, 1]
    total = jnp.sum(decay_row, axis=1, keepdims=True)                                 # [1, 1]
    log_pairwise = cumulative - as_row(cumulative)  # [c, c]: log decay from token j to token i
    # exp only where causal: above the diagonal the log decay is positive and could overflow.
    pairwise_decay = jnp.where(causal, jnp.exp(jnp.where(causal, log_pairwise, 0.0)), 0.0)

    beta = as_column(beta_row)
    key_beta = key * beta
    interactions = _dot(key_beta, key, _A_BT, precision) * pairwise_decay
    inverse = unit_lower_inverse(jnp.where(strictly_causal, interactions, 0.0), identity, precision)
    new_values = _dot(inverse, value * beta, _A_B, precision)                          # [c, value_block]
    decayed_keys = _dot(inverse, key_beta * jnp.exp(cumulative), _A_B, precision)      # [c, key_dim]

    correction = new_values - _dot(decayed_keys, state, _A_B, precision)
    intra_chunk = _dot(query, key, _A_BT, precision) * pairwise_decay
    out = (_dot(query * jnp.exp(cumulative), state, _A_B, precision)
           + _dot(intra_chunk, correction, _A_B, precision))
    key_to_chunk_end = key * jnp.exp(total - cumulative)
    state = state * jnp.exp(total) + _dot(key_to_chunk_end, correction, _AT_B, precision)
    return state, out
