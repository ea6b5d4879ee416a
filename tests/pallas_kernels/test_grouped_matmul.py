"""`grouped_matmul` (both drivers, interpret mode) equals the ragged_dot oracle at awkward group layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Tiles, grouped_matmul, grouped_matmul_for_platform, grouped_matmul_reference, work_tiles

SMALL_TILES = Tiles(16, 16, 16)  # several tiles along every dimension of the small shapes below
DEPTH, COLS = 32, 48


def operands(rows: int, groups: int, seed: int, dtype=jnp.float32):
    rng = np.random.RandomState(seed)
    return jnp.asarray(rng.randn(rows, DEPTH), dtype), jnp.asarray(rng.randn(groups, COLS, DEPTH), dtype)


def per_row_numpy(lhs, rhs, group_sizes, active=None):
    """Row r of group g is lhs[r] @ rhs[g]ᵀ, one row at a time; everything else 0."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out, row = np.zeros((lhs.shape[0], rhs.shape[1])), 0
    for group, size in enumerate(np.asarray(group_sizes)):
        for r in range(row, min(row + size, lhs.shape[0])):
            if active is None or group in active:
                out[r] = lhs[r] @ rhs[group].T
        row += size
    return out


def run_kernel(lhs, rhs, group_sizes, active=None, **options):
    options = dict(tiles=SMALL_TILES, interpret=True) | options
    kernel = jax.jit(lambda lhs, rhs, sizes, *active: grouped_matmul(
        lhs, rhs, sizes, active_groups=active[0] if active else None, **options))
    extra = () if active is None else (jnp.asarray(active, jnp.int32),)
    return kernel(lhs, rhs, jnp.asarray(group_sizes, jnp.int32), *extra)


def assert_close(actual, expected, rtol=1e-5):
    scale = float(np.max(np.abs(expected)))
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=rtol * scale)


LAYOUTS = {  # rows, group sizes
    "empty_groups_and_rows_past_the_total": (50, [10, 0, 17, 3, 0]),
    "one_group_holds_every_row": (50, [0, 0, 50, 0, 0]),
    "more_groups_than_rows": (5, [0, 1, 0, 2, 0, 0, 1, 0, 1, 0, 0, 0]),
    "every_group_empty": (20, [0, 0, 0]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_driver_matches_oracle(layout):
    rows, sizes = LAYOUTS[layout]
    lhs, rhs = operands(rows, len(sizes), seed=rows)
    out = run_kernel(lhs, rhs, sizes, variant="gpu")
    expected = grouped_matmul_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert out.shape == (rows, COLS) and out.dtype == jnp.float32
    assert_close(out, np.asarray(expected))


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_only_active_groups_are_computed_and_inactive_weights_never_touch_the_result(variant):
    sizes, active = [10, 0, 17, 3, 0, 12], [5, 2, 0, 5]  # group 3 has rows but is not active; 5 is listed twice
    lhs, rhs = operands(50, len(sizes), seed=1)
    rhs = rhs.at[jnp.array([1, 3, 4])].set(jnp.nan)  # read and multiplied, these would poison the output
    out = run_kernel(lhs, rhs, sizes, active, variant=variant)
    expected = per_row_numpy(lhs, np.nan_to_num(rhs), sizes, active)
    assert np.all(np.asarray(out)[27:30] == 0), "rows of inactive group 3 must be zero"
    assert_close(out, expected)


def test_tpu_driver_matches_oracle_with_rows_past_the_total():
    lhs, rhs = operands(50, 5, seed=2)
    sizes = [10, 0, 17, 3, 0]
    out = run_kernel(lhs, rhs, sizes, variant="tpu")
    assert_close(out, per_row_numpy(lhs, rhs, sizes))


def test_bf16_operands_accumulate_in_float32_and_default_to_lhs_dtype():
    lhs, rhs = operands(40, 4, seed=3, dtype=jnp.bfloat16)
    sizes = [7, 20, 0, 9]
    out = run_kernel(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    assert_close(out, per_row_numpy(lhs, rhs, sizes))  # bf16 products are exact in float32
    default_dtype = run_kernel(lhs, rhs, sizes, interpret=None, tiles=None)  # every default, interpreted on CPU
    assert default_dtype.dtype == jnp.bfloat16
    assert_close(default_dtype, per_row_numpy(lhs, rhs, sizes), rtol=1e-2)


def test_work_list_names_only_active_groups_and_covers_exactly_their_rows():
    sizes, active = jnp.array([10, 0, 17, 3, 0, 12], jnp.int32), jnp.array([5, 2, 0, 5], jnp.int32)
    schedule = work_tiles(sizes, rows=50, tile_rows=16, active_groups=active)
    in_use = int(schedule.num_tiles[0])
    groups = np.asarray(schedule.groups)
    assert set(groups.tolist()) <= {0, 2, 5}, "no tile, used or not, may point at an inactive group's weights"
    covered = np.zeros(50, int)
    for start, end in zip(np.asarray(schedule.row_starts)[:in_use], np.asarray(schedule.row_ends)[:in_use],
                          strict=True):
        covered[start:end] += 1
    expected = np.zeros(50, int)
    expected[0:10] = expected[10:27] = expected[30:42] = 1
    np.testing.assert_array_equal(covered, expected)
    assert np.all(np.diff(np.asarray(schedule.row_tiles)) >= 0), "the TPU driver needs row tiles in order"


def test_oracle_matches_per_row_numpy():
    lhs, rhs = operands(50, 5, seed=4)
    sizes = [10, 0, 17, 3, 0]
    assert_close(grouped_matmul_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32)), per_row_numpy(lhs, rhs, sizes))
    active = jnp.array([2], jnp.int32)
    assert_close(grouped_matmul_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32), active_groups=active),
                 per_row_numpy(lhs, rhs, sizes, [2]))


