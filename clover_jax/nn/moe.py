"""Sparse MoE block (transformers' `Qwen3_5MoeSparseMoeBlock`).

Router `softmax(W_gate x)` in float32 over all experts, top-k, weights renormalised to sum 1;
routed experts `down(silu(gate(x)) * up(x))`; a shared expert scaled by
`sigmoid(shared_expert_gate x)` is added.

Causal rows always route plainly; block rows (a denoising forward) route within the block's
coreset (docs/design.md §5) when it is enabled. All rows then share one grouped expert computation.

On a mesh whose expert axis has more than one device, the routed experts are expert-parallel:
inside `shard_map` each device runs the pairs routed to its own experts and a `psum` over the
expert axis adds the partial outputs. The rows are replicated over the expert axis (attention
and GDN run there anyway), so a psum of [rows, hidden] is the only collective; an all-to-all
dispatch pays off only when the rows are themselves split over the expert axis and many — in
decoding a step holds one block of rows per sequence, and the psum moves `rows × hidden`
values where an all-to-all would move `rows × top_k × hidden` twice.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

from clover_jax.core.config import CloverConfig
from clover_jax.core.kernels import ExpertRule, KernelChoice
from clover_jax.core.passes import PassMode
from clover_jax.core.quantization import QuantizedWeight
from clover_jax.core.ragged import (
    COMPACT_PLATFORMS,
    PagedBatch,
    RaggedMode,
    gather_rows,
    on_live,
    scatter_rows,
    slots_first,
)
from clover_jax.core.streams import StreamMode, Streams
from clover_jax.nn.coreset import coreset_mask, distinct_experts, route_within
from clover_jax.nn.expert_dispatch import grouped_expert_mlp, per_expert, routed_expert_mlp, stacked
from clover_jax.nn.expert_lora import ExpertAdapters, adapted_expert_mlp, is_quantized
from clover_jax.nn.layers import Linear, low_rank_update, table_param
from clover_jax.parallel.sharding import MeshSharding


def route_top_k(probabilities: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Router probabilities float32 [..., experts] -> (expert ids int [..., top_k], weights summing to 1)."""
    weights, expert_ids = jax.lax.top_k(probabilities, top_k)
    return expert_ids, weights / jnp.sum(weights, axis=-1, keepdims=True)


def expert_mlp(rule: ExpertRule, *args) -> jax.Array:
    """The routed experts as the resolved rule (`KernelChoice.expert_rule`) says (arguments of
    `routed_expert_mlp`)."""
    if rule.kernel == "grouped":
        return grouped_expert_mlp(*args, platform=rule.platform, kernel=rule.grouped_kernel, interpret=rule.interpret)
    return routed_expert_mlp(*args, strategy=rule.strategy)


def expert_parallel_mlp(rule: ExpertRule, mesh_sharding: MeshSharding, tokens: jax.Array, expert_ids: jax.Array,
                        expert_weights: jax.Array, gate_up_proj: jax.Array, down_proj: jax.Array,
                        adapters: ExpertAdapters | None = None) -> jax.Array:
    """`expert_mlp` inside `shard_map` on the mesh_sharding's mesh (same arguments): each device runs the
    pairs routed to its own experts (the experts split over the expert axis, when it has more
    than one device) and a psum over that axis adds the partial outputs. With `adapters` (a LoRA /
    QLoRA training pass) each device runs `adapted_expert_mlp` on its experts' stacks and factors."""
    expert_axis = mesh_sharding.rules.experts if mesh_sharding.axis_size(mesh_sharding.rules.experts) > 1 else None
    data_axis = mesh_sharding.rules.batch if mesh_sharding.axis_size(mesh_sharding.rules.batch) > 1 else None
    rows, experts = PartitionSpec(data_axis, None), PartitionSpec(expert_axis, None, None)
    gate_up_proj, down_proj = stacked(gate_up_proj), stacked(down_proj)  # split over the expert axis as one stack

    def local(tokens, expert_ids, expert_weights, gate_up_proj, down_proj, adapters):
        def run(ids):
            if adapters is None:
                return expert_mlp(rule, tokens, ids, expert_weights, gate_up_proj, down_proj)
            return adapted_expert_mlp(tokens, ids, expert_weights, gate_up_proj, down_proj, adapters, rule)

        if expert_axis is None:
            return run(expert_ids)
        num_local = gate_up_proj.shape[0]
        local_ids = expert_ids - jax.lax.axis_index(expert_axis) * num_local
        local_ids = jnp.where((local_ids >= 0) & (local_ids < num_local), local_ids, num_local)
        return jax.lax.psum(run(local_ids), expert_axis)

    # check_vma=False: Pallas kernels (megablox gmm, ours) declare outputs without the varying-axes
    # annotation that shard_map's check requires, and would otherwise not lower inside it.
    return jax.shard_map(local, mesh=mesh_sharding.mesh, in_specs=(rows, rows, rows, experts, experts, experts),
                         out_specs=rows, check_vma=False)(tokens, expert_ids, expert_weights, gate_up_proj, down_proj,
                                                          adapters)


