"""Loaded parameters against the stored tensors, read independently of the parameter table.

The expectations are written out here by hand — which checkpoint tensor, which slice of which
parameter — rather than derived from `clover_jax.core.params`, so a wrong row in the table (gate
and up swapped, a transposed or misplaced tensor) fails these tests even though a write-then-read
round trip through the same table would pass. Layer `l` sits in group `l // len(pattern)`, slot
`l % len(pattern)` (`groups/layer_{slot}`, leading axis `group`).
"""

from __future__ import annotations

import glob
import math
import os

import jax
import numpy as np
from safetensors.numpy import load_file

from clover_jax.core.config import CloverConfig
from weights import load_params


def stored_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint's files, under the text-only `model.` prefix."""
    tensors = {}
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(file))
    return {name.replace("model.language_model.", "model.", 1): value for name, value in tensors.items()}


def loaded(directory: str) -> tuple[dict, CloverConfig]:
    config = CloverConfig.from_pretrained(directory)
    params, _ = load_params(directory, config, progress=False)
    flat = {tuple(key.key for key in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    return flat, config


class Expect:
    """Compares parameter regions with stored tensors and remembers which parameters it saw."""

    def __init__(self, params: dict):
        self.params, self.seen = params, set()

    def equal(self, path: tuple[str, ...], index: tuple, expected: np.ndarray, what: str) -> None:
        np.testing.assert_array_equal(self.params[path][index], expected, err_msg=f"{'/'.join(path)}{index} vs {what}")
        self.seen.add(path)

    def close(self, path: tuple[str, ...], index: tuple, expected: float, what: str) -> None:
        np.testing.assert_allclose(self.params[path][index], expected, rtol=1e-6, err_msg=f"{'/'.join(path)} {what}")
        self.seen.add(path)

    def saw_every_parameter(self) -> None:
        assert self.seen == set(self.params), sorted(set(self.params) - self.seen)


def check_backbone(expect: Expect, stored: dict, config: CloverConfig) -> None:
    """Every backbone parameter (all but the Clover block-mode tensors) against `stored`."""
    expect.equal(("embed_tokens", "embedding"), (), stored["model.embed_tokens.weight"], "embed_tokens")
    expect.equal(("norm", "weight"), (), stored["model.norm.weight"], "final norm")
    if not config.tie_word_embeddings:
        expect.equal(("lm_head",), (), stored["lm_head.weight"], "lm_head")
    pattern, inter = len(config.group_pattern), config.moe_intermediate_size
    for layer, layer_type in enumerate(config.layer_types):
        group, slot = divmod(layer, pattern)
        where = ("groups", f"layer_{slot}")

        def same(path: str, suffix: str, index: tuple = (), take=lambda tensor: tensor,
                 layer=layer, group=group, where=where) -> None:  # this layer's, bound
            name = f"model.layers.{layer}.{suffix}"
            expect.equal(where + tuple(path.split("/")), (group,) + index, take(stored[name]), name)

        same("input_layernorm/weight", "input_layernorm.weight")
        same("post_attention_layernorm/weight", "post_attention_layernorm.weight")
        same("mlp/gate", "mlp.gate.weight")
        for expert in range(config.num_experts):
            # gate rows first, then up rows: the MoE computes silu(x W[:I]ᵀ) * (x W[I:]ᵀ)
            same("mlp/experts_gate_up_proj", f"mlp.experts.{expert}.gate_proj.weight", (expert, slice(0, inter)))
            same("mlp/experts_gate_up_proj", f"mlp.experts.{expert}.up_proj.weight", (expert, slice(inter, 2 * inter)))
            same("mlp/experts_down_proj", f"mlp.experts.{expert}.down_proj.weight", (expert,))
        for part in ("gate_proj", "up_proj", "down_proj"):
            same(f"mlp/shared_expert/{part}/weight", f"mlp.shared_expert.{part}.weight")
        same("mlp/shared_expert_gate/weight", "mlp.shared_expert_gate.weight")
        if layer_type == "linear_attention":
            for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm"):
                same(f"linear_attn/{part}/weight", f"linear_attn.{part}.weight")
            same("linear_attn/conv1d_weight", "linear_attn.conv1d.weight", take=lambda conv: conv[:, 0, :])
            same("linear_attn/dt_bias", "linear_attn.dt_bias")
            same("linear_attn/A_log", "linear_attn.A_log")
        else:
            for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                same(f"self_attn/{part}/weight", f"self_attn.{part}.weight")


def check_block_mode(expect: Expect, stored: dict, config: CloverConfig) -> None:
    """The Clover block-mode tensors: stored ones where the checkpoint has them, else the
    defaults of docs/design.md §2 (right conv 0, block_logit_scale ln √key_head_dim, others 0)."""
    pattern = len(config.group_pattern)
    for layer, layer_type in enumerate(config.layer_types):
        if layer_type != "linear_attention":
            continue
        group, slot = divmod(layer, pattern)
        where = ("groups", f"layer_{slot}", "linear_attn")
        prefix = f"model.layers.{layer}.linear_attn"
        if f"{prefix}.conv1d_right.weight" in stored:
            expect.equal(where + ("conv1d_right_weight",), (group,), stored[f"{prefix}.conv1d_right.weight"][:, 0, :],
                         "conv1d_right")
            for name in ("block_logit_scale", "memory_logit_bias", "block_size_calibration"):
                expect.equal(where + (name,), (group,), stored[f"{prefix}.{name}"], name)
        else:
            expect.close(where + ("conv1d_right_weight",), (group,), 0.0, "default")
            expect.close(where + ("block_logit_scale",), (group,), math.log(math.sqrt(config.linear_key_head_dim)),
                         "default")
            expect.close(where + ("memory_logit_bias",), (group,), 0.0, "default")
            expect.close(where + ("block_size_calibration",), (group,), 0.0, "default")


def test_per_expert_checkpoint_puts_every_stored_tensor_where_the_model_reads_it(qwen36_checkpoint):
    params, config = loaded(qwen36_checkpoint)
    stored = stored_tensors(qwen36_checkpoint)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in stored  # the per-expert layout
    expect = Expect(params)
    check_backbone(expect, stored, config)
    check_block_mode(expect, stored, config)
    expect.saw_every_parameter()


def test_fused_multimodal_checkpoint_loads_the_same_values_as_the_per_expert_one(fused_checkpoint,
                                                                                 qwen36_checkpoint):
    params, config = loaded(fused_checkpoint)
    fused = stored_tensors(fused_checkpoint)
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused and "model.layers.0.mlp.experts.0.gate_proj.weight" \
        not in fused
    expect = Expect(params)
    check_backbone(expect, stored_tensors(qwen36_checkpoint), config)  # the weights the fused file was written from
    check_block_mode(expect, fused, config)
    expect.saw_every_parameter()
    pattern = len(config.group_pattern)
    for layer in range(config.num_hidden_layers):  # and the fused tensors themselves, whole
        group, slot = divmod(layer, pattern)
        mlp = ("groups", f"layer_{slot}", "mlp")
        np.testing.assert_array_equal(params[mlp + ("experts_gate_up_proj",)][group],
                                      fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"])
        np.testing.assert_array_equal(params[mlp + ("experts_down_proj",)][group],
                                      fused[f"model.layers.{layer}.mlp.experts.down_proj"])


def test_clover_block_mode_tensors_load_from_their_stored_names(clover_checkpoint):
    params, config = loaded(clover_checkpoint)
    stored = stored_tensors(clover_checkpoint)
    assert "model.layers.0.linear_attn.conv1d_right.weight" in stored
    expect = Expect(params)
    check_backbone(expect, stored, config)
    check_block_mode(expect, stored, config)
    expect.saw_every_parameter()


def test_tied_checkpoint_with_alternating_layers_loads_every_stored_tensor(tied_checkpoint):
    params, config = loaded(tied_checkpoint)
    assert config.tie_word_embeddings and len(config.group_pattern) == 2 and ("lm_head",) not in params
    expect = Expect(params)
    stored = stored_tensors(tied_checkpoint)
    check_backbone(expect, stored, config)
    check_block_mode(expect, stored, config)
    expect.saw_every_parameter()
