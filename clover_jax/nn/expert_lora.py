"""Routed experts with per-expert LoRA adapters, as grouped matmuls (a LoRA or QLoRA training pass).

Each (token, choice) pair is sorted by expert, as the expert loop sorts them
(`expert_dispatch._pairs`); then every product is one grouped matmul over the sorted rows
(`jax.lax.ragged_dot`, group sizes = pairs per expert), the frozen weight's and the rank-r
factors' alike:

    gate|up = rows W_guᵀ + (rows A_guᵀ) B_guᵀ      rows: [pairs, hidden], sorted by expert
    out     = act W_downᵀ + (act A_downᵀ) B_downᵀ   act = silu(gate) * up

There is no loop over experts, and `ragged_dot` has gradients for its rows and its weights, so
reverse-mode differentiation goes straight through: the frozen stacks get no gradient (they are
not differentiated), the factors get theirs, and the rows' gradient reaches the layers below. The
same path serves a quantised base (QLoRA) with or without expert adapters: the expert loop over
`QuantizedWeight`s has data-dependent trip counts, which reverse mode cannot go through. Here the
stack is dequantised to the compute dtype for the step (on the accelerators a grouped kernel that
reads int8/int4 tiles with its own backward would save that copy; not built yet).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.quantization import QuantizedWeight, dequantize
from clover_jax.nn.expert_dispatch import _pairs, expert_count, stacked


class ExpertAdapters(NamedTuple):
    """One layer's routed-expert LoRA factors (float32; the scale folded into B), or None where the
    stack has none: gate_up_a [experts, r, hidden], gate_up_b [experts, 2 * intermediate, r],
    down_a [experts, r, intermediate], down_b [experts, hidden, r]."""

    gate_up_a: jax.Array | None
    gate_up_b: jax.Array | None
    down_a: jax.Array | None
    down_b: jax.Array | None


def adapted_expert_mlp(tokens: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                       gate_up_proj: "jax.Array | QuantizedWeight", down_proj: "jax.Array | QuantizedWeight",
                       adapters: ExpertAdapters) -> jax.Array:
    """`routed_expert_mlp`'s result (tokens [tokens, hidden], expert_ids / expert_weights
    [tokens, top_k]; stacks [experts, out, in], float or quantised) with the adapters added to
    each expert's two projections. returns [tokens, hidden] in the dtype of `tokens`."""
    dtype = tokens.dtype
    gate_up_proj, down_proj = stacked(gate_up_proj), stacked(down_proj)
    num_experts = expert_count(gate_up_proj)
    pairs = _pairs(expert_ids, expert_weights, num_experts, dtype)
    sizes = pairs.group_sizes  # pairs of experts not held here sort last, past every group: their rows are 0

    def project(rows, weight, a, b):
        # [pairs, in] x [experts, in, out] per group; the base in the compute dtype, the adapter in float32
        out = jax.lax.ragged_dot(rows, jnp.swapaxes(dequantize(weight, dtype), 1, 2), sizes)
        if a is None:
            return out
        inner = jax.lax.ragged_dot(rows.astype(jnp.float32), jnp.swapaxes(a, 1, 2), sizes)   # [pairs, r]
        return (out.astype(jnp.float32) + jax.lax.ragged_dot(inner, jnp.swapaxes(b, 1, 2), sizes)).astype(dtype)

    rows = tokens[pairs.sorted_tokens]
    gate, up = jnp.split(project(rows, gate_up_proj, adapters.gate_up_a, adapters.gate_up_b), 2, axis=-1)
    pair_outputs = project(jax.nn.silu(gate) * up, down_proj, adapters.down_a, adapters.down_b)
    return jnp.zeros_like(tokens).at[pairs.sorted_tokens].add(pair_outputs * pairs.kept[:, None])


def is_quantized(stack) -> bool:
    return isinstance(stack, QuantizedWeight) or (isinstance(stack, tuple) and isinstance(stack[0], QuantizedWeight))
