"""Defaults of the serving engine that the command line shows before it imports jax."""

# The prefix cache (decoding.engine.prefix_cache): its device-memory budget, and the grid, in tokens,
# of the points where it keeps GDN states.
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30  # 2 GiB
DEFAULT_GRID = 32
# The block sizes a server (and an engine) accepts unless told otherwise, beside the checkpoint's own.
DEFAULT_BLOCK_SIZES = (16, 32, 64)
