"""Pallas kernels for the Clover backbone, each beside a plain-JAX oracle.

* `gdn_chunk`: the chunked gated delta rule (Gated DeltaNet prefill/commit), differentiable;
  `gdn_chunk_with_block_states` also emits the state before every block (the training pass);
  oracles `gdn_chunk_reference` (token by token) and `gdn_chunk_xla` (the plain-JAX chunked
  rule, whose derivative is the kernel's backward pass).
* `grouped_matmul`: routed-expert matmul over rows sorted by expert, weights in the checkpoint's
  [experts, out, in] layout — float, or int8 / int4 dequantised tile by tile inside the kernel
  (`quantized_weights` states their layout) — optionally only for a listed subset of experts
  (the block coreset); oracle `grouped_matmul_reference` (`jax.lax.ragged_dot` after
  dequantising). `grouped_matmul_for_platform` picks JAX's shipped kernel where it is the better
  one (megablox on TPU, float weights). Both are differentiable (`grouped_matmul_backward`: d lhs
  through the stored weights, quantised ones per tile; d rhs by the transposed grouped matmul).

The names below are imported on first use: importing Pallas costs startup time, and
`pallas_kernels.quantized_weights` (plain JAX) is read by code that never runs a kernel.
Nothing here imports the model packages; see docs/kernels.md.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

_EXPORTS = {
    "CHUNK_SIZE": "pallas_kernels.gdn_chunk_size",
    "gdn_chunk": "pallas_kernels.gdn_chunk",
    "gdn_chunk_reference": "pallas_kernels.gdn_chunk_reference",
    "gdn_chunk_with_block_states": "pallas_kernels.gdn_chunk",
    "gdn_chunk_xla": "pallas_kernels.gdn_chunk_xla",
    "GPU_TILES": "pallas_kernels.grouped_matmul_tiles",
    "TPU_TILES": "pallas_kernels.grouped_matmul_tiles",
    "Tiles": "pallas_kernels.grouped_matmul_tiles",
    "grouped_matmul": "pallas_kernels.grouped_matmul",
    "grouped_matmul_for_platform": "pallas_kernels.grouped_matmul_platform",
    "grouped_matmul_reference": "pallas_kernels.grouped_matmul_reference",
    "WorkTiles": "pallas_kernels.grouped_matmul_schedule",
    "work_tiles": "pallas_kernels.grouped_matmul_schedule",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    # `as` marks each name as re-exported (__all__ is built from _EXPORTS at run time)
    from pallas_kernels.gdn_chunk import (
        gdn_chunk as gdn_chunk,
        gdn_chunk_with_block_states as gdn_chunk_with_block_states,
    )
    from pallas_kernels.gdn_chunk_reference import gdn_chunk_reference as gdn_chunk_reference
    from pallas_kernels.gdn_chunk_size import CHUNK_SIZE as CHUNK_SIZE
    from pallas_kernels.gdn_chunk_xla import gdn_chunk_xla as gdn_chunk_xla
    from pallas_kernels.grouped_matmul import grouped_matmul as grouped_matmul
    from pallas_kernels.grouped_matmul_platform import grouped_matmul_for_platform as grouped_matmul_for_platform
    from pallas_kernels.grouped_matmul_reference import grouped_matmul_reference as grouped_matmul_reference
    from pallas_kernels.grouped_matmul_schedule import WorkTiles as WorkTiles, work_tiles as work_tiles
    from pallas_kernels.grouped_matmul_tiles import GPU_TILES as GPU_TILES, TPU_TILES as TPU_TILES, Tiles as Tiles


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # Importing a submodule binds it on the package. Where a submodule shares its name with
        # the function it exports (grouped_matmul, gdn_chunk, ...), the function keeps the name,
        # as it did when this package imported everything eagerly.
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
