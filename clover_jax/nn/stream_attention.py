"""Full attention over a training pass's two streams (`clover_jax.core.streams`), with a backward
pass that never holds a [rows, keys] score matrix.

Queries are every row of both streams, keys are of two kinds, folded into one float32 softmax:

* the clean stream's keys: query row q sees clean key j when both belong to one example and
  `j < limit[q]` — a clean row p has limit p + 1 (causal), a noisy row of block k has limit kB
  (the clean prefix `denoise_logits` holds) — `Streams.clean_attention_rule`;
* a noisy block's own keys: each noisy row sees every row of its block (bidirectional), never
  another block's — computed block by block, so this part costs `N·B²`, not `(N·B)²`.

Flash-attention style, in plain JAX (so it runs on every platform): the forward reduces the clean
keys `key_block` at a time with an online softmax (`online_attention.absorb`) and keeps only the
output and each row's float32 log-sum-exp; the backward (a `jax.custom_vjp`) recomputes each key
block's scores from them and accumulates dQ, dK, dV block by block. Both directions hold
`[rows, key_block]` scores per head at a time, so memory grows linearly with the length. (Reverse
mode through the online-softmax loop would save every block's scores, i.e. all [rows, L] of them.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from clover_jax.core.kernels import KEY_BLOCK
from clover_jax.nn.online_attention import Running, absorb

_F32 = jnp.float32
QUERY_BLOCK = 512  # rows reduced at a time: a tile's scores are [QUERY_BLOCK, KEY_BLOCK] per head


class _Layout(NamedTuple):
    """Static: clean keys L, rows per noisy block, rows and clean keys reduced at a time."""

    clean_length: int
    block_size: int
    query_block: int
    key_block: int


def two_stream_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, query_segment: jax.Array,
                         query_limit: jax.Array, key_segment: jax.Array, block_size: int,
                         key_block: int = KEY_BLOCK, query_block: int = QUERY_BLOCK) -> jax.Array:
    """query: [b, L + N*B, heads, head_dim]; key, value: [b, L + N*B, kv_heads, head_dim] (rotated);
    query_segment, query_limit: int [b, L + N*B] and key_segment: int [b, L], the clean-key rule
    (`Streams.clean_attention_rule`) -> [b, L + N*B, heads, head_dim].

    Key/value heads serve consecutive query heads; a row that sees no key gets zeros. Differentiable
    in query, key and value, with the memory-linear backward above."""
    batch, rows, heads, head_dim = query.shape
    clean_length = key_segment.shape[1]
    if key.shape[:2] != (batch, rows) or value.shape != key.shape or heads % key.shape[2]:
        raise ValueError(f"key {key.shape} and value {value.shape} must be [batch, rows, kv_heads, head_dim] for "
                         f"query {query.shape}, kv_heads dividing heads")
    if (rows - clean_length) % block_size or {query_segment.shape, query_limit.shape} != {(batch, rows)}:
        raise ValueError(f"{rows} rows must be {clean_length} clean rows and whole blocks of {block_size}, with "
                         f"query_segment {query_segment.shape} and query_limit {query_limit.shape} one per row")
    layout = _Layout(clean_length, block_size, min(query_block, rows), min(key_block, max(clean_length, 1)))
    return _attention(query, key, value, query_segment, query_limit, key_segment, layout)


def _grouped(query: jax.Array, kv_heads: int) -> jax.Array:
    """[b, t, heads, d] -> pre-scaled [b, t, kv_heads, group, d], in the query's dtype."""
    return rearrange(query, "b t (k g) d -> b t k g d", k=kv_heads) * query.shape[-1] ** -0.5


def _pad_rows(x: jax.Array, rows: int, axis: int = 1, value=0) -> jax.Array:
    """x with `axis` cut or zero-padded (or `value`-padded) to `rows`."""
    x = jax.lax.slice_in_dim(x, 0, min(rows, x.shape[axis]), axis=axis)
    padding = [(0, 0)] * x.ndim
    padding[axis] = (0, rows - x.shape[axis])
    return jnp.pad(x, padding, constant_values=value)


