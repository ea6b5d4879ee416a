"""Pallas kernels for the Clover backbone, each beside a plain-JAX oracle.

* `gdn_chunk`: the chunked gated delta rule (Gated DeltaNet prefill/commit), oracle
  `gdn_chunk_reference` (token by token).
* `grouped_matmul`: routed-expert matmul over rows sorted by expert, weights in the checkpoint's
  [experts, out, in] layout, optionally only for a listed subset of experts (the block coreset);
  oracle `grouped_matmul_reference` (`jax.lax.ragged_dot`). `grouped_matmul_for_platform` picks
  JAX's shipped kernel where it is the better one (megablox on TPU).

Nothing here imports the model packages; see docs/kernels.md.
"""

from pallas_kernels.gdn_chunk import CHUNK_SIZE, gdn_chunk
from pallas_kernels.gdn_chunk_reference import gdn_chunk_reference
from pallas_kernels.grouped_matmul import GPU_TILES, TPU_TILES, Tiles, grouped_matmul
from pallas_kernels.grouped_matmul_platform import grouped_matmul_for_platform
from pallas_kernels.grouped_matmul_reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul_schedule import WorkTiles, work_tiles

__all__ = [
    "CHUNK_SIZE", "GPU_TILES", "TPU_TILES", "Tiles", "WorkTiles", "gdn_chunk", "gdn_chunk_reference",
    "grouped_matmul", "grouped_matmul_for_platform", "grouped_matmul_reference", "work_tiles",
]
