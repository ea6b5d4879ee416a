"""Orbax copies of checkpoints: convert a Hugging Face directory once, then load it into shardings.

A converted directory is self-contained:

    clover_orbax.json     the manifest, written last: format version, dtype, leaf, parameter and byte counts
    params/               an Orbax (OCDBT) checkpoint of the parameter pytree of `clover_jax.nn.model`
    config.json, generation_config.json, tokenizer files, ...   copied from the source directory

Conversion is atomic. Everything but the manifest is built in a temporary sibling directory
(`.<name>.converting-*`), every file and directory is fsynced, the directory is renamed into
place, and the manifest is written (through a temporary name, fsynced, renamed) last. A failed
conversion removes what it wrote; one killed outright leaves a directory without a manifest,
which `load_orbax_params` refuses with a `CheckpointError` saying to rerun the conversion. So
no interrupted conversion leaves a directory that loads. The staging directories are named for
the converting process, and the next conversion into the same output removes those whose
process is gone (`weights.staging`).

The source is never written to: an output that is the source, holds it, or lies anywhere inside
it is refused (real paths, symlinks and bind mounts seen through), and `overwrite=True` replaces
only an earlier conversion (or an empty directory), never a directory holding anything else.

Loading restores every leaf straight into its target sharding (`jax.ShapeDtypeStruct` with a
sharding as the restore target), so each process reads only the shards its devices hold and a
sharded tensor is never assembled on one host. The stored tree is checked against
`flat_layout(config)` from the Orbax metadata before any tensor data is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from tqdm.auto import tqdm

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout
from clover_jax.core.quantization import QuantizedWeight, QuantSpec, quantized_shardings
from clover_jax.core.tree_paths import Path, get
from weights.checkpoint_files import FLOAT_DTYPES, CheckpointError
from weights.finite_check import require_finite_array
from weights.loader import LoadReport, ShardingFor, load_params, quant_spec_for
from weights.orbax_layout import MANIFEST, PARAMS_DIR, is_orbax_checkpoint
from weights.staging import contains, make_staging, remove_stale_staging
from weights.write_errors import write_error_number

logger = logging.getLogger(__name__)

FORMAT = "clover-jax-orbax"
FORMAT_VERSION = 2
# Version 2 stores quantised weights in today's layout (int4 packed in pairs of groups, scales
# [..., groups, out]; pallas_kernels.quantized_weights); a quantised version-1 directory is refused.
FIRST_QUANTIZED_LAYOUT_VERSION = 2
# Weight files in any format are not copied; every other top-level file is (config, tokenizer, ...).
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth",
                   ".gguf", ".h5", ".msgpack", ".ckpt")
# Device-to-host staging while saving is limited to about this many GB beyond the parameters.
SAVE_STAGING_GB = 1
# Leaves are restored in groups of about this many bytes: host staging (and, on the CPU backend,
# the second copy made when the read bytes become device buffers) is bounded by one group.
RESTORE_BATCH_BYTES = 256 << 20



@dataclasses.dataclass(frozen=True)
class OrbaxManifest:
    """What `clover_orbax.json` records; its presence marks a finished conversion."""

    format_version: int
    dtype: str
    num_leaves: int
    num_parameters: int
    bytes: int
    source: str
    copied_files: tuple[str, ...]
    quantization: str | None = None  # e.g. "int4-g128": quantised leaves are stored as {values, scales}

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["copied_files"] = list(self.copied_files)
        return json.dumps({"format": FORMAT, **fields, "orbax_checkpoint_version": ocp.__version__}, indent=2)


# ---------------------------------------------------------------- conversion
def convert_to_orbax(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: Any = None,
    name_map: dict[str, str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
    quantize: QuantSpec | str | None = None,
    check_finite: bool = True,
) -> OrbaxManifest:
    """Convert the Hugging Face checkpoint `hf_dir` into a self-contained Orbax directory `out_dir`.

    dtype: parameter dtype to store (None: the checkpoint's); name_map: as for `load_params`.
    overwrite: replace an existing `out_dir` that holds an earlier conversion, finished or
        interrupted (otherwise refused with FileExistsError). A directory holding anything else
        is never replaced, and `out_dir` may not be the source, contain it, or lie inside it
        (ValueError); both are compared as real paths, symlinks resolved.
    quantize: store weight-only quantised weights ("int8", "int4", ... as for `load_params`);
        loading the directory then restores them as they are, without quantising again.
    check_finite: refuse a source tensor holding NaN or Inf, as `load_params` does.

    Peak memory: `load_params` places the parameters on the default device, so the model is
    held once there (host memory on the CPU backend, device memory on an accelerator) plus one
    stacked parameter in host memory while loading. Saving stages device-to-host copies of
    about SAVE_STAGING_GB GB (or one parameter, if larger) at a time. Host memory therefore
    peaks near 1x the checkpoint + max(SAVE_STAGING_GB GB, the largest stacked parameter) on
    the CPU backend, and near that staging alone on an accelerator; the model is never held
    twice. (Measured on CPU for a 0.38 GB checkpoint, which is staged whole: 1.4-1.7x the
    checkpoint above the JAX baseline.)
    Run it in one process (on one host); the result loads on any number of hosts.
    """
    # Real paths: a symlinked out_dir is written where it points, and compared with the source there.
    source, target = os.path.realpath(os.fspath(hf_dir)), os.path.realpath(os.fspath(out_dir))
    _check_out_dir(source, target, overwrite)
    if jax.process_count() > 1:
        raise ValueError("convert_to_orbax runs in a single process; convert on one host, then load on many")
    config = CloverConfig.from_pretrained(source)
    quantize = quant_spec_for(config, quantize)  # the manifest records the int4 group actually used
    os.makedirs(os.path.dirname(target), exist_ok=True)
    remove_stale_staging(target)
    building = make_staging(target, "converting")
    placed = False
    try:
        params, report = load_params(source, config, dtype=dtype, name_map=name_map, progress=progress,
                                     quantize=quantize, check_finite=check_finite)
        params = _quantized_as_dicts(params)
        leaves = jax.tree.leaves(params)
        manifest = OrbaxManifest(
            format_version=FORMAT_VERSION, dtype=report.dtype, num_leaves=len(leaves),
            num_parameters=sum(int(leaf.size) for leaf in leaves), bytes=sum(int(leaf.nbytes) for leaf in leaves),
            source=source, copied_files=tuple(_copy_metadata_files(source, building)),
            quantization=None if quantize is None else quantize.name)
        del leaves
        started = time.perf_counter()
        logger.info("writing the Orbax checkpoint (%.2f GB, %s) to %s", manifest.bytes / 1e9, manifest.dtype, building)
        checkpointer = _checkpointer()
        try:
            with _write_errors_named(target):
                checkpointer.save(os.path.join(building, PARAMS_DIR), args=ocp.args.PyTreeSave(params))
                del params
                _fsync_tree(building)
        finally:
            checkpointer.close()  # after a failed write too: its writer threads end before the cleanup below
        logger.info("wrote and synced %.2f GB in %.1fs", manifest.bytes / 1e9, time.perf_counter() - started)
        _move_into_place(building, target)
        placed = True
        _write_durably(os.path.join(target, MANIFEST), manifest.to_json())  # the completion marker, last
    except BaseException:
        _remove_tree(target if placed else building)
        raise
    logger.info("converted %s -> %s (%d leaves, %d parameters)", source, target, manifest.num_leaves,
                manifest.num_parameters)
    return manifest


def _remove_tree(path: str, seconds: float = 30.0) -> None:
    """Remove `path` whole, retrying until it has stayed gone for a moment: a write that failed
    part-way (a full disk) can leave TensorStore writes landing, and directories being created, for a
    while after the error on a loaded machine, so `rmtree` may find a directory not yet empty, or the
    directory may come back just after it went."""
    deadline = time.monotonic() + seconds
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            time.sleep(0.2)
            if not os.path.lexists(path):
                return
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    logger.warning("could not remove %s after a failed conversion; remove it by hand", path)


@contextlib.contextmanager
def _write_errors_named(target: str):
    """A failed write (a full disk: TensorStore reports it as a ValueError carrying the OS error code)
    as an OSError that names the output and says that nothing was replaced."""
    try:
        yield
    except (OSError, ValueError) as error:
        number = write_error_number(error)
        if number is None:
            raise
        raise OSError(number, f"writing the Orbax checkpoint to {target} failed: {os.strerror(number)} (a full "
                      f"disk?); the source and anything at {target} before are unchanged. {error}") from error


def _check_out_dir(source: str, target: str, overwrite: bool) -> None:
    """Refuse, before anything is read or written, an output that could touch the source or
    replace what is not an earlier conversion. `source` and `target` are real paths."""
    if not os.path.isdir(source):
        raise CheckpointError(f"checkpoint directory {source!r} does not exist")
    if os.path.exists(target) and not os.path.isdir(target):
        raise FileExistsError(f"out_dir {target!r} exists and is not a directory")
    if contains(target, source):
        raise ValueError(f"out_dir {target!r} would replace the source checkpoint {source!r}; choose another")
    if contains(source, target):
        raise ValueError(f"out_dir {target!r} lies inside the source checkpoint {source!r}; choose a directory "
                         "outside it")
    if os.path.isdir(target) and os.listdir(target):
        if not overwrite:
            raise FileExistsError(f"out_dir {target!r} exists and is not empty; pass overwrite=True to replace it")
        if not is_orbax_checkpoint(target):
            raise FileExistsError(f"out_dir {target!r} holds files that are not an earlier convert_to_orbax result; "
                                  "overwrite=True replaces only those: choose another directory or empty it")


def _copy_metadata_files(source: str, staging: str) -> list[str]:
    """Copy every top-level non-weight file (config, generation config, tokenizer, ...)."""
    copied = []
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if name.startswith(".") or name in (MANIFEST, PARAMS_DIR) or name.endswith(WEIGHT_SUFFIXES):
            continue
        if not os.path.isfile(path):
            logger.info("not copying %s: only top-level files are copied", path)
            continue
        shutil.copyfile(path, os.path.join(staging, name))  # follows symlinks (Hugging Face cache snapshots)
        copied.append(name)
    logger.info("copied %d metadata files: %s", len(copied), copied)
    return copied


def _fsync_tree(root: str) -> None:
    """fsync every file, then every directory (deepest first), under `root`."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_durably(path: str, text: str) -> None:
    """Write `path` through a temporary name and a rename, so it is either absent or whole."""
    partial = path + ".partial"
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    _fsync(os.path.dirname(path))


def _move_into_place(staging: str, target: str) -> None:
    """Rename the finished `staging` directory to `target`, replacing what is there."""
    parent = os.path.dirname(target)
    old = None
    if os.path.isdir(target):
        old = make_staging(target, "replaced")
        os.replace(target, os.path.join(old, "old"))
    os.replace(staging, target)
    _fsync(parent)
    if old is not None:
        shutil.rmtree(old)


# ---------------------------------------------------------------- loading
def read_manifest(directory: str | os.PathLike) -> OrbaxManifest:
    """The manifest of a finished conversion; CheckpointError for an unfinished or foreign directory."""
    directory = os.fspath(directory)
    rerun = f"the conversion was interrupted; rerun convert_to_orbax(hf_dir, {directory!r}, overwrite=True)"
    if not os.path.isdir(directory):
        raise CheckpointError(f"Orbax checkpoint directory {directory!r} does not exist")
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        if os.path.isdir(os.path.join(directory, PARAMS_DIR)) or ".converting-" in os.path.basename(directory):
            raise CheckpointError(f"{directory!r} has no {MANIFEST}, which is written last: {rerun}")
        raise CheckpointError(f"{directory!r} is not an Orbax checkpoint written by convert_to_orbax "
                              f"(no {MANIFEST} and no {PARAMS_DIR}/)")
    try:
        with open(path) as handle:
            fields = json.load(handle)
        if fields.get("format") != FORMAT:
            raise KeyError("format")
        manifest = OrbaxManifest(int(fields["format_version"]), str(fields["dtype"]), int(fields["num_leaves"]),
                                 int(fields["num_parameters"]), int(fields["bytes"]), str(fields["source"]),
                                 tuple(fields["copied_files"]), fields.get("quantization"))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{path} is incomplete or corrupt ({type(error).__name__}: {error}): {rerun}") from error
    if manifest.format_version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {manifest.format_version}; this clover-jax reads up to "
                              f"{FORMAT_VERSION} (upgrade clover-jax or reconvert)")
    if manifest.quantization is not None and manifest.format_version < FIRST_QUANTIZED_LAYOUT_VERSION:
        raise CheckpointError(f"{path}: its {manifest.quantization} weights are stored in the layout of format version "
                              f"{manifest.format_version}, which this clover-jax no longer reads; reconvert with "
                              f"convert_to_orbax(hf_dir, {directory!r}, quantize={manifest.quantization!r}, "
                              "overwrite=True)")
    return manifest


