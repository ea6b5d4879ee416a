"""Routed experts with per-expert LoRA adapters, as grouped matmuls (a LoRA or QLoRA training pass).

Each (token, choice) pair is sorted by expert, as the expert loop sorts them
(`expert_dispatch._pairs`); then every product is one grouped matmul over the sorted rows
(`jax.lax.ragged_dot`, group sizes = pairs per expert), the frozen weight's and the rank-r
factors' alike:

    gate|up = rows W_guᵀ + (rows A_guᵀ) B_gu        rows: [pairs, hidden], sorted by expert
    out     = act W_downᵀ + (act A_downᵀ) B_down    act = silu(gate) * up

(B as `ExpertAdapters` holds it: [r, out] per expert.)

The factors are float32 parameters; the products with the rows run in the compute dtype, the
rank-r products and the sums in float32.

There is no loop over experts, and every grouped matmul has gradients for its rows and its float
weights, so reverse-mode differentiation goes straight through: the frozen stacks get no gradient
(they are not differentiated), the factors get theirs, and the rows' gradient reaches the layers
below. The same path serves a quantised base (QLoRA) with or without expert adapters: the expert
loop over `QuantizedWeight`s has data-dependent trip counts, which reverse mode cannot go through.

Which grouped matmul: the pass's `ExpertRule`. "grouped" (GPU and TPU in training, or asked for on
CPU, interpreted) takes the kernels of `pallas_kernels.grouped_matmul_for_platform`, which read a
quantised base as stored and dequantise tile by tile in the forward and in the rows' gradient alike
(the base is frozen, so it needs no weight gradient): no float copy of the stack exists. Otherwise
(CPU) `jax.lax.ragged_dot`, after dequantising the stack to the compute dtype for the step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.kernels import ExpertRule
from clover_jax.core.quantization import QuantizedWeight, dequantize
from clover_jax.nn.expert_dispatch import _pairs, expert_count, stacked
from pallas_kernels.platforms import grouped_matmul_kernel


class ExpertAdapters(NamedTuple):
    """One layer's routed-expert LoRA factors (float32; the scale folded into B), or None where the
    stack has none: gate_up_a [experts, r, hidden], gate_up_b [experts, r, 2 * intermediate],
    down_a [experts, r, intermediate], down_b [experts, r, hidden].

    B holds its rank axis before its output axis (the transpose of a trained B's [out, r],
    `clover_jax.adapters.lora.attach`): a TPU lays a float32 array out in tiles of 8 x 128 over its
    last two axes, so a last axis of rank 16 takes 128 lanes, 8 times its bytes, and the layer
    scan's backward stacks every layer's gradient of B before the optimizer reads it. The grouped
    matmul reads B as it is (`transpose_rhs=False`): the compiler lays arrays out to suit the
    kernels' operands. Measured on v5e-8 (LoRA r16 on every target, 8 x 4,096, mesh (4, 2, 1),
    base and layer inputs in host memory): the step's temporaries 12.52 GiB with B as [out, r],
    12.49 with B transposed for the pass but handed to the kernel as [out, r], 10.34 as here."""

    gate_up_a: jax.Array | None
    gate_up_b: jax.Array | None
    down_a: jax.Array | None
    down_b: jax.Array | None


def adapted_expert_mlp(tokens: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                       gate_up_proj: "jax.Array | QuantizedWeight", down_proj: "jax.Array | QuantizedWeight",
                       adapters: ExpertAdapters, rule: ExpertRule | None = None) -> jax.Array:
    """`routed_expert_mlp`'s result (tokens [tokens, hidden], expert_ids / expert_weights
    [tokens, top_k]; stacks [experts, out, in], float or quantised) with the adapters added to
    each expert's two projections. rule: the pass's (`KernelChoice.expert_rule`); "grouped" takes
    the grouped-matmul kernels, anything else `jax.lax.ragged_dot`; its `chunk_rows`, when the
    tokens are more, runs them a chunk at a time (`_in_chunks`). returns [tokens, hidden] in the
    dtype of `tokens`."""
    chunk_rows = rule.chunk_rows if rule is not None else None
    if chunk_rows and tokens.shape[0] > chunk_rows:
        return _in_chunks(tokens, expert_ids, expert_weights, chunk_rows, expert_count(stacked(gate_up_proj)),
                          lambda *chunk: _adapted_pairs(*chunk, gate_up_proj, down_proj, adapters, rule))
    return _adapted_pairs(tokens, expert_ids, expert_weights, gate_up_proj, down_proj, adapters, rule)


def _in_chunks(tokens: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, chunk_rows: int,
               num_experts: int, run) -> jax.Array:
    """`run(tokens, expert_ids, expert_weights)` over consecutive chunks of at most `chunk_rows`
    tokens, one at a time, each chunk rematerialised in the backward pass: its sorted rows and
    grouped-matmul outputs ([pairs, hidden] and [pairs, 2 x intermediate] per projection, and
    their gradients) exist for one chunk at a time. Every token's output is its own, so the
    result is the unchunked one. The tokens are padded to equal chunks by rows routed nowhere
    (expert id `num_experts`, weight 0: no group holds their pairs), dropped after."""
    num_tokens, hidden = tokens.shape
    chunks = -(-num_tokens // chunk_rows)
    rows = -(-num_tokens // chunks)
    pad = chunks * rows - num_tokens
    padded = (jnp.pad(tokens, ((0, pad), (0, 0))),
              jnp.pad(expert_ids, ((0, pad), (0, 0)), constant_values=num_experts),
              jnp.pad(expert_weights, ((0, pad), (0, 0))))
    by_chunk = [value.reshape((chunks, rows) + value.shape[1:]) for value in padded]
    outputs = jax.lax.map(jax.checkpoint(lambda chunk: run(*chunk)), tuple(by_chunk))
    return outputs.reshape(chunks * rows, hidden)[:num_tokens]


def _adapted_pairs(tokens, expert_ids, expert_weights, gate_up_proj, down_proj, adapters, rule):
    """`adapted_expert_mlp` over all its tokens at once."""
    dtype = tokens.dtype
    gate_up_proj, down_proj = stacked(gate_up_proj), stacked(down_proj)
    num_experts = expert_count(gate_up_proj)
    pairs = _pairs(expert_ids, expert_weights, num_experts, dtype)
    sizes = pairs.group_sizes  # pairs of experts not held here sort last, past every group: their rows are 0
    matmul = _grouped_matmul(rule, sizes) if rule is not None and rule.kernel == "grouped" else _ragged_matmul(sizes)

    def project(rows, weight, a, b):
        # [pairs, in] x [experts, out, in] per group, in the compute dtype; the rank-r product
        # (B [experts, r, out] read as it is) and the sum in float32. The rows enter the
        # adapter's A in the compute dtype (its float32 factor cast, as a LoRA runs under bfloat16
        # autocast): a float32 copy of the rows, and a float32 gradient for them, would be
        # [pairs, hidden] each — 0.8 GB per layer at 98,304 pairs (one 4,096-token sequence,
        # three streams, top-8).
        out = matmul(rows, weight, dtype)
        if a is None:
            return out
        inner = matmul(rows, a.astype(dtype), dtype).astype(jnp.float32)   # [pairs, r]
        return (out.astype(jnp.float32) + matmul(inner, b, jnp.float32, transpose=False)).astype(dtype)

    rows = tokens[pairs.sorted_tokens]
    gate, up = jnp.split(project(rows, gate_up_proj, adapters.gate_up_a, adapters.gate_up_b), 2, axis=-1)
    pair_outputs = project(jax.nn.silu(gate) * up, down_proj, adapters.down_a, adapters.down_b)
    return jnp.zeros_like(tokens).at[pairs.sorted_tokens].add(pair_outputs * pairs.kept[:, None])


def _ragged_matmul(sizes: jax.Array):
    """XLA's grouped matmul; a quantised stack is dequantised whole to the compute dtype first.
    weight: [experts, out, in], or [experts, in, out] with transpose=False (a factor B)."""
    def matmul(rows, weight, dtype, transpose=True):
        weight = dequantize(weight, dtype)
        return jax.lax.ragged_dot(rows, jnp.swapaxes(weight, 1, 2) if transpose else weight, sizes)
    return matmul


def _grouped_matmul(rule: ExpertRule, sizes: jax.Array):
    """The grouped-matmul kernels of `rule` (and their backward): a quantised stack is read as
    stored and dequantised tile by tile, for the output and for the rows' gradient alike, so no
    float copy of it exists; float factors get their gradient from the transposed grouped matmul."""
    from pallas_kernels import grouped_matmul_for_platform  # imported on use: Pallas costs startup time on CPU

    def matmul(rows, weight, dtype, transpose=True):
        quantized = isinstance(weight, QuantizedWeight)
        values, scales = (weight.values, weight.scales) if quantized else (weight, None)
        kernel = "pallas" if rule.platform == "cpu" else grouped_matmul_kernel(rule.platform, "auto", False, quantized)
        return grouped_matmul_for_platform(rule.platform, rows.astype(dtype), values, sizes, rhs_scales=scales,
                                           preferred_element_type=dtype, kernel=kernel, interpret=rule.interpret,
                                           transpose_rhs=transpose)
    return matmul


def is_quantized(stack) -> bool:
    return isinstance(stack, QuantizedWeight) or (isinstance(stack, tuple) and isinstance(stack[0], QuantizedWeight))
