"""Load a Hugging Face layout checkpoint into the parameter pytree of `clover_jax.nn.model`.

Everything that can be checked from the safetensors headers — unknown and missing names,
shapes, dtypes, truncated files — is checked before any tensor data is read. Then parameters
are filled one at a time: a host buffer for one stacked parameter is filled tensor by tensor
(expert slices of fused tensors are read as slices), placed on its device(s), and dropped, so
host memory holds at most one stacked parameter beyond what has already been placed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import defaultdict
from typing import Any, Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout
from clover_jax.core.quantization import QuantSpec, place, quantize as quantize_weight
from weights.checkpoint_files import FLOAT_DTYPES, CheckpointError, CheckpointFiles, aligned_empty
from weights.finite_check import describe_source, require_finite
from weights.name_table import Placement, Source, canonical_sources, expected_placements, normalise_prefix
from weights.sharded_reads import read_sharded

logger = logging.getLogger(__name__)

ShardingFor = Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding]


@dataclasses.dataclass(frozen=True)
class LoadReport:
    dtype: str
    tensors_read: int
    skipped: int  # model.visual.* / mtp.* tensors
    bytes_read: int
    seconds: float


def load_params(
    directory: str | os.PathLike,
    config: CloverConfig,
    *,
    dtype: Any = None,
    name_map: dict[str, str] | None = None,
    sharding_for: ShardingFor | None = None,
    progress: bool = True,
    strict: bool = False,
    quantize: QuantSpec | str | None = None,
    check_finite: bool = True,
) -> tuple[dict, LoadReport]:
    """Read `directory`'s safetensors into parameters of dtype `dtype` (None: the checkpoint's).

    `name_map` renames checkpoint tensors (checkpoint name -> canonical name, see `name_table`).
    `sharding_for(path, shape)` gives each parameter's sharding; default: the default device.
    Clover block-mode tensors that are absent take docs/design.md §2 defaults (logged), unless `strict`.
    `quantize` ("int8", "int4", a `QuantSpec`): quantise the routed experts (and with `+dense` the
    dense projections) as each parameter is read, so the float model is never held whole.
    `check_finite`: refuse a tensor holding NaN or Inf (CheckpointError naming it), checked on each
    tensor as it is read, in the dtype it is loaded in (`weights.finite_check`; 8-13 GB/s on
    bfloat16 on one CPU core). False skips the check.
    """
    quantize = quant_spec_for(config, quantize)  # a bad int4 group is refused before any file is opened
    started = time.perf_counter()
    placements = expected_placements(config)
    with CheckpointFiles(directory) as files:
        sources, skipped = _match_tensors(files, config, placements, dict(name_map or {}), strict)
        defaulted = [name for name in placements if name not in sources]
        if defaulted:
            values = {name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]:
                      placements[name].default for name in defaulted}  # the parameter table's defaults
            logger.info("%d Clover block-mode tensors are absent from %s; using the defaults of docs/design.md §2 "
                        "(%s)", len(defaulted), os.fspath(directory),
                        ", ".join(f"{name} {value:.6g}" for name, value in sorted(values.items())))
        _check_shapes_and_dtypes(files, placements, sources)
        target_dtype = np.dtype(dtype if dtype is not None else _checkpoint_dtype(files))
        if target_dtype not in FLOAT_DTYPES.values():
            raise ValueError(f"dtype {target_dtype} is not a float dtype; use one of "
                             f"{sorted(str(d) for d in FLOAT_DTYPES.values())} (or None for the checkpoint's)")

        by_leaf: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for canonical, placement in placements.items():
            by_leaf[placement.path].append(canonical)
        leaf_shapes = flat_layout(config)
        total_bytes = sum(files.tensors[sources[c].tensor].num_bytes * _fraction(sources[c], files)
                          for c in sources)

        params: dict = {}
        bytes_read = 0
        with tqdm(total=int(total_bytes), unit="B", unit_scale=True, desc="loading weights",
                  disable=not progress) as bar:
            for path, names in by_leaf.items():
                shape = leaf_shapes[path]
                _check_leaf_covered(path, shape, [placements[n] for n in names])
                sharding = sharding_for(path, shape) if sharding_for is not None else None
                leaf_quantize = quantize if quantize is not None and quantize.applies_to(path) else None
                if sharding is not None and len(sharding.device_set) > 1:
                    array, leaf_bytes = read_sharded(files, shape, target_dtype, sharding,
                                                      [(placements[n], sources.get(n)) for n in names],
                                                      leaf_quantize, check_finite)
                    _set_path(params, path, array)
                    bytes_read += leaf_bytes
                    bar.update(leaf_bytes)
                    continue
                buffer = aligned_empty(shape, target_dtype)
                for canonical in names:
                    region = buffer[placements[canonical].index]
                    if canonical not in sources:
                        region[...] = placements[canonical].default
                        continue
                    files.read_into(sources[canonical].tensor, sources[canonical].index, region)
                    if check_finite:
                        require_finite(region, describe_source(files, sources[canonical], target_dtype))
                    bytes_read += region.nbytes
                    bar.update(region.nbytes)
                if leaf_quantize is not None:
                    quantized = quantize_weight(buffer, leaf_quantize)
                    _set_path(params, path, place(quantized, sharding))
                else:
                    _set_path(params, path, jax.device_put(buffer, sharding))
                del buffer
    report = LoadReport(str(target_dtype), len(sources), skipped, bytes_read, time.perf_counter() - started)
    logger.info("loaded %d tensors (%.2f GB, %s) from %s in %.1fs; skipped %d model.visual.*/mtp.* tensors",
                report.tensors_read, bytes_read / 1e9, report.dtype, os.fspath(directory), report.seconds, skipped)
    return params, report


def quant_spec_for(config: CloverConfig, quantize: QuantSpec | str | None) -> QuantSpec | None:
    """`quantize` parsed and fitted to `config` (plain "int4" takes the largest even group, up to
    128, that divides the quantised widths; an explicit group that does not is a ValueError)."""
    quantize = QuantSpec.parse(quantize)
    return None if quantize is None else quantize.fitted(flat_layout(config))


def _match_tensors(files: CheckpointFiles, config: CloverConfig, placements: dict[str, Placement],
                   name_map: dict[str, str], strict: bool) -> tuple[dict[str, Source], int]:
    """Canonical name -> where its data is; raises on unknown, missing or duplicated tensors."""
    absent = sorted(set(name_map) - set(files.tensors))
    if absent:
        raise CheckpointError(f"name_map renames tensors that the checkpoint does not have: {absent}")
    sources: dict[str, Source] = {}
    unexpected, skipped = [], 0
    for name, info in files.tensors.items():
        canonical_name = normalise_prefix(name_map.get(name, name))
        if canonical_name == "lm_head.weight" and config.tie_word_embeddings:
            logger.info("ignoring lm_head.weight: config.tie_word_embeddings is true")
            continue
        held = canonical_sources(canonical_name, name, info.shape, config)
        if held is None:
            skipped += 1
            continue
        if not all(canonical in placements for canonical in held):
            unexpected.append(f"{name} (in {info.file})")
            continue
        for canonical, source in held.items():
            if canonical in sources:
                raise CheckpointError(
                    f"tensor {canonical} is given twice: by {sources[canonical].tensor} and by {name}")
            sources[canonical] = source
    missing = [name for name, placement in placements.items()
               if name not in sources and (strict or placement.default is None)]
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) that match no parameter of this "
                        f"{config.model_type} config: {unexpected}. If they are this model's tensors under "
                        "other names, pass name_map={checkpoint name: expected name}.")
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {missing}" + (
            " (strict=True: Clover block-mode tensors are required)" if strict else ""))
    if problems:
        raise CheckpointError(f"checkpoint {files.directory} does not fit the config: " + " ".join(problems))
    return sources, skipped


def _check_shapes_and_dtypes(files: CheckpointFiles, placements: dict[str, Placement],
                             sources: dict[str, Source]) -> None:
    problems = []
    for canonical, source in sources.items():
        placement = placements[canonical]
        info = files.tensors[source.tensor]
        if tuple(source.shape) != tuple(placement.shape):
            problems.append(f"tensor {source.tensor} in {info.file} has shape {tuple(source.shape)}, "
                            f"expected {tuple(placement.shape)} from config.json")
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {source.tensor} in {info.file} has dtype {info.dtype}; "
                            f"weights must be one of {sorted(FLOAT_DTYPES)}")
    if problems:
        raise CheckpointError("; ".join(dict.fromkeys(problems)))


def _checkpoint_dtype(files: CheckpointFiles) -> str:
    """The float dtype holding most of the checkpoint's bytes."""
    bytes_by_dtype: dict[str, int] = defaultdict(int)
    for info in files.tensors.values():
        if info.dtype in FLOAT_DTYPES:
            bytes_by_dtype[info.dtype] += info.num_bytes
    return FLOAT_DTYPES[max(bytes_by_dtype, key=bytes_by_dtype.get)]


def _fraction(source: Source, files: CheckpointFiles) -> float:
    """Share of its checkpoint tensor that a (possibly sliced) source reads."""
    full = int(np.prod(files.tensors[source.tensor].shape))
    return int(np.prod(source.shape)) / full if full else 0.0


def _check_leaf_covered(path, shape, placements: list[Placement]) -> None:
    """The table must fill every element of a parameter; an unfilled one would be garbage memory."""
    covered = sum(int(np.prod(p.shape)) for p in placements)
    if covered != int(np.prod(shape)):
        raise AssertionError(f"name table fills {covered} of {int(np.prod(shape))} elements of {'/'.join(path)}")


def _set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