def load_orbax_params(
    directory: str | os.PathLike,
    config: CloverConfig,
    sharding_for: ShardingFor | None = None,
    dtype: Any = None,
    progress: bool = True,
    check_finite: bool = True,
) -> tuple[dict, LoadReport]:
    """Restore the parameters of a `convert_to_orbax` directory, each leaf straight into its sharding.

    sharding_for(path, shape) gives each parameter's sharding; default: the default device.
    dtype: None keeps the stored dtype; otherwise leaves are cast while they are read.
    check_finite: refuse a parameter holding NaN or Inf (CheckpointError naming it), checked on
        each leaf as it is restored (`weights.finite_check`); False skips the check.
    Raises CheckpointError for an unfinished conversion or a tree that does not fit `config`;
    both are checked before any tensor data is read.

    Leaves are restored in groups of about RESTORE_BATCH_BYTES (a larger leaf alone), so host
    memory beyond the placed parameters stays near one group: on an accelerator that is all
    the host holds; on the CPU backend the placed parameters are the model itself, so the peak
    is about 1x the checkpoint plus one group (measured: 1.43x above the JAX baseline for a
    0.38 GB checkpoint, against 1.00x for `load_params`).
    """
    started = time.perf_counter()
    directory = os.fspath(directory)
    manifest = read_manifest(directory)
    stored = _stored_layout(directory, manifest)
    spec = QuantSpec.parse(manifest.quantization)
    _check_against_layout(stored, _expected_layout(config, spec), directory, config)
    target_dtype = np.dtype(dtype if dtype is not None else manifest.dtype)
    if target_dtype not in FLOAT_DTYPES.values():
        raise ValueError(f"dtype {target_dtype} is not a float dtype; use one of "
                         f"{sorted(str(d) for d in FLOAT_DTYPES.values())} (or None for the stored one)")

    default = _default_sharding()
    def target(path, shape, stored_dtype):
        # A quantised leaf's parts ({values, scales}) keep their stored dtypes and the sharding of
        # the weight they stand for.
        is_part = path[-1] in QUANTIZED_PARTS and spec is not None and spec.applies_to(path[:-1])
        weight_path = path[:-1] if is_part else path
        sharding = sharding_for(weight_path, shape) if sharding_for else default
        if is_part:
            sharding = quantized_shardings(sharding, len(shape))[path[-1] == "scales"]
        return jax.ShapeDtypeStruct(shape, stored_dtype if is_part else target_dtype, sharding=sharding)

    targets = {path: target(path, shape, stored_dtype) for path, (shape, stored_dtype) in stored.items()}
    params: dict = {}
    with tqdm(total=sum(_nbytes(t) for t in targets.values()), unit="B", unit_scale=True,
              desc="restoring weights", disable=not progress) as bar:
        for batch in _batches(targets, RESTORE_BATCH_BYTES):
            for path, array in _restore(directory, batch).items():
                if check_finite:
                    require_finite_array(array, f"parameter {'/'.join(path)} in {directory}/{PARAMS_DIR}")
                _set_path(params, path, array)
                bar.update(_nbytes(array))
    params = _dicts_as_quantized(params)
    bytes_read = sum(_nbytes(target) for target in targets.values())
    report = LoadReport(str(target_dtype), len(stored), 0, bytes_read, time.perf_counter() - started)
    logger.info("restored %d leaves (%.2f GB, %s) from %s in %.1fs", report.tensors_read, bytes_read / 1e9,
                report.dtype, directory, report.seconds)
    return params, report


