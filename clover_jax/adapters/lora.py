"""LoRA adapters: which weights get them, their parameters, how a pass uses them, and merging.

A LoRA run trains a small pytree, `trainable`, beside the frozen base parameters:

    trainable = {"lora": {...path of the adapted weight...: {"a": A, "b": B}},
                 "full": {...path...: leaf},           # the block-mode tensors, trained fully
                 "mask_rows": {"embedding": [hidden], "lm_head": [hidden]}}

* "lora": for a weight W [..., out, in] (`...`: the layer groups, and the experts of a routed
  stack), A: float32 [..., rank, in] (uniform ±1/√in, as PEFT draws it) and B: float32
  [..., out, rank] (zeros: the run starts at the base model). The weight in a pass is
  W + (alpha / rank) B A. One adapter per routed expert on the fused gate|up stack and one on
  down; the experts' products run as grouped matmuls (`clover_jax.nn.expert_lora`).
* "full": the Clover block-mode tensors (docs/design.md §2; a converted Qwen base holds their
  defaults, which are not a LoRA's business to approximate) — trained as in full fine-tuning.
* "mask_rows": the mask token's embedding row and (untied heads) LM-head row — a converted base
  has no trained mask token; the rest of both tables stays frozen.

`attach` builds the parameter tree a training pass runs: the frozen base with the factors placed
beside each adapted weight (`{name}_lora_a`, `{name}_lora_b`, the scale folded into B, read by
`clover_jax.nn.layers.low_rank_update` and the MoE layer; a routed stack's B transposed to
[..., rank, out], as `clover_jax.nn.expert_lora.ExpertAdapters` says why), the fully trained
leaves put in and the mask token's embedding row beside the frozen table
(`embed_tokens/trained_mask_row`).
`merge` folds everything into the base weights (the merged checkpoint, adapter loading).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.adapters.targets import TARGETS
from clover_jax.core.config import CloverConfig
from clover_jax.core.params import param_rows
from clover_jax.core.quantization import QuantizedWeight
from clover_jax.core.tree_paths import Path, get, key_names, put
from clover_jax.nn.model import TRAINED_MASK_ROW


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What a LoRA run adapts (hashable: part of the compiled step). mask_token_id: the row of the
    embedding / LM head trained fully; tied: the LM head is the embedding."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    mask_token_id: int
    tied: bool

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def adapted_paths(config: CloverConfig, targets: tuple[str, ...]) -> list[Path]:
    """Full paths of the weights that get adapters, in the pytree's order."""
    inside = {path for target in targets for path in TARGETS[target]}
    return [path for path in param_rows(config) if path[0] == "groups" and path[2:] in inside]


def fully_trained_paths(config: CloverConfig) -> list[Path]:
    """Full paths of the Clover block-mode tensors (the table rows with a default)."""
    return [path for path, row in param_rows(config).items() if row.default is not None]


def init_trainable(params: dict, config: CloverConfig, spec: LoraSpec, key: jax.Array) -> dict:
    """The trainable pytree of a fresh run over base `params` (canonical layout; float32 leaves)."""
    lora: dict = {}
    for index, path in enumerate(adapted_paths(config, spec.targets)):
        shape = tuple(get(params, path).shape)  # a QuantizedWeight's shape is its float weight's
        lead, (out, inputs) = shape[:-2], shape[-2:]
        bound = 1.0 / math.sqrt(inputs)
        a = jax.random.uniform(jax.random.fold_in(key, index), lead + (spec.rank, inputs), jnp.float32, -bound, bound)
        lora = put(lora, path, {"a": a, "b": jnp.zeros(lead + (out, spec.rank), jnp.float32)})
    full: dict = {}
    for path in fully_trained_paths(config):
        full = put(full, path, jnp.asarray(get(params, path), jnp.float32))
    rows = {"embedding": jnp.asarray(params["embed_tokens"]["embedding"][spec.mask_token_id], jnp.float32)}
    if not spec.tied:
        rows["lm_head"] = jnp.asarray(params["lm_head"][spec.mask_token_id], jnp.float32)
    return {"lora": lora, "full": full, "mask_rows": rows}


