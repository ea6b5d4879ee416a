"""The chunked gated delta rule in plain JAX: the XLA rule the model runs where no kernel does
(`clover_jax.nn.gated_delta`), the oracle of `gdn_chunk`'s block states, and the function whose
reverse-mode derivative is `gdn_chunk`'s backward pass (`gdn_chunk_vjp.py`).

Per value head, with a float32 state `S ∈ R^{key_dim × value_dim}`:

    S ← exp(g_t) S;   S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ;   o_t = Sᵀ q_t

The chunked form turns the per-token recurrence into matmuls inside chunks (the "UT transform":
the inverse of a unit lower-triangular matrix replaces the chain of delta updates) and a
`lax.scan` carries the state from chunk to chunk, so memory is linear in the length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from pallas_kernels.gdn_chunk_size import CHUNK_SIZE, chunk_for_blocks

_EXACT = jax.lax.Precision.HIGHEST  # the recurrent state stays float32 on TPU too


def float32_inputs(query, key, value, decay, beta, initial_state):
    """Key heads repeated to the consecutive value heads they serve, everything float32, and the
    initial state (zeros when None): the common preamble of every form of the rule."""
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


def chunk_scan(query, key, value, decay, beta, state, *, chunk_size: int, resets: jax.Array | None = None):
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

    # Everything per chunk happens inside the scan body, on one chunk of every head at a time:
    # batched over all chunks at once, XLA:TPU emits the small [c, c] products (HIGHEST-precision
    # dots become base-dilated convolutions over the batch) as megabytes of unrolled code per
    # operation, and compiling the differentiated rule took minutes; in the loop body it is one chunk's.
    def step(state, chunk):
        query_c, key_c, value_c, beta_c, cumulative_c, *reset = chunk
        if reset:  # the training layout: packed examples, and the state before every chunk kept
            state = jnp.where(reset[0][:, None, None, None], 0.0, state)
        before = state if reset else None
        new_value, decayed_key, query_decayed, key_to_chunk_end, intra, decay_c = _chunk_terms(
            query_c, key_c, value_c, beta_c, cumulative_c)
        correction = new_value - jnp.einsum("bhcd,bhde->bhce", decayed_key, state, precision=_EXACT)
        out = (jnp.einsum("bhcd,bhde->bhce", query_decayed, state, precision=_EXACT)
               + jnp.einsum("bhij,bhje->bhie", intra, correction, precision=_EXACT))
        state = state * decay_c[..., None, None] + jnp.einsum(
            "bhcd,bhce->bhde", key_to_chunk_end, correction, precision=_EXACT)
        return state, (out, before)

    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)
    inputs = tuple(map(chunk_major, (query, key, value, beta, cumulative)))
    # Checkpointed: reverse mode keeps only the state before each chunk and recomputes the chunk's
    # terms rather than stacking every intermediate of every chunk (2,048 tokens, 32 heads: 0.6 GB
    # of temporaries instead of 1.6 GB).
    state, (out, before) = jax.lax.scan(jax.checkpoint(step), state,
                                        inputs if resets is None else inputs + (resets.T,))
    out = rearrange(out, "n b h c e -> b (n c) h e")[:, :num_tokens]
    return out, state, None if before is None else jnp.moveaxis(before, 0, 1)


def slot_chunk_scan(query, key, value, decay, beta, states, *, chunk_slot, chunk_first, count=None):
    """The chunked rule over the serving engine's ragged chunks, each segment starting from its
    slot's state (`clover_jax.core.ragged`).

    query, key: [chunks, C, key_heads, key_dim]; value: [chunks, C, value_heads, value_dim];
    decay, beta: [chunks, C, value_heads] (padding rows zero: they leave a state as it is);
    states: float32 [slots, value_heads, key_dim, value_dim]; chunk_slot: int32 [chunks], each
    chunk's slot; chunk_first: bool [chunks], the chunk starts its segment (the running state
    restarts from its slot's). A segment's chunks follow each other in order. count: int32 [], the
    chunks that hold rows (the rest, padding at the end, are skipped: a pass of blocks alone runs
    none); None: every chunk.
    returns (float32 out [chunks, C, value_heads, value_dim], zeros past `count`; float32 states:
             every slot's after its segment's last chunk, the others' as given)
    """
    num_value_heads = value.shape[2]
    repeat = lambda x: jnp.repeat(x, num_value_heads // x.shape[2], axis=2).astype(jnp.float32)
    head_major = lambda x: jnp.moveaxis(x, 2, 1)[:, None]  # [chunks, 1, heads, C, ...]: a batch of one
    query, key = head_major(repeat(query)), head_major(repeat(key))
    value, beta = head_major(value.astype(jnp.float32)), head_major(beta.astype(jnp.float32))
    cumulative = jnp.cumsum(head_major(decay.astype(jnp.float32)), axis=-1)
    states = states.astype(jnp.float32)

    def step(index, carry):
        state, table, out_all = carry
        take = lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False)
        query_c, key_c, value_c, beta_c, cumulative_c, slot, first = map(
            take, (query, key, value, beta, cumulative, chunk_slot, chunk_first))
        state = jnp.where(first, table[slot][None], state)
        new_value, decayed_key, query_decayed, key_to_chunk_end, intra, decay_c = _chunk_terms(
            query_c, key_c, value_c, beta_c, cumulative_c)
        correction = new_value - jnp.einsum("bhcd,bhde->bhce", decayed_key, state, precision=_EXACT)
        out = (jnp.einsum("bhcd,bhde->bhce", query_decayed, state, precision=_EXACT)
               + jnp.einsum("bhij,bhje->bhie", intra, correction, precision=_EXACT))
        state = state * decay_c[..., None, None] + jnp.einsum(
            "bhcd,bhce->bhde", key_to_chunk_end, correction, precision=_EXACT)
        # every chunk writes its slot's entry; a segment's last chunk writes last
        table = jax.lax.dynamic_update_index_in_dim(table, state[0], slot, 0)
        return state, table, jax.lax.dynamic_update_index_in_dim(out_all, out[0], index, 0)

    out = jnp.zeros(value.shape[:1] + value.shape[2:], jnp.float32)          # [chunks, heads, C, value_dim]
    initial = (jnp.zeros((1,) + states.shape[1:], jnp.float32), states, out)
    _, states, out = jax.lax.fori_loop(0, query.shape[0] if count is None else count, step, initial)
    return jnp.moveaxis(out, 1, 2), states  # [chunks, C, heads, value_dim]


def _chunk_terms(query, key, value, beta, cumulative):
    """The chunk-local terms of one chunk of every head (the UT transform).

    query, key: [b, h, c, key_dim]; value: [b, h, c, value_dim]; beta, cumulative: [b, h, c]
    (cumulative: log decay from the chunk's start to each token).
    returns (new values [b, h, c, value_dim], decayed keys [b, h, c, key_dim], decayed queries
             [b, h, c, key_dim], keys decayed to the chunk's end [b, h, c, key_dim], intra-chunk
             scores [b, h, c, c], the chunk's total decay [b, h])
    """
    chunk_size = key.shape[-2]
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    strictly_causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    log_pairwise = cumulative[..., :, None] - cumulative[..., None, :]
    pairwise_decay = jnp.exp(jnp.where(causal, log_pairwise, -jnp.inf))  # [b, h, c, c]

    key_beta = key * beta[..., None]
    interactions = jnp.einsum("bhid,bhjd->bhij", key_beta, key, precision=_EXACT) * pairwise_decay
    inverse = unit_lower_inverse(jnp.where(strictly_causal, interactions, 0.0))  # (I + A)^-1
    solve = lambda rhs: jnp.einsum("bhij,bhjd->bhid", inverse, rhs, precision=_EXACT)
    new_values = solve(value * beta[..., None])
    decayed_keys = solve(key_beta * jnp.exp(cumulative)[..., None])

    intra_chunk = jnp.einsum("bhid,bhjd->bhij", query, key, precision=_EXACT) * pairwise_decay
    query_decayed = query * jnp.exp(cumulative)[..., None]
    key_to_chunk_end = key * jnp.exp(cumulative[..., -1:] - cumulative)[..., None]
    return new_values, decayed_keys, query_decayed, key_to_chunk_end, intra_chunk, jnp.exp(cumulative[..., -1])


def gdn_chunk_xla(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
    block_size: int | None = None,
    resets: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`gdn_chunk`'s arguments and results in plain JAX, with its block states.

    query, key: [batch, tokens, key_heads, key_dim]; value: [batch, tokens, value_heads, value_dim];
    decay, beta: [batch, tokens, value_heads]; initial_state: float32 [batch, value_heads, key_dim,
    value_dim] or None (zeros). block_size None: chunks of `chunk_size`, any length. Otherwise tokens
    are a whole number of blocks, the chunk is `chunk_for_blocks(block_size, chunk_size)` (refused
    when there is none) and resets (bool [batch, blocks] or None) restart the state from zeros
    before a block.
    returns (float32 out [batch, tokens, value_heads, value_dim], float32 final state
             [batch, value_heads, key_dim, value_dim], and with block_size the float32 state before
             each block [batch, blocks, value_heads, key_dim, value_dim], else None)
    """
    inputs = float32_inputs(query, key, value, decay, beta, initial_state)
    if block_size is None:
        out, state, _ = chunk_scan(*inputs, chunk_size=chunk_size)
        return out, state, None
    chunk = block_chunk(block_size, chunk_size, key.shape[1])
    per_block = block_size // chunk
    batch, blocks = key.shape[0], key.shape[1] // block_size
    resets = jnp.zeros((batch, blocks), bool) if resets is None else resets
    chunk_resets = jnp.zeros((batch, blocks * per_block), bool).at[:, ::per_block].set(resets)
    out, state, before = chunk_scan(*inputs, chunk_size=chunk, resets=chunk_resets)
    return out, state, before[:, ::per_block]


def block_chunk(block_size: int, chunk_size: int, tokens: int) -> int:
    """The chunk of the block-state form (`chunk_for_blocks`), after checking that `tokens` is a
    whole number of blocks; a ValueError names what does not fit."""
    if tokens % block_size:
        raise ValueError(f"{tokens} tokens are not a whole number of blocks of {block_size}")
    chunk = chunk_for_blocks(block_size, chunk_size)
    if chunk is None:
        raise ValueError(f"block_size={block_size} must divide the chunk ({chunk_size}) or be a multiple of it, "
                         "so that every block boundary is a chunk boundary")
    return chunk
