"""The decoder stack: embedding, layer groups scanned with `nn.scan`, final norm, LM head.

Layers come in groups that repeat the config's layer pattern — for Qwen3.6 (3 GDN + 1 full
attention) × 10. Every parameter under `groups` has a leading `[num_groups]` axis in the
canonical ("stacked") layout, and layer `i` of the checkpoint is slot `i % len(pattern)` of
group `i // len(pattern)`. Two loops run the groups (`CloverTransformer.layer_loop`, by platform
`layer_loop_for`):

* "scan" (GPU, TPU): `nn.scan` over the stacked parameters, so compile time does not grow with
  depth; accelerators read each group's slice of a stacked weight in place.
* "unrolled" (CPU): a Python loop over groups whose parameters are separate arrays
  (`params["groups"]` is a tuple of per-group trees, `run_layout.unstack_groups`). XLA:CPU copies any
  slice of a stacked weight before a matmul — measured: a matrix-vector product over slices of
  a stacked weight reads 2–10× slower than over separate arrays — so on CPU every weight is its
  own buffer and a decoding step reads each one once; routed experts of 1 MiB or more are held
  one buffer per expert too (a tuple per stack), which a single row reads in place
  (`clover_jax.nn.expert_dispatch`). Compile time grows with the group count.

The prefix state stays stacked in both: each layer reads and writes its group's slice of the
state by group index (`dynamic_update_slice` in place, attention reading the K/V cache block by
block), so no pass copies a whole cache.

One pass runs `num_causal` causal rows, which append to the state (prefill, commit, an
autoregressive step), followed by block rows that are denoised against the state the causal
rows leave (docs/design.md §3). `num_causal = tokens` is a causal pass, `num_causal = 0` a denoising
forward, anything between a fused commit + denoise. Callers do not pick these numbers: they run
the named passes of `TransformerPasses(module)` (the interface of `clover_jax.core.passes`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from clover_jax.core.config import CloverConfig
from clover_jax.core.kernels import KernelChoice
from clover_jax.core.passes import ModelPasses, Params, PassMode, PassOutput, RaggedOutput
from clover_jax.core.ragged import PagedBatch, PagedState, RaggedMode, empty_paged_state, gather_rows
from clover_jax.core.state import ModelState, Rows, empty_state, rows_for, slot_name
from clover_jax.core.streams import StreamMode, Streams
from clover_jax.nn import rollback
from clover_jax.nn.attention import GatedAttention
from clover_jax.nn.gdn import GatedDeltaNet
from clover_jax.nn.layers import RMSNorm, table_param
from clover_jax.nn.moe import RouterStats, SparseMoE
from clover_jax.nn.remat import LAYER_INPUT, REMAT
from clover_jax.nn.run_layout import unstack_groups
from clover_jax.parallel.sharding import MeshSharding, constrain_batch, constrain_paged_state, constrain_state

LAYER_LOOPS = ("scan", "unrolled")


def layer_loop_for(platform: str) -> str:
    """How the layer groups run on `platform`: unrolled over separate arrays on CPU (XLA:CPU copies
    every slice of a stacked weight before a matmul), scanned on accelerators (which read a
    group's slice in place, and whose compile time then does not grow with depth)."""
    return "unrolled" if platform == "cpu" else "scan"


class StreamOutput(NamedTuple):
    """A training pass's result: hidden: [b, L + N * block, hidden_size], both streams after the
    final norm; head: [vocab, hidden_size], the LM head (the logits of a row are `head @ hidden`:
    the loss reads them a chunk at a time); router_stats: `RouterStats` with leading [layers]
    (collected when the "intermediates" collection is mutable, else None)."""

    hidden: jax.Array
    head: jax.Array
    router_stats: RouterStats | None


class DecoderLayer(nn.Module):
    TABLE_SCOPE: ClassVar = (True, ())  # its rows in the parameter table: the layer rows

    config: CloverConfig
    layer_type: str
    dtype: jnp.dtype = jnp.float32
    kernels: KernelChoice = KernelChoice()
    mesh_sharding: MeshSharding | None = None

    @nn.compact
    def __call__(self, hidden: jax.Array, state: Any, group, rows: Rows, mode: PassMode,
                 coreset_top_p) -> tuple[jax.Array, Any]:
        """hidden: [batch, tokens, hidden_size] -> (same shape, the mixer's new state).

        state: this slot's state for every group (leading [num_groups] axis); group: which one is
        ours; mode: which rows are causal, and whether the block routes within its coreset.
        """
        config = self.config
        mixer = GatedDeltaNet if self.layer_type == "linear_attention" else GatedAttention
        name = "linear_attn" if self.layer_type == "linear_attention" else "self_attn"
        mixed = RMSNorm(config, self.dtype, name="input_layernorm")(hidden)
        mixed, state = mixer(config, self.dtype, kernels=self.kernels, mesh_sharding=self.mesh_sharding,
                             name=name)(mixed, state, group, rows, mode)
        hidden = hidden + mixed
        feed_forward = RMSNorm(config, self.dtype, name="post_attention_layernorm")(hidden)
        feed_forward = SparseMoE(config, self.dtype, self.kernels, self.mesh_sharding, name="mlp")(
            feed_forward, mode, coreset_top_p, streams=rows if isinstance(mode, StreamMode) else None,
            ragged=rows if isinstance(mode, RaggedMode) else None)
        return hidden + feed_forward, state


class LayerGroup(nn.Module):
    """One repetition of the layer pattern; the unit that `nn.scan` stacks."""

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelChoice = KernelChoice()
    mesh_sharding: MeshSharding | None = None
    remat_layers: bool = False  # recompute each decoder layer in the backward pass (`REMAT` "layer")
    params_from_host: Any = None  # (slot, a layer's parameters) -> them on the chips (`CloverTransformer`)

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, dict], group, rows: Rows, mode: PassMode, coreset_top_p):
        """carry: (hidden [batch, tokens, hidden_size], the state of every layer, stacked over groups);
        group: this group's index. returns (the carry after the group, None)."""
        hidden, layers = carry
        layers = dict(layers)
        for slot, layer_type in enumerate(self.config.group_pattern):
            name = slot_name(slot)
            layer_module = DecoderLayer
            if self.params_from_host is not None:
                # inside the remat: the backward copies the layer in again rather than keeping the copy
                to_device = functools.partial(_to_device, self.params_from_host, name)
                layer_module = nn.map_variables(layer_module, "params", trans_in_fn=to_device, mutable=False)
            if self.remat_layers:  # static_argnums counts `self`: 5 is `mode`
                layer_module = nn.remat(layer_module, static_argnums=(5,))
            layer = layer_module(self.config, layer_type, self.dtype, self.kernels, self.mesh_sharding, name=name)
            hidden = checkpoint_name(hidden, LAYER_INPUT)
            hidden, layers[name] = layer(hidden, layers[name], group, rows, mode, coreset_top_p)
        return (hidden, layers), None