def lora_items(trainable: dict) -> list[tuple[Path, dict]]:
    """[(path of the adapted weight, {"a", "b"})] in a stable order."""
    items: list[tuple[Path, dict]] = []

    def walk(node, path):
        if set(node) == {"a", "b"} and not isinstance(node["a"], dict):
            items.append((path, node))
            return
        for name in sorted(node):
            walk(node[name], path + (name,))

    walk(trainable.get("lora", {}), ())
    return items


def full_items(trainable: dict) -> list[tuple[Path, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(trainable.get("full", {}))[0]
    return [(key_names(path), leaf) for path, leaf in leaves]


def attach(base: dict, trainable: dict, spec: LoraSpec) -> dict:
    """The parameter tree a training pass runs: `base` (frozen, any dtype, possibly quantised) with
    the adapters beside their weights (B scaled), the fully trained leaves put in and the mask
    token's embedding row beside the table. Differentiable in `trainable`."""
    params = base
    for path, factors in lora_items(trainable):
        params = put(params, path[:-1] + (f"{path[-1]}_lora_a",), factors["a"])
        b = factors["b"] * spec.scale
        if path[2:] in TARGETS["routed_experts"]:  # [groups, experts, rank, out] in the pass: `ExpertAdapters`
            b = jnp.swapaxes(b, -1, -2)
        params = put(params, path[:-1] + (f"{path[-1]}_lora_b",), b)
    for path, leaf in full_items(trainable):
        params = put(params, path, leaf.astype(get(base, path).dtype))
    # The tables stay the frozen arrays: a row written into a [vocab, hidden] table would make the
    # pass copy the table and its gradient a dense [vocab, hidden] array (about 1 GB each at
    # Clover-35B's vocabulary). The embedding reads the row beside its table (`TRAINED_MASK_ROW`);
    # the LM head's row only makes the mask token's logit, which the loss sets to −∞ as decoding
    # does, so the pass leaves it out (its gradient is zero either way; `merge` puts it in).
    table = base["embed_tokens"]["embedding"]
    return put(params, ("embed_tokens", TRAINED_MASK_ROW), trainable["mask_rows"]["embedding"].astype(table.dtype))


def _with_mask_rows(params: dict, rows: dict, spec: LoraSpec) -> dict:
    table = params["embed_tokens"]["embedding"]
    params = put(params, ("embed_tokens", "embedding"),
                 table.at[spec.mask_token_id].set(rows["embedding"].astype(table.dtype)))
    if not spec.tied:
        params = put(params, ("lm_head",), params["lm_head"].at[spec.mask_token_id].set(
            rows["lm_head"].astype(params["lm_head"].dtype)))
    return params


def delta(factors: dict, scale: float) -> jax.Array:
    """scale · B A: float32 [..., out, in]."""
    return scale * jnp.einsum("...or,...ri->...oi", jnp.asarray(factors["b"], jnp.float32),
                              jnp.asarray(factors["a"], jnp.float32))


def merge(base: dict, trainable: dict, spec: LoraSpec) -> dict:
    """`base` (float weights, canonical layout) with every adapter folded in (W + scale · B A, summed
    in float32, rounded to W's dtype once) and the fully trained leaves and mask rows put in."""
    params = base
    for path, factors in lora_items(trainable):
        weight = get(base, path)
        if isinstance(weight, QuantizedWeight):
            raise ValueError(f"{'/'.join(path)} is quantised: merge an adapter into a float base (load the base "
                             "unquantised, merge, then quantise)")
        merged = jnp.asarray(weight, jnp.float32) + delta(factors, spec.scale)
        params = put(params, path, merged.astype(weight.dtype))
    for path, leaf in full_items(trainable):
        params = put(params, path, jnp.asarray(leaf).astype(get(base, path).dtype))
    return _with_mask_rows(params, jax.tree_util.tree_map(jnp.asarray, trainable["mask_rows"]), spec)


def parameter_count(trainable: dict) -> int:
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(trainable)))