class RouterStats(NamedTuple):
    """One MoE layer's routing over the rows of real examples in a training pass, summed (so that
    steps and devices add up): probability: float32 [experts], Σ router probabilities; dispatched:
    float32 [experts], pairs dispatched to each expert (after the coreset, pairs of weight 0 not
    counted); z: float32 [], Σ logsumexp(router logits)²; rows: float32 [], the rows counted."""

    probability: jax.Array
    dispatched: jax.Array
    z: jax.Array
    rows: jax.Array


def router_stats(router_logits: jax.Array, probabilities: jax.Array, expert_ids: jax.Array,
                 expert_weights: jax.Array, real: jax.Array) -> RouterStats:
    """router_logits, probabilities: float32 [b, t, experts]; expert_ids, expert_weights: [b, t, top_k];
    real: bool [b, t], the rows of real examples."""
    num_experts = probabilities.shape[-1]
    weight = real.astype(jnp.float32)
    used = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32) * (expert_weights > 0)[..., None]
    return RouterStats(
        probability=jnp.einsum("bte,bt->e", probabilities, weight),
        dispatched=jnp.einsum("btke,bt->e", used, weight),
        z=jnp.sum(jnp.square(jax.nn.logsumexp(router_logits, axis=-1)) * weight),
        rows=jnp.sum(weight))


class SharedExpert(nn.Module):
    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = Linear(self.config, self.dtype, name="gate_proj")(x)
        up = Linear(self.config, self.dtype, name="up_proj")(x)
        return Linear(self.config, self.dtype, name="down_proj")(jax.nn.silu(gate) * up)