class _Tiles(NamedTuple):
    """The clean-key part's operands padded to whole tiles. Padded keys are never seen (every
    row's limit is at most L); padded rows see nothing (limit 0)."""

    grouped: jax.Array        # [b, rows', k, g, d], pre-scaled
    segment: jax.Array        # int [b, rows']
    limit: jax.Array          # int [b, rows']
    key: jax.Array            # [b, L', k, d]
    value: jax.Array          # [b, L', k, d]
    key_segment: jax.Array    # int [b, L']
    key_blocks: jax.Array     # int [rows' / query_block]: key blocks a query block reads (the rest it cannot see)


def _tiles(grouped, key, value, query_segment, query_limit, key_segment, layout: _Layout) -> _Tiles:
    rows = -(-grouped.shape[1] // layout.query_block) * layout.query_block
    keys = -(-layout.clean_length // layout.key_block) * layout.key_block
    limit = _pad_rows(query_limit, rows)
    reach = jnp.max(limit.reshape(limit.shape[0], -1, layout.query_block), axis=(0, 2))
    return _Tiles(_pad_rows(grouped, rows), _pad_rows(query_segment, rows), limit, _pad_rows(key, keys),
                  _pad_rows(value, keys), _pad_rows(key_segment, keys), -(-reach // layout.key_block))


def _tile(tiles: _Tiles, layout: _Layout, query_tile, key_tile):
    """(grouped [b, qb, k, g, d], key, value [b, kb, k, d], allowed bool [b, qb, kb]) of one tile pair."""
    rows = lambda x: jax.lax.dynamic_slice_in_dim(x, query_tile * layout.query_block, layout.query_block, axis=1)
    keys = lambda x: jax.lax.dynamic_slice_in_dim(x, key_tile * layout.key_block, layout.key_block, axis=1)
    index = key_tile * layout.key_block + jnp.arange(layout.key_block)
    allowed = ((rows(tiles.segment)[:, :, None] == keys(tiles.key_segment)[:, None, :])
               & (index[None, None, :] < rows(tiles.limit)[:, :, None]))
    return rows(tiles.grouped), keys(tiles.key), keys(tiles.value), allowed


def _own_blocks(x: jax.Array, layout: _Layout, axis: int = 1) -> jax.Array:
    """The noisy rows of x as a batch of their blocks: [b, ..., N*B (at axis), ...] -> [b*N, ..., B, ...]."""
    noisy = jax.lax.slice_in_dim(x, layout.clean_length, x.shape[axis], axis=axis)
    noisy = jnp.moveaxis(noisy, axis, 1)
    noisy = noisy.reshape((noisy.shape[0] * (noisy.shape[1] // layout.block_size), layout.block_size)
                          + noisy.shape[2:])
    return jnp.moveaxis(noisy, 1, axis)


def _from_own_blocks(x: jax.Array, batch: int, axis: int = 1) -> jax.Array:
    """Inverse of `_own_blocks` for the noisy rows: [b*N, ..., B, ...] -> [b, ..., N*B, ...]."""
    x = jnp.moveaxis(x, axis, 1)
    x = x.reshape((batch, -1) + x.shape[2:])
    return jnp.moveaxis(x, 1, axis)


def _forward(query, key, value, query_segment, query_limit, key_segment, layout: _Layout):
    """(out [b, rows, heads, d] in the query's dtype, float32 log-sum-exp [b, kv_heads, group, rows])."""
    batch, rows, _, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = _grouped(query, kv_heads)
    tiles = _tiles(grouped, key, value, query_segment, query_limit, key_segment, layout)
    group, size = grouped.shape[3], layout.query_block
    empty = lambda *shape: Running(jnp.full((batch, kv_heads, group) + shape, -jnp.inf, _F32),
                                   jnp.zeros((batch, kv_heads, group) + shape, _F32),
                                   jnp.zeros((batch, kv_heads, group) + shape + (head_dim,), _F32))

    def query_tile(tile, whole: Running) -> Running:
        def key_tile(key_index, running):
            query_rows, keys, values, allowed = _tile(tiles, layout, tile, key_index)
            return absorb(running, query_rows, keys, values, allowed)

        part = jax.lax.fori_loop(0, tiles.key_blocks[tile], key_tile, empty(size))
        put = lambda all_rows, rows_of_tile: jax.lax.dynamic_update_slice_in_dim(all_rows, rows_of_tile, tile * size,
                                                                                  axis=3)
        return Running(*map(put, whole, part))

    running = jax.lax.fori_loop(0, tiles.key_blocks.shape[0], query_tile, empty(tiles.grouped.shape[1]))
    running = Running(*(_pad_rows(x, rows, axis=3) for x in running))
    if rows > layout.clean_length:  # each noisy row's own block: every row of it
        own = lambda x: _own_blocks(x, layout, axis=3)
        blocks = batch * ((rows - layout.clean_length) // layout.block_size)
        noisy = absorb(Running(*map(own, running)), _own_blocks(grouped, layout), _own_blocks(key, layout),
                       _own_blocks(value, layout), jnp.ones((blocks, layout.block_size, layout.block_size), bool))
        clean = lambda x: x[:, :, :, :layout.clean_length]
        running = Running(*(jnp.concatenate([clean(whole), _from_own_blocks(part, batch, axis=3)], axis=3)
                            for whole, part in zip(running, noisy, strict=True)))
    seen = running.total > 0
    out = running.weighted / jnp.where(seen, running.total, 1.0)[..., None]
    log_sum_exp = jnp.where(seen, running.peak + jnp.log(jnp.where(seen, running.total, 1.0)), -jnp.inf)
    return rearrange(out, "b k g t d -> b t (k g) d").astype(query.dtype), log_sum_exp


def _score_gradients(grouped, key, value, allowed, log_sum_exp, d_out, delta):
    """One tile's share of the backward pass. grouped: [b, t, k, g, d] (pre-scaled); key, value:
    [b, s, k, d]; allowed: bool [b, t, s]; log_sum_exp, delta: [b, k, g, t]; d_out: float32
    [b, k, g, t, d] -> (d_grouped [b, k, g, t, d], d_key, d_value [b, s, k, d]), float32."""
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=_F32)
    finite = jnp.where(jnp.isfinite(log_sum_exp), log_sum_exp, 0.0)
    weights = jnp.where(allowed[:, None, None], jnp.exp(scores - finite[..., None]), 0.0)  # softmax, [b,k,g,t,s]
    d_value = jnp.einsum("bkgts,bkgtd->bskd", weights, d_out)
    d_weights = jnp.einsum("bkgtd,bskd->bkgts", d_out, value.astype(_F32))
    d_scores = weights * (d_weights - delta[..., None])
    d_grouped = jnp.einsum("bkgts,bskd->bkgtd", d_scores, key.astype(_F32))
    d_key = jnp.einsum("bkgts,btkgd->bskd", d_scores, grouped.astype(_F32))
    return d_grouped, d_key, d_value


def _backward(layout: _Layout, saved, d_out):
    query, key, value, query_segment, query_limit, key_segment, out, log_sum_exp = saved
    batch, rows, _, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = _grouped(query, kv_heads)
    tiles = _tiles(grouped, key, value, query_segment, query_limit, key_segment, layout)
    to_heads = lambda x: rearrange(x.astype(_F32), "b t (k g) d -> b k g t d", k=kv_heads)
    d_out = to_heads(d_out)
    delta = jnp.sum(d_out * to_heads(out), axis=-1)  # [b, k, g, t]: Σ_j P_ij dP_ij, the softmax's correction
    size = layout.query_block
    padded = lambda x: _pad_rows(x, tiles.grouped.shape[1], axis=3)
    tile_rows = lambda x, tile: jax.lax.dynamic_slice_in_dim(x, tile * size, size, axis=3)
    log_sum_exp_rows, d_out_rows, delta_rows = padded(log_sum_exp), padded(d_out), padded(delta)

    def query_tile(tile, carry):
        d_grouped_all, d_key_all, d_value_all = carry

        def key_tile(key_index, carry):
            d_grouped, d_key_all, d_value_all = carry
            query_rows, keys, values, allowed = _tile(tiles, layout, tile, key_index)
            d_rows, d_key, d_value = _score_gradients(query_rows, keys, values, allowed,
                                                      tile_rows(log_sum_exp_rows, tile), tile_rows(d_out_rows, tile),
                                                      tile_rows(delta_rows, tile))
            first = key_index * layout.key_block
            add = lambda whole, part: jax.lax.dynamic_update_slice_in_dim(
                whole, jax.lax.dynamic_slice_in_dim(whole, first, layout.key_block, axis=1) + part, first, axis=1)
            return d_grouped + d_rows, add(d_key_all, d_key), add(d_value_all, d_value)

        d_grouped, d_key_all, d_value_all = jax.lax.fori_loop(
            0, tiles.key_blocks[tile], key_tile, (jnp.zeros(tile_rows(d_out_rows, tile).shape, _F32), d_key_all,
                                                  d_value_all))
        d_grouped_all = jax.lax.dynamic_update_slice_in_dim(d_grouped_all, d_grouped, tile * size, axis=3)
        return d_grouped_all, d_key_all, d_value_all

    zeros_like = lambda x: jnp.zeros(x.shape, _F32)
    d_grouped, d_key, d_value = jax.lax.fori_loop(
        0, tiles.key_blocks.shape[0], query_tile, (zeros_like(d_out_rows), zeros_like(tiles.key),
                                                   zeros_like(tiles.value)))
    d_grouped = _pad_rows(d_grouped, rows, axis=3)
    d_key, d_value = (_pad_rows(x, rows) for x in (d_key, d_value))  # the noisy keys' rows, zero so far
    if rows > layout.clean_length:
        own = lambda x: _own_blocks(x, layout, axis=3)
        blocks = batch * ((rows - layout.clean_length) // layout.block_size)
        d_own, d_own_key, d_own_value = _score_gradients(
            _own_blocks(grouped, layout), _own_blocks(key, layout), _own_blocks(value, layout),
            jnp.ones((blocks, layout.block_size, layout.block_size), bool), own(log_sum_exp), own(d_out), own(delta))
        noisy = lambda whole, part, axis: jnp.concatenate(
            [jax.lax.slice_in_dim(whole, 0, layout.clean_length, axis=axis),
             jax.lax.slice_in_dim(whole, layout.clean_length, rows, axis=axis) + _from_own_blocks(part, batch, axis)],
            axis=axis)
        d_grouped = noisy(d_grouped, d_own, 3)
        d_key, d_value = noisy(d_key, d_own_key, 1), noisy(d_value, d_own_value, 1)
    d_query = rearrange(d_grouped, "b k g t d -> b t (k g) d") * head_dim ** -0.5
    return d_query.astype(query.dtype), d_key.astype(key.dtype), d_value.astype(value.dtype), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(query, key, value, query_segment, query_limit, key_segment, layout):
    return _forward(query, key, value, query_segment, query_limit, key_segment, layout)[0]


def _attention_forward(query, key, value, query_segment, query_limit, key_segment, layout):
    out, log_sum_exp = _forward(query, key, value, query_segment, query_limit, key_segment, layout)
    return out, (query, key, value, query_segment, query_limit, key_segment, out, log_sum_exp)


_attention.defvjp(_attention_forward, _backward)