QUANTIZED_PARTS = ("values", "scales")


def _quantized_as_dicts(tree):
    """QuantizedWeight leaves -> {"values", "scales"} dicts (what Orbax stores)."""
    if isinstance(tree, QuantizedWeight):
        return {"values": tree.values, "scales": tree.scales}
    if isinstance(tree, dict):
        return {key: _quantized_as_dicts(value) for key, value in tree.items()}
    return tree


def _dicts_as_quantized(tree):
    if isinstance(tree, dict):
        if set(tree) == set(QUANTIZED_PARTS):
            return QuantizedWeight(tree["values"], tree["scales"])
        return {key: _dicts_as_quantized(value) for key, value in tree.items()}
    return tree


def _expected_layout(config: CloverConfig, spec: QuantSpec | None) -> dict[Path, tuple[int, ...]]:
    """flat_layout, with each quantised weight as its two stored parts."""
    expected = {}
    for path, shape in flat_layout(config).items():
        if spec is None or not spec.applies_to(path):
            expected[path] = tuple(shape)
            continue
        expected[path + ("values",)], expected[path + ("scales",)] = spec.stored_shapes(tuple(shape))
    return expected


def _default_sharding() -> jax.sharding.Sharding:
    """The default device, as `jax.device_put(x)` (and so `load_params`) would use it."""
    device = jax.config.jax_default_device
    if isinstance(device, str):
        device = jax.local_devices(backend=device)[0]
    return jax.sharding.SingleDeviceSharding(device if device is not None else jax.local_devices()[0])


