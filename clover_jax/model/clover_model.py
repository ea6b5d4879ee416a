"""`CloverModel`: the user-facing handle on a loaded checkpoint (docs/design.md §6).

The methods validate their inputs on the host, then call one of the pure jitted functions below,
each a named pass of the model's `ModelPasses` (`clover_jax.core.passes`), whose compiled form
depends only on the shapes (batch, tokens, state capacity) and the static pass layout — never on
the prefix length or the token values, so denoising steps never recompile.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core import compilation_cache
from clover_jax.core.config import CloverConfig
from clover_jax.core.executable_cache import persistent_jit
from clover_jax.core.hub import resolve_checkpoint
from clover_jax.core.kernels import choose_kernels
from clover_jax.core.passes import DEFAULT_CHUNK, ModelPasses, Params, PassOutput
from clover_jax.core.quantization import QuantSpec
from clover_jax.core.state import ModelState, empty_state
from clover_jax.nn.model import CloverTransformer, TransformerPasses, layer_loop_for
from clover_jax.nn.run_layout import stack_groups, unstack_groups
from clover_jax.parallel import memory
from clover_jax.parallel.sharding import MeshSharding, ShardingRules

logger = logging.getLogger(__name__)


class BlockLogits(NamedTuple):
    """logits: float32 [batch, block, vocab]; distinct_experts: int32 [num_layers, batch]."""

    logits: jax.Array
    distinct_experts: jax.Array


@persistent_jit(static_argnames=("passes", "num_causal", "logits_from", "coreset"))
def run_pass(passes: ModelPasses, params: Params, input_ids: jax.Array, state: ModelState, num_causal: int,
             logits_from: int, coreset: bool, coreset_top_p: jax.Array) -> PassOutput:
    """Any pass layout, compiled: `ModelPasses.run` (for layouts the named passes below do not cover)."""
    return passes.run(params, input_ids, state, num_causal=num_causal, logits_from=logits_from, coreset=coreset,
                      coreset_top_p=coreset_top_p)


@persistent_jit(static_argnames=("passes", "coreset"))
def run_denoise(passes: ModelPasses, params: Params, block_ids: jax.Array, state: ModelState, coreset: bool,
                coreset_top_p: jax.Array) -> BlockLogits:
    """A denoising forward that returns only its logits: the state is read, never copied out."""
    out = passes.denoise(params, block_ids, state, coreset=coreset, coreset_top_p=coreset_top_p, distinct_experts=True)
    return BlockLogits(out.logits, out.distinct_experts)


@persistent_jit(static_argnames=("passes", "coreset"))
def run_commit_and_denoise(passes: ModelPasses, params: Params, commit_ids: jax.Array, block_ids: jax.Array,
                           state: ModelState, coreset: bool, coreset_top_p: jax.Array) -> PassOutput:
    """A commit fused with the next block's denoising forward: `ModelPasses.commit_and_denoise`, compiled."""
    return passes.commit_and_denoise(params, commit_ids, block_ids, state, coreset=coreset,
                                     coreset_top_p=coreset_top_p, distinct_experts=True)


@persistent_jit(static_argnames=("passes", "chunk_size", "logits"))
def run_causal(passes: ModelPasses, params: Params, input_ids: jax.Array, state: ModelState,
               chunk_size: int, logits: str) -> tuple[jax.Array | None, ModelState]:
    """Prefill / commit / forward: `ModelPasses.prefill`, compiled."""
    return passes.prefill(params, input_ids, state, chunk_size=chunk_size, logits=logits)


