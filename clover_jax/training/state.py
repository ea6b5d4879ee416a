"""The train state and its optimizer: float32 master parameters (a LoRA run: its trainable part),
AdamW's state, the step counter; and a LoRA run's frozen base in the compute dtype.

Each step casts the master copy to the compute dtype (`param_dtype`, e.g. bfloat16) for the pass,
so gradients and AdamW's moments are float32 and bfloat16 parameters still take small updates. A
LoRA run's frozen base is an argument of the step, never differentiated, never in the optimizer
state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clover_jax.core.quantization import QuantizedWeight
from clover_jax.core.tree_paths import key_names
from clover_jax.nn.model import Params
from clover_jax.training.config import FinetuneConfig


class TrainState(NamedTuple):
    """step: int32 []; params: float32 master parameters (canonical layout; a LoRA run: the
    trainable part, `clover_jax.adapters.lora.init_trainable`); opt_state: optax's."""

    step: jax.Array
    params: Params
    opt_state: Any


def is_router(path) -> bool:
    return key_names(path)[-1:] == ("gate",) and "mlp" in key_names(path)


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
        lambda path, leaf: leaf.ndim - ("groups" in key_names(path)) > 1, params)
    optimizer = optax.chain(optax.clip_by_global_norm(settings.grad_clip),
                            optax.adamw(schedule, weight_decay=settings.weight_decay, mask=decays))
    if not settings.freeze_router:
        return optimizer
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if is_router(path) else "trained", params)
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def compute_base(params: Params, dtype: str) -> Params:
    """A LoRA run's frozen base in the compute dtype (quantised weights as they are), where it is
    (for `train_sharding.place` to spread over the run's mesh)."""
    cast = lambda leaf: leaf if isinstance(leaf, QuantizedWeight) else jnp.asarray(leaf, dtype)
    return jax.tree_util.tree_map(cast, params, is_leaf=lambda leaf: isinstance(leaf, QuantizedWeight))


def init_state(optimizer: OptimizerSettings, params: Params) -> TrainState:
    """A fresh state: float32 master copies of `params`, step 0, where they are (for
    `train_sharding.place` to put on the run's mesh)."""
    master = jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, jnp.float32), params)
    return TrainState(jnp.int32(0), master, make_optimizer(optimizer).init(master))