def _stored_layout(directory: str, manifest: OrbaxManifest) -> dict[Path, tuple[tuple[int, ...], np.dtype]]:
    """{leaf path: (shape, dtype)} from the Orbax metadata alone (no tensor data is read)."""
    try:
        metadata = _checkpointer().metadata(os.path.join(directory, PARAMS_DIR)).item_metadata.tree
    except Exception as error:
        raise CheckpointError(f"cannot read the Orbax metadata in {directory!r}/{PARAMS_DIR} "
                              f"({type(error).__name__}: {error}); reconvert the checkpoint") from error
    stored: dict[Path, tuple[tuple[int, ...], np.dtype]] = {}

    def walk(tree, path: Path) -> None:
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, path + (str(key),))
        else:
            stored[path] = (tuple(int(size) for size in tree.shape), np.dtype(tree.dtype))

    walk(metadata, ())
    count = sum(int(np.prod(shape)) for shape, _ in stored.values())
    if (len(stored), count) != (manifest.num_leaves, manifest.num_parameters):
        raise CheckpointError(
            f"{directory!r}/{PARAMS_DIR} holds {len(stored)} leaves and {count} parameters but {MANIFEST} "
            f"records {manifest.num_leaves} and {manifest.num_parameters}; reconvert the checkpoint")
    return stored


