"""The grouped matmul's backward pass (both drivers, interpret mode) equals the oracle's autodiff:
d lhs and d rhs at awkward group layouts, float32 and bfloat16 inputs, a listed subset of groups,
and d lhs through int8 / int4 weights equal to d lhs through the dequantised weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Tiles, grouped_matmul, grouped_matmul_for_platform, grouped_matmul_reference

SMALL_TILES = Tiles(16, 16, 16)
DEPTH, COLS = 32, 48

LAYOUTS = {  # rows, group sizes
    "empty_groups_rows_past_the_total_and_a_partial_tile": (50, [10, 0, 17, 3, 0]),
    "a_single_group": (37, [37]),
    "more_groups_than_rows": (5, [0, 1, 0, 2, 0, 0, 1, 0, 1, 0, 0, 0]),
}


def operands(rows, groups, seed, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    return (jnp.asarray(rng.randn(rows, DEPTH), dtype), jnp.asarray(rng.randn(groups, COLS, DEPTH), dtype),
            jnp.asarray(rng.randn(rows, COLS), jnp.float32))


def gradients(matmul, lhs, rhs, cotangent, argnums=(0, 1)):
    """d/d(lhs, rhs) of Σ cotangent · matmul(lhs, rhs), the product taken in float32."""
    loss = lambda lhs, rhs: jnp.sum(matmul(lhs, rhs).astype(jnp.float32) * cotangent)
    return jax.jit(jax.grad(loss, argnums))(lhs, rhs)


def assert_close(actual, expected, rtol):
    expected = np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(expected))) or 1.0
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_gradients_equal_the_oracles_autodiff_in_float32(layout, variant):
    rows, sizes = LAYOUTS[layout]
    lhs, rhs, cotangent = operands(rows, len(sizes), seed=rows)
    sizes = jnp.asarray(sizes, jnp.int32)
    kernel = gradients(lambda x, r: grouped_matmul(x, r, sizes, tiles=SMALL_TILES, variant=variant, interpret=True),
                       lhs, rhs, cotangent)
    oracle = gradients(lambda x, r: grouped_matmul_reference(x, r, sizes), lhs, rhs, cotangent)
    for got, want in zip(kernel, oracle, strict=True):
        assert got.dtype == want.dtype == jnp.float32
        assert_close(got, want, rtol=1e-5)
    empty = np.flatnonzero(np.asarray(sizes) == 0)
    assert np.all(np.asarray(kernel[1])[empty] == 0), "a group without rows gets a zero weight gradient"
    assert np.all(np.asarray(kernel[0])[int(np.sum(sizes)):] == 0), "rows past the total get no gradient"


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_bfloat16_gradients_accumulate_in_float32(variant):
    rows, sizes = LAYOUTS["empty_groups_rows_past_the_total_and_a_partial_tile"]
    lhs, rhs, cotangent = operands(rows, len(sizes), seed=7, dtype=jnp.bfloat16)
    cotangent = cotangent.astype(jnp.bfloat16).astype(jnp.float32)  # so the bf16 cotangent is exact
    sizes = jnp.asarray(sizes, jnp.int32)
    kernel = gradients(lambda x, r: grouped_matmul(x, r, sizes, tiles=SMALL_TILES, variant=variant, interpret=True,
                                                   preferred_element_type=jnp.bfloat16), lhs, rhs, cotangent)
    # the oracle on the same bf16 values in float32: bf16 products are exact in float32, so only the
    # final rounding of each gradient to bfloat16 separates them
    oracle = gradients(lambda x, r: grouped_matmul_reference(x, r, sizes), lhs.astype(jnp.float32),
                       rhs.astype(jnp.float32), cotangent)
    for got, want in zip(kernel, oracle, strict=True):
        assert got.dtype == jnp.bfloat16
        assert_close(got, want, rtol=2 ** -8)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_listed_groups_only_get_gradients(variant):
    sizes, active = jnp.array([10, 0, 17, 3, 0, 12], jnp.int32), jnp.array([5, 2, 0, 5], jnp.int32)
    lhs, rhs, cotangent = operands(50, 6, seed=3)
    kernel = gradients(lambda x, r: grouped_matmul(x, r, sizes, active_groups=active, tiles=SMALL_TILES,
                                                   variant=variant, interpret=True), lhs, rhs, cotangent)
    oracle = gradients(lambda x, r: grouped_matmul_reference(x, r, sizes, active_groups=active), lhs, rhs, cotangent)
    for got, want in zip(kernel, oracle, strict=True):
        assert_close(got, want, rtol=1e-5)
    assert np.all(np.asarray(kernel[1])[[1, 3, 4]] == 0) and np.all(np.asarray(kernel[0])[27:30] == 0)


def quantised(rows, groups, bits, seed, depth=64, group_size=16, dtype=jnp.float32):
    from clover_jax.core.quantization import QuantSpec, quantize
    from pallas_kernels.quantized_weights import dequantized

    rng = np.random.RandomState(seed)
    values, scales = quantize(rng.randn(groups, COLS, depth), QuantSpec(bits, group_size=group_size))
    values, scales = jnp.asarray(values), jnp.asarray(scales)
    return (jnp.asarray(rng.randn(rows, depth), dtype), values, scales, dequantized(values, scales, jnp.float32),
            jnp.asarray(rng.randn(rows, COLS), jnp.float32))


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("bits", [8, 4])
def test_d_lhs_through_quantised_weights_equals_d_lhs_through_the_dequantised_weights(variant, bits):
    sizes = jnp.array([10, 0, 17, 3, 0, 12], jnp.int32)
    lhs, values, scales, weights, cotangent = quantised(50, 6, bits, seed=bits)
    for active in (None, jnp.array([5, 2], jnp.int32)):
        kernel = lambda x, v, listed=active: grouped_matmul(x, v, sizes, rhs_scales=scales, active_groups=listed,
                                                            tiles=SMALL_TILES, variant=variant, interpret=True)
        oracle = lambda x, w, listed=active: grouped_matmul_reference(x, w, sizes, active_groups=listed)
        d_lhs = gradients(kernel, lhs, values, cotangent, argnums=0)
        want = gradients(oracle, lhs, weights, cotangent, argnums=0)
        assert_close(d_lhs, want, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_quantised_weights_are_frozen_and_bfloat16_d_lhs_stays_near_the_dequantised_one(variant):
    sizes = jnp.array([7, 20, 0, 9], jnp.int32)
    lhs, values, scales, weights, cotangent = quantised(40, 4, 4, seed=11, dtype=jnp.bfloat16)
    loss = lambda x, s: jnp.sum(grouped_matmul(x, values, sizes, rhs_scales=s, variant=variant, interpret=True,
                                               preferred_element_type=jnp.float32) * cotangent)
    d_lhs, d_scales = jax.jit(jax.grad(loss, (0, 1)))(lhs, scales)
    assert not np.any(np.asarray(d_scales)), "a quantised base is frozen: its scales get no cotangent"
    want = gradients(lambda x, w: grouped_matmul_reference(x, w, sizes), lhs.astype(jnp.float32), weights,
                     cotangent, argnums=0)
    assert d_lhs.dtype == jnp.bfloat16
    assert_close(d_lhs, want, rtol=2 ** -7)  # d_out is scaled, then rounded to bf16, before the dot


@pytest.mark.parametrize("transpose_rhs", [True, False])
@pytest.mark.parametrize("kernel", ["megablox", "pallas", "xla"])
def test_every_kernel_choice_for_a_platform_is_differentiable(kernel, transpose_rhs):
    """Each kernel's value and gradients against the oracle's, the weights [groups, cols, depth]
    or (transpose_rhs=False, a LoRA factor B's layout) [groups, depth, cols], whose gradient
    comes back in that layout."""
    rows, sizes = LAYOUTS["empty_groups_rows_past_the_total_and_a_partial_tile"]
    lhs, rhs, cotangent = operands(rows, len(sizes), seed=5)
    sizes = jnp.asarray(sizes, jnp.int32)
    platform = "cpu" if kernel == "xla" else "tpu"
    stored = rhs if transpose_rhs else jnp.swapaxes(rhs, 1, 2)

    def value_and_gradients(matmul, weights):
        loss = lambda x, w: jnp.sum(matmul(x, w).astype(jnp.float32) * cotangent)
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(lhs, weights)

    value, (d_lhs, d_stored) = value_and_gradients(
        lambda x, w: grouped_matmul_for_platform(platform, x, w, sizes, kernel=kernel, interpret=True,
                                                 transpose_rhs=transpose_rhs), stored)
    want_value, (want_lhs, want_rhs) = value_and_gradients(lambda x, w: grouped_matmul_reference(x, w, sizes), rhs)
    assert d_stored.shape == stored.shape
    assert_close(value, want_value, rtol=1e-5)
    assert_close(d_lhs, want_lhs, rtol=1e-5)
    assert_close(d_stored, want_rhs if transpose_rhs else jnp.swapaxes(want_rhs, 1, 2), rtol=1e-5)
