"""Weight-only int8 / int4 quantisation and the will-it-fit planner."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from clover_jax import CloverModel, QuantSpec, plan
from clover_jax.core.quantization import QuantizedWeight, dequantize, quantize
from tests.conftest import token_ids


@pytest.mark.parametrize("spec", [QuantSpec(8), QuantSpec(4, group_size=16)])
def test_dequantised_weights_are_within_half_a_step_of_the_float_ones(spec):
    weight = np.random.RandomState(0).randn(3, 8, 64).astype(np.float32)
    quantized = quantize(weight, spec)
    restored = np.asarray(dequantize(QuantizedWeight(*map(jax.numpy.asarray, quantized)), np.float32))
    group = 64 if spec.bits == 8 else spec.group_size
    grouped = np.abs(weight).reshape(3, 8, -1, group).max(-1, keepdims=True)
    step = np.repeat(grouped / (127 if spec.bits == 8 else 7), group, -1).reshape(weight.shape)
    # half a quantisation step, plus the bfloat16 rounding of the scale (2^-8 relative)
    assert np.all(np.abs(restored - weight) <= 0.5 * step + np.abs(weight) * 2**-8 + 1e-7)
    assert quantized.values.nbytes * 8 == weight.size * spec.bits  # int4 holds 4 bits per weight


@pytest.fixture(scope="module", params=["int8", "int4-g8+dense"])
def quantized(request, clover_checkpoint):
    return CloverModel.from_pretrained(clover_checkpoint, progress=False, quantize=request.param)


def test_quantised_model_equals_the_float_model_on_the_dequantised_weights(quantized, clover):
    """The on-the-fly dequantising matmuls compute exactly what float weights would."""
    is_quantized = lambda leaf: isinstance(leaf, QuantizedWeight)
    floats = jax.tree.map(lambda leaf: dequantize(leaf, clover.dtype) if is_quantized(leaf) else leaf,
                          quantized.params, is_leaf=is_quantized)
    assert any(is_quantized(leaf) for leaf in jax.tree.leaves(quantized.params, is_leaf=is_quantized))
    reference = CloverModel(clover.config, floats, clover.dtype)
    ids = token_ids(2, 24, clover.config.vocab_size, seed=1)
    np.testing.assert_allclose(quantized.forward(ids), reference.forward(ids), atol=1e-5, rtol=1e-5)
    block = np.full((2, 4), 127, np.int32)
    np.testing.assert_allclose(quantized.denoise_logits(ids[:, :8], block), reference.denoise_logits(ids[:, :8], block),
                               atol=1e-5, rtol=1e-5)


def test_plan_bytes_equal_the_loaded_arrays(quantized, clover):
    """The planner's exact byte count for the format this model was loaded with (one device)."""
    is_quantized = lambda leaf: isinstance(leaf, QuantizedWeight)
    actual = sum(leaf.values.nbytes + leaf.scales.nbytes if is_quantized(leaf) else leaf.nbytes
                 for leaf in jax.tree.leaves(quantized.params, is_leaf=is_quantized))
    from jax.sharding import AbstractMesh

    from clover_jax.parallel.planner import weight_bytes_per_device
    from clover_jax.parallel.sharding import MESH_AXES, MeshSharding

    spec = next(leaf for leaf in jax.tree.leaves(quantized.params, is_leaf=is_quantized) if is_quantized(leaf))
    parsed = QuantSpec(8) if spec.bits == 8 else QuantSpec(4, 8, dense=True)
    one = MeshSharding(AbstractMesh((1, 1, 1), MESH_AXES), clover.config)
    assert weight_bytes_per_device(clover.config, "float32", parsed, one) == actual


def test_plan_recommendation_follows_the_devices(clover_checkpoint):
    one_small = plan(clover_checkpoint, ["TPU v5e"], context_length=4096)
    assert one_small.recommendation.weights == "bfloat16"  # a tiny model fits anywhere
    from clover_jax import CloverConfig

    # Scale the tiny config's experts up until bf16 no longer fits one 16 GB chip.
    config = CloverConfig.from_pretrained(clover_checkpoint).replace(
        hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_hidden_layers=40,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10)
    on_v5e = plan(config, ["TPU v5e"], context_length=8192)
    on_v6e = plan(config, ["TPU v6e"], context_length=8192)
    on_eight = plan(config, ["TPU v5e"] * 8, context_length=8192)
    assert on_v5e.recommendation is None and "nothing fits on 1 × TPU v5e (16 GiB)" in on_v5e.reason
    assert on_v6e.recommendation.weights == "int4 experts (g128)"
    assert on_v6e.reason.startswith("int4 experts (g128) on 1 × TPU v6e (32 GiB)")
    assert on_eight.recommendation.weights == "bfloat16" and on_eight.options[0].mesh["expert"] == 8
    assert on_eight.options[0].weight_bytes < on_v5e.options[0].weight_bytes / 4


