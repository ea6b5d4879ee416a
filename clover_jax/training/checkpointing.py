"""Orbax checkpoints of a run, and resuming from the last complete one.

A checkpoint, written at optimizer-step boundaries every `checkpoint_every` steps and at the last
step, holds the whole train state: the float32 master parameters and the optimizer state (and
the step, in the state), the data position (`dataset.DataPosition`) and the metrics logged so
far. The noise is a function of the seed and the step, so nothing else is needed: a run started
again with the same arguments continues from the latest complete checkpoint and writes the same
checkpoint, bit for bit on CPU, as a run never stopped. Saves are asynchronous (training goes on
while Orbax writes); Orbax publishes a checkpoint only once every file is written, so a run
killed in the middle of a save resumes from the one before it.

`fault_point` lets the tests kill a run at an enumerated point: with the environment variable
`CLOVER_JAX_KILL_AT=<point>:<step>`, the process sends itself SIGKILL when it reaches that point
("step": a train step dispatched, its result not read yet; "save": a save started, not finished).
"""

from __future__ import annotations

import logging
import os
import signal

import jax

from clover_jax.training.dataset import DataPosition
from clover_jax.training.step import TrainState

logger = logging.getLogger(__name__)

KILL_AT = "CLOVER_JAX_KILL_AT"


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process when `CLOVER_JAX_KILL_AT` names this point and step (tests only)."""
    if os.environ.get(KILL_AT) == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


class Saver:
    """The run's Orbax `CheckpointManager` in `directory` (two checkpoints kept)."""

    def __init__(self, directory: str | os.PathLike, every: int):
        import orbax.checkpoint as ocp

        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def restore_latest(self, state: TrainState, position: DataPosition,
                       history: list[dict]) -> tuple[TrainState, DataPosition, list[dict]]:
        """The latest complete checkpoint's state, position and metrics, or the given ones when none."""
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        if step is None:
            return state, position, history
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
        progress = restored["progress"]
        state = TrainState(*restored["state"]) if not isinstance(restored["state"], TrainState) else restored["state"]
        # Restored arrays are committed to a device; fresh ones would make a second compiled step.
        state = jax.device_put(state, jax.devices()[0])
        logger.info("resumed from step %d in %s", step, self.directory)
        return (state, DataPosition(progress["position"]["step"], tuple(progress["position"]["drawn"])),
                list(progress["metrics"]))

    def maybe_save(self, step: int, state: TrainState, position: DataPosition, history: list[dict],
                   final: bool) -> None:
        """Start an asynchronous save at `step` when it is a checkpoint step (or the last one)."""
        import orbax.checkpoint as ocp

        if not (final or self.manager.should_save(step)):
            return
        progress = {"position": {"step": position.step, "drawn": list(position.drawn)}, "metrics": history}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        progress=ocp.args.JsonSave(progress)), force=final)
        fault_point("save", step)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
