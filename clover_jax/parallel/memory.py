"""Memory estimate of a request, and a clear error when it cannot fit the device (docs/design.md §1).

Parameters and state are exact (computed from the same shapes the model allocates); the
activation term is an upper-bound estimate of the largest temporaries of one causal chunk or
one denoising step (attention scores of one key block, MoE rows, GDN chunk matrices, logits).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import numpy as np

from clover_jax.core.config import CloverConfig
from clover_jax.core.kernels import KEY_BLOCK
from clover_jax.core.params import parameter_counts
from pallas_kernels.gdn_chunk_size import CHUNK_SIZE

if TYPE_CHECKING:
    from clover_jax.parallel.sharding import MeshSharding

GDN_CHUNK = CHUNK_SIZE  # the chunked gated delta rule's chunk length


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    kv_cache: int
    gdn_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.kv_cache + self.gdn_state + self.activations

    def describe(self) -> str:
        gb = lambda n: f"{n / 1e9:.2f} GB"
        return (f"{gb(self.total)} = parameters {gb(self.parameters)} + K/V cache {gb(self.kv_cache)} + "
                f"GDN state {gb(self.gdn_state)} + activations {gb(self.activations)}")


@functools.lru_cache(maxsize=32)
def parameter_count(config: CloverConfig) -> int:
    return parameter_counts(config)["total"]


def estimate_memory(config: CloverConfig, batch: int, context_length: int, dtype="bfloat16",
                    chunk_size: int = 2048, block_size: int = 32, mesh_sharding: "MeshSharding | None" = None
                    ) -> MemoryEstimate:
    """Bytes to run `batch` sequences of `context_length` positions (prompt + response); with
    `mesh_sharding`, the bytes one device of its mesh holds (each term split as the rules split
    the axis it grows with: the batch over the data axis, K/V heads, GDN value heads, attention
    heads and the vocabulary as their parameters are; parameters are the whole model's)."""
    split = _Splits(mesh_sharding, batch)
    itemsize = np.dtype(dtype).itemsize
    parameters = parameter_count(config) * itemsize
    attention_layers = config.layer_types.count("full_attention")
    gdn_layers = config.num_hidden_layers - attention_layers
    kv_cache = attention_layers * 2 * batch * context_length * config.num_key_value_heads * config.head_dim * itemsize
    gdn_state = gdn_layers * batch * (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
        // split("value_heads")
        + (config.linear_conv_kernel_dim - 1) * config.conv_dim * itemsize)
    rows = batch * max(chunk_size, 2 * block_size)
    scores = (3 * batch * config.num_attention_heads * max(chunk_size, 2 * block_size) * KEY_BLOCK * 4
              // split("q_heads"))
    moe = rows * config.num_experts_per_tok * (2 * config.hidden_size + 3 * config.moe_intermediate_size) * 4
    gdn = 4 * rows * config.linear_num_value_heads * (GDN_CHUNK + config.linear_key_head_dim
                                                      + config.linear_value_head_dim) * 4 // split("value_heads")
    dense = 8 * rows * max(config.hidden_size, config.conv_dim) * 4
    logits = (4 * batch * 2 * block_size * config.vocab_size * 4 + batch * config.vocab_size * 4) // split("vocab")
    return MemoryEstimate(parameters, kv_cache // split("kv_heads") // split.batch, gdn_state // split.batch,
                          (scores + moe + gdn + dense + logits) // split.batch)


class _Splits:
    """How many ways a mesh splits each logical axis (1 without a mesh), and the batch."""

    def __init__(self, mesh_sharding: "MeshSharding | None", batch: int):
        self.mesh_sharding = mesh_sharding
        self.batch = self(("batch",), batch) if mesh_sharding is not None else 1

    def __call__(self, logical: "str | tuple", batch: int | None = None) -> int:
        if self.mesh_sharding is None:
            return 1
        axes = (logical,) if isinstance(logical, str) else logical
        spec = self.mesh_sharding.spec(axes, batch)
        return math.prod(self.mesh_sharding.axis_size(axis) for axis in spec if axis is not None)


def available_bytes(device: jax.Device | None = None) -> int | None:
    """Free memory of `device` (default: this process's first), or None when the platform does not say."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    return None


def check_fits(needed: MemoryEstimate, already_placed: int = 0, device: jax.Device | None = None,
               split: int = 1) -> None:
    """Raise ValueError when the request's memory beyond `already_placed` bytes exceeds what is free.

    split: devices that share the state and activations (the mesh's data axis).
    """
    free = available_bytes(device)
    extra = (needed.total - already_placed) / split
    if free is not None and extra > free:
        raise ValueError(f"this request needs about {needed.describe()}; {extra / 1e9:.2f} GB more than the "
                         f"parameters already placed, but only {free / 1e9:.2f} GB are free on "
                         f"{device or jax.local_devices()[0]}. Use a shorter context, a smaller batch, or more "
                         "devices.")
