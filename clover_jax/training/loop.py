"""The training loop: steps from the state's (or the latest checkpoint's) to `config.steps`, on the
run's mesh — each a batch, the one jitted step, a metrics record every `log_every` steps (to
`on_metrics`, the log and the returned history), evaluations, and checkpoints (`checkpointing`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from clover_jax.nn.model import Params
from clover_jax.training import checkpointing, faults, train_sharding
from clover_jax.training.batches import BatchIterator, Normalisers, normalisers
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.state import TrainState
from clover_jax.training.step import StepProgram, train_step

logger = logging.getLogger(__name__)


class LoopRun(NamedTuple):
    """What the loop runs: the step of each block size, the shardings of the state, the batch and
    the base on the run's mesh (`train_sharding.TrainLayout`), a LoRA run's frozen base (placed
    there; its fingerprint is checked on resume), the coreset threshold, and the evaluation (a
    function of the state returning "eval_*" metrics; None: no evaluation)."""

    programs: dict[int, StepProgram]
    layout: train_sharding.TrainLayout
    frozen: Params | None
    coreset_top_p: float
    evaluation: Callable[[TrainState], dict] | None = None


def run_loop(state: TrainState, batches: BatchIterator, run: LoopRun, config: FinetuneConfig, *,
             on_metrics: Callable[[dict], None] | None = None,
             progress: bool = True) -> tuple[TrainState, list[dict]]:
    """Train from `state` (or the latest checkpoint in `config.checkpoint_dir`) to `config.steps`;
    returns the final state and the logged metrics."""
    history: list[dict] = []
    saver = None
    if config.checkpoint_dir:
        fingerprint = None if run.frozen is None else checkpointing.fingerprint(run.frozen)
        saver = checkpointing.Saver(config.checkpoint_dir, config.checkpoint_every, base_fingerprint=fingerprint)
        try:
            state, batches.position, history = saver.restore_latest(state, batches.position, history)
        except BaseException:
            saver.close(failing=True)  # its log handler and manager go with it
            raise
    layout = run.layout
    replicated = layout.replicated
    state = jax.device_put(state, layout.state)
    key = jax.jit(lambda: jax.random.key(config.seed), out_shardings=replicated)()
    top_p = train_sharding.place(np.float32(run.coreset_top_p), replicated)
    started = time.perf_counter()
    tokens_seen = 0
    try:
        with tqdm(total=config.steps, initial=int(state.step), desc="training", unit="step",
                  disable=not progress) as bar:
            for step in range(int(state.step), config.steps):
                batch = batches.next()
                norm = normalisers(batch.rows, batch.block_size)
                rows = train_sharding.place(batch.rows, layout.rows)
                placed_norm = train_sharding.place(norm, Normalisers(replicated, replicated))
                state, metrics = train_step(run.programs[batch.block_size], layout)(state, rows, key, placed_norm,
                                                                                    top_p, run.frozen)
                faults.reached("step", step + 1)
                tokens_seen += int(np.sum(batch.rows.segment > 0))
                done = step + 1
                if done % config.log_every == 0 or done == config.steps:
                    record = _record(metrics, done, norm, batch.block_size, tokens_seen, time.perf_counter() - started)
                    if run.evaluation is not None and config.eval_every and done % config.eval_every == 0:
                        record.update(run.evaluation(state))
                    history.append(record)
                    shown = {"loss": f"{record['loss']:.4f}"}
                    if record["masked_tokens"]:
                        shown["masked_acc"] = f"{record['masked_accuracy']:.3f}"
                    bar.set_postfix(shown)
                    logger.debug("step %d: %s", done, record)
                    if on_metrics is not None:
                        on_metrics(record)
                if saver is not None:
                    saver.maybe_save(done, state, batches.position, history, final=done == config.steps)
                bar.update(1)
        if run.evaluation is not None and not (config.eval_every and config.steps % config.eval_every == 0):
            final = run.evaluation(state)
            if history and history[-1]["step"] == config.steps:
                history[-1].update(final)
            else:
                history.append({"step": config.steps, **final})
            if on_metrics is not None:
                on_metrics(history[-1])
    except BaseException:
        if saver is not None:
            saver.close(failing=True)  # the error that ended the run stays the one reported
        raise
    if saver is not None:
        saver.close()
    return state, history


def _record(metrics: dict, step: int, norm: Normalisers, block_size: int, tokens_seen: int,
            seconds: float) -> dict[str, Any]:
    values = jax.device_get(metrics)
    record: dict[str, Any] = {"step": step}
    for name, value in values.items():
        value = np.asarray(value)
        record[name] = float(value) if value.ndim == 0 else [round(float(v), 6) for v in value]
    record.update(block_size=block_size, loss_tokens=int(norm.loss_tokens), next_token_targets=int(norm.next_tokens),
                  tokens=tokens_seen, seconds=round(seconds, 3))
    return record
