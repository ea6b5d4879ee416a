"""Weight-only quantisation: int8 per output channel, int4 in groups along the input dimension.

A quantised weight `[..., out, in]` is a `QuantizedWeight(values, scales)` pytree that takes the
float weight's place in the parameter tree:

* int8: `values` int8 `[..., out, in]`, `scales` bfloat16 `[..., 1, out]`, `w ≈ values × scale`
  with `scale = max|w_row| / 127`;
* int4: `values` uint8 `[..., out, in / 2]` — two 4-bit codes per byte, so the array holds
  exactly 4 bits per weight on every backend — and `scales` bfloat16 `[..., in / group, out]`
  with `scale = max|w_group| / 7`, codes in [-8, 7].

Which inputs share a byte, and why scales are one row per group, is the layout of
`pallas_kernels.quantized_weights`, the one the kernels read in place. A quantised weight is
placed as its float weight except along its input axis, never split (`quantized_shardings`).

Matmuls dequantise on the fly: on accelerators the routed experts' grouped matmul dequantises
tile by tile inside the kernel (`pallas_kernels.grouped_matmul`), so no float copy of an expert
exists; the XLA path dequantises only the expert a tile uses (`clover_jax.nn.expert_dispatch`);
dense layers dequantise their weight before the matmul (`layers.Linear`).
Quantisation happens at load time, one parameter at a time (`weights.load_params(quantize=...)`),
so the unquantised model is never held whole.

int4 groups: plain `"int4"` asks for the default group of 128 inputs; on a model whose quantised
input widths are not multiples of 2 × 128 (the layout packs pairs of groups), it takes the
largest even group below 128 whose double divides them all (logged). An explicit group
(`"int4-g128"`, `QuantSpec(4, group_size=128)`) that does not fit every width is refused
before any weight is read.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Mapping, NamedTuple

import jax
import ml_dtypes
import numpy as np

from clover_jax.core.params import ALWAYS, DENSE, find_param
from pallas_kernels.quantized_weights import check_int4_widths, dequantized, pack_int4

logger = logging.getLogger(__name__)

SCALE_DTYPE = ml_dtypes.bfloat16
DEFAULT_GROUP = 128


class QuantizedWeight(NamedTuple):
    """values: int8 [..., out, in] or packed uint8 [..., out, in / 2]; scales: bfloat16 [..., groups, out]."""

    values: jax.Array
    scales: jax.Array

    @property
    def bits(self) -> int:
        return 4 if self.values.dtype == np.uint8 else 8

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape."""
        return self.values.shape[:-1] + (self.values.shape[-1] * (2 if self.bits == 4 else 1),)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """bits: 8 or 4; group_size: int4 input-dimension group (int8 is per output channel);
    dense: also quantise the dense projections (attention, GDN, shared expert), not only the
    routed experts. Embedding, LM head, norms and the router stay in the model dtype.
    fit_group: group_size is only the preferred group (plain "int4"): `fitted` lowers it to the
    largest even group that divides every quantised input width instead of refusing."""

    bits: int = 8
    group_size: int = DEFAULT_GROUP
    dense: bool = False
    fit_group: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {self.bits!r}")
        if self.bits == 4 and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                               or self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"int4 group_size must be an even number >= 2, got {self.group_size!r}")

    @property
    def name(self) -> str:
        """The text `parse` reads back: "int8", "int4-g128" ("int4" while the group is to be fitted),
        with "+dense" when dense."""
        group = "" if self.bits == 8 or self.fit_group else f"-g{self.group_size}"
        return f"int{self.bits}{group}" + ("+dense" if self.dense else "")

    @classmethod
    def parse(cls, text: "str | QuantSpec | None") -> "QuantSpec | None":
        """None, a QuantSpec, or "int8" / "int4" / "int4-g64" / "int8+dense"."""
        if text is None or isinstance(text, QuantSpec):
            return text
        name, _, extra = str(text).partition("+")
        bits_text, has_group, group = name.partition("-g")
        if bits_text not in ("int8", "int4") or extra not in ("", "dense") or has_group and (
                bits_text == "int8" or not group.isascii() or not group.isdigit()):
            raise ValueError(f"quantize={text!r}: expected 'int8' or 'int4', optionally '-g<group>' "
                             "(int4) and '+dense'")
        return cls(bits=int(bits_text[3:]), group_size=int(group) if group else DEFAULT_GROUP,
                   dense=extra == "dense", fit_group=bits_text == "int4" and not group)

    def applies_to(self, path: tuple[str, ...]) -> bool:
        """Whether the parameter at `path` is quantised under this spec (its row's `quantize` in
        the parameter table; a path that is no parameter is not)."""
        row = find_param(path)
        return row is not None and (row.quantize == ALWAYS or self.dense and row.quantize == DENSE)

    def check_shape(self, path: tuple[str, ...], shape: tuple[int, ...]) -> None:
        problem = check_int4_widths(shape[-1], self.group_size) if self.bits == 4 else None
        if problem:
            raise ValueError(f"{'/'.join(path)}: {problem}; choose a group_size whose double divides it")

    def fitted(self, layout: Mapping[tuple[str, ...], tuple[int, ...]]) -> "QuantSpec":
        """This spec for a model whose parameters have `layout` ({path: shape}, `flat_layout`).

        An explicit int4 group must fit every quantised input width — twice the group divides it,
        since the layout packs pairs of groups (ValueError naming the first parameter it does not
        fit). With `fit_group` (plain "int4") the group becomes the largest even number
        <= group_size that fits them all, logged when it is not group_size.
        The result has `fit_group` False, so its `name` records the group used.
        """
        quantised = [(path, tuple(shape)) for path, shape in layout.items() if self.applies_to(path)]
        exact = dataclasses.replace(self, fit_group=False)
        if self.bits != 4 or all(check_int4_widths(shape[-1], self.group_size) is None for _, shape in quantised):
            return exact
        if not self.fit_group:
            for path, shape in quantised:
                self.check_shape(path, shape)
        widths = sorted({shape[-1] for _, shape in quantised})
        common = math.gcd(*widths)
        group = next((size for size in range(self.group_size, 1, -2) if common % (2 * size) == 0), None)
        if group is None:
            raise ValueError(f"int4 needs an even group whose double divides every quantised input width, and the "
                             f"widths {widths} have none; use int8")
        logger.info("int4: group_size %d does not fit the quantised input widths %s; using %d, the largest even "
                    "group whose double divides them (ask for 'int4-g<N>' to choose)", self.group_size, widths, group)
        return dataclasses.replace(exact, group_size=group)

    def stored_shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(values shape, scales shape) of the quantised form of a float weight of `shape` [..., out, in]."""
        lead, out, inputs = tuple(shape[:-2]), shape[-2], shape[-1]
        if self.bits == 8:
            return lead + (out, inputs), lead + (1, out)
        return lead + (out, inputs // 2), lead + (inputs // self.group_size, out)

    def stored_dtypes(self) -> tuple[np.dtype, np.dtype]:
        return np.dtype(np.int8 if self.bits == 8 else np.uint8), np.dtype(SCALE_DTYPE)

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the quantised form of a float weight of `shape` (values + bfloat16 scales)."""
        rows = int(np.prod(shape[:-1]))
        if self.bits == 8:
            return rows * shape[-1] + rows * 2
        return rows * shape[-1] // 2 + rows * (shape[-1] // self.group_size) * 2


