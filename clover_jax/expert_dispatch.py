"""Routed experts as a grouped computation whose cost follows tokens × top-k.

Two implementations of one function, chosen by `KernelChoice.moe`:

* "xla" (`routed_expert_mlp`, below);
* "pallas" (`grouped_expert_mlp`): the pairs sorted by expert go through two grouped matmuls
  (`pallas_kernels.grouped_matmul_for_platform`: megablox `gmm` on TPU, our Pallas kernel on
  GPU, interpret mode on CPU); experts that no pair uses get no work tiles, so their weights are
  never read — with the block coreset, a denoising step reads only the coreset's experts.

The XLA form:

The (token, choice) pairs are sorted by expert, packed into row tiles that each belong to one
expert, and a `lax.scan` runs the expert MLP tile by tile with that expert's weights. Tiles past
the ones in use are skipped with `lax.cond`, so work is proportional to the routed pairs, not
to the number of experts (`jax.lax.ragged_dot` on the XLA CPU backend costs time in proportion
to the expert count, measured in `benchmarks/`).

The static tile height adapts to the load: one row per tile in decoding (each pair reads only
its expert), up to 128 rows per tile in long prefills (matmul-sized tiles, with at most one
partial tile per expert of padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.quantization import dequantize, take
from pallas_kernels import grouped_matmul_for_platform


def tile_rows_for(num_pairs: int, num_experts: int) -> int:
    """A power of two close to a quarter of the mean rows per expert, in [1, 128]."""
    target = max(1, num_pairs // (4 * num_experts))
    return min(128, 1 << (target.bit_length() - 1))


def routed_expert_mlp(
    tokens: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
) -> jax.Array:
    """Σ_choices weight · down(silu(gate(x)) * up(x)) of each token's chosen experts.

    tokens: [tokens, hidden]; expert_ids: int [tokens, top_k]; expert_weights: [tokens, top_k]
    (an id >= experts means "not held here": the pair is dropped, as an expert-parallel shard
    does with the pairs routed to other shards)
    gate_up_proj: [experts, 2 * intermediate, hidden] (gate rows first); down_proj: [experts, hidden, intermediate]
    (the checkpoint's `[out, in]` layout, so loading is a contiguous copy); either may be a `QuantizedWeight`
    returns [tokens, hidden] in the dtype of `tokens`
    """
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_up_proj.shape[0]
    num_pairs = num_tokens * top_k
    tile_rows = tile_rows_for(num_pairs, num_experts)
    max_tiles = min(num_pairs, -(-num_pairs // tile_rows) + min(num_experts, num_pairs))

    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    sorted_tokens = order // top_k

    group_sizes = jnp.bincount(flat_experts, length=num_experts)
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    tiles_per_group = -(-group_sizes // tile_rows)
    tile_ends = jnp.cumsum(tiles_per_group)
    tiles_in_use = tile_ends[-1]
    # Each pair's row in the tiled layout: its group's first tile, then its rank in the group.
    rank_in_group = jnp.arange(num_pairs) - group_starts[sorted_experts]
    padded_rows = (tile_ends - tiles_per_group)[sorted_experts] * tile_rows + rank_in_group
    dropped = max_tiles * tile_rows  # an index past the tiled rows: scatters drop it, gathers fill 0
    padded_rows = jnp.where(sorted_experts < num_experts, padded_rows, dropped)
    tile_experts = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(max_tiles), side="right"), num_experts - 1)

    hidden = tokens.shape[-1]
    packed = jnp.zeros((max_tiles * tile_rows, hidden), tokens.dtype).at[padded_rows].set(
        tokens[sorted_tokens], mode="drop")
    packed = packed.reshape(max_tiles, tile_rows, hidden)

    def expert_mlp(rows, expert):
        # A quantised expert is dequantised here, one expert per tile: only its weights are read.
        gate_up = dequantize(take(gate_up_proj, expert), rows.dtype)
        gate, up = jnp.split(jnp.einsum("mh,ih->mi", rows, gate_up), 2, axis=-1)
        return jnp.einsum("mi,hi->mh", jax.nn.silu(gate) * up, dequantize(take(down_proj, expert), rows.dtype))

    def run_tile(_, tile):
        index, rows, expert = tile
        out = jax.lax.cond(index < tiles_in_use, expert_mlp, lambda rows, _: jnp.zeros_like(rows), rows, expert)
        return None, out

    _, outputs = jax.lax.scan(run_tile, None, (jnp.arange(max_tiles), packed, tile_experts))
    pair_outputs = outputs.reshape(max_tiles * tile_rows, hidden).at[padded_rows].get(mode="fill", fill_value=0)
    pair_weights = expert_weights.reshape(-1)[order].astype(tokens.dtype)
    weighted = pair_outputs * pair_weights[:, None]
    return jnp.zeros_like(tokens).at[sorted_tokens].add(weighted)


def grouped_expert_mlp(
    tokens: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    platform: str,
) -> jax.Array:
    """`routed_expert_mlp` (same arguments and result) through grouped-matmul kernels for `platform`
    ("cpu": the Pallas kernel in interpret mode, for parity tests; "gpu"; "tpu")."""
    num_tokens, top_k = expert_ids.shape
    num_experts = gate_up_proj.shape[0]
    # The Pallas grouped matmul has no quantised variant yet: quantised experts are dequantised whole.
    gate_up_proj, down_proj = dequantize(gate_up_proj, tokens.dtype), dequantize(down_proj, tokens.dtype)
    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)  # ids >= num_experts sort last, past every group
    sorted_tokens = order // top_k
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
    matmul = lambda rows, weights: grouped_matmul_for_platform(
        "cuda" if platform == "gpu" else platform, rows, weights, group_sizes,
        kernel="pallas" if platform == "cpu" else "auto", interpret=platform == "cpu")
    gate, up = jnp.split(matmul(tokens[sorted_tokens], gate_up_proj), 2, axis=-1)
    pair_outputs = matmul(jax.nn.silu(gate) * up, down_proj)  # rows of dropped pairs are 0
    pair_weights = expert_weights.reshape(-1)[order].astype(tokens.dtype)
    return jnp.zeros_like(tokens).at[sorted_tokens].add(pair_outputs * pair_weights[:, None])
