"""What each LoRA target name adapts (`FinetuneConfig.lora_targets`): full parameter paths, matched
on the part inside a decoder layer (`groups/layer_k/` + these). Plain data, so the config reads the
names without importing JAX."""

from __future__ import annotations

from clover_jax.core.tree_paths import Path

TARGETS: dict[str, tuple[Path, ...]] = {
    "attention": tuple(("self_attn", name, "weight") for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "gdn": tuple(("linear_attn", name, "weight")
                 for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")),
    "shared_expert": tuple(("mlp", "shared_expert", name, "weight") for name in ("gate_proj", "up_proj", "down_proj")),
    "routed_experts": (("mlp", "experts_gate_up_proj"), ("mlp", "experts_down_proj")),
    "router": (("mlp", "gate"),),
}
LORA_TARGETS = tuple(TARGETS)
