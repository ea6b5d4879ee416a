"""This machine's memory read bandwidth and matmul rate, measured with XLA the way the model runs.

* read bandwidth: `jnp.sum` over a float32 array far larger than the last-level cache (1 GiB by
  default), best of `repeats` — the rate at which XLA streams weights that are not in cache;
* matmul rate: a float32 [n, n] @ [n, n] matmul (n = 2048), best of `repeats` — the peak a large,
  well-shaped matmul reaches (smaller matmuls, e.g. 32 rows, reach less: the roofline bounds
  below are what the hardware allows, not what XLA's kernels reach at every shape).

Both are measured in the same process as the figures they bound, right before them.
"""

from __future__ import annotations

import time


def read_bandwidth(gibibytes: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second."""
    import jax
    import jax.numpy as jnp

    array = jnp.ones((int(gibibytes * 2**30) // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(array).block_until_ready()
    best = min(_time(lambda: total(array).block_until_ready()) for _ in range(repeats))
    return gibibytes * 2**30 / best  # the array is freed with this frame


def matmul_rate(n: int = 2048, repeats: int = 7) -> float:
    """Float32 FLOP per second of a large square matmul."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    product = jax.jit(lambda x: x @ x)
    product(a).block_until_ready()
    best = min(_time(lambda: product(a).block_until_ready()) for _ in range(repeats))
    return 2 * n**3 / best


def measure() -> dict:
    return {"read_bytes_per_s": read_bandwidth(), "matmul_flops_per_s": matmul_rate()}


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