def _to_device(params_from_host, slot: str, variables: dict) -> dict:
    return {**variables, "params": params_from_host(slot, variables["params"])}


# The embedding's optional parameter [hidden]: the mask token's row, read instead of the table's.
TRAINED_MASK_ROW = "trained_mask_row"


class Embedding(nn.Module):
    """Token embedding: ids int [batch, tokens] -> [batch, tokens, hidden] (its table is the tied LM
    head when `config.tie_word_embeddings`)."""

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = table_param(self, self.config, "embedding")

    def __call__(self, ids: jax.Array) -> jax.Array:
        embedded = jnp.take(self.embedding, ids, axis=0)
        if self.has_variable("params", TRAINED_MASK_ROW):
            # A LoRA run trains the mask token's row beside its frozen table (`clover_jax.adapters.lora`):
            # put in here, the row's gradient is a sum over its positions, not a table-wide scatter.
            row = self.get_variable("params", TRAINED_MASK_ROW)
            embedded = jnp.where((ids == self.config.mask_token_id)[..., None], row.astype(embedded.dtype), embedded)
        return embedded.astype(self.dtype)

    def table(self) -> jax.Array:
        return self.embedding


class CloverTransformer(nn.Module):
    """kernels: which implementation runs attention, the GDN rule and the routed experts
    (`clover_jax.core.kernels.choose_kernels`); mesh_sharding: the mesh and sharding rules, or None on
    one device; layer_loop: "scan" or "unrolled" (`layer_loop_for`)."""

    TABLE_SCOPE: ClassVar = (False, ())  # its rows in the parameter table: the top rows

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelChoice = KernelChoice()
    mesh_sharding: MeshSharding | None = None
    layer_loop: str = "scan"
    remat: str | bool = "none"  # what the backward pass recomputes (`REMAT`; training, scanned groups)
    # The stacked layer parameters live in host memory ("pinned_host"): a function (slot name, one
    # layer's parameters sliced from the stacks) -> them on the chips, which each decoder layer calls
    # where it runs (training a LoRA over a base too large for the chips, with "layer" remat so that
    # the backward copies a layer in again instead of keeping every layer's copy). None: on the chips.
    params_from_host: Any = None

    @nn.compact
    def __call__(self, input_ids: jax.Array, state: ModelState | None, num_causal: int | None = None,
                 logits_from: int = 0, coreset: bool = False, coreset_top_p: Any = 1.0,
                 commit: jax.Array | None = None, *, streams: Streams | None = None,
                 block_size: int | None = None, ragged: PagedBatch | None = None) -> PassOutput | StreamOutput:
        """One pass over `input_ids` (int [batch, tokens]) at the end of `state`'s prefix.

        num_causal: leading rows that are causal (None: all); logits_from: first row whose logits
        are computed (a long prefill needs none: pass `tokens`); coreset: route block rows
        within their coreset with `coreset_top_p`; commit: None (every sequence appends its causal
        rows) or bool [batch], which sequences do (`clover_jax.core.state.rows_for`). Applied with
        the "intermediates" collection mutable, the output's `distinct_experts` holds each layer's
        distinct experts [layers, batch]; otherwise it is None.

        A training pass (`streams` given, `state` None): `input_ids` is the clean stream [b, L]
        followed by the noisy blocks [b, N * block_size] (`clover_jax.core.streams`); the result is
        a `StreamOutput` with the final hidden states of both streams, not logits.

        A ragged pass (`ragged` given, `state` a `PagedState`): `input_ids` is [1, T], the
        serving engine's segments (`clover_jax.core.ragged`); the result is a `RaggedOutput`, the
        final hidden states of the rows `ragged.logit_rows` names ([S, W, hidden]: the engine's
        decisions apply the LM head to the rows they read, `head_logits`) and the `PagedState`.
        """
        config = self.config
        num_tokens = input_ids.shape[1]
        embedding = Embedding(config, self.dtype, name="embed_tokens")
        hidden = constrain_batch(embedding(input_ids), self.mesh_sharding)
        group_args = (config, self.dtype, self.kernels, self.mesh_sharding)
        if ragged is not None:
            rows, mode = ragged, RaggedMode(coreset)
        elif streams is not None:
            rows, mode = streams, StreamMode(block_size, coreset)
            state = ModelState(length=jnp.zeros((), jnp.int32), start=jnp.zeros(input_ids.shape[:1], jnp.int32),
                               layers={slot_name(slot): None for slot in range(len(config.group_pattern))})
        else:
            num_causal = num_tokens if num_causal is None else num_causal
            rows = rows_for(state, num_tokens, num_causal, commit)
            mode = PassMode(num_causal, coreset)
        collecting = self.is_mutable_collection("intermediates")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop={self.layer_loop!r} is not one of {LAYER_LOOPS}")
        if self.layer_loop == "unrolled":
            # params["groups"]: one tree per group, each a separate set of arrays (see the module docstring).
            carry, sown = (hidden, state.layers), []
            groups = self.get_variable("params", "groups")
            if not isinstance(groups, tuple):  # stacked parameters still run, through sliced copies
                groups = unstack_groups({"groups": groups})["groups"]
            for group, group_params in enumerate(groups):
                (carry, _), variables = LayerGroup(*group_args, parent=None).apply(
                    {"params": group_params}, carry, group, rows, mode, coreset_top_p,
                    mutable=["intermediates"] if collecting else [])
                sown.append(variables.get("intermediates", {}))
            hidden, layers = carry
            sown = jax.tree_util.tree_map(lambda *per_group: jnp.stack(per_group), *sown) if collecting else None
        else:
            remat = {False: "none", True: "full"}.get(self.remat, self.remat)
            if remat not in REMAT:
                raise ValueError(f"remat={self.remat!r} is not one of {REMAT}")
            group_module = LayerGroup
            if remat in ("full", "dots"):
                # static_argnums counts `self`: 4 is `mode`
                policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "dots" else None
                group_module = nn.remat(LayerGroup, static_argnums=(4,), policy=policy)
            elif remat == "layer_offload":
                # the layer inputs the backward starts each layer's recomputation from, kept in host memory
                policy = jax.checkpoint_policies.save_and_offload_only_these_names(
                    names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
                    offload_src="device", offload_dst="pinned_host")
                group_module = nn.remat(LayerGroup, static_argnums=(4,), policy=policy)
            groups = nn.scan(group_module, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                             in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=config.num_groups)
            (hidden, layers), _ = groups(*group_args, remat_layers=remat in ("layer", "layer_offload"),
                                         params_from_host=self.params_from_host, name="groups")(
                (hidden, state.layers), jnp.arange(config.num_groups), rows, mode, coreset_top_p)
            sown = self.variables.get("intermediates", {}).get("groups", {}) if collecting else None
        norm = RMSNorm(config, self.dtype, name="norm")
        head = embedding.table() if config.tie_word_embeddings else table_param(self, config, "lm_head")
        if ragged is not None:
            hidden = norm(gather_rows(hidden[0], ragged.logit_rows))                  # [S, W, hidden]
            return RaggedOutput(hidden, constrain_paged_state(PagedState(layers), self.mesh_sharding))
        hidden = norm(hidden[:, logits_from:])
        if streams is not None:
            return StreamOutput(hidden, head, None if sown is None else self.router_stats_by_layer(sown))
        logits = jnp.einsum("bth,vh->btv", hidden, head, preferred_element_type=jnp.float32)
        appended = num_causal if rows.committed is None else rows.committed
        new_state = ModelState(length=rows.length + appended, start=state.start, layers=layers)
        distinct = None if sown is None else self.distinct_by_layer(sown, input_ids.shape[0])
        return PassOutput(logits, new_state, distinct)

    def router_stats_by_layer(self, sown: dict) -> RouterStats:
        """Each MoE layer's `RouterStats` from the sown {layer_k: {mlp: {router_stats: (stats with
        leading [groups],)}}}, stacked in layer order: every leaf [layers, ...]."""
        per_slot = [sown[slot_name(slot)]["mlp"]["router_stats"][0] for slot in range(len(self.config.group_pattern))]
        return jax.tree_util.tree_map(lambda *slots: jnp.stack(slots, axis=1).reshape((-1,) + slots[0].shape[1:]),
                                      *per_slot)

    def distinct_by_layer(self, sown: dict, batch: int) -> jax.Array:
        """int32 [layers, batch] from the sown {layer_k: {mlp: {distinct_experts: ([groups, batch],)}}}
        of the groups (zeros for a pass without block rows, where nothing was sown)."""
        slots = [sown.get(slot_name(slot), {}).get("mlp", {}).get("distinct_experts")
                 for slot in range(len(self.config.group_pattern))]
        per_slot = [jnp.zeros((self.config.num_groups, batch), jnp.int32) if value is None else value[0]
                    for value in slots]
        return jnp.stack(per_slot, axis=1).reshape(-1, batch)  # layer g * slots + s


