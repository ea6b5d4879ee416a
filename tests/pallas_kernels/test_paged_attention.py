"""The paged attention kernel (pallas_kernels/paged_attention.py), both drivers in interpret mode,
against its oracle at awkward shapes: rows of three slots in tiles that do not fill, limits that
end inside a page and inside a block of pages, a slot reading a single page, padding rows and
padding tiles (zeros), the group chosen among several, pages shuffled in the pool; float32 to
rounding, bfloat16 to bfloat16's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, tile_pages
from pallas_kernels.paged_attention_reference import paged_attention_reference

GROUPS, NUM_PAGES, KV_HEADS, PAGE, HEAD_DIM, HEADS = 2, 40, 2, 4, 32, 8
SLOTS, PAGES_PER_SLOT, TILE = 3, 10, 4
# (slot, limits of its rows): slot 0 five causal rows, slot 2 seven block rows, slot 1 one row on one page
ROWS = [(0, [11, 12, 13, 14, 15]), (2, [23] * 7), (1, [3])]


def case(dtype, seed=0):
    rng = np.random.default_rng(seed)
    pages = lambda: jnp.asarray(rng.normal(size=(GROUPS, NUM_PAGES, KV_HEADS, PAGE, HEAD_DIM)), dtype)
    table = jnp.asarray(rng.permutation(np.arange(1, NUM_PAGES))[:SLOTS * PAGES_PER_SLOT].reshape(SLOTS, -1),
                        jnp.int32)
    slot = [s for s, limits in ROWS for _ in limits] + [0] * 3       # three padding rows
    limit = [value for _, limits in ROWS for value in limits] + [0] * 3
    tokens = len(slot)
    tiles, tile_slot, row = [], [], 0
    for s, limits in ROWS:
        for first in range(0, len(limits), TILE):
            rows = list(range(row + first, row + min(first + TILE, len(limits))))
            tiles.append(rows + [tokens] * (TILE - len(rows)))
            tile_slot.append(s)
        row += len(limits)
    tiles += [[tokens] * TILE] * 2                                   # two padding tiles
    tile_slot += [0, 0]
    query = jnp.asarray(rng.normal(size=(tokens, HEADS, HEAD_DIM)) * HEAD_DIM ** -0.5, dtype)
    return (query, pages(), pages(), table, jnp.asarray(slot, jnp.int32), jnp.asarray(limit, jnp.int32),
            jnp.asarray(tiles, jnp.int32), jnp.asarray(tile_slot, jnp.int32))


@pytest.mark.parametrize("variant", ["tpu", "gpu"])
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_the_kernel_equals_its_oracle(variant, dtype, tolerance):
    query, keys, values, table, slot, limit, tiles, tile_slot = case(dtype)
    expected = paged_attention_reference(query, keys, values, 1, table, slot, limit).astype(jnp.float32)
    for per_block in (1, 2, 3):  # blocks of pages that end past a slot's last page, and inside it
        out = paged_attention(query, keys, values, jnp.int32(1), table, limit, tiles, tile_slot,
                              pages_per_block=per_block, variant=variant, interpret=True)
        assert out.shape == query.shape and out.dtype == query.dtype
        scale = float(np.abs(expected).max())
        np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=tolerance * scale)
        assert not np.asarray(out[-3:], np.float32).any()  # padding rows: zeros


def test_tiles_read_up_to_their_largest_limit():
    _, _, _, _, _, limit, tiles, _ = case(jnp.float32)
    assert tile_pages(limit, tiles, PAGE).tolist() == [4, 4, 6, 6, 1, 0, 0]


def test_a_page_table_beyond_the_tpu_kernels_smem_is_refused_by_name(monkeypatch):
    import pallas_kernels.paged_attention as kernel

    query, keys, values, table, _, limit, tiles, tile_slot = case(jnp.float32)
    monkeypatch.setattr(kernel, "TPU_TABLE_ENTRIES", table.size - 1)
    with pytest.raises(ValueError, match="exceeds the .* entries the TPU kernel keeps in SMEM"):
        paged_attention(query, keys, values, jnp.int32(1), table, limit, tiles, tile_slot, variant="tpu",
                        interpret=True)
    # the GPU kernel reads the table from global memory: no such bound
    paged_attention(query, keys, values, jnp.int32(1), table, limit, tiles, tile_slot, variant="gpu", interpret=True)
