"""Routed experts as a grouped computation: each distinct expert's weights are read once per
pass, and compute follows the routed (token, choice) pairs.

Two implementations of one function, chosen by `KernelChoice.moe`:

* "xla" (`routed_expert_mlp`, below);
* "pallas" (`grouped_expert_mlp`): the pairs sorted by expert go through two grouped matmuls
  (`pallas_kernels.grouped_matmul_for_platform`: megablox `gmm` on TPU, our Pallas kernel on
  GPU and for quantised experts, interpret mode on CPU); experts that no pair uses get no work
  tiles, so their weights are never read — with the block coreset, a denoising step reads only
  the coreset's experts. Quantised experts stay quantised: the kernel dequantises each tile.
  Differentiable through the grouped matmuls' own backward pass (what training runs on GPU and
  TPU, `KernelChoice.for_training`).

The XLA form loops over experts, not over pairs. The pairs are sorted by expert; an outer
`while_loop` visits the experts that at least one pair uses (as many iterations as there are
such experts, not one per expert of the layer), takes that expert's weights once, and an inner
`while_loop` runs its pairs in row tiles of static height. No `lax.cond` is involved: a loop
trip count is data, so unused experts cost nothing, and nothing is copied through a branch.

Why this shape, measured on XLA:CPU (see `docs/performance.md`): any dynamic selection of
an expert (`take`, gather, dynamic slice) is materialised as a copy before the matmul; taken
once per expert and reused by all of that expert's tiles, the copy stays in cache and the
step reads each used expert from memory once. Per-pair tiles (the earlier form) re-read an
expert for every pair routed to it, and `jax.lax.ragged_dot` there costs time in proportion to
the expert count. The tile height adapts to the pass: one row in decoding, up to 128 rows in
long prefills.

The experts may also come one buffer per expert (a tuple, the CPU run layout of
`clover_jax.nn.run_layout.unstack_groups`): a single row then reads each chosen expert in place
through a `switch` over the experts, where indexing a stack would copy it first (measured,
medium model's experts, 8 layers x 8 experts of 3 MB, one row: 6.4 ms against 10.8 ms).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.kernels import EXPERT_STRATEGIES as STRATEGIES
from clover_jax.core.quantization import QuantizedWeight, dequantize, take


def per_expert(weights) -> bool:
    """Whether routed-expert weights are held one buffer per expert (a tuple of arrays or of
    `QuantizedWeight`s) rather than as one `[experts, ...]` stack."""
    return type(weights) is tuple  # a QuantizedWeight is a tuple too, but not exactly one


def stacked(weights):
    """Routed-expert weights as one `[experts, ...]` stack (a copy when held one buffer per expert)."""
    if per_expert(weights):
        return jax.tree_util.tree_map(lambda *experts: jnp.stack(experts), *weights)
    return weights


def expert_count(weights) -> int:
    return len(weights) if per_expert(weights) else weights.shape[0]


def one_expert(weights, expert: jax.Array, dtype) -> jax.Array:
    """Expert `expert`'s weight (traced index) in `dtype`, dequantised when quantised and
    materialised: XLA:CPU copies a dynamic slice of a stack, and a `switch` over per-expert
    buffers returns a copy of the chosen one."""
    if per_expert(weights):
        return jax.lax.switch(expert, [functools.partial(dequantize, weight, dtype) for weight in weights])
    return dequantize(take(weights, expert), dtype)


def expert_output(gate_up: jax.Array, down: jax.Array, rows: jax.Array) -> jax.Array:
    """down(silu(gate(x)) * up(x)) of one expert. rows: [m, hidden]; gate_up: [2I, hidden];
    down: [hidden, I] (either may be quantised) -> [m, hidden] in the dtype of `rows`."""
    gate, up = jnp.split(jnp.einsum("mh,ih->mi", rows, dequantize(gate_up, rows.dtype)), 2, axis=-1)
    return jnp.einsum("mi,hi->mh", jax.nn.silu(gate) * up, dequantize(down, rows.dtype))


def tile_rows_for(num_pairs: int, num_experts: int) -> int:
    """The power of two at or below the mean pairs per expert that can be used, in [1, 128]:
    most experts fill one or two tiles, and padding stays under one tile per expert (measured on
    a 32-row block: a quarter of the mean was 1.6x slower, the loop paying per tile)."""
    target = max(1, num_pairs // min(num_experts, num_pairs))
    return min(128, 1 << (target.bit_length() - 1))


def routed_expert_mlp(
    tokens: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    strategy: str = "auto",
) -> jax.Array:
    """Σ_choices weight · down(silu(gate(x)) * up(x)) of each token's chosen experts.

    tokens: [tokens, hidden]; expert_ids: int [tokens, top_k]; expert_weights: [tokens, top_k]
    (an id >= experts means "not held here": the pair is dropped, as an expert-parallel shard
    does with the pairs routed to other shards)
    gate_up_proj: [experts, 2 * intermediate, hidden] (gate rows first); down_proj: [experts, hidden, intermediate]
    (the checkpoint's `[out, in]` layout, so loading is a contiguous copy); either may be a `QuantizedWeight`,
    or a tuple of one expert's weights each (`per_expert`)
    strategy: "loop" (the expert-major loops; over float stacks differentiable through a written-out
    backward of the same shape, which training runs), "dense" (every expert for every token,
    weighted by the routing) or "auto" ("loop": measured faster than "dense" at every row count, even
    on the bundled model's 8 experts of 18K parameters; see below)
    returns [tokens, hidden] in the dtype of `tokens`
    """
    num_tokens = expert_ids.shape[0]
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "auto":
        # Measured on XLA:CPU, 2 cores, the bundled model's experts (8 x 18K parameters, top-2),
        # standalone: 1 token 29 vs 73 us (loop vs dense), 16 tokens 122 vs 134, 256 tokens
        # 266 vs 654; in the model, decoding tokens/s rose ~40% in every mode. Dense pays for
        # every expert on every token, which outgrows the loop's per-iteration cost at once.
        strategy = "loop"
    if strategy == "dense":
        return _every_expert_mlp(tokens, expert_ids, expert_weights, stacked(gate_up_proj), stacked(down_proj))
    if num_tokens == 1:
        return _single_token_mlp(tokens, expert_ids[0], expert_weights[0], gate_up_proj, down_proj)
    if per_expert(gate_up_proj) or isinstance(gate_up_proj, QuantizedWeight) or isinstance(down_proj, QuantizedWeight):
        return _expert_loop(tokens, expert_ids, expert_weights, gate_up_proj, down_proj)
    # Float stacks (what training holds): the same loop, with a backward pass of the same shape.
    return _differentiable_expert_loop(tokens, expert_ids, expert_weights, gate_up_proj, down_proj)


class _Pairs(NamedTuple):
    """The (token, choice) pairs sorted by expert: order int [pairs] (into the flattened
    [tokens * top_k] choices), sorted_tokens int [pairs], kept float [pairs] (the routing weight,
    0 for a pair whose expert is not held here), group_sizes / group_starts int [experts], the
    used experts in ascending order (padded) and their count, and the tile height."""

    order: jax.Array
    sorted_tokens: jax.Array
    kept: jax.Array
    group_sizes: jax.Array
    group_starts: jax.Array
    used: jax.Array
    num_used: jax.Array
    tile_rows: int


def _pairs(expert_ids: jax.Array, expert_weights: jax.Array, num_experts: int, dtype) -> _Pairs:
    num_tokens, top_k = expert_ids.shape
    num_pairs = num_tokens * top_k
    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)  # ids >= num_experts (dropped pairs) sort last
    pair_weights = expert_weights.reshape(-1)[order].astype(dtype)
    group_sizes = jnp.zeros(num_experts, jnp.int32).at[flat_experts].add(1, mode="drop")
    # The used experts in ascending order, padded with an unused index that is never visited.
    used = jnp.nonzero(group_sizes, size=min(num_experts, num_pairs), fill_value=0)[0]
    return _Pairs(order, order // top_k, jnp.where(flat_experts[order] < num_experts, pair_weights, 0), group_sizes,
                  jnp.cumsum(group_sizes) - group_sizes, used, jnp.sum(group_sizes > 0),
                  # An expert holds at most one pair per token: no expert needs a tile taller than the tokens.
                  min(tile_rows_for(num_pairs, num_experts), num_tokens))


def _visit_tiles(pairs: _Pairs, carry, *, enter, tile, leave=None):
    """The expert-major loops: for every used expert in ascending order, `local = enter(expert)`,
    then for each of its tiles `carry, local = tile(carry, local, offset, valid)` (offset: the
    tile's first row in pair order; valid bool [tile_rows]: its rows that are the expert's, the
    others belonging to the next expert, visited later), then `carry = leave(carry, local, expert)`.
    Loop trip counts are data: unused experts cost nothing."""
    tile_rows = pairs.tile_rows

    def expert_step(outer):
        slot, carry = outer
        expert = pairs.used[slot]
        first, count = pairs.group_starts[expert], pairs.group_sizes[expert]

        def tile_step(inner):
            index, carry, local = inner
            valid = index * tile_rows + jnp.arange(tile_rows) < count
            return (index + 1,) + tile(carry, local, first + index * tile_rows, valid)

        num_tiles = (count + tile_rows - 1) // tile_rows
        _, carry, local = jax.lax.while_loop(lambda c: c[0] < num_tiles, tile_step, (jnp.int32(0), carry,
                                                                                    enter(expert)))
        return slot + 1, carry if leave is None else leave(carry, local, expert)

    return jax.lax.while_loop(lambda c: c[0] < pairs.num_used, expert_step, (jnp.int32(0), carry))[1]


def _expert_loop(tokens, expert_ids, expert_weights, gate_up_proj, down_proj):
    """The expert-major loops (see the module docstring). Arguments as `routed_expert_mlp`."""
    pairs = _pairs(expert_ids, expert_weights, expert_count(gate_up_proj), tokens.dtype)
    num_pairs, tile_rows = pairs.order.shape[0], pairs.tile_rows
    # Rows in expert order, with one tile of padding so that a tile may run past the last pair.
    sorted_rows = jnp.zeros((num_pairs + tile_rows, tokens.shape[-1]), tokens.dtype).at[:num_pairs].set(
        tokens[pairs.sorted_tokens])

    def enter(expert):
        # Materialised once for all of the expert's tiles: measured on XLA:CPU, tiles reading a copy
        # beat tiles reading per-expert buffers in place (the copy stays in cache between tiles).
        return one_expert(gate_up_proj, expert, tokens.dtype), one_expert(down_proj, expert, tokens.dtype)

    def tile(pair_outputs, weights, offset, valid):
        out = expert_output(*weights, jax.lax.dynamic_slice_in_dim(sorted_rows, offset, tile_rows))
        # Rows past this expert's pairs belong to the next expert, which overwrites them later.
        return jax.lax.dynamic_update_slice_in_dim(pair_outputs, out, offset, axis=0), weights

    pair_outputs = _visit_tiles(pairs, jnp.zeros_like(sorted_rows), enter=enter, tile=tile)
    weighted = pair_outputs[:num_pairs] * pairs.kept[:, None]
    return jnp.zeros_like(tokens).at[pairs.sorted_tokens].add(weighted)


@jax.custom_vjp
def _differentiable_expert_loop(tokens, expert_ids, expert_weights, gate_up_proj, down_proj):
    """`_expert_loop` over float stacks, with a backward pass of the same shape: reverse-mode
    differentiation cannot go through data-dependent trip counts, so the backward is written out
    (tested against the dense form's gradient): per used expert and tile, recompute the
    activations, then d(rows), d(routing weight) and the expert's d(gate_up), d(down)."""
    return _expert_loop(tokens, expert_ids, expert_weights, gate_up_proj, down_proj)


def _expert_loop_forward(tokens, expert_ids, expert_weights, gate_up_proj, down_proj):
    out = _expert_loop(tokens, expert_ids, expert_weights, gate_up_proj, down_proj)
    return out, (tokens, expert_ids, expert_weights, gate_up_proj, down_proj)


def _expert_loop_backward(residuals, d_out):
    tokens, expert_ids, expert_weights, gate_up_proj, down_proj = residuals
    num_experts = gate_up_proj.shape[0]
    pairs = _pairs(expert_ids, expert_weights, num_experts, tokens.dtype)
    num_pairs, tile_rows = pairs.order.shape[0], pairs.tile_rows
    padded = lambda rows: jnp.zeros((num_pairs + tile_rows, rows.shape[-1]), rows.dtype).at[:num_pairs].set(rows)
    sorted_rows = padded(tokens[pairs.sorted_tokens])
    # d(output of a pair) = its routing weight · d_out of its token; the weight's own gradient
    # needs the pair's unweighted output, recomputed below.
    sorted_d_out = padded(d_out[pairs.sorted_tokens].astype(tokens.dtype))
    kept = jnp.pad(pairs.kept, (0, tile_rows))

    def enter(expert):
        gate_up, down = gate_up_proj[expert].astype(tokens.dtype), down_proj[expert].astype(tokens.dtype)
        return gate_up, down, jnp.zeros_like(gate_up), jnp.zeros_like(down)

    def tile(carry, local, offset, valid):
        d_rows, d_kept = carry
        gate_up, down, d_gate_up, d_down = local
        rows = jax.lax.dynamic_slice_in_dim(sorted_rows, offset, tile_rows)
        d_pair = jax.lax.dynamic_slice_in_dim(sorted_d_out, offset, tile_rows) * valid[:, None]
        weight = jax.lax.dynamic_slice_in_dim(kept, offset, tile_rows)
        gate, up = jnp.split(jnp.einsum("mh,ih->mi", rows, gate_up), 2, axis=-1)
        activated = jax.nn.silu(gate) * up
        out = jnp.einsum("mi,hi->mh", activated, down)                     # the pair's unweighted output
        d_weight = jnp.sum(out * d_pair, axis=-1)                          # [m]
        d_out_pair = d_pair * weight[:, None]
        d_activated = jnp.einsum("mh,hi->mi", d_out_pair, down)
        d_down = d_down + jnp.einsum("mh,mi->hi", d_out_pair, activated)
        sigmoid = jax.nn.sigmoid(gate)
        d_gate = d_activated * up * sigmoid * (1 + gate * (1 - sigmoid))    # silu'(g) = σ(g)(1 + g(1 − σ(g)))
        d_hidden = jnp.concatenate([d_gate, d_activated * jax.nn.silu(gate)], axis=-1)
        d_gate_up = d_gate_up + jnp.einsum("mi,mh->ih", d_hidden, rows)
        d_rows = jax.lax.dynamic_update_slice_in_dim(d_rows, jnp.einsum("mi,ih->mh", d_hidden, gate_up), offset,
                                                     axis=0)
        d_kept = jax.lax.dynamic_update_slice_in_dim(d_kept, d_weight, offset, axis=0)
        return (d_rows, d_kept), (gate_up, down, d_gate_up, d_down)

    def leave(carry, local, expert):
        d_rows, d_kept, d_gate_up_all, d_down_all = carry
        return (d_rows, d_kept, d_gate_up_all.at[expert].set(local[2]), d_down_all.at[expert].set(local[3]))

    def tile_all(carry, local, offset, valid):
        (d_rows, d_kept), local = tile(carry[:2], local, offset, valid)
        return (d_rows, d_kept) + carry[2:], local

    d_rows, d_kept, d_gate_up, d_down = _visit_tiles(
        pairs, (jnp.zeros_like(sorted_rows), jnp.zeros_like(kept), jnp.zeros(gate_up_proj.shape, tokens.dtype),
                jnp.zeros(down_proj.shape, tokens.dtype)), enter=enter, tile=tile_all, leave=leave)
    d_tokens = jnp.zeros_like(tokens).at[pairs.sorted_tokens].add(d_rows[:num_pairs])
    flat_held = expert_ids.reshape(-1)[pairs.order] < num_experts
    d_weights = jnp.zeros(expert_ids.size, expert_weights.dtype).at[pairs.order].set(
        jnp.where(flat_held, d_kept[:num_pairs], 0).astype(expert_weights.dtype)).reshape(expert_weights.shape)
    return (d_tokens, None, d_weights, d_gate_up.astype(gate_up_proj.dtype), d_down.astype(down_proj.dtype))


_differentiable_expert_loop.defvjp(_expert_loop_forward, _expert_loop_backward)


def _every_expert_mlp(tokens, expert_ids, expert_weights, gate_up_proj, down_proj):
    """Every expert on every token, each output weighted by the token's routing weight for that
    expert (0 where it was not chosen, or not held here): two matmuls and no loop."""
    num_experts = gate_up_proj.shape[0]
    routing = jnp.sum(jax.nn.one_hot(expert_ids, num_experts, dtype=tokens.dtype)
                      * expert_weights[..., None].astype(tokens.dtype), axis=1)            # [tokens, experts]
    gate, up = jnp.split(jnp.einsum("th,eih->tei", tokens, dequantize(gate_up_proj, tokens.dtype)), 2, axis=-1)
    outputs = jnp.einsum("tei,ehi->teh", jax.nn.silu(gate) * up, dequantize(down_proj, tokens.dtype))
    # Weighted after the down projection, as the reference implementation does (same rounding order).
    return jnp.einsum("teh,te->th", outputs, routing)


def _single_token_mlp(token, expert_ids, expert_weights, gate_up_proj, down_proj):
    """One token (an autoregressive step at batch 1): its top-k experts are distinct, so a scan
    over the choices reads each routed expert once — in place when the experts are held one
    buffer per expert (a `switch` picks the branch that reads it), through a copy of the
    stack's slice otherwise. token: [1, hidden]; ids, weights: [top_k]."""
    num_experts = expert_count(gate_up_proj)
    if per_expert(gate_up_proj):
        branches = [functools.partial(expert_output, gate_up, down)
                    for gate_up, down in zip(gate_up_proj, down_proj, strict=True)]
        output = lambda expert: jax.lax.switch(expert, branches, token)
    else:
        output = lambda expert: expert_output(take(gate_up_proj, expert), take(down_proj, expert), token)

    def choice(total, pair):
        expert, weight = pair
        held = expert < num_experts
        out = output(jnp.minimum(expert, num_experts - 1))
        return total + jnp.where(held, weight, 0).astype(token.dtype) * out, None

    total, _ = jax.lax.scan(choice, jnp.zeros_like(token), (expert_ids, expert_weights))
    return total


def grouped_expert_mlp(
    tokens: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    platform: str,
    kernel: str,
    interpret: bool,
) -> jax.Array:
    """`routed_expert_mlp` (same arguments and result) through grouped matmuls with `kernel`
    ("megablox", "pallas", ...: `pallas_kernels.grouped_matmul_for_platform`'s names) in
    `platform`'s driver, interpreted or not, as `KernelChoice.expert_rule` resolved them."""
    num_tokens, top_k = expert_ids.shape
    gate_up_proj, down_proj = stacked(gate_up_proj), stacked(down_proj)  # the kernels index one stack
    num_experts = gate_up_proj.shape[0]
    from pallas_kernels import grouped_matmul_for_platform  # imported on use: Pallas costs startup time on CPU

    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)  # ids >= num_experts sort last, past every group
    sorted_tokens = order // top_k
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)

    def matmul(rows, weights):
        # Quantised experts are read as stored and dequantised tile by tile inside the kernel.
        values, scales = (weights.values, weights.scales) if isinstance(weights, QuantizedWeight) else (weights, None)
        return grouped_matmul_for_platform(platform, rows, values, group_sizes, rhs_scales=scales, kernel=kernel,
                                           interpret=interpret)

    gate, up = jnp.split(matmul(tokens[sorted_tokens], gate_up_proj), 2, axis=-1)
    pair_outputs = matmul(jax.nn.silu(gate) * up, down_proj)  # rows of dropped pairs are 0
    pair_weights = expert_weights.reshape(-1)[order].astype(tokens.dtype)
    return jnp.zeros_like(tokens).at[sorted_tokens].add(pair_outputs * pair_weights[:, None])