@dataclasses.dataclass(frozen=True)
class TransformerPasses(ModelPasses):
    """The pass interface (`clover_jax.core.passes`) of a `CloverTransformer`: what the decoders,
    `CloverModel` and training are handed instead of the module. Hashable and named by its module,
    so equal modules share compiled programs."""

    module: CloverTransformer

    @property
    def config(self) -> CloverConfig:
        return self.module.config

    def run(self, params: Params, input_ids: jax.Array, state: ModelState, *, num_causal: int, logits_from: int,
            coreset: bool = False, coreset_top_p: Any = 1.0, commit: jax.Array | None = None,
            distinct_experts: bool = False) -> PassOutput:
        run = functools.partial(self.module.apply, {"params": params}, input_ids, state, num_causal=num_causal,
                                logits_from=logits_from, coreset=coreset, coreset_top_p=coreset_top_p, commit=commit)
        return run(mutable=["intermediates"])[0] if distinct_experts else run()

    def new_state(self, batch: int, capacity: int, start: jax.Array | None = None) -> ModelState:
        state = empty_state(self.module.config, batch, capacity, self.module.dtype, start)
        return constrain_state(state, self.module.mesh_sharding)

    def recording(self, state: ModelState, rows: int) -> ModelState:
        return rollback.recording(state, self.module.config, rows)

    def ragged(self, params: Params, input_ids: jax.Array, batch: PagedBatch, state: PagedState, *, coreset: bool,
               coreset_top_p: Any) -> RaggedOutput:
        return self.module.apply({"params": params}, input_ids[None], state, coreset=coreset,
                                 coreset_top_p=coreset_top_p, ragged=batch)

    @property
    def platform(self) -> str:
        return self.module.kernels.platform

    def head_logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        config = self.module.config
        head = params["embed_tokens"]["embedding"] if config.tie_word_embeddings else params["lm_head"]
        return jnp.einsum("...h,vh->...v", hidden, head, preferred_element_type=jnp.float32)

    def new_paged_state(self, slots: int, num_pages: int, page_size: int) -> PagedState:
        state = empty_paged_state(self.module.config, slots, num_pages, page_size, self.module.dtype)
        return constrain_paged_state(state, self.module.mesh_sharding)

    def rolled_back(self, state: ModelState, keep: jax.Array, rows: int) -> ModelState:
        return rollback.rolled_back(state, keep, rows, self.module.kernels)


def param_shapes(config: CloverConfig, dtype) -> Params:
    """The parameter pytree as `jax.ShapeDtypeStruct`s, traced from the modules without allocating
    (`clover_jax.core.param_layout` gives the same shapes without tracing)."""
    module = CloverTransformer(config, dtype)
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.key(0), ids, empty_state(config, 1, 1, dtype)))["params"]

