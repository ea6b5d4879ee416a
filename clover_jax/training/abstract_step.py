"""The real train step with abstract arguments: what a compiler needs to lay out one optimizer step
of a fine-tuning run on a mesh, without a byte of the model.

`abstract_step(...)` returns the jitted step (`step.train_step`) and its arguments as
`jax.ShapeDtypeStruct`s carrying the training shardings (`train_sharding`): the float32 master
parameters and AdamW's moments (full fine-tuning) or the trainable LoRA part and the frozen
base in the compute dtype, possibly quantised (LoRA / QLoRA); one global batch of `TrainRows` at
`seq_len` clean tokens per sequence with every block noisy (the complementary copy doubles the
noisy stream: three streams of rows); the key, normalisers and coreset threshold.
`clover_jax.api.compile.train_step` lowers and compiles it for a named target.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clover_jax.adapters import lora
from clover_jax.core.config import CloverConfig
from clover_jax.core.quantization import QuantSpec
from clover_jax.nn.model import CloverTransformer
from clover_jax.parallel.sharding import MeshSharding
from clover_jax.training import train_sharding
from clover_jax.training.batches import Normalisers, TrainRows
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.state import TrainState, make_optimizer
from clover_jax.training.step import StepProgram, train_step


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
    module = CloverTransformer(model_config, jnp.dtype(compute_dtype), kernels, mesh_sharding)
    program = StepProgram.of(config, module, block_size=block_size, compute_dtype=compute_dtype)
    spec = program.lora
    if spec is not None:
        quantize = None if config.quantize is None else QuantSpec.parse(config.quantize)
        frozen = _unsharded(mesh_sharding.abstract_params(jnp.dtype(compute_dtype), quantize))
        trained = jax.eval_shape(lambda base: lora.init_trainable(base, model_config, spec, jax.random.key(0)), frozen)
    else:
        frozen = None
        trained = _unsharded(mesh_sharding.abstract_params(jnp.float32))
    state = jax.eval_shape(
        lambda params: TrainState(jnp.int32(0), params, make_optimizer(program.optimizer).init(params)), trained)
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
    return AbstractStep(train_step(program, layout), args, layout)


def _unsharded(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def _with(tree: Any, shardings: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                              sharding=sharding), tree, shardings)