def test_the_kernel_choice_speaks_the_platform_vocabulary_and_takes_gpu_lowering_names():
    from pallas_kernels.platforms import grouped_matmul_kernel as kernel_for

    assert [kernel_for(p, "auto", False) for p in ("cpu", "gpu", "cuda", "rocm", "tpu")] == \
        ["xla", "pallas", "pallas", "pallas", "megablox"]
    assert kernel_for("tpu", "auto", True) == "pallas"  # megablox has no listed-subset form
    lhs, rhs = operands(8, 2, seed=6)
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        grouped_matmul_for_platform("metal", lhs, rhs, jnp.array([4, 4], jnp.int32))


def test_megablox_choice_for_tpu_matches_oracle_and_zeroes_rows_past_the_total():
    lhs, rhs = operands(50, 5, seed=5)
    sizes = jnp.array([10, 0, 17, 3, 0], jnp.int32)
    out = jax.jit(lambda *args: grouped_matmul_for_platform("tpu", *args, interpret=True))(lhs, rhs, sizes)
    assert_close(out, per_row_numpy(lhs, rhs, sizes))


# ---------------------------------------------------------------------- quantised weights, read in place
def quantised_operands(rows: int, groups: int, bits: int, seed: int, depth: int = 64, group_size: int = 16):
    """bf16 lhs and a float rhs quantised as the model stores it (`clover_jax.core.quantization`)."""
    from clover_jax.core.quantization import QuantSpec, quantize

    rng = np.random.RandomState(seed)
    lhs = jnp.asarray(rng.randn(rows, depth), jnp.bfloat16)
    values, scales = quantize(rng.randn(groups, COLS, depth), QuantSpec(bits, group_size=group_size))
    return lhs, jnp.asarray(values), jnp.asarray(scales)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_weights_dequantised_in_the_kernel_equal_dequantise_then_matmul(variant, bits):
    from pallas_kernels.quantized_weights import dequantized

    sizes, active = [10, 0, 17, 3, 0, 12], [5, 2, 0]
    lhs, values, scales = quantised_operands(50, len(sizes), bits, seed=bits)
    weights = dequantized(values, scales, jnp.float32)  # what the kernel must never materialise
    for listed in (None, active):
        out = run_kernel(lhs, values, sizes, listed, rhs_scales=scales, variant=variant,
                         preferred_element_type=jnp.float32)
        # codes and bf16 scales are exact in float32: the kernel's dot of codes, scaled after, is
        # dequantise-then-matmul up to float32 accumulation
        expected = per_row_numpy(lhs, weights, sizes, listed)
        assert_close(out, expected, rtol=1e-5)
        oracle = grouped_matmul_reference(lhs, values, jnp.asarray(sizes, jnp.int32), rhs_scales=scales,
                                          active_groups=None if listed is None else jnp.asarray(listed, jnp.int32),
                                          preferred_element_type=jnp.float32)
        assert_close(out, np.asarray(oracle), rtol=1e-5)


def test_int4_tiles_are_pairs_of_groups_whatever_depth_tile_is_asked_for():
    lhs, values, scales = quantised_operands(20, 3, 4, seed=9, depth=128, group_size=16)
    sizes = [5, 9, 6]
    from pallas_kernels.quantized_weights import dequantized

    expected = per_row_numpy(lhs, dequantized(values, scales, jnp.float32), sizes)
    for tiles in (Tiles(16, 16, 16), Tiles(16, 48, 128)):
        out = run_kernel(lhs, values, sizes, rhs_scales=scales, tiles=tiles, variant="tpu",
                         preferred_element_type=jnp.float32)
        assert_close(out, expected)


def test_quantised_rhs_without_scales_or_with_mismatched_scales_is_refused():
    lhs, values, scales = quantised_operands(8, 2, 4, seed=1)
    sizes = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="pass its rhs_scales"):
        grouped_matmul(lhs, values, sizes, interpret=True)
    with pytest.raises(ValueError, match="does not hold lhs depth"):
        grouped_matmul(lhs[:, :32], values, sizes, rhs_scales=scales, interpret=True)
    with pytest.raises(ValueError, match="megablox.*float weights"):
        grouped_matmul_for_platform("tpu", lhs, values, sizes, rhs_scales=scales, kernel="megablox")
    with pytest.raises(ValueError, match="transpose_rhs=False takes float weights"):
        grouped_matmul_for_platform("tpu", lhs, values, sizes, rhs_scales=scales, transpose_rhs=False)
    from pallas_kernels.platforms import grouped_matmul_kernel as kernel_for

    assert kernel_for("tpu", "auto", False, quantized=True) == "pallas"  # megablox takes float weights only


def test_int4_packing_round_trips_and_pairs_whole_groups_in_each_byte():
    from pallas_kernels.quantized_weights import pack_int4, unpack_int4

    codes = np.random.RandomState(0).randint(-8, 8, (3, 64)).astype(np.int8)
    packed = pack_int4(codes, 16)
    assert packed.shape == (3, 32) and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(packed), 16)), codes)
    # byte 16·q + j holds inputs 32·q + j (low nibble) and 32·q + 16 + j (high nibble)
    assert (packed[0, 17] & 0xF) == (codes[0, 33] & 0xF) and (packed[0, 17] >> 4) == (codes[0, 49] & 0xF)
    with pytest.raises(ValueError, match="multiple of 2 x group_size"):
        pack_int4(codes[:, :48], 16)
