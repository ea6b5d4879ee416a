"""Declarative map from checkpoint tensor names to parameter paths.

Names are first brought to one *canonical* form — the text-only `model.` prefix and routed
experts stored one per expert, which is what `save_pretrained` writes — then looked up in the
tables below. Other layouts become canonical names on the way in:

* `model.language_model.*` (Qwen3.5/3.6 multimodal checkpoints) drops `language_model.`;
* fused experts `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and
  `mlp.experts.down_proj [E, H, I]` become per-expert names that read a slice of the fused
  tensor, so each expert is still read on its own;
* `model.visual.*` and `mtp.*` are skipped and counted;
* a user `name_map` (checkpoint name -> canonical name) renames anything else.

Parameter layout (see `clover_jax.model`): weights keep the checkpoint's `[out, in]`, routed
experts are stacked `[experts, out, in]` with gate and up fused along `out` (gate rows first,
as in the fused checkpoint layout), and every layer parameter has a leading `[num_groups]`
axis. Every placement is therefore a plain copy into a contiguous region.
"""

from __future__ import annotations

import dataclasses
import math
import re

from clover_jax.config import CloverConfig
from clover_jax.param_layout import flat_layout
from clover_jax.state import slot_name
from weights.checkpoint_files import CheckpointError

COPY, SQUEEZE_CHANNEL = "copy", "squeeze_channel"

TOP_LEVEL = {
    "model.embed_tokens.weight": ("embed_tokens", "embedding"),
    "model.norm.weight": ("norm", "weight"),
    "lm_head.weight": ("lm_head",),
}

# Per decoder layer, after `model.layers.{i}.`: (parameter path inside the layer, transform).
EVERY_LAYER = {
    "input_layernorm.weight": (("input_layernorm", "weight"), COPY),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), COPY),
    "mlp.gate.weight": (("mlp", "gate"), COPY),
    "mlp.shared_expert.gate_proj.weight": (("mlp", "shared_expert", "gate_proj", "weight"), COPY),
    "mlp.shared_expert.up_proj.weight": (("mlp", "shared_expert", "up_proj", "weight"), COPY),
    "mlp.shared_expert.down_proj.weight": (("mlp", "shared_expert", "down_proj", "weight"), COPY),
    "mlp.shared_expert_gate.weight": (("mlp", "shared_expert_gate", "weight"), COPY),
}
LINEAR_ATTENTION_LAYER = {
    "linear_attn.in_proj_qkv.weight": (("linear_attn", "in_proj_qkv", "weight"), COPY),
    "linear_attn.in_proj_z.weight": (("linear_attn", "in_proj_z", "weight"), COPY),
    "linear_attn.in_proj_b.weight": (("linear_attn", "in_proj_b", "weight"), COPY),
    "linear_attn.in_proj_a.weight": (("linear_attn", "in_proj_a", "weight"), COPY),
    "linear_attn.conv1d.weight": (("linear_attn", "conv1d_weight"), SQUEEZE_CHANNEL),
    "linear_attn.dt_bias": (("linear_attn", "dt_bias"), COPY),
    "linear_attn.A_log": (("linear_attn", "A_log"), COPY),
    "linear_attn.norm.weight": (("linear_attn", "norm", "weight"), COPY),
    "linear_attn.out_proj.weight": (("linear_attn", "out_proj", "weight"), COPY),
}
# Clover block-mode tensors of GDN layers (docs/design.md §2): optional, with the defaults `default(config)`.
CLOVER_GDN_LAYER = {
    "linear_attn.conv1d_right.weight": (("linear_attn", "conv1d_right_weight"), SQUEEZE_CHANNEL, lambda c: 0.0),
    "linear_attn.block_logit_scale": (("linear_attn", "block_logit_scale"), COPY,
                                      lambda c: math.log(math.sqrt(c.linear_key_head_dim))),
    "linear_attn.memory_logit_bias": (("linear_attn", "memory_logit_bias"), COPY, lambda c: 0.0),
    "linear_attn.block_size_calibration": (("linear_attn", "block_size_calibration"), COPY, lambda c: 0.0),
}
FULL_ATTENTION_LAYER = {
    f"self_attn.{name}.weight": (("self_attn", name, "weight"), COPY)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
}
# Per routed expert, after `model.layers.{i}.mlp.experts.{e}.`: (path, half of the fused out axis).
EVERY_EXPERT = {
    "gate_proj.weight": (("mlp", "experts_gate_up_proj"), 0),
    "up_proj.weight": (("mlp", "experts_gate_up_proj"), 1),
    "down_proj.weight": (("mlp", "experts_down_proj"), None),
}

