"""Bytes read and FLOPs of one forward pass, from a `CloverConfig` (shapes from `clover_jax.core.param_layout`).

A pass of `causal` causal rows then `block` block rows per sequence, after a prefix of `prefix`
tokens, reads at least once:
  * every non-expert weight (projections, norms, routers, shared experts; the LM head, or the
    tied embedding), but of the embedding table only the rows it looks up;
  * per MoE layer, the weights of every distinct routed expert the pass uses;
  * the K/V cache of the prefix (attention layers) and the GDN states.
FLOPs: 2 × rows × non-expert parameters per token, 2 × rows × top-k × one expert's parameters,
2 × logit rows × vocab × hidden for the LM head, attention over the prefix and the block, and
the GDN rule (recurrent state updates for causal rows, memory readout and in-block softmax for
block rows). Writes (logits, the new K/V rows) are small and left out.

`bound(cost, rates)` is max(bytes / read bandwidth, FLOPs / matmul rate): no implementation of
the pass can be faster on the machine whose rates are given.
"""

from __future__ import annotations

import math
from typing import Sequence

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout


def parameter_groups(config: CloverConfig) -> dict[str, int]:
    """Parameters by kind: embedding, lm_head, dense (everything a token reads besides the routed
    experts and the embedding), one_expert (per layer), routed_experts (all of them)."""
    counts = {"embedding": 0, "lm_head": 0, "dense": 0, "routed_experts": 0}
    for path, shape in flat_layout(config).items():
        size = math.prod(shape)
        if path[0] == "embed_tokens":
            counts["embedding"] += size
        elif path[0] == "lm_head":
            counts["lm_head"] += size
        elif path[-1] in ("experts_gate_up_proj", "experts_down_proj"):
            counts["routed_experts"] += size
        else:
            counts["dense"] += size
    counts["one_expert"] = 3 * config.moe_intermediate_size * config.hidden_size
    counts["total"] = counts["embedding"] + counts["lm_head"] + counts["dense"] + counts["routed_experts"]
    return counts


def pass_cost(config: CloverConfig, causal: int, block: int, prefix: int, distinct_experts: float | Sequence[float],
              logit_rows: int, *, batch: int = 1, weight_bytes: int = 4, kv_bytes: int | None = None) -> dict:
    """Bytes and FLOPs of one pass per the module docstring.

    distinct_experts: distinct routed experts per MoE layer (one number for every layer, or one
    per layer); logit_rows: rows whose logits are computed (all block rows, or 1 for a step).
    """
    kv_bytes = weight_bytes if kv_bytes is None else kv_bytes
    params = parameter_groups(config)
    layers = config.num_hidden_layers
    distinct = ([float(distinct_experts)] * layers if isinstance(distinct_experts, (int, float))
                else list(distinct_experts))
    rows = batch * (causal + block)
    head = params["lm_head"] or params["embedding"]  # tied: the embedding is the head
    weight_read = weight_bytes * (params["dense"] + head + rows * config.hidden_size
                                  + sum(distinct) * params["one_expert"])
    attention_layers = config.layer_types.count("full_attention")
    gdn_layers = layers - attention_layers
    kv_read = batch * attention_layers * prefix * 2 * config.num_key_value_heads * config.head_dim * kv_bytes
    state_size = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    gdn_read = batch * gdn_layers * (4 * state_size
                                     + (config.linear_conv_kernel_dim - 1) * config.conv_dim * weight_bytes)

    matmul = 2 * rows * params["dense"] + 2 * batch * logit_rows * head
    experts = 2 * rows * config.num_experts_per_tok * layers * params["one_expert"]
    query_width = config.num_attention_heads * config.head_dim
    keys_per_row = prefix + causal / 2 + block  # causal rows see half of their pass on average
    attention = 4 * rows * attention_layers * query_width * keys_per_row
    per_head = config.linear_key_head_dim * config.linear_value_head_dim
    gdn = batch * gdn_layers * config.linear_num_value_heads * (
        causal * 6 * per_head + block * (2 * per_head + 2 * block * (config.linear_key_head_dim
                                                                     + config.linear_value_head_dim)))
    flops = matmul + experts + attention + gdn
    total_bytes = weight_read + kv_read + gdn_read
    return {"causal": causal, "block": block, "prefix": prefix, "batch": batch,
            "distinct_experts_per_layer": sum(distinct) / layers, "weight_bytes": weight_read,
            "kv_cache_bytes": kv_read, "gdn_state_bytes": gdn_read, "bytes": total_bytes, "flops": flops,
            "flops_per_byte": flops / total_bytes}


def bound(cost: dict, rates: dict) -> dict:
    """The roofline time of a pass on a machine with `rates` (`benchmarks.machine_rates.measure`)."""
    memory = cost["bytes"] / rates["read_bytes_per_s"]
    compute = cost["flops"] / rates["matmul_flops_per_s"]
    return {"seconds": max(memory, compute), "memory_seconds": memory, "compute_seconds": compute,
            "limited_by": "memory" if memory >= compute else "compute"}
