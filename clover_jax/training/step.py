"""The train step: what it is made of (`StepProgram`, from a `FinetuneConfig`) and the one jitted
step (`train_step`), on the run's mesh — one device is a 1x1x1 mesh.

An optimizer step runs its micro-batches under one `lax.scan`, adding their gradients; the loss's
normalisers count the whole batch, so the sum is the gradient of the batch's loss. The noise of
micro-batch i of step s is drawn from `fold_in(fold_in(key(seed), s), i)`: a resumed run draws the
same. In a LoRA run (`program.lora`) the state holds only the trainable part
(`clover_jax.adapters.lora`) and the frozen base, already in the compute dtype (or quantised), is an
argument of the step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from clover_jax.adapters import lora
from clover_jax.nn.model import CloverTransformer, Params
from clover_jax.training.batches import Normalisers, TrainRows, block_rows
from clover_jax.training.block_pass import training_module
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.loss import LossParts, LossSettings, empty_parts, loss_parts
from clover_jax.training.masking import Editing, draw_noise
from clover_jax.training.state import OptimizerSettings, TrainState, make_optimizer
from clover_jax.training.train_sharding import TrainLayout


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What a compiled train step depends on (hashable, a static argument): the module
    (differentiable, `block_pass.training_module`), the loss and optimizer settings, the floor of
    the masking ratio, the compute dtype, the micro-batches per step, a LoRA run's adapters."""

    module: CloverTransformer
    settings: LossSettings
    optimizer: OptimizerSettings
    min_mask_ratio: float
    compute_dtype: str
    micro_batches: int
    lora: lora.LoraSpec | None = None  # a LoRA run: the state holds the trainable part only

    @classmethod
    def of(cls, config: FinetuneConfig, module: CloverTransformer, *, block_size: int, compute_dtype: str,
           substitute_vocabulary: tuple[tuple[int, int], ...] | None = None) -> "StepProgram":
        """The step `config` describes at `block_size`, over `module` (the model as the run writes it:
        its config holds the mask token; on the run's mesh): the one place a `FinetuneConfig` becomes
        the training module (remat, offloaded base), the loss settings, the optimizer and the LoRA spec.
        substitute_vocabulary: token editing's uniform substitutes, id ranges [start, stop) (the
        trainer passes the tokenizer's non-special ids); None: every id but the mask token."""
        model_config = module.config
        editing = None
        if config.edit_fraction > 0:
            mask = model_config.mask_token_id
            everything = ((0, mask), (mask + 1, model_config.vocab_size)) if mask is not None else (
                (0, model_config.vocab_size),)
            editing = Editing(float(config.edit_fraction), float(config.edit_keep_weight), config.edit_substitutes,
                              substitute_vocabulary or tuple((a, b) for a, b in everything if b > a))
        settings = LossSettings(block_size=block_size, mask_token_id=model_config.mask_token_id,
                                coreset=model_config.moe_block_coreset_enabled, complementary=config.complementary,
                                loss_weighting=config.weighting, next_token_weight=float(config.next_token_weight),
                                load_balance_weight=float(config.load_balance_weight),
                                router_z_weight=float(config.router_z_weight), editing=editing)
        spec = None
        if config.method == "lora":
            spec = lora.LoraSpec(config.lora_rank, float(config.lora_alpha), config.lora_targets,
                                 model_config.mask_token_id, model_config.tie_word_embeddings)
        trained = training_module(module, remat=config.remat, offload_base=config.offload_base)
        return cls(trained, settings, OptimizerSettings.of(config), config.mask_ratio_floor, compute_dtype,
                   config.grad_accum_steps, spec)

    def run_params(self, master: Params, frozen: Params | None) -> Params:
        """The parameters a pass runs: the master copy in the compute dtype, or (LoRA) the frozen
        base with the trainable part attached (adapters stay float32)."""
        if self.lora is None:
            return jax.tree_util.tree_map(lambda leaf: leaf.astype(self.compute_dtype), master)
        return lora.attach(frozen, master, self.lora)


