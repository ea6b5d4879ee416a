"""Checkpoint tensor names -> parameter paths, derived from the parameter table.

The names themselves, their transforms and the Clover tensors' defaults are rows of
`clover_jax.core.params`; this module reads them. Names are first brought to one *canonical*
form — the text-only `model.` prefix and routed experts stored one per expert, which is what
`save_pretrained` writes — then looked up. Other layouts become canonical names on the way in:

* `model.language_model.*` (Qwen3.5/3.6 multimodal checkpoints) drops `language_model.`;
* fused experts (a row's `fused` name: `mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first,
  and `mlp.experts.down_proj [E, H, I]`) become per-expert names that read a slice of the fused
  tensor, so each expert is still read on its own;
* `model.visual.*` and `mtp.*` are skipped and counted;
* a user `name_map` (checkpoint name -> canonical name) renames anything else.

Parameter layout (see `clover_jax.nn.model`): weights keep the checkpoint's `[out, in]`, routed
experts are stacked `[experts, out, in]` with gate and up fused along `out` (gate rows first,
as in the fused checkpoint layout), and every layer parameter has a leading `[num_groups]`
axis. Every placement is therefore a plain copy into a contiguous region.
"""

from __future__ import annotations

import dataclasses
import re

from clover_jax.core.config import CloverConfig
from clover_jax.core.params import COPY, PARAMS, SQUEEZE_CHANNEL, STACK_EXPERTS, Param, layer_params, param_rows
from clover_jax.core.state import slot_name
from weights.checkpoint_files import CheckpointError

__all__ = ["COPY", "SQUEEZE_CHANNEL", "SKIPPED_PREFIXES", "Placement", "Source", "canonical_sources",
           "expected_placements", "normalise_prefix"]

SKIPPED_PREFIXES = ("model.visual.", "mtp.")
# Fused-expert tensor name (after `model.layers.{i}.`) -> its row.
_FUSED = {row.fused: row for row in PARAMS if row.fused is not None}
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.(" + "|".join(re.escape(name) for name in _FUSED) + ")")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one canonical tensor goes: `params[path][index] = transform(tensor)`."""

    path: tuple[str, ...]
    index: tuple  # leading integer indices, then possibly a slice of the next axis
    transform: str
    shape: tuple[int, ...]  # the canonical tensor's shape in the checkpoint
    default: float | None = None  # the value used when an optional tensor is absent


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a canonical tensor's data is: `checkpoint[tensor][index]`."""

    tensor: str
    index: tuple
    shape: tuple[int, ...]


def expected_placements(config: CloverConfig) -> dict[str, Placement]:
    """Every canonical tensor this config needs, in a stable order: the top-level tensors, then
    layer by layer its tensors in table order, then its routed experts one by one."""
    placements = {row.checkpoint[0]: _placement(row, path, (), config)
                  for path, row in param_rows(config).items() if not row.in_layers}
    for layer, layer_type in enumerate(config.layer_types):
        group, slot = divmod(layer, len(config.group_pattern))
        prefix = f"model.layers.{layer}."
        rows = [(("groups", slot_name(slot)) + row.path, row) for row in layer_params(layer_type)]
        for path, row in rows:
            if row.transform != STACK_EXPERTS:
                placements[prefix + row.checkpoint[0]] = _placement(row, path, (group,), config)
        experts = [(path, row, _expert_parts(row, config)) for path, row in rows if row.transform == STACK_EXPERTS]
        for expert in range(config.num_experts):
            for path, row, parts in experts:
                for name, tail in parts:
                    placements[prefix + name.format(expert=expert)] = _placement(row, path, (group, expert) + tail,
                                                                                config)
    return placements


def _expert_parts(row: Param, config: CloverConfig) -> list[tuple[str, tuple]]:
    """(per-expert name, index after the expert axis) of each tensor a STACK_EXPERTS row is read
    from: several names split the `out` axis in order."""
    if len(row.checkpoint) == 1:
        return [(row.checkpoint[0], ())]
    size = row.stored_shape(config)[0]
    return [(name, (slice(part * size, (part + 1) * size),)) for part, name in enumerate(row.checkpoint)]


def _placement(row: Param, path: tuple[str, ...], index: tuple, config: CloverConfig) -> Placement:
    transform = SQUEEZE_CHANNEL if row.transform == SQUEEZE_CHANNEL else COPY
    default = None if row.default is None else row.default(config)
    return Placement(path, index, transform, row.stored_shape(config), default)


def canonical_sources(name: str, checkpoint_name: str, shape: tuple[int, ...],
                      config: CloverConfig) -> dict[str, Source] | None:
    """Canonical tensors held by checkpoint tensor `checkpoint_name`, or None if it is skipped.

    `name` is its prefix-normalised (and `name_map`-renamed) name.

    A plain tensor is its own canonical tensor; a fused expert tensor holds one per expert.
    """
    if name.startswith(SKIPPED_PREFIXES):
        return None
    fused = _FUSED_EXPERTS.fullmatch(name)
    if not fused:
        return {name: Source(checkpoint_name, (), shape)}
    layer, fused_name = fused.groups()
    row = _FUSED[fused_name]
    _require_shape(checkpoint_name, shape, row.shape(config))
    return {f"model.layers.{layer}.{name.format(expert=expert)}": Source(checkpoint_name, (expert,) + tail,
                                                                         row.stored_shape(config))
            for expert in range(config.num_experts) for name, tail in _expert_parts(row, config)}


def normalise_prefix(name: str) -> str:
    """`model.language_model.X` -> `model.X`; everything else unchanged."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def _require_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(
            f"tensor {name} has shape {tuple(shape)}, expected {expected} "
            "(num_experts, 2*moe_intermediate_size or hidden_size, ...) from config.json")