SKIPPED_PREFIXES = ("model.visual.", "mtp.")
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one canonical tensor goes: `params[path][index] = transform(tensor)`."""

    path: tuple[str, ...]
    index: tuple  # leading integer indices, then possibly a slice of the next axis
    transform: str
    shape: tuple[int, ...]  # the canonical tensor's shape in the checkpoint
    default: float | None = None  # the value used when an optional tensor is absent


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a canonical tensor's data is: `checkpoint[tensor][index]`."""

    tensor: str
    index: tuple
    shape: tuple[int, ...]


def expected_placements(config: CloverConfig) -> dict[str, Placement]:
    """Every canonical tensor this config needs, in a stable order."""
    hidden, intermediate = config.hidden_size, config.moe_intermediate_size
    placements: dict[str, Placement] = {}
    leaf_shape = flat_layout(config).__getitem__

    for name, path in TOP_LEVEL.items():
        if path == ("lm_head",) and config.tie_word_embeddings:
            continue
        placements[name] = Placement(path, (), COPY, leaf_shape(path))

    pattern = config.group_pattern
    for layer, layer_type in enumerate(config.layer_types):
        group, slot = divmod(layer, len(pattern))
        prefix = ("groups", slot_name(slot))
        table = {suffix: (path, transform, None) for suffix, (path, transform) in EVERY_LAYER.items()}
        if layer_type == "linear_attention":
            table.update({suffix: (path, transform, None) for suffix, (path, transform) in LINEAR_ATTENTION_LAYER.items()})
            table.update({suffix: (path, transform, default(config))
                          for suffix, (path, transform, default) in CLOVER_GDN_LAYER.items()})
        else:
            table.update({suffix: (path, transform, None) for suffix, (path, transform) in FULL_ATTENTION_LAYER.items()})
        for suffix, (path, transform, default) in table.items():
            slot_shape = leaf_shape(prefix + path)[1:]
            shape = slot_shape[:1] + (1,) + slot_shape[1:] if transform == SQUEEZE_CHANNEL else slot_shape
            placements[f"model.layers.{layer}.{suffix}"] = Placement(prefix + path, (group,), transform, shape, default)
        for expert in range(config.num_experts):
            for suffix, (path, half) in EVERY_EXPERT.items():
                if half is None:
                    index, shape = (group, expert), (hidden, intermediate)
                else:
                    index, shape = (group, expert, slice(half * intermediate, (half + 1) * intermediate)), \
                        (intermediate, hidden)
                placements[f"model.layers.{layer}.mlp.experts.{expert}.{suffix}"] = Placement(
                    prefix + path, index, COPY, shape)
    return placements


def canonical_sources(name: str, checkpoint_name: str, shape: tuple[int, ...],
                      config: CloverConfig) -> dict[str, Source] | None:
    """Canonical tensors held by checkpoint tensor `checkpoint_name`, or None if it is skipped.

    `name` is its prefix-normalised (and `name_map`-renamed) name.

    A plain tensor is its own canonical tensor; a fused expert tensor holds one per expert.
    """
    if name.startswith(SKIPPED_PREFIXES):
        return None
    fused = _FUSED_EXPERTS.fullmatch(name)
    if not fused:
        return {name: Source(checkpoint_name, (), shape)}
    layer, kind = fused.groups()
    experts, hidden, intermediate = config.num_experts, config.hidden_size, config.moe_intermediate_size
    base = f"model.layers.{layer}.mlp.experts"
    if kind == "gate_up_proj":
        expected = (experts, 2 * intermediate, hidden)
        _require_shape(checkpoint_name, shape, expected)
        sources = {}
        for expert in range(experts):
            sources[f"{base}.{expert}.gate_proj.weight"] = Source(
                checkpoint_name, (expert, slice(0, intermediate)), (intermediate, hidden))
            sources[f"{base}.{expert}.up_proj.weight"] = Source(
                checkpoint_name, (expert, slice(intermediate, 2 * intermediate)), (intermediate, hidden))
        return sources
    _require_shape(checkpoint_name, shape, (experts, hidden, intermediate))
    return {f"{base}.{expert}.down_proj.weight": Source(checkpoint_name, (expert,), (hidden, intermediate))
            for expert in range(experts)}


def normalise_prefix(name: str) -> str:
    """`model.language_model.X` -> `model.X`; everything else unchanged."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def _require_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(
            f"tensor {name} has shape {tuple(shape)}, expected {expected} "
            "(num_experts, 2*moe_intermediate_size or hidden_size, ...) from config.json")