def _check_against_layout(stored: dict, expected: dict[Path, tuple[int, ...]], directory: str,
                          config: CloverConfig) -> None:
    missing = sorted("/".join(path) for path in expected if path not in stored)
    extra = sorted("/".join(path) for path in stored if path not in expected)
    wrong = sorted(f"{'/'.join(path)} has shape {stored[path][0]}, expected {tuple(shape)}"
                   for path, shape in expected.items() if path in stored and stored[path][0] != tuple(shape))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing parameter(s): {missing}")
    if extra:
        problems.append(f"{len(extra)} unexpected parameter(s): {extra}")
    if wrong:
        problems.append(f"{len(wrong)} wrongly shaped parameter(s): {wrong}")
    if problems:
        raise CheckpointError(f"Orbax checkpoint {directory!r} does not fit the {config.model_type} config "
                              f"(was it converted from another model?): " + "; ".join(problems))


def _batches(targets: dict[Path, jax.ShapeDtypeStruct], limit: int):
    """Consecutive groups of leaves of about `limit` bytes (a larger leaf is a group of its own)."""
    batch, size = {}, 0
    for path, target in targets.items():
        if batch and size + _nbytes(target) > limit:
            yield batch
            batch, size = {}, 0
        batch[path] = target
        size += _nbytes(target)
    if batch:
        yield batch


def _restore(directory: str, batch: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Read the leaves of `batch` into their shardings; returns once they are on their devices."""
    item, restore_args = {}, {}
    for path, target in batch.items():
        _set_path(item, path, target)
        _set_path(restore_args, path, ocp.ArrayRestoreArgs(sharding=target.sharding, global_shape=target.shape,
                                                           dtype=target.dtype))
    try:
        restored = _checkpointer().restore(
            os.path.join(directory, PARAMS_DIR),
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True))
    except Exception as error:
        raise CheckpointError(f"cannot read the parameters in {directory!r}/{PARAMS_DIR} "
                              f"({type(error).__name__}: {error}); reconvert the checkpoint") from error
    arrays = {path: get(restored, path) for path in batch}
    jax.block_until_ready(list(arrays.values()))
    return arrays


def _nbytes(array) -> int:
    return int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize


def _checkpointer() -> ocp.Checkpointer:
    handler = ocp.PyTreeCheckpointHandler(save_device_host_concurrent_gb=SAVE_STAGING_GB, use_compression=False)
    return ocp.Checkpointer(handler)


def _set_path(tree: dict, path: Path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
