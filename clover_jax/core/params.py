"""The parameter table: one row per leaf of the parameter pytree, and everything derived from it.

A row says, for one parameter of the Flax modules (`clover_jax.nn.model`):

* `path` — where it sits: from the root for the top-level rows, inside a decoder layer for the
  others (which the pytree holds once per slot of the repeating layer group, under
  `groups/layer_{slot}/`, with a leading `[num_groups]` axis);
* `shape` — its shape as a function of the config (one layer's, for layer rows);
* `axes` — the logical name of each dimension (`clover_jax.parallel.sharding` maps them to mesh axes;
  None: never sharded);
* `checkpoint` — the Hugging Face tensor name(s) it is read from, after `model.layers.{i}.` for
  layer rows, and `transform` — how they fill it:
    - COPY: one tensor, the leaf itself (one layer's slice of it for layer rows);
    - SQUEEZE_CHANNEL: a depthwise conv weight, stored `[channels, 1, kernel]`;
    - STACK_EXPERTS: one tensor per routed expert (`{expert}` in the name); with several names,
      the names split the leaf's `out` axis in order (`gate_proj` rows first, then `up_proj`);
      `fused` names the checkpoint layout that holds all experts in one `[experts, out, in]`
      tensor, laid out like the leaf;
* `default` — for the optional Clover block-mode tensors (docs/design.md §2), the value a
  checkpoint without them gets;
* `init` — how a freshly initialised model fills it (training the bundled model, tests):
  "normal" (σ 0.02), "conv" (σ 0.1), "zeros", "ones" or "default" (the `default` value);
* `quantize` — "always" (the routed experts, under any `QuantSpec`), "dense" (only with
  `QuantSpec(dense=True)`) or "never" (embedding, LM head, norms, router, small projections).

It is the only declaration of a weight: the Flax modules create each parameter from its row
(`clover_jax.nn.layers.table_param`: shape, initialiser), and `param_layout` (shapes),
`sharding.param_logical_axes`, `weights.name_table` (checkpoint names and defaults),
`QuantSpec.applies_to` and `parameter_counts` all read it. To add a weight, add its row;
`tests/clover_jax/core/test_param_layout.py` checks the table against the tree the modules trace.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from clover_jax.core.config import CloverConfig
from clover_jax.core.state import slot_name
from clover_jax.core.tree_paths import Path

Shape = tuple[int, ...]

# Where a row lives: at the top of the tree, in every layer, or in layers of one `config.layer_types` kind.
TOP, EVERY_LAYER, LINEAR_ATTENTION, FULL_ATTENTION = "top", "every_layer", "linear_attention", "full_attention"
COPY, SQUEEZE_CHANNEL, STACK_EXPERTS = "copy", "squeeze_channel", "stack_experts"
ALWAYS, DENSE, NEVER = "always", "dense", "never"
INITS = ("normal", "conv", "zeros", "ones", "default")


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf of the parameter pytree (see the module docstring for each field)."""

    path: Path
    where: str
    shape: Callable[[CloverConfig], Shape]
    axes: tuple[str | None, ...]
    checkpoint: tuple[str, ...]
    transform: str = COPY
    fused: str | None = None
    default: Callable[[CloverConfig], float] | None = None
    quantize: str = NEVER
    untied_only: bool = False  # absent when config.tie_word_embeddings (the LM head)
    init: str = "normal"

    def __post_init__(self):
        if self.init not in INITS or (self.init == "default") != (self.default is not None):
            raise ValueError(f"{self.path}: init {self.init!r} (one of {INITS}; 'default' exactly when a default "
                             "is given)")
        for name in ("path", "checkpoint"):  # written as "a/b" or "name" in the table
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, tuple(value.split("/")) if name == "path" else (value,))

    @property
    def in_layers(self) -> bool:
        return self.where != TOP

    def present(self, config: CloverConfig) -> bool:
        return not (self.untied_only and config.tie_word_embeddings)

    def leaf_shape(self, config: CloverConfig) -> Shape:
        """The pytree leaf's shape: layer rows carry the leading [num_groups] axis."""
        shape = tuple(self.shape(config))
        return (config.num_groups,) + shape if self.in_layers else shape

    @property
    def leaf_axes(self) -> tuple[str | None, ...]:
        return ("layers",) + self.axes if self.in_layers else self.axes

    def stored_shape(self, config: CloverConfig) -> Shape:
        """Shape of each tensor named in `checkpoint` (one layer's, one expert's)."""
        shape = tuple(self.shape(config))
        if self.transform == SQUEEZE_CHANNEL:
            return shape[:1] + (1,) + shape[1:]
        if self.transform == STACK_EXPERTS:
            return (shape[1] // len(self.checkpoint),) + shape[2:]
        return shape


def _shared(config: CloverConfig) -> int:
    return config.shared_expert_intermediate_size


def _routed(part: str, shape, checkpoint: tuple[str, ...], fused: str) -> Param:
    return Param(f"mlp/{part}", EVERY_LAYER, shape, ("experts", None, None), checkpoint, STACK_EXPERTS, fused=fused,
                 quantize=ALWAYS)


# In the order of the pytree (`param_layout`): the top rows before the layers come first in the tree.
PARAMS: tuple[Param, ...] = (
    Param("embed_tokens/embedding", TOP, lambda c: (c.vocab_size, c.hidden_size), ("vocab", None),
          "model.embed_tokens.weight"),
    # ---- every decoder layer
    Param("input_layernorm/weight", EVERY_LAYER, lambda c: (c.hidden_size,), (None,), "input_layernorm.weight",
          init="zeros"),
    Param("post_attention_layernorm/weight", EVERY_LAYER, lambda c: (c.hidden_size,), (None,),
          "post_attention_layernorm.weight", init="zeros"),
    Param("mlp/gate", EVERY_LAYER, lambda c: (c.num_experts, c.hidden_size), (None, None), "mlp.gate.weight"),
    _routed("experts_gate_up_proj", lambda c: (c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size),
            ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
            "mlp.experts.gate_up_proj"),
    _routed("experts_down_proj", lambda c: (c.num_experts, c.hidden_size, c.moe_intermediate_size),
            ("mlp.experts.{expert}.down_proj.weight",), "mlp.experts.down_proj"),
    Param("mlp/shared_expert/gate_proj/weight", EVERY_LAYER, lambda c: (_shared(c), c.hidden_size), ("mlp", None),
          "mlp.shared_expert.gate_proj.weight", quantize=DENSE),
    Param("mlp/shared_expert/up_proj/weight", EVERY_LAYER, lambda c: (_shared(c), c.hidden_size), ("mlp", None),
          "mlp.shared_expert.up_proj.weight", quantize=DENSE),
    Param("mlp/shared_expert/down_proj/weight", EVERY_LAYER, lambda c: (c.hidden_size, _shared(c)), (None, "mlp"),
          "mlp.shared_expert.down_proj.weight", quantize=DENSE),
    Param("mlp/shared_expert_gate/weight", EVERY_LAYER, lambda c: (1, c.hidden_size), (None, None),
          "mlp.shared_expert_gate.weight"),
    # ---- Gated DeltaNet layers. q|k|v are concatenated along in_proj_qkv's rows, so a contiguous
    # shard would cut across the three: the projection and its convolutions stay replicated.
    Param("linear_attn/in_proj_qkv/weight", LINEAR_ATTENTION, lambda c: (c.conv_dim, c.hidden_size), (None, None),
          "linear_attn.in_proj_qkv.weight", quantize=DENSE),
    Param("linear_attn/in_proj_z/weight", LINEAR_ATTENTION, lambda c: (c.linear_value_dim, c.hidden_size),
          ("value_heads", None), "linear_attn.in_proj_z.weight", quantize=DENSE),
    Param("linear_attn/in_proj_b/weight", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads, c.hidden_size),
          ("value_heads", None), "linear_attn.in_proj_b.weight"),
    Param("linear_attn/in_proj_a/weight", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads, c.hidden_size),
          ("value_heads", None), "linear_attn.in_proj_a.weight"),
    Param("linear_attn/conv1d_weight", LINEAR_ATTENTION, lambda c: (c.conv_dim, c.linear_conv_kernel_dim),
          (None, None), "linear_attn.conv1d.weight", SQUEEZE_CHANNEL, init="conv"),
    Param("linear_attn/dt_bias", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads,), ("value_heads",),
          "linear_attn.dt_bias", init="ones"),
    Param("linear_attn/A_log", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads,), ("value_heads",),
          "linear_attn.A_log", init="zeros"),
    # Clover block-mode tensors (docs/design.md §2): optional in a checkpoint, with these defaults.
    Param("linear_attn/conv1d_right_weight", LINEAR_ATTENTION, lambda c: (c.conv_dim, c.linear_conv_kernel_dim),
          (None, None), "linear_attn.conv1d_right.weight", SQUEEZE_CHANNEL, default=lambda c: 0.0,
          init="default"),
    Param("linear_attn/block_logit_scale", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads,), ("value_heads",),
          "linear_attn.block_logit_scale", default=lambda c: math.log(math.sqrt(c.linear_key_head_dim)),
          init="default"),
    Param("linear_attn/memory_logit_bias", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads,), ("value_heads",),
          "linear_attn.memory_logit_bias", default=lambda c: 0.0, init="default"),
    Param("linear_attn/block_size_calibration", LINEAR_ATTENTION, lambda c: (c.linear_num_value_heads,),
          ("value_heads",), "linear_attn.block_size_calibration", default=lambda c: 0.0, init="default"),
    Param("linear_attn/norm/weight", LINEAR_ATTENTION, lambda c: (c.linear_value_head_dim,), (None,),
          "linear_attn.norm.weight", init="ones"),
    Param("linear_attn/out_proj/weight", LINEAR_ATTENTION, lambda c: (c.hidden_size, c.linear_value_dim),
          (None, "value_heads"), "linear_attn.out_proj.weight", quantize=DENSE),
    # ---- full attention layers: q_proj holds the query and the output gate of each head.
    Param("self_attn/q_proj/weight", FULL_ATTENTION,
          lambda c: (2 * c.num_attention_heads * c.head_dim, c.hidden_size), ("q_heads", None),
          "self_attn.q_proj.weight", quantize=DENSE),
    Param("self_attn/k_proj/weight", FULL_ATTENTION, lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
          ("kv_heads", None), "self_attn.k_proj.weight", quantize=DENSE),
    Param("self_attn/v_proj/weight", FULL_ATTENTION, lambda c: (c.num_key_value_heads * c.head_dim, c.hidden_size),
          ("kv_heads", None), "self_attn.v_proj.weight", quantize=DENSE),
    Param("self_attn/o_proj/weight", FULL_ATTENTION, lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
          (None, "q_heads"), "self_attn.o_proj.weight", quantize=DENSE),
    Param("self_attn/q_norm/weight", FULL_ATTENTION, lambda c: (c.head_dim,), (None,), "self_attn.q_norm.weight",
          init="zeros"),
    Param("self_attn/k_norm/weight", FULL_ATTENTION, lambda c: (c.head_dim,), (None,), "self_attn.k_norm.weight",
          init="zeros"),
    # ---- after the layers
    Param("norm/weight", TOP, lambda c: (c.hidden_size,), (None,), "model.norm.weight", init="zeros"),
    Param("lm_head", TOP, lambda c: (c.vocab_size, c.hidden_size), ("vocab", None), "lm_head.weight",
          untied_only=True),
)

