"""Writing tiny Hugging Face checkpoints for the tests (random weights, `save_pretrained`)."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np

ROPE_QUARTER = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

# Qwen3.6's ratios scaled down: (3 GDN + 1 attention) x 2, 2 value heads per key head,
# partial rotary 0.25, a shared expert, untied head.
QWEN36_LIKE = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_conv_kernel_dim=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, rope_parameters=ROPE_QUARTER,
    eos_token_id=1, max_position_embeddings=4096,
)

# QWEN36_LIKE cut to one GDN and one attention layer: the same widths, a quarter of the compile time
# (the serving tests compile many programs: every lane shape, every reference `generate` call).
TWO_LAYERS = dict(QWEN36_LIKE, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])

# QWEN36_LIKE's widths in two groups of (GDN, attention): both layer types and two groups in half
# the layers, so about 40% less compile time (the sharding tests compile every program per mesh).
TWO_GROUPS = dict(QWEN36_LIKE, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)

# A different shape: alternating GDN / attention, tied embeddings, one K/V head,
# key heads = value heads, half the head dims rotating, top-3 of 5 experts.
TIED_ONE_TO_ONE = dict(
    vocab_size=96, hidden_size=48, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=24, linear_key_head_dim=12, linear_value_head_dim=8,
    linear_num_key_heads=3, linear_num_value_heads=3, linear_conv_kernel_dim=3, moe_intermediate_size=16,
    shared_expert_intermediate_size=20, num_experts=5, num_experts_per_tok=3, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=2048,
)


def randomize_(model, seed: int) -> None:
    """Redraw every parameter so activations are O(1) and no weight sits at its neutral init."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    normal = lambda p, std, mean=0.0: p.copy_(mean + std * torch.randn(p.shape, generator=generator))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                normal(param, 0.1, mean=1.0)
            elif name.endswith("norm.weight"):  # zero-centred RMSNorms: the scale is 1 + w
                normal(param, 0.1)
            elif name.endswith("A_log"):
                param.copy_(torch.log(0.5 + 3.5 * torch.rand(param.shape, generator=generator)))
            elif name.endswith("dt_bias"):
                normal(param, 0.5)
            elif name.endswith("conv1d.weight"):
                normal(param, 0.4)
            elif "embed_tokens" in name:
                normal(param, 1.0)
            else:  # [..., out, in]: unit-variance outputs
                normal(param, 1.0 / math.sqrt(param.shape[-1]))


def write_hf_checkpoint(directory, fields: dict, seed: int) -> str:
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields))
    randomize_(model, seed)
    model.save_pretrained(str(directory))
    return str(directory)


def rewrite_fused_multimodal(source: str, target: str) -> str:
    """Rewrite a text-only checkpoint as a 2-shard `qwen3_5_moe` one: `model.language_model.`
    prefix, fused experts, and extra `model.visual.*` / `mtp.*` tensors to be skipped."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(source, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as handle:
        text_config = json.load(handle)

    experts: dict[int, dict[int, dict[str, np.ndarray]]] = {}
    renamed = {}
    for name, value in tensors.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if match:
            layer, expert, kind = int(match[1]), int(match[2]), match[3]
            experts.setdefault(layer, {}).setdefault(expert, {})[kind] = value
        elif name.startswith("model."):
            renamed["model.language_model." + name[len("model."):]] = value
        else:
            renamed[name] = value
    for layer, by_expert in experts.items():
        order = sorted(by_expert)
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        renamed[f"{prefix}.gate_up_proj"] = np.stack(
            [np.concatenate([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], axis=0) for e in order])
        renamed[f"{prefix}.down_proj"] = np.stack([by_expert[e]["down_proj"] for e in order])
    rng = np.random.RandomState(0)
    renamed["model.visual.patch_embed.proj.weight"] = rng.randn(8, 3, 2, 2).astype(np.float32)
    renamed["model.visual.blocks.0.attn.qkv.weight"] = rng.randn(24, 8).astype(np.float32)
    renamed["mtp.fc.weight"] = rng.randn(8, 16).astype(np.float32)

    os.makedirs(target, exist_ok=True)
    names = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: np.ascontiguousarray(renamed[n]) for n in shard_names}, os.path.join(target, file))
        weight_map.update({n: file for n in shard_names})
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)
    text_config["model_type"] = "qwen3_5_moe_text"
    wrapper = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": text_config, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    with open(os.path.join(target, "config.json"), "w") as handle:
        json.dump(wrapper, handle)
    return target


def add_clover_tensors(source: str, target: str, mask_token_id: int, seed: int = 0) -> str:
    """Copy a backbone checkpoint and give every GDN layer random Clover block-mode tensors
    (docs/design.md §2 names), with a `clover_moe` config."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(source, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as handle:
        config = json.load(handle)
    rng = np.random.RandomState(seed)
    heads = config["linear_num_value_heads"]
    conv_dim = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"] + \
        heads * config["linear_value_head_dim"]
    for layer, layer_type in enumerate(config["layer_types"]):
        if layer_type != "linear_attention":
            continue
        prefix = f"model.layers.{layer}.linear_attn"
        tensors[f"{prefix}.conv1d_right.weight"] = (
            0.3 * rng.randn(conv_dim, 1, config["linear_conv_kernel_dim"])).astype(np.float32)
        tensors[f"{prefix}.block_logit_scale"] = (math.log(math.sqrt(config["linear_key_head_dim"]))
                                                  + 0.3 * rng.randn(heads)).astype(np.float32)
        tensors[f"{prefix}.memory_logit_bias"] = rng.randn(heads).astype(np.float32)
        tensors[f"{prefix}.block_size_calibration"] = (0.5 * rng.randn(heads)).astype(np.float32)
    os.makedirs(target, exist_ok=True)
    save_file(tensors, os.path.join(target, "model.safetensors"))
    config.update(model_type="clover_moe", mask_token_id=mask_token_id, moe_block_coreset_enabled=True,
                  moe_block_coreset_top_p=0.9)
    with open(os.path.join(target, "config.json"), "w") as handle:
        json.dump(config, handle)
    return target
