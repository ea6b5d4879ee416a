"""Reading a parameter onto a mesh, each device's slice on its own.

`read_sharded` builds a parameter with `jax.make_array_from_callback`: the callback receives one
device's index into the parameter and reads only the checkpoint bytes inside it — per-expert
tensors, slices of fused expert tensors and per-layer tensors stacked into `[num_groups, ...]`
are intersected with that index. So no host assembles a sharded parameter whole, and a process
(in a multi-host run) reads only the slices of its own devices.
"""

from __future__ import annotations

import jax
import numpy as np

from clover_jax.core.quantization import QuantizedWeight, QuantSpec, quantize as quantize_weight, quantized_shardings
from weights.checkpoint_files import CheckpointFiles, aligned_empty
from weights.finite_check import describe_source, require_finite
from weights.name_table import SQUEEZE_CHANNEL, Placement, Source


def read_sharded(files: CheckpointFiles, shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
                  parts: list[tuple[Placement, Source | None]],
                  quantize: QuantSpec | None = None,
                  check_finite: bool = True) -> tuple[jax.Array | QuantizedWeight, int]:
    """One parameter placed with `sharding`, each addressable device's slice read on its own
    (`jax.make_array_from_callback`): no host ever assembles a sharded parameter whole, and a
    process reads only the slices of its own devices. Devices holding the same slice (replicas)
    share one read. `check_finite`: refuse a slice holding NaN or Inf, naming its tensor.
    Returns the array and the bytes read."""
    reads: dict[tuple, np.ndarray] = {}

    def read_slice(index: tuple) -> np.ndarray:
        ranges = tuple(item.indices(size)[:2] for item, size in zip(index, shape, strict=True))
        if ranges not in reads:
            reads[ranges] = _read_region(files, ranges, dtype, parts, check_finite)
        return reads[ranges]

    if quantize is None:
        array = jax.make_array_from_callback(shape, sharding, read_slice)
        return array, sum(region.nbytes for region in reads.values())
    # Quantised: each slice is read and quantised once; values and scales are built from it.
    # Slices never cut the input dimension (`quantized_shardings`), so int4 groups stay whole.
    # Scales are [..., groups, out] (the weight's last two axes swapped), and so is their sharding.
    quantized: dict[tuple, QuantizedWeight] = {}
    float_bytes = []

    def quantized_slice(index: tuple) -> QuantizedWeight:
        index = index[:-1] + (slice(0, shape[-1]),)  # the float slice behind a values slice
        key = tuple(item.indices(size)[:2] for item, size in zip(index, shape, strict=True))
        if key not in quantized:
            region = read_slice(index)
            float_bytes.append(region.nbytes)
            quantized[key] = quantize_weight(region, quantize)
            del reads[key]
        return quantized[key]

    scales_index = lambda index: index[:-2] + (index[-1], slice(None))  # -> the float slice's index
    values_shape, scales_shape = quantize.stored_shapes(shape)
    values_sharding, scales_sharding = quantized_shardings(sharding, len(shape))
    values = jax.make_array_from_callback(values_shape, values_sharding, lambda index: quantized_slice(index).values)
    scales = jax.make_array_from_callback(scales_shape, scales_sharding,
                                          lambda index: quantized_slice(scales_index(index)).scales)
    return QuantizedWeight(values, scales), sum(float_bytes)


def _read_region(files: CheckpointFiles, ranges: tuple[tuple[int, int], ...], dtype: np.dtype,
                 parts: list[tuple[Placement, Source | None]], check_finite: bool = True) -> np.ndarray:
    """The part of a parameter inside `ranges` ([start, stop) per axis), from the checkpoint
    tensors placed in it. A placement fills `param[lead ints][optional slice][...]`."""
    out = aligned_empty(tuple(stop - start for start, stop in ranges), dtype)
    for placement, source in parts:
        lead = [item for item in placement.index if isinstance(item, int)]
        if not all(start <= i < stop for i, (start, stop) in zip(lead, ranges, strict=False)):
            continue
        extent = (placement.shape if placement.transform != SQUEEZE_CHANNEL
                  else placement.shape[:1] + placement.shape[2:])
        offset = placement.index[len(lead)].start if len(placement.index) > len(lead) else 0
        # The region the placement fills, in parameter coordinates, intersected with `ranges`.
        region = [(offset if axis == 0 else 0, (offset if axis == 0 else 0) + size) for axis, size in enumerate(extent)]
        wanted = ranges[len(lead):]
        overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(region, wanted, strict=True)]
        if any(low >= high for low, high in overlap):
            continue
        destination = tuple(i - start for i, (start, _) in zip(lead, ranges, strict=False)) + tuple(
            slice(low - start, high - start) for (low, high), (start, _) in zip(overlap, wanted, strict=True))
        within = [slice(low - first, high - first) for (low, high), (first, _) in zip(overlap, region, strict=True)]
        if source is None:
            out[destination] = placement.default
            continue
        if placement.transform == SQUEEZE_CHANNEL:
            within.insert(1, slice(0, 1))
        out[destination] = files.read(source.tensor, _compose(source.index, within)).reshape(out[destination].shape)
        if check_finite:
            require_finite(out[destination], describe_source(files, source, dtype))
    return out


def _compose(source_index: tuple, within: list[slice]) -> tuple:
    """`tensor[source_index][within]` as one index into the tensor (source_index: leading ints,
    then at most one slice, which `within[0]` refines)."""
    lead = tuple(item for item in source_index if isinstance(item, int))
    if len(source_index) > len(lead):
        first = source_index[len(lead)].start or 0
        within = [slice(first + within[0].start, first + within[0].stop)] + within[1:]
    return lead + tuple(within)