class SparseMoE(nn.Module):
    TABLE_SCOPE: ClassVar = (True, ("mlp",))  # its rows in the parameter table

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelChoice = KernelChoice()
    mesh_sharding: MeshSharding | None = None

    @nn.compact
    def __call__(self, x: jax.Array, mode: PassMode | StreamMode | RaggedMode, coreset_top_p: jax.Array | float = 1.0,
                 streams: Streams | None = None, ragged: PagedBatch | None = None) -> jax.Array:
        """x: [batch, tokens, hidden] -> [batch, tokens, hidden]. mode: the leading causal rows route
        plainly, the block rows within their coreset when `mode.coreset`. When the "intermediates"
        collection is asked for, the distinct experts of the block rows (int32 [batch]) are sown
        there as "distinct_experts".

        In a training pass (`mode` a `StreamMode`, `streams` its layout) the clean rows route
        plainly and each noisy block within its own coreset; with "intermediates" asked for, the
        router's statistics over the rows of real examples are sown as "router_stats"
        (`RouterStats`, for the load-balance and z losses).

        In a ragged pass (`mode` a `RaggedMode`, `ragged` its layout, x [1, T, hidden]) causal rows
        route plainly and each slot's block rows within their block's coreset."""
        config = self.config
        batch, num_tokens, hidden = x.shape
        training = isinstance(mode, StreamMode)
        top_k = config.num_experts_per_tok
        causal = streams.segment.shape[1] if training else num_tokens if ragged is not None else mode.num_causal
        block = mode.block_size if training else num_tokens - causal  # the rows one coreset serves
        x = x.astype(self.dtype)

        router = table_param(self, config, "gate")
        router_logits = jnp.einsum("bth,eh->bte", x, router, preferred_element_type=jnp.float32)
        router_update = low_rank_update(self, "gate", x)  # a LoRA run's router adapter, when it has one
        if router_update is not None:
            router_logits = router_logits + router_update
        probabilities = jax.nn.softmax(router_logits, axis=-1)
        expert_ids, expert_weights = route_top_k(probabilities, top_k)
        if ragged is not None:
            expert_ids, expert_weights = self._ragged_routes(probabilities[0], expert_ids[0], expert_weights[0],
                                                             ragged, mode.coreset, coreset_top_p)
            expert_ids, expert_weights = expert_ids[None], expert_weights[None]
        if num_tokens > causal:
            by_block = lambda y: y.reshape((-1, block) + y.shape[2:])
            block_probabilities = by_block(probabilities[:, causal:])
            if mode.coreset:
                allowed = coreset_mask(block_probabilities, top_k, coreset_top_p)
                block_ids, block_weights = route_within(block_probabilities, allowed, top_k)
                expert_ids = expert_ids.at[:, causal:].set(block_ids.reshape(batch, -1, top_k))
                expert_weights = expert_weights.at[:, causal:].set(block_weights.reshape(batch, -1, top_k))
            if self.is_mutable_collection("intermediates") and not training:
                self.sow("intermediates", "distinct_experts",
                         distinct_experts(expert_ids[:, causal:], expert_weights[:, causal:], config.num_experts))
        if training and self.is_mutable_collection("intermediates"):
            real = jnp.concatenate([streams.segment > 0, jnp.repeat(streams.block_segment > 0, block, axis=1)], axis=1)
            self.sow("intermediates", "router_stats",
                     router_stats(router_logits, probabilities, expert_ids, expert_weights, real))

        gate_up_proj = table_param(self, config, "experts_gate_up_proj")
        down_proj = table_param(self, config, "experts_down_proj")
        tokens = x.reshape(batch * num_tokens, hidden)
        pairs = (expert_ids.reshape(batch * num_tokens, top_k), expert_weights.reshape(batch * num_tokens, top_k))
        mesh = self.mesh_sharding
        one = gate_up_proj[0] if per_expert(gate_up_proj) else gate_up_proj
        rule = self.kernels.expert_rule(isinstance(one, QuantizedWeight),
                                        1 if mesh is None else mesh.axis_size(mesh.rules.experts), mesh is not None)
        adapters = self.expert_adapters()
        if adapters is not None or (training and is_quantized(gate_up_proj)):
            # A LoRA / QLoRA training pass: grouped matmuls that reverse mode differentiates (`expert_lora`).
            adapters = adapters or ExpertAdapters(None, None, None, None)
            if rule.kernel == "grouped" and rule.per_device:  # Pallas custom calls run per device on a mesh
                routed = expert_parallel_mlp(rule, mesh, tokens, *pairs, gate_up_proj, down_proj, adapters)
            else:
                routed = adapted_expert_mlp(tokens, *pairs, gate_up_proj, down_proj, adapters, rule)
        elif rule.per_device:
            routed = expert_parallel_mlp(rule, mesh, tokens, *pairs, gate_up_proj, down_proj)
        else:
            routed = expert_mlp(rule, tokens, *pairs, gate_up_proj, down_proj)

        shared = SharedExpert(config, self.dtype, name="shared_expert")(tokens)
        shared_gate = Linear(config, self.dtype, name="shared_expert_gate")(tokens)
        out = routed + jax.nn.sigmoid(shared_gate) * shared
        return out.reshape(batch, num_tokens, hidden)

    def _ragged_routes(self, probabilities: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                       batch: PagedBatch, coreset: bool, coreset_top_p) -> tuple[jax.Array, jax.Array]:
        """A ragged pass's routes ([T, top_k] each): each slot's block rows within the coreset of
        its block (padding rows of a block window have zero probability: they add no mass), every
        other row its plain top-k; padding rows go to no expert (id `num_experts`, dropped by every
        dispatch), so that the pass's padding costs no expert work."""
        if coreset:
            top_k = self.config.num_experts_per_tok
            num_slots = batch.block_length.shape[0]
            order = slots_first(batch.block_length > 0)

            def routes(width: int) -> tuple[jax.Array, jax.Array]:  # the first `width` slots' blocks of `order`
                block_rows = batch.block_rows[order[:width] if width < num_slots else slice(None)]
                window = gather_rows(probabilities, block_rows)                        # [w, Bmax, E]
                block_ids, block_weights = route_within(window, coreset_mask(window, top_k, coreset_top_p), top_k)
                return (scatter_rows(expert_ids, block_rows, block_ids),
                        scatter_rows(expert_weights, block_rows, block_weights))

            # on a CPU only the slots with a block route within their coreset (`on_live`)
            expert_ids, expert_weights = on_live(jnp.sum(batch.block_length > 0), num_slots, routes,
                                                 compact=self.kernels.platform in COMPACT_PLATFORMS,
                                                 empty=(expert_ids, expert_weights))
        valid = batch.valid[:, None]
        return jnp.where(valid, expert_ids, self.config.num_experts), jnp.where(valid, expert_weights, 0.0)

    def expert_adapters(self) -> ExpertAdapters | None:
        """The routed experts' LoRA factors a LoRA training pass placed beside the stacks
        (`{stack}_lora_a` / `{stack}_lora_b`, `clover_jax.adapters.lora`), or None when there are none."""
        factors = {}
        for stack, short in (("experts_gate_up_proj", "gate_up"), ("experts_down_proj", "down")):
            for part in ("a", "b"):
                name = f"{stack}_lora_{part}"
                factors[f"{short}_{part}"] = (self.get_variable("params", name)
                                              if self.has_variable("params", name) else None)
        return None if all(value is None for value in factors.values()) else ExpertAdapters(**factors)