def quantize(weight: np.ndarray, spec: QuantSpec) -> QuantizedWeight:
    """Quantise a float weight [..., out, in] on the host (NumPy), returning NumPy arrays."""
    weight = np.asarray(weight, np.float32)
    if spec.bits == 8:
        scale = np.max(np.abs(weight), axis=-1, keepdims=True) / 127.0
        safe = np.where(scale > 0, scale, 1.0)
        codes = np.clip(np.rint(weight / safe), -127, 127).astype(np.int8)
        return QuantizedWeight(codes, np.swapaxes(scale, -1, -2).astype(SCALE_DTYPE))
    grouped = weight.reshape(weight.shape[:-1] + (weight.shape[-1] // spec.group_size, spec.group_size))
    scale = np.max(np.abs(grouped), axis=-1, keepdims=True) / 7.0
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.rint(grouped / safe), -8, 7).astype(np.int8).reshape(weight.shape)
    return QuantizedWeight(pack_int4(codes, spec.group_size), np.swapaxes(scale[..., 0], -1, -2).astype(SCALE_DTYPE))


def quantized_shardings(sharding: "jax.sharding.Sharding", rank: int) -> tuple["jax.sharding.Sharding",
                                                                             "jax.sharding.Sharding"]:
    """(values sharding, scales sharding) of a quantised weight of `rank` axes whose float weight is
    placed with `sharding`: the same placement, except that the input axis is never split (a shard
    holds whole rows of codes, so every int4 group and its scale stay on one device; the float
    weight's input split, a tensor-parallel output projection's, is dropped), and the scales
    ([..., groups, out]) split as the output axis."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding, sharding
    spec = tuple(sharding.spec) + (None,) * (rank - len(sharding.spec))
    named = lambda entries: jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*entries))
    return named(spec[:-1] + (None,)), named(spec[:-2] + (None, spec[-2]))


def place(weight: "QuantizedWeight | np.ndarray", sharding: "jax.sharding.Sharding | None"):
    """`jax.device_put` of a float or quantised weight with the sharding of the float weight."""
    if not isinstance(weight, QuantizedWeight) or sharding is None:
        return jax.device_put(weight, sharding)
    values_sharding, scales_sharding = quantized_shardings(sharding, weight.values.ndim)
    return QuantizedWeight(jax.device_put(weight.values, values_sharding),
                           jax.device_put(weight.scales, scales_sharding))


def dequantize(weight: "QuantizedWeight | jax.Array", dtype) -> jax.Array:
    """The float weight [..., out, in] in `dtype` (a float array is returned cast)."""
    if not isinstance(weight, QuantizedWeight):
        return weight.astype(dtype)
    return dequantized(weight.values, weight.scales, dtype)


def take(weight: "QuantizedWeight | jax.Array", index) -> "QuantizedWeight | jax.Array":
    """`weight[index]` on the leading axes, for float and quantised weights alike."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(weight.values[index], weight.scales[index])
    return weight[index]
