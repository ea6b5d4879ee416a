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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from pallas_kernels.gdn_chunk_size import CHUNK_SIZE

_EXACT = jax.lax.Precision.HIGHEST  # the recurrent state stays float32 on TPU too


def _float32_inputs(query, key, value, decay, beta, initial_state):
    """Key heads repeated to the consecutive value heads they serve, everything float32, and the
    initial state (zeros when None): the common preamble of both forms of the rule."""
    batch, _, _, key_dim = key.shape
    _, _, num_value_heads, value_dim = value.shape
    repeat = lambda x: jnp.repeat(x, num_value_heads // x.shape[2], axis=2).astype(jnp.float32)
    state = (jnp.zeros((batch, num_value_heads, key_dim, value_dim), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    as_float = lambda x: x.astype(jnp.float32)
    return repeat(query), repeat(key), as_float(value), as_float(decay), as_float(beta), state


def unit_lower_inverse(strictly_lower: jax.Array) -> jax.Array:
    """(I + N)^-1 for strictly lower-triangular N [..., c, c], by matmuls only.

    N is nilpotent (N^c = 0), so (I + N)^-1 = (I - N)(I + N^2)(I + N^4)...(I + N^(c/2)):
    log2(c) batched matmuls instead of a triangular solve (whose LAPACK custom call on XLA:CPU
    deadlocked inside parallel regions here, and which is slow on accelerators).
    """
    size = strictly_lower.shape[-1]
    identity = jnp.eye(size, dtype=strictly_lower.dtype)
    inverse, power = identity - strictly_lower, strictly_lower
    reach = 2
    while reach < size:
        power = jnp.einsum("...ij,...jk->...ik", power, power, precision=_EXACT)
        inverse = jnp.einsum("...ij,...jk->...ik", inverse, identity + power, precision=_EXACT)
        reach *= 2
    return inverse


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
    inputs = _float32_inputs(query, key, value, decay, beta, initial_state)
    out, state, _ = _chunk_scan(*inputs, chunk_size=chunk_size)
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
    one block, or 64 rows when a block is a multiple of 64), so each state is exact.
    returns (float32 outputs [batch, tokens, value_heads, value_dim],
             float32 states before each block [batch, blocks, value_heads, key_dim, value_dim])
    """
    num_tokens = key.shape[1]
    if num_tokens % block_size:
        raise ValueError(f"{num_tokens} rows are not a whole number of blocks of {block_size}")
    chunk = CHUNK_SIZE if block_size > CHUNK_SIZE and block_size % CHUNK_SIZE == 0 else block_size
    per_block = block_size // chunk
    chunk_resets = jnp.zeros((resets.shape[0], num_tokens // chunk), bool).at[:, ::per_block].set(resets)
    out, _, before = _chunk_scan(*_float32_inputs(query, key, value, decay, beta, None), chunk_size=chunk,
                                 resets=chunk_resets)
    return out, before[:, ::per_block]


def _chunk_scan(query, key, value, decay, beta, state, *, chunk_size: int, resets: jax.Array | None = None):
    """The chunked rule on float32 inputs (key heads repeated): (outputs, final state, and with
    `resets` the state before each chunk [batch, chunks, value_heads, key_dim, value_dim], else
    None). resets: None, or bool [batch, chunks], chunks before which the state restarts from zeros."""
    num_tokens = key.shape[1]

    # Zero padding is inert: g = 0 keeps the state, beta = 0 and k = 0 write nothing.
    pad = (-num_tokens) % chunk_size
    pad_tokens = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    query, key, value, decay, beta = map(pad_tokens, (query, key, value, decay, beta))

    to_chunks = lambda x: rearrange(x, "b (n c) h ... -> b h n c ...", c=chunk_size)
    query, key, value, decay, beta = map(to_chunks, (query, key, value, decay, beta))

    cumulative = jnp.cumsum(decay, axis=-1)  # [b, h, n, c]: log decay from chunk start to each token
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    strictly_causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    log_pairwise = cumulative[..., :, None] - cumulative[..., None, :]
    pairwise_decay = jnp.exp(jnp.where(causal, log_pairwise, -jnp.inf))  # [b, h, n, c, c]

    key_beta = key * beta[..., None]
    value_beta = value * beta[..., None]
    interactions = jnp.einsum("bhnid,bhnjd->bhnij", key_beta, key, precision=_EXACT) * pairwise_decay
    inverse = unit_lower_inverse(jnp.where(strictly_causal, interactions, 0.0))  # (I + A)^-1
    solve = lambda rhs: jnp.einsum("bhnij,bhnjd->bhnid", inverse, rhs, precision=_EXACT)
    new_values = solve(value_beta)                                   # [b, h, n, c, value_dim]
    decayed_keys = solve(key_beta * jnp.exp(cumulative)[..., None])  # [b, h, n, c, key_dim]

    intra_chunk = jnp.einsum("bhnid,bhnjd->bhnij", query, key, precision=_EXACT) * pairwise_decay
    query_decayed = query * jnp.exp(cumulative)[..., None]
    key_to_chunk_end = key * jnp.exp(cumulative[..., -1:] - cumulative)[..., None]
    chunk_decay = jnp.exp(cumulative[..., -1])  # [b, h, n]

    def step(state, chunk):
        new_value, decayed_key, query_c, key_c, intra, decay_c, *reset = chunk
        if reset:  # the training layout: packed examples, and the state before every chunk kept
            state = jnp.where(reset[0][:, None, None, None], 0.0, state)
        before = state if reset else None
        correction = new_value - jnp.einsum("bhcd,bhde->bhce", decayed_key, state, precision=_EXACT)
        out = (jnp.einsum("bhcd,bhde->bhce", query_c, state, precision=_EXACT)
               + jnp.einsum("bhij,bhje->bhie", intra, correction, precision=_EXACT))
        state = state * decay_c[..., None, None] + jnp.einsum(
            "bhcd,bhce->bhde", key_c, correction, precision=_EXACT)
        return state, (out, before)

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    inputs = tuple(map(chunk_major, (new_values, decayed_keys, query_decayed, key_to_chunk_end, intra_chunk,
                                     chunk_decay)))
    state, (out, before) = jax.lax.scan(step, state, inputs if resets is None else inputs + (resets.T,))
    out = rearrange(out, "n b h c e -> b (n c) h e")[:, :num_tokens]
    return out, state, None if before is None else jnp.moveaxis(before, 0, 1)


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
    query, key, value, decay, beta, state = _float32_inputs(query, key, value, decay, beta, initial_state)
    token_major = lambda x: jnp.moveaxis(x, 1, 0)
    step = lambda state, token: recurrent_gated_delta_step(state, *token)
    state, out = jax.lax.scan(step, state, tuple(map(token_major, (query, key, value, decay, beta))))
    return jnp.moveaxis(out, 0, 1), state
