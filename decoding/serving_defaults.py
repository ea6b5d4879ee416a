"""Defaults of the serving engine that the command line shows before it imports jax."""

# The prefix cache (decoding.engine.prefix_cache): its device-memory budget, and the grid, in tokens,
# of the points where it keeps GDN states.
DEFAULT_PREFIX_CACHE_BYTES = 2 << 30  # 2 GiB
DEFAULT_GRID = 32
