"""The optimizer and the jitted train step.

The train state holds float32 master parameters; each step casts them to the compute dtype
(`param_dtype`, e.g. bfloat16) for the forward pass, so gradients and AdamW's moments are
float32 and bfloat16 parameters still take small updates. In a LoRA run (`program.lora`) the state
holds only the trainable part (`clover_jax.training.lora`): the frozen base is an argument of the
step, already in the compute dtype (or quantised), never differentiated, never in the optimizer
state. An optimizer step runs its
micro-batches under one `lax.scan`, adding their gradients; the loss's normalisers count the
whole batch, so the sum is the gradient of the batch's loss. The noise of micro-batch i of step
s is drawn from `fold_in(fold_in(key(seed), s), i)`: a resumed run draws the same.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clover_jax.core.quantization import QuantizedWeight
from clover_jax.nn.model import CloverTransformer, Params
from clover_jax.training import lora as lora_params
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.loss import LossParts, LossSettings, Normalisers, TrainRows, block_rows, loss_parts
from clover_jax.training.masking import draw_noise


class TrainState(NamedTuple):
    """step: int32 []; params: float32 master parameters (canonical layout; a LoRA run: the
    trainable part, `lora.init_trainable`); opt_state: optax's."""

    step: jax.Array
    params: Params
    opt_state: Any


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(key, "key", key)) for key in path)


def is_router(path) -> bool:
    return _path_names(path)[-1:] == ("gate",) and "mlp" in _path_names(path)


class OptimizerSettings(NamedTuple):
    """The optimizer's part of a `FinetuneConfig` (hashable: it is part of the compiled step)."""

    learning_rate: float
    warmup_steps: int
    steps: int
    weight_decay: float
    grad_clip: float
    freeze_router: bool

    @classmethod
    def of(cls, config: FinetuneConfig) -> "OptimizerSettings":
        return cls(float(config.learning_rate), config.warmup_steps, config.steps, float(config.weight_decay),
                   float(config.grad_clip), config.freeze_router)


def make_optimizer(settings: OptimizerSettings) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (linear warm-up, cosine decay to 10% of the peak). Weight
    decay skips vectors (norm scales, GDN decay parameters, the block-mode scalars); a frozen
    router takes no update at all."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.learning_rate, settings.warmup_steps, max(settings.steps, settings.warmup_steps + 1),
        end_value=settings.learning_rate * 0.1)
    # A layer's parameters carry a leading [groups] axis: a layer vector is [groups, n].
    decays = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf.ndim - ("groups" in _path_names(path)) > 1, params)
    optimizer = optax.chain(optax.clip_by_global_norm(settings.grad_clip),
                            optax.adamw(schedule, weight_decay=settings.weight_decay, mask=decays))
    if not settings.freeze_router:
        return optimizer
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if is_router(path) else "trained", params)
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def normalisers(rows: TrainRows, block_size: int) -> Normalisers:
    """The global batch's loss tokens (in its noisy blocks) and next-token targets, on the host."""
    _, maskable = block_rows(rows, block_size)
    predicts = rows.next_token[:, 1:] & (rows.segment[:, 1:] == rows.segment[:, :-1])
    return Normalisers(np.float32(max(int(np.sum(maskable)), 1)), np.float32(max(int(np.sum(predicts)), 1)))


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """What a compiled train step depends on (hashable, a static argument): the module
    (differentiable, `block_pass.training_module`), the loss and optimizer settings, the floor of
    the masking ratio, the compute dtype, the micro-batches per step."""

    module: CloverTransformer
    settings: LossSettings
    optimizer: OptimizerSettings
    min_mask_ratio: float
    compute_dtype: str
    micro_batches: int
    lora: lora_params.LoraSpec | None = None  # a LoRA run: the state holds the trainable part only

    def run_params(self, master: Params, frozen: Params | None) -> Params:
        """The parameters a pass runs: the master copy in the compute dtype, or (LoRA) the frozen
        base with the trainable part attached (adapters stay float32)."""
        if self.lora is None:
            return jax.tree_util.tree_map(lambda leaf: leaf.astype(self.compute_dtype), master)
        return lora_params.attach(frozen, master, self.lora)


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
        _, maskable = block_rows(batch, settings.block_size)
        noise = draw_noise(jax.random.fold_in(step_key, index), maskable, min_ratio=program.min_mask_ratio,
                           complementary=settings.complementary)

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
    LoRA run's base parameters (`compute_base`), None otherwise. Jitted as `train_step` (one
    device) or `sharded_train_step` (a mesh)."""
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
    return TrainState(state.step + 1, params, opt_state), metrics


train_step = jax.jit(step_body, static_argnames="program", donate_argnames="state")


@functools.lru_cache(maxsize=16)
def sharded_train_step(program: StepProgram, layout) -> Any:
    """`step_body` jitted for a mesh: arguments and results pinned to `layout`'s shardings
    (`clover_jax.training.train_sharding.TrainLayout`), the state donated. Called as
    `train_step` is, without `program`."""
    replicated = layout.replicated
    metrics = replicated  # every metric is a scalar or [layers] vector, whole on every device
    return jax.jit(functools.partial(step_body, program=program), donate_argnums=0,
                   in_shardings=(layout.state, layout.rows, replicated, replicated, replicated, layout.frozen),
                   out_shardings=(layout.state, metrics))


def empty_parts(module: CloverTransformer) -> LossParts:
    """`LossParts` of zeros: scalars, and [layers, experts] for the expert load."""
    config = module.config
    scalar = jnp.zeros((), jnp.float32)
    return LossParts(*([scalar] * 7), jnp.zeros((config.num_hidden_layers, config.num_experts), jnp.float32))


def compute_base(params: Params, dtype: str, on_device: bool = True) -> Params:
    """A LoRA run's frozen base in the compute dtype (quantised weights as they are), on the
    device (`on_device`; else where it is, for `train_sharding.place` to spread over a mesh)."""
    cast = lambda leaf: leaf if isinstance(leaf, QuantizedWeight) else jnp.asarray(leaf, dtype)
    base = jax.tree_util.tree_map(cast, params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))
    return jax.device_put(base, jax.devices()[0]) if on_device else base


def init_state(optimizer: OptimizerSettings, params: Params, on_device: bool = True) -> TrainState:
    """A fresh state: float32 master copies of `params`, step 0 (on the first device with
    `on_device`; else where it is, for `train_sharding.place`)."""
    master = jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, jnp.float32), params)
    state = TrainState(jnp.int32(0), master, make_optimizer(optimizer).init(master))
    # Committed to the device as every step's output is: an uncommitted first state would make the
    # second step a second compiled program.
    return jax.device_put(state, jax.devices()[0]) if on_device else state
