"""Optimisation loop: optax AdamW, one jitted train step, Orbax checkpoints, a progress bar.

The train state is an explicit pytree (`TrainState`); `Trainer.fit` runs steps from the
state's step to `config.steps`, taking the batch of each step from a function of the step
number (so a run resumed from an Orbax checkpoint sees the same data) and the noise from
`fold_in(key(seed), step)`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from clover_jax.nn.model import CloverTransformer, Params
from clover_jax.training.batches import TrainBatch
from clover_jax.training.objective import joint_loss

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 32
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    final_learning_rate_fraction: float = 0.05  # cosine decay ends at this fraction of the peak
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    adam_b2: float = 0.98
    min_mask_ratio: float = 0.02
    # λ of the joint objective: block diffusion + λ · next-token loss on the causal pass (0: diffusion only)
    next_token_weight: float = 1.0
    seed: int = 0
    checkpoint_every: int = 500
    log_every: int = 25
    # The model's GDN chunk setting (`KernelChoice.gdn_chunk`) for training passes (same maths;
    # None: chosen per pass length as in decoding). Training passes hold few tokens.
    gdn_chunk_size: int | None = 16


class TrainState(NamedTuple):
    step: jax.Array  # int32 []
    params: Params
    opt_state: Any


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with linear warm-up and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.final_learning_rate_fraction)
    return optax.chain(optax.clip_by_global_norm(config.grad_clip),
                       optax.adamw(schedule, b2=config.adam_b2, weight_decay=config.weight_decay))


class Trainer:
    """Joint block-diffusion and next-token training of a `CloverTransformer` (see
    `clover_jax.training.objective`)."""

    def __init__(self, module: CloverTransformer, config: TrainConfig, mask_token_id: int, coreset: bool = True,
                 coreset_top_p: float = 0.9):
        if config.gdn_chunk_size is not None:
            module = module.clone(kernels=dataclasses.replace(module.kernels, gdn_chunk=config.gdn_chunk_size))
        self.module = module
        self.config = config
        self.optimizer = make_optimizer(config)
        loss = functools.partial(joint_loss, module=module, mask_token_id=mask_token_id,
                                 next_token_weight=config.next_token_weight, coreset=coreset,
                                 coreset_top_p=coreset_top_p, min_ratio=config.min_mask_ratio)

        def train_step(state: TrainState, batch: TrainBatch, key: jax.Array):
            (value, parts), grads = jax.value_and_grad(
                lambda params: loss(params, batch=batch, key=key), has_aux=True)(state.params)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": value, "diffusion_loss": parts.diffusion_loss,
                       "cross_entropy": parts.diffusion.cross_entropy, "accuracy": parts.diffusion.accuracy,
                       "masked_fraction": parts.diffusion.masked_fraction,
                       "next_token_cross_entropy": parts.next_token.cross_entropy,
                       "next_token_accuracy": parts.next_token.accuracy, "grad_norm": optax.global_norm(grads)}
            return TrainState(state.step + 1, params, opt_state), metrics

        self._train_step = jax.jit(train_step, donate_argnums=0)

    def init_state(self, params: Params) -> TrainState:
        return TrainState(jnp.int32(0), params, self.optimizer.init(params))

    def step(self, state: TrainState, batch: TrainBatch, key: jax.Array) -> tuple[TrainState, dict]:
        return self._train_step(state, batch, key)

    def fit(self, state: TrainState, batch_for_step: Callable[[int], TrainBatch],
            checkpoint_dir: str | os.PathLike | None = None, progress: bool = True) -> tuple[TrainState, list[dict]]:
        """Train until `config.steps`; resume from the latest checkpoint in `checkpoint_dir`.

        Returns the final state and the logged metrics (every `log_every` steps and the last).
        """
        config = self.config
        manager = _checkpoint_manager(checkpoint_dir, config.checkpoint_every) if checkpoint_dir else None
        if manager is not None and manager.latest_step() is not None:
            import orbax.checkpoint as ocp

            restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
            state = TrainState(*restored) if not isinstance(restored, TrainState) else restored
            logger.info("resumed from step %d in %s", int(state.step), checkpoint_dir)
        # Restored arrays are committed to a device; commit fresh ones too, so both hit one compiled step.
        state = jax.device_put(state, jax.devices()[0])
        base_key = jax.random.key(config.seed)
        first = int(state.step)
        history: list[dict] = []
        started = time.perf_counter()
        try:
            with tqdm(total=config.steps, initial=first, desc="training", unit="step", disable=not progress) as bar:
                for step in range(first, config.steps):
                    state, metrics = self.step(state, batch_for_step(step), jax.random.fold_in(base_key, step))
                    done = step + 1
                    if done % config.log_every == 0 or done == config.steps:
                        # NaN marks a part that was not computed (the next-token loss at weight 0)
                        record = {name: float(value) for name, value in jax.device_get(metrics).items()
                                  if not np.isnan(value)}
                        record.update(step=done, seconds=time.perf_counter() - started)
                        history.append(record)
                        bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.3f}",
                                        next_acc=f"{record.get('next_token_accuracy', float('nan')):.3f}")
                        logger.debug("step %d: %s", done, record)
                    if manager is not None:
                        _save(manager, done, state, force=done == config.steps)
                    bar.update(1)
        finally:
            if manager is not None:
                manager.wait_until_finished()
                manager.close()
        return state, history


def _checkpoint_manager(directory, every: int):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
    return ocp.CheckpointManager(os.path.abspath(os.fspath(directory)), options=options)


def _save(manager, step: int, state: TrainState, force: bool) -> None:
    import orbax.checkpoint as ocp

    if force or manager.should_save(step):
        manager.save(step, args=ocp.args.StandardSave(state), force=force)


def count_parameters(params: Params) -> int:
    return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))
