"""The chunk length of the chunked gated delta rule, stated once: the Pallas kernel's tile
(`gdn_chunk`), the plain-JAX chunked rule's default and largest chunk (`clover_jax.nn.gated_delta`,
`clover_jax.core.kernels`) and the memory estimate's (`clover_jax.parallel.memory`). Plain Python,
so that reading it never imports Pallas."""

from __future__ import annotations

CHUNK_SIZE = 64


def chunk_for_blocks(block_size: int, chunk_size: int = CHUNK_SIZE) -> int | None:
    """The chunk of a pass that needs the state at every block boundary (the training pass's clean
    stream): the block itself when it divides `chunk_size` (blocks of 4, 8, 16, 32, 64 tokens are
    chunks of their own), `chunk_size` when the block is a multiple of it (a block of 128 is two
    chunks), else None: no chunk both fits the kernel's tile and ends on every block boundary."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if chunk_size % block_size == 0:
        return block_size
    if block_size % chunk_size == 0:
        return chunk_size
    return None
