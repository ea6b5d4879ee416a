"""The parameter pytree's shapes, computed from the config alone.

The loader (and, later, sharding rules and the memory planner) need every parameter's shape
without tracing the model; `tests/clover_jax/test_param_layout.py` checks this table against
`jax.eval_shape` of the Flax modules' `init`, so the two cannot drift apart.
"""

from __future__ import annotations

from clover_jax.config import CloverConfig
from clover_jax.state import slot_name

Shape = tuple[int, ...]


def _layer_layout(config: CloverConfig, layer_type: str) -> dict:
    hidden, experts = config.hidden_size, config.num_experts
    intermediate, shared = config.moe_intermediate_size, config.shared_expert_intermediate_size
    layout = {
        "input_layernorm": {"weight": (hidden,)},
        "post_attention_layernorm": {"weight": (hidden,)},
        "mlp": {
            "gate": (experts, hidden),
            "experts_gate_up_proj": (experts, 2 * intermediate, hidden),
            "experts_down_proj": (experts, hidden, intermediate),
            "shared_expert": {"gate_proj": {"weight": (shared, hidden)}, "up_proj": {"weight": (shared, hidden)},
                              "down_proj": {"weight": (hidden, shared)}},
            "shared_expert_gate": {"weight": (1, hidden)},
        },
    }
    if layer_type == "linear_attention":
        heads, kernel, conv = config.linear_num_value_heads, config.linear_conv_kernel_dim, config.conv_dim
        layout["linear_attn"] = {
            "in_proj_qkv": {"weight": (conv, hidden)},
            "in_proj_z": {"weight": (config.linear_value_dim, hidden)},
            "in_proj_b": {"weight": (heads, hidden)},
            "in_proj_a": {"weight": (heads, hidden)},
            "conv1d_weight": (conv, kernel),
            "dt_bias": (heads,),
            "A_log": (heads,),
            "conv1d_right_weight": (conv, kernel),
            "block_logit_scale": (heads,),
            "memory_logit_bias": (heads,),
            "block_size_calibration": (heads,),
            "norm": {"weight": (config.linear_value_head_dim,)},
            "out_proj": {"weight": (hidden, config.linear_value_dim)},
        }
    else:
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        layout["self_attn"] = {
            "q_proj": {"weight": (2 * heads * head_dim, hidden)},
            "k_proj": {"weight": (kv_heads * head_dim, hidden)},
            "v_proj": {"weight": (kv_heads * head_dim, hidden)},
            "o_proj": {"weight": (hidden, heads * head_dim)},
            "q_norm": {"weight": (head_dim,)},
            "k_norm": {"weight": (head_dim,)},
        }
    return layout


def _stacked(tree, groups: int):
    if isinstance(tree, dict):
        return {key: _stacked(value, groups) for key, value in tree.items()}
    return (groups,) + tree


def param_layout(config: CloverConfig) -> dict:
    """Nested dict of parameter shapes; layer parameters carry a leading [num_groups] axis."""
    layout = {
        "embed_tokens": {"embedding": (config.vocab_size, config.hidden_size)},
        "groups": {slot_name(slot): _stacked(_layer_layout(config, layer_type), config.num_groups)
                   for slot, layer_type in enumerate(config.group_pattern)},
        "norm": {"weight": (config.hidden_size,)},
    }
    if not config.tie_word_embeddings:
        layout["lm_head"] = (config.vocab_size, config.hidden_size)
    return layout


def flat_layout(config: CloverConfig) -> dict[tuple[str, ...], Shape]:
    """{parameter path: shape} for every leaf of `param_layout`."""
    flat: dict[tuple[str, ...], Shape] = {}

    def walk(tree, path):
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, path + (key,))
        else:
            flat[path] = tree

    walk(param_layout(config), ())
    return flat