@pytest.mark.parametrize("quantize, message", [
    ("int4-g6", "multiple of 2 x group_size = 12; got 64"),
    ("int4-g32", "multiple of 2 x group_size = 64; got 32"),  # 32 divides the widths, but not in pairs of groups
    ("int4-g128", "multiple of 2 x group_size = 256; got 64"),
    (QuantSpec(4), "multiple of 2 x group_size = 256"),  # a group given explicitly, by default
])
def test_an_explicit_int4_group_that_does_not_divide_the_inputs_is_refused_before_reading(
        clover_checkpoint, monkeypatch, quantize, message):
    from weights import checkpoint_files, load_params

    monkeypatch.setattr(checkpoint_files.CheckpointFiles, "__init__", lambda *a: pytest.fail("files were opened"))
    from clover_jax import CloverConfig

    with pytest.raises(ValueError, match=message):
        load_params(clover_checkpoint, CloverConfig.from_pretrained(clover_checkpoint), quantize=quantize)


def largest_even_group(widths, limit=128):
    """The naive reading of the rule: the largest even group up to `limit` such that every width
    holds a whole number of pairs of groups."""
    return max([g for g in range(2, limit + 1, 2) if all(w % (2 * g) == 0 for w in widths)], default=None)


@pytest.mark.parametrize("text, widths", [
    ("int4", [64, 32]),                    # routed experts: gate_up reads hidden 64, down reads 32
    ("int4+dense", [64, 32, 128, 48]),     # + attention o_proj (4 heads x 32) and the shared expert (48)
])
def test_plain_int4_fits_the_largest_dividing_group_and_says_so(clover, text, widths, caplog):
    from clover_jax.core.param_layout import flat_layout

    spec = QuantSpec.parse(text)
    layout = flat_layout(clover.config)
    assert sorted({shape[-1] for path, shape in layout.items() if spec.applies_to(path)}) == sorted(widths)
    with caplog.at_level("INFO", logger="clover_jax.core.quantization"):
        fitted = spec.fitted(layout)
    expected = largest_even_group(widths)
    assert (fitted.bits, fitted.group_size, fitted.dense, fitted.name) == (
        4, expected, spec.dense, f"int4-g{expected}" + ("+dense" if spec.dense else ""))
    assert f"group_size 128 does not fit the quantised input widths {sorted(widths)}; using {expected}" in caplog.text
    assert QuantSpec.parse(fitted.name) == fitted  # the name records the group used


def test_plain_int4_loads_the_experts_in_the_fitted_groups(clover_checkpoint, clover):
    from weights import load_params

    params, _ = load_params(clover_checkpoint, clover.config, progress=False, quantize="int4")
    loaded = params["groups"]["layer_3"]["mlp"]["experts_down_proj"]
    float_weight = np.asarray(clover.params["groups"]["layer_3"]["mlp"]["experts_down_proj"])
    expected = quantize(float_weight, QuantSpec(4, group_size=16))
    assert loaded.scales.shape == float_weight.shape[:-2] + (2, float_weight.shape[-2])  # 32 inputs: 2 groups of 16
    np.testing.assert_array_equal(np.asarray(loaded.values), expected.values)
    np.testing.assert_array_equal(np.asarray(loaded.scales).view(np.uint16), expected.scales.view(np.uint16))


def test_int4_without_any_even_dividing_group_is_refused():
    layout = {("groups", "layer_0", "mlp", "experts_gate_up_proj"): (1, 4, 8, 63),
              ("groups", "layer_0", "mlp", "experts_down_proj"): (1, 4, 63, 32)}
    with pytest.raises(ValueError, match=r"the widths \[32, 63\] have none; use int8"):
        QuantSpec.parse("int4").fitted(layout)
    assert QuantSpec.parse("int8").fitted(layout) == QuantSpec(8)


@pytest.mark.parametrize("text", ["int8-g64", "int4-g", "int4-gx", "int4-g-2", "int4-g0", "int16", "int4+sparse"])
def test_malformed_quantize_names_are_refused(text):
    with pytest.raises(ValueError, match="quantize=|group_size must be an even number"):
        QuantSpec.parse(text)


# Written out by hand: the routed experts always; with +dense also the attention, GDN and shared
# expert projections; never the embedding, LM head, norms, router, shared-expert gate, in_proj_a/b.
ROUTED = {"mlp/experts_gate_up_proj", "mlp/experts_down_proj"}
DENSE = {"self_attn/q_proj/weight", "self_attn/k_proj/weight", "self_attn/v_proj/weight", "self_attn/o_proj/weight",
         "linear_attn/in_proj_qkv/weight", "linear_attn/in_proj_z/weight", "linear_attn/out_proj/weight",
         "mlp/shared_expert/gate_proj/weight", "mlp/shared_expert/up_proj/weight",
         "mlp/shared_expert/down_proj/weight"}


@pytest.mark.parametrize("dense", [False, True])
def test_exactly_the_routed_experts_and_with_dense_the_projections_are_quantised(clover, dense):
    from clover_jax.core.param_layout import flat_layout

    spec = QuantSpec(8, dense=dense)
    quantised = {"/".join(path[2:]) if path[0] == "groups" else "/".join(path)
                 for path in flat_layout(clover.config) if spec.applies_to(path)}
    assert quantised == (ROUTED | DENSE if dense else ROUTED)
    assert not spec.applies_to(("groups", "layer_0", "mlp", "no_such_weight"))
