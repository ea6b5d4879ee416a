"""The real train step with abstract arguments: what a compiler needs to lay out one optimizer step
of a fine-tuning run on a mesh, without a byte of the model.

`abstract_step(...)` returns the jitted step (`step.sharded_train_step`) and its arguments as
`jax.ShapeDtypeStruct`s carrying the training shardings (`train_sharding`): the float32 master
parameters and AdamW's moments (full fine-tuning) or the trainable LoRA part and the frozen
base in the compute dtype, possibly quantised (LoRA / QLoRA); one global batch of `TrainRows` at
`seq_len` clean tokens per sequence with every block noisy (the complementary copy doubles the
noisy stream: three streams of rows); the key, normalisers and coreset threshold.
`clover_jax.api.train_aot` lowers and compiles it for a named target.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.core.config import CloverConfig
from clover_jax.core.quantization import QuantSpec
from clover_jax.nn.model import CloverTransformer
from clover_jax.parallel.sharding import MeshSharding
from clover_jax.training import lora, train_sharding
from clover_jax.training.block_pass import training_module
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.loss import LossSettings, Normalisers, TrainRows
from clover_jax.training.step import OptimizerSettings, StepProgram, TrainState, make_optimizer, sharded_train_step


class AbstractStep(NamedTuple):
    """jitted: the step (call or `.lower(*args)`); args: its abstract arguments; layout: their shardings."""

    jitted: Any
    args: tuple
    layout: train_sharding.TrainLayout


def abstract_step(model_config: CloverConfig, config: FinetuneConfig, mesh_sharding: MeshSharding, kernels, *,
                  block_size: int = 32, compute_dtype: str = "bfloat16") -> AbstractStep:
    """The train step of `config` (method, LoRA targets and rank, quantize, batch_size,
    grad_accum_steps, seq_len, complementary, remat) for `model_config` on `mesh_sharding`'s mesh,
    with `kernels` (`clover_jax.core.kernels.KernelChoice`) as the model would run them there."""
    module = training_module(CloverTransformer(model_config, jnp.dtype(compute_dtype), kernels, mesh_sharding),
                             remat=config.remat, offload_base=config.offload_base)
    spec = None
    settings = LossSettings(block_size=block_size, mask_token_id=model_config.mask_token_id,
                            coreset=model_config.moe_block_coreset_enabled, complementary=config.complementary,
                            loss_weighting=config.weighting, next_token_weight=float(config.next_token_weight),
                            load_balance_weight=float(config.load_balance_weight),
                            router_z_weight=float(config.router_z_weight))
    optimizer = OptimizerSettings.of(config)
    if config.method == "lora":
        spec = lora.LoraSpec(config.lora_rank, float(config.lora_alpha), config.lora_targets,
                             model_config.mask_token_id, model_config.tie_word_embeddings)
        quantize = None if config.quantize is None else QuantSpec.parse(config.quantize)
        frozen = _unsharded(mesh_sharding.abstract_params(jnp.dtype(compute_dtype), quantize))
        trained = jax.eval_shape(lambda base: lora.init_trainable(base, model_config, spec, jax.random.key(0)), frozen)
    else:
        frozen = None
        trained = _unsharded(mesh_sharding.abstract_params(jnp.float32))
    state = jax.eval_shape(lambda params: TrainState(jnp.int32(0), params, make_optimizer(optimizer).init(params)),
                           trained)
    batch, length = config.batch_size, config.seq_len
    token = lambda dtype: jax.ShapeDtypeStruct((batch, length), dtype)
    rows = TrainRows(token(jnp.int32), token(jnp.int32), token(jnp.int32), token(jnp.bool_), token(jnp.bool_),
                     jax.ShapeDtypeStruct((batch, length // block_size), jnp.int32))
    layout = train_sharding.train_layout(mesh_sharding, state, rows, frozen, offload_base=config.offload_base)
    replicated = layout.replicated
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (_with(state, layout.state), _with(rows, layout.rows),
            jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated), Normalisers(scalar, scalar), scalar,
            None if frozen is None else _with(frozen, layout.frozen))
    program = StepProgram(module, settings, optimizer, config.mask_ratio_floor, compute_dtype, config.grad_accum_steps,
                          spec)
    return AbstractStep(sharded_train_step(program, layout), args, layout)


def _unsharded(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def _with(tree: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                              sharding=sharding), tree, shardings)