def batch_gradients(params: Params, step: jax.Array, rows: TrainRows, key: jax.Array, norm: Normalisers,
                    coreset_top_p: jax.Array, frozen: Params | None = None, *,
                    program: StepProgram) -> tuple[Params, LossParts]:
    """The gradient of the batch's loss in `params` (the state's: master or trainable part), and
    the loss's parts summed over the micro-batches; the noise is step `step`'s."""
    split = lambda array: array.reshape((program.micro_batches, array.shape[0] // program.micro_batches)
                                        + array.shape[1:])
    micro_rows = jax.tree_util.tree_map(split, rows)
    step_key = jax.random.fold_in(key, step)
    settings = program.settings

    def micro(carry, inputs):
        grads, parts = carry
        index, batch = inputs
        targets, maskable = block_rows(batch, settings.block_size)
        noise = draw_noise(jax.random.fold_in(step_key, index), maskable, min_ratio=program.min_mask_ratio,
                           complementary=settings.complementary, editing=settings.editing, targets=targets)

        def loss(master):
            compute = program.run_params(master, frozen)
            out = loss_parts(compute, program.module, batch, noise, norm, settings=settings,
                             coreset_top_p=coreset_top_p)
            return out.loss, out

        (_, out), micro_grads = jax.value_and_grad(loss, has_aux=True)(params)
        return (jax.tree_util.tree_map(jnp.add, grads, micro_grads),
                jax.tree_util.tree_map(jnp.add, parts, out)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    (grads, parts), _ = jax.lax.scan(micro, (zeros, empty_parts(program.module)),
                                     (jnp.arange(program.micro_batches), micro_rows))
    return grads, parts


def step_body(state: TrainState, rows: TrainRows, key: jax.Array, norm: Normalisers, coreset_top_p: jax.Array,
              frozen: Params | None = None, *, program: StepProgram) -> tuple[TrainState, dict]:
    """One optimizer step: `rows` ([batch, ...]) split into `program.micro_batches`. frozen: a
    LoRA run's base parameters (`state.compute_base`), None otherwise."""
    grads, parts = batch_gradients(state.params, state.step, rows, key, norm, coreset_top_p, frozen, program=program)
    updates, opt_state = make_optimizer(program.optimizer).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    load = parts.expert_load / program.micro_batches
    metrics = {"loss": parts.loss, "diffusion_loss": parts.diffusion_loss, "next_token_loss": parts.next_token_loss,
               "load_balance_loss": parts.load_balance_loss / program.micro_batches,
               "router_z_loss": parts.router_z_loss / program.micro_batches,
               "masked_accuracy": parts.masked_correct / jnp.maximum(parts.masked_tokens, 1.0),
               "masked_tokens": parts.masked_tokens,
               "grad_norm": optax.global_norm(grads),
               "expert_load_max": jnp.max(load, axis=-1), "expert_load_min": jnp.min(load, axis=-1),
               "expert_load_cv": jnp.std(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)}
    if program.settings.editing is not None:
        metrics.update(keep_loss=parts.keep_loss, substituted_tokens=parts.substituted_tokens,
                       substituted_accuracy=parts.substituted_correct / jnp.maximum(parts.substituted_tokens, 1.0))
    return TrainState(state.step + 1, params, opt_state), metrics


@functools.lru_cache(maxsize=16)
def train_step(program: StepProgram, layout: TrainLayout) -> Any:
    """`step_body` jitted for the run's mesh: arguments and results pinned to `layout`'s shardings
    (`train_sharding.TrainLayout`), the state donated. Called as
    `train_step(program, layout)(state, rows, key, normalisers, coreset_top_p, frozen)`."""
    replicated = layout.replicated
    metrics = replicated  # every metric is a scalar or [layers] vector, whole on every device
    return jax.jit(functools.partial(step_body, program=program), donate_argnums=0,
                   in_shardings=(layout.state, layout.rows, replicated, replicated, replicated, layout.frozen),
                   out_shardings=(layout.state, metrics))