_TOP_ROWS = {row.path: row for row in PARAMS if not row.in_layers}
_LAYER_ROWS = {row.path: row for row in PARAMS if row.in_layers}


# Paths, inside a decoder layer, of the routed-expert stacks (`[experts, ...]` leaves).
ROUTED_EXPERT_PATHS: tuple[Path, ...] = tuple(row.path for row in PARAMS if row.transform == STACK_EXPERTS)


def layer_params(layer_type: str) -> list[Param]:
    """The rows of one decoder layer of `layer_type` ("linear_attention" / "full_attention")."""
    return [row for row in _LAYER_ROWS.values() if row.where in (EVERY_LAYER, layer_type)]


def param_rows(config: CloverConfig) -> dict[Path, Param]:
    """{full pytree path: row} for every leaf of this config, in the pytree's order."""
    rows: dict[Path, Param] = {}
    for row in PARAMS:
        if not row.in_layers:
            if row.present(config):
                rows[row.path] = row
        elif row is next(iter(_LAYER_ROWS.values())):  # the layer groups sit where the layer rows begin
            for slot, layer_type in enumerate(config.group_pattern):
                for layer_row in layer_params(layer_type):
                    rows[("groups", slot_name(slot)) + layer_row.path] = layer_row
    return rows


def table_row(in_layers: bool, path: Path) -> Param | None:
    """The row at `path` inside a decoder layer (`in_layers`) or from the root, or None."""
    return (_LAYER_ROWS if in_layers else _TOP_ROWS).get(tuple(path))


def find_param(path: Path) -> Param | None:
    """The row of the leaf at full pytree `path` (`groups/layer_{slot}/...` for layer rows), or None."""
    path = tuple(path)
    if path in _TOP_ROWS:
        return _TOP_ROWS[path]
    if len(path) > 2 and path[0] == "groups":
        return _LAYER_ROWS.get(path[2:])
    return None


def parameter_counts(config: CloverConfig) -> dict[str, int]:
    """Total parameters, the routed experts' share, those one token uses (top-k of the experts), and
    the embedding plus LM head."""
    total = routed = embedding = 0
    for path, row in param_rows(config).items():
        count = math.prod(row.leaf_shape(config))
        total += count
        if row.transform == STACK_EXPERTS:
            routed += count
        if path[0] in ("embed_tokens", "lm_head"):
            embedding += count
    active = total - routed + routed * config.num_experts_per_tok // config.num_experts
    return {"total": total, "routed_experts": routed, "active_per_token": active, "embeddings": embedding}
