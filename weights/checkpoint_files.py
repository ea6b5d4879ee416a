"""The safetensors files of a checkpoint directory: discovery, header validation, slice reads.

Only headers are read up front (names, shapes, dtypes, byte offsets), validated by
`safetensors.safe_open`; tensor data is read later, one tensor or one expert slice at a time.
When the destination has the tensor's dtype, the bytes are read with `os.preadv` straight into
the destination buffer (one copy, no memory map whose pages would stay resident); otherwise
`safe_open(...).get_slice` reads the slice and numpy converts it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from contextlib import ExitStack

import ml_dtypes
import numpy as np
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor and/or the file."""


INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names -> numpy dtypes (bfloat16 comes from ml_dtypes, which JAX ships).
FLOAT_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
                "BF16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, e.g. "BF16"
    offset: int = 0  # absolute byte offset of the tensor's data in its file

    @property
    def num_bytes(self) -> int:
        itemsize = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(self.dtype, 1)
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize


class CheckpointFiles:
    """Open handles on every safetensors file of a checkpoint, and the index of its tensors."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.files, weight_map = _discover_files(self.directory)
        self._stack = ExitStack()
        self._handles = {}
        self._descriptors: dict[str, int] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            for file in self.files:
                self._open(file)
            for name, file in (weight_map or {}).items():
                if self.tensors.get(name) is None or self.tensors[name].file != file:
                    raise CheckpointError(
                        f"{INDEX_FILE} places tensor {name} in {file}, but {file} does not hold it")
        except BaseException:
            self.close()
            raise

    def _open(self, file: str) -> None:
        path = os.path.join(self.directory, file)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is listed in the index but does not exist")
        try:
            handle = self._stack.enter_context(safe_open(path, framework="numpy"))
            offsets = _data_offsets(path)
            infos = []
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                infos.append(TensorInfo(name, file, tuple(tensor_slice.get_shape()), tensor_slice.get_dtype(),
                                        offsets[name]))
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises its own error types for bad headers
            raise CheckpointError(
                f"checkpoint file {path} is truncated or corrupt (cannot read its safetensors header): {error}"
            ) from error
        _check_data_size(path, infos)
        self._handles[file] = handle
        descriptor = os.open(path, os.O_RDONLY)
        self._stack.callback(os.close, descriptor)
        self._descriptors[file] = descriptor
        for info in infos:
            if info.name in self.tensors:
                raise CheckpointError(
                    f"tensor {info.name} appears in both {self.tensors[info.name].file} and {file}")
            self.tensors[info.name] = info

    def read(self, name: str, index=()) -> np.ndarray:
        """Read tensor `name` (or `tensor[index]`, reading only that slice) as a numpy array."""
        info = self.tensors[name]
        try:
            tensor_slice = self._handles[info.file].get_slice(name)
            return tensor_slice[index] if index != () else tensor_slice[:]
        except Exception as error:
            raise CheckpointError(f"cannot read tensor {name} from {info.file}: {error}") from error

    def read_into(self, name: str, index: tuple, out: np.ndarray) -> None:
        """Fill `out` with `tensor[index]` (same number of elements; `index` is leading integers,
        then at most one slice), reading the bytes straight into `out` when the dtypes agree."""
        info = self.tensors[name]
        source_dtype = FLOAT_DTYPES.get(info.dtype)
        byte_range = None if source_dtype is None else _contiguous_range(info.shape, index, source_dtype.itemsize)
        if byte_range is None or out.dtype != source_dtype or not out.flags.c_contiguous:
            out[...] = self.read(name, index).reshape(out.shape).astype(out.dtype)
            return
        start, length = byte_range
        target = memoryview(out.reshape(-1).view(np.uint8))
        if target.nbytes != length:
            raise CheckpointError(f"tensor {name}{list(index)} holds {length} bytes, its destination {target.nbytes}")
        done = 0
        while done < length:  # preadv may return short counts (e.g. above 2 GiB per call)
            count = os.preadv(self._descriptors[info.file], [target[done:]], info.offset + start + done)
            if count <= 0:
                raise CheckpointError(f"checkpoint file {info.file} ended while reading tensor {name}")
            done += count

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "CheckpointFiles":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _discover_files(directory: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of `directory`, and the index's tensor -> file map if it has one."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_weight_map(index_path)
        return sorted(set(weight_map.values())), weight_map
    if os.path.isfile(os.path.join(directory, "model.safetensors")):
        return ["model.safetensors"], None
    raise CheckpointError(
        f"no model.safetensors or {INDEX_FILE} in {directory!r}")


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The index's `weight_map` {tensor name: file}, each file a relative path inside the checkpoint.

    An entry that is absolute or climbs out with `..` is refused: the index must not make the
    loader open files outside the checkpoint directory. (The files themselves may be symlinks,
    as in the Hugging Face Hub cache, whose snapshots link to `../../blobs/...`.)
    """
    try:
        with open(index_path, encoding="utf-8") as handle:
            index = json.load(handle)
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{index_path} is not valid JSON: {error}") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        raise CheckpointError(f"{index_path} is not a safetensors index: it needs an object with a 'weight_map'")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map must be an object of tensor name -> file name strings")
    files = {}
    for name, file in weight_map.items():
        parts = file.replace("\\", "/").split("/")
        if not file or "\0" in file or os.path.isabs(file) or file.startswith(("/", "\\")) or ".." in parts:
            raise CheckpointError(f"{index_path} places tensor {name} in {file!r}, which is not a file name inside "
                                  "the checkpoint directory (absolute paths and '..' are refused)")
        files[name] = os.path.normpath(file)
    return files


def _data_offsets(path: str) -> dict[str, int]:
    """Absolute file offset of each tensor's data, from the safetensors header."""
    with open(path, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
    return {name: 8 + header_size + entry["data_offsets"][0]
            for name, entry in header.items() if name != "__metadata__"}


def _contiguous_range(shape: tuple[int, ...], index: tuple, itemsize: int) -> tuple[int, int] | None:
    """(start, length) in bytes of `tensor[index]` in a C-ordered tensor, or None if not contiguous."""
    strides = [math.prod(shape[axis + 1:]) for axis in range(len(shape))]
    start, axis = 0, 0
    for axis, item in enumerate(index):
        if isinstance(item, slice):
            low, high, step = item.indices(shape[axis])
            if step != 1 or axis != len(index) - 1:
                return None
            return (start + low * strides[axis]) * itemsize, (high - low) * strides[axis] * itemsize
        start += item * strides[axis]
    count = strides[len(index) - 1] if index else math.prod(shape)
    return start * itemsize, count * itemsize


def _check_data_size(path: str, infos: list[TensorInfo]) -> None:
    """A file shorter than its header says is truncated; safetensors may only notice on read."""
    with open(path, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
    data_bytes = os.path.getsize(path) - 8 - header_size
    needed = sum(info.num_bytes for info in infos)
    if data_bytes < needed:
        raise CheckpointError(
            f"checkpoint file {path} is truncated: its header describes {needed} bytes of tensor data "
            f"but only {data_bytes} are present")


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data is 64-byte aligned — on the CPU backend `jax.device_put`
    then adopts the buffer instead of copying it — and 2 MiB aligned when large, so the kernel
    can back it with transparent huge pages (first-touch page faults dominate loading on VMs)."""
    num_bytes = int(np.prod(shape)) * dtype.itemsize
    alignment = 2 << 20 if num_bytes >= 2 << 20 else 64
    raw = np.empty(num_bytes + alignment, np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw[offset:offset + num_bytes].view(dtype).reshape(shape)