class CloverModel:
    """A Clover / Qwen3.5-MoE text model: config, parameters and validated entry points.

    Parameters are an explicit pytree; state is an explicit `ModelState`. `run_params` holds them
    in the layout the model runs with (per layer group on CPU, stacked on accelerators; see
    `clover_jax.nn.model`): pass `(model.passes, model.run_params)` to pure functions — `passes` is
    the model's pass interface (`clover_jax.core.passes.ModelPasses`), `module` the Flax
    `CloverTransformer` behind it. `params` gives the canonical stacked tree (on CPU a stacked
    copy, made on each access).
    """

    def __init__(self, config: CloverConfig, params: Params, dtype: Any, path: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK, mesh_sharding: MeshSharding | None = None, impl: str = "auto"):
        compilation_cache.enable()
        self.config = config
        self.chunk_size = chunk_size  # tokens per causal pass of a long prefill (docs/design.md §1: 2048)
        self.path = path  # the checkpoint directory, where generate() finds generation_config.json
        self.dtype = jnp.dtype(dtype)
        self.mesh_sharding = mesh_sharding  # mesh and sharding rules; None: one device
        self.kernels = choose_kernels(impl)
        self.module = CloverTransformer(config, self.dtype, self.kernels, mesh_sharding,
                                        layer_loop_for(self.kernels.platform))
        self.passes: ModelPasses = TransformerPasses(self.module)  # made once: compiled calls key on it
        self.fitted_requests: set[tuple[int, int, int]] = set()  # (batch, capacity, block) that fit
        self.params = params

    @property
    def params(self) -> Params:
        """The parameter pytree in the canonical layout (layer parameters stacked over groups)."""
        return stack_groups(self.run_params)

    @params.setter
    def params(self, params: Params) -> None:
        self.run_params = unstack_groups(params) if self.module.layer_loop == "unrolled" else stack_groups(params)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        dtype: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        name_map: dict[str, str] | None = None,
        strict: bool = False,
        progress: bool = True,
        chunk_size: int = DEFAULT_CHUNK,
        rules: ShardingRules | None = None,
        impl: str = "auto",
        quantize: "QuantSpec | str | None" = None,
        revision: str | None = None,
        check_finite: bool = True,
        adapter: str | os.PathLike | None = None,
    ) -> "CloverModel":
        """Load a Hugging Face layout checkpoint — a local directory or a Hub id such as
        "org/name" (`clover_jax.core.hub`: only the files clover-jax reads are downloaded, into the Hub
        cache) — or an Orbax directory written by `weights.convert_to_orbax` (local only, restored
        straight into the mesh's shardings).

        revision: branch, tag or commit of a Hub id (default: its main branch).

        dtype: parameter and activation dtype; None keeps the checkpoint's (e.g. bfloat16).
        mesh: a (data, expert, tensor) mesh (`clover_jax.make_mesh`); each parameter is placed
            with the sharding `rules` give it, every device reading only its own slice
            (None: the default device).
        rules: logical axis -> mesh axis (`clover_jax.ShardingRules`; default: batch over data,
            experts over expert, heads / shared-expert / vocab over tensor).
        impl: "auto", "pallas" or "xla" — which kernels run (`clover_jax.core.kernels`).
        quantize: None, "int8", "int4" (groups of 128), "int4-g64", with "+dense" to quantise the
            dense projections too, or a `clover_jax.core.quantization.QuantSpec`: weight-only
            quantisation while loading (`clover_jax.core.quantization`).
        name_map: checkpoint tensor name -> expected name, for checkpoints whose names differ.
        strict: refuse a checkpoint that lacks the Clover block-mode tensors instead of using
            docs/design.md §2 defaults for them.
        chunk_size: tokens per causal pass when a long prompt is prefilled (memory vs speed).
        check_finite: refuse weights holding NaN or Inf (`weights.CheckpointError` naming the
            tensor), checked on each tensor as it is read; False skips the check.
        adapter: a LoRA adapter directory (`clover_jax.adapters.adapter_io`, written by a LoRA or
            QLoRA run) for this base: the base is read in float, the adapter merged in, then
            `quantize` applied; the model takes the adapter's config, tokenizer and generation config.
        """
        from weights import loader  # weights depends on clover_jax, not the reverse
        from weights.orbax_layout import is_orbax_checkpoint

        compilation_cache.enable()  # before loading compiles its first program

        # the small files first: a bad config.json is refused before any weights are downloaded
        config = CloverConfig.from_pretrained(resolve_checkpoint(path, revision, require=("config.json",)))
        choose_kernels(impl)  # a bad impl is refused before reading weights
        if adapter is not None:
            return cls._with_adapter(path, config, adapter, dtype=dtype, mesh=mesh, name_map=name_map, strict=strict,
                                     progress=progress, chunk_size=chunk_size, impl=impl, quantize=quantize,
                                     revision=revision, check_finite=check_finite)
        mesh_sharding = None if mesh is None else MeshSharding(mesh, config, rules or ShardingRules())
        sharding_for = None if mesh_sharding is None else mesh_sharding.param_sharding
        quantize = QuantSpec.parse(quantize)
        path = resolve_checkpoint(path, revision, weights=True)
        if is_orbax_checkpoint(path):
            from weights import orbax_checkpoint  # Orbax is imported only when an Orbax directory is loaded

            if quantize is not None:
                raise ValueError("quantize applies while reading safetensors; load the Orbax directory unquantised "
                                 "or quantise the Hugging Face checkpoint")
            if name_map:
                raise ValueError("name_map applies to safetensors checkpoints; an Orbax directory (from "
                                 "weights.convert_to_orbax) already holds the parameters under their own names")
            params, report = orbax_checkpoint.load_orbax_params(path, config, sharding_for=sharding_for, dtype=dtype,
                                                                progress=progress, check_finite=check_finite)
        else:
            params, report = loader.load_params(path, config, dtype=dtype, name_map=name_map,
                                                sharding_for=sharding_for, progress=progress, strict=strict,
                                                quantize=quantize, check_finite=check_finite)
        return cls(config, params, report.dtype, os.fspath(path), chunk_size, mesh_sharding, impl)

    @classmethod
    def _with_adapter(cls, path, config: CloverConfig, adapter, *, mesh, quantize, chunk_size: int, impl: str,
                      **load) -> "CloverModel":
        """`from_pretrained` with a LoRA adapter: checked against the base's config before any weight is
        read, merged into the float base, then quantised as loading would."""
        from clover_jax.adapters.adapter_io import read_adapter
        from weights.loader import quant_spec_for

        read = read_adapter(adapter)
        read.check_base(config)
        if mesh is not None:
            raise ValueError("adapter= loads onto one device: merge the adapter (a LoRA run's out directory) and "
                             "load that checkpoint on the mesh")
        spec = quant_spec_for(read.config, quantize)
        base = cls.from_pretrained(path, progress=load.pop("progress"), **load)
        params = read.merged_params(base.params, base.config)
        if spec is not None:
            from clover_jax.core.params import param_rows
            from clover_jax.core.quantization import place, quantize as quantize_weight
            from clover_jax.core.tree_paths import get, put

            for leaf_path in param_rows(read.config):
                if spec.applies_to(leaf_path):
                    params = put(params, leaf_path, place(quantize_weight(np.asarray(get(params, leaf_path)), spec),
                                                          None))
        return cls(read.config, params, base.dtype, read.path, chunk_size, None, impl)

    # ------------------------------------------------------------------ causal mode
    def forward(self, input_ids) -> jax.Array:
        """Causal logits (docs/design.md §1). input_ids: int [batch, tokens] -> float32 [batch, tokens, vocab]."""
        ids = self.check_token_ids(input_ids, "input_ids")
        state = self.init_state(ids.shape[0], ids.shape[1])
        return run_causal(self.passes, self.run_params, self.place_batch(ids), state, self.chunk_size, "all")[0]

    def init_state(self, batch: int, capacity: int, start=None) -> ModelState:
        """An empty prefix state holding up to `capacity` rows; `start` (int [batch]) marks left padding."""
        if batch < 1 or capacity < 1:
            raise ValueError(f"batch and capacity must be >= 1, got {batch} and {capacity}")
        if capacity > self.config.max_position_embeddings:
            raise ValueError(f"capacity {capacity} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        make = lambda: empty_state(self.config, batch, capacity, self.dtype, start)
        if self.mesh_sharding is None:
            # committed to the device, as every pass's output is: an uncommitted state would make the
            # second `extend` a different compiled call from the first
            return jax.device_put(make(), jax.devices()[0])
        # Created in place on the mesh (a batch the data axis cannot split is refused here).
        return jax.jit(make, out_shardings=self.mesh_sharding.state_shardings(jax.eval_shape(make)))()

    def extend(self, state: ModelState, token_ids, logits: str = "last") -> tuple[jax.Array | None, ModelState]:
        """Append tokens causally: the prompt prefill and the commit of a decided block.

        token_ids: int [batch, tokens]; logits: "all", "last" or "none" (a long prefill needs none).
        returns (float32 logits [batch, tokens or 1, vocab] or None, the extended state)
        """
        ids = self.check_token_ids(token_ids, "token_ids", state)
        self._check_room(state, ids.shape[1])
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        return run_causal(self.passes, self.run_params, self.place_batch(ids), state, self.chunk_size, logits)

    # ------------------------------------------------------------------ block mode
    def denoise(self, state: ModelState, block_ids, coreset: bool | None = None,
                coreset_top_p: float | None = None) -> BlockLogits:
        """Denoising forward of a block after the prefix in `state` (docs/design.md §3, §5); the state is unchanged.

        block_ids: int [batch, block], may hold `mask_token_id`. coreset / coreset_top_p override
        the config's `moe_block_coreset_enabled` / `moe_block_coreset_top_p` for this call.
        """
        ids = self.check_token_ids(block_ids, "block_ids", state)
        self._check_room(state, ids.shape[1])
        coreset = self._coreset(coreset, coreset_top_p)
        return run_denoise(self.passes, self.run_params, self.place_batch(ids), state, coreset["coreset"],
                           np.float32(coreset["coreset_top_p"]))

    def commit_and_denoise(self, state: ModelState, commit_ids, block_ids, coreset: bool | None = None,
                           coreset_top_p: float | None = None) -> tuple[BlockLogits, ModelState]:
        """Commit a decided block and run the next block's first denoising step in one forward.

        Equal to `extend(state, commit_ids)` followed by `denoise(new_state, block_ids)`.
        """
        commit = self.check_token_ids(commit_ids, "commit_ids", state)
        block = self.check_token_ids(block_ids, "block_ids", state)
        self._check_room(state, commit.shape[1] + block.shape[1])
        coreset = self._coreset(coreset, coreset_top_p)
        out = run_commit_and_denoise(self.passes, self.run_params, self.place_batch(commit), self.place_batch(block),
                                     state, coreset["coreset"], jnp.float32(coreset["coreset_top_p"]))
        return BlockLogits(out.logits, out.distinct_experts), out.state

    def denoise_logits(self, prefix_ids, block_ids, coreset: bool | None = None,
                       coreset_top_p: float | None = None) -> jax.Array:
        """Logits of a block after a causal prefix (docs/design.md §6): [b, P], [b, B] -> float32 [b, B, V].

        The prefix may be empty (P = 0).
        """
        block = self.check_token_ids(block_ids, "block_ids")
        prefix = np.asarray(prefix_ids)
        if prefix.ndim != 2 or prefix.shape[0] != block.shape[0]:
            raise ValueError(f"prefix_ids must be [batch, prefix] with the batch of block_ids "
                             f"({block.shape[0]}), got shape {prefix.shape}")
        state = self.init_state(block.shape[0], prefix.shape[1] + block.shape[1])
        if prefix.shape[1]:
            _, state = self.extend(state, prefix, logits="none")
        return self.denoise(state, block, coreset, coreset_top_p).logits

    # ------------------------------------------------------------------ helpers
    def check_memory(self, batch: int, capacity: int, block_size: int) -> None:
        """Refuse, before compiling, a decode whose state (`capacity` rows) and activations do not
        fit the device(s) (`clover_jax.parallel.memory.check_fits`)."""
        # Checked once per request shape: asking the OS for free memory costs more than the rest of a
        # small call's host work, and a shape that fitted keeps its compiled program.
        if (batch, capacity, block_size) in self.fitted_requests:
            return
        # A causal pass never holds more rows than the context (a short prompt is not a whole chunk).
        needed = memory.estimate_memory(self.config, batch, capacity, self.dtype, min(self.chunk_size, capacity),
                                        block_size)
        split = 1 if self.mesh_sharding is None else self.mesh_sharding.axis_size(self.mesh_sharding.rules.batch)
        memory.check_fits(needed, already_placed=needed.parameters, split=split)
        self.fitted_requests.add((batch, capacity, block_size))

    def place_batch(self, array) -> jax.Array:
        """A host [batch, ...] array on the device(s): split over the data axis on a mesh."""
        if self.mesh_sharding is None:
            return jnp.asarray(array)
        array = np.asarray(array)
        return jax.device_put(array, self.mesh_sharding.batch_sharding(array.shape[0], array.ndim))

    def _coreset(self, enabled: bool | None, top_p: float | None) -> dict:
        enabled = self.config.moe_block_coreset_enabled if enabled is None else bool(enabled)
        top_p = self.config.moe_block_coreset_top_p if top_p is None else float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"coreset_top_p must be in (0, 1], got {top_p}")
        return {"coreset": enabled, "coreset_top_p": top_p}

    def _check_room(self, state: ModelState, num_tokens: int) -> None:
        filled = int(state.length)
        if filled + num_tokens > state.capacity:
            raise ValueError(f"the state holds {filled} of {state.capacity} rows; {num_tokens} more do not fit "
                             "(make the state with a larger capacity)")

    def check_token_ids(self, ids, name: str, state: ModelState | None = None) -> np.ndarray:
        """Host-side validation of int [batch, tokens] token ids; returns them as int32."""
        array = np.asarray(ids)
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
            raise ValueError(f"{name} must be a non-empty int array [batch, tokens], got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} must hold integer token ids, got dtype {array.dtype}")
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"{name} holds ids in [{low}, {high}], outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        if array.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{name} has {array.shape[1]} tokens, more than max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        if state is not None and array.shape[0] != state.batch:
            raise ValueError(f"{name} has batch {array.shape[0]} but the state was made for batch {state.batch}")
        return array.astype(np.int32)
