"""Orbax checkpoints of a run, and resuming from the last complete one.

A checkpoint, written at optimizer-step boundaries every `checkpoint_every` steps and at the last
step, holds the whole train state: the float32 master parameters and the optimizer state (and
the step, in the state), the data position (`dataset.DataPosition`) and the metrics logged so
far. The noise is a function of the seed and the step, so nothing else is needed: a run started
again with the same arguments continues from the latest complete checkpoint and writes the same
checkpoint, bit for bit on CPU, as a run never stopped. Saves are asynchronous (training goes on
while Orbax writes); Orbax publishes a checkpoint only once every file is written, so a run
killed in the middle of a save resumes from the one before it.

A LoRA run's state holds only the trainable part; the frozen base is not saved. Its `fingerprint`
(sha256 of every leaf's path, shape, dtype and float32 sum and sum of squares, quantised values and
scales included) is saved beside the progress, and a resume over a different base is refused.

A save reports the fault point "save" (`faults`) once it has started, before it is published: the
point where the tests kill a run mid-save.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.training import faults
from clover_jax.training.batches import DataPosition
from clover_jax.training.state import TrainState
from clover_jax.training.train_sharding import HOST_MEMORY

logger = logging.getLogger(__name__)


def fingerprint(params) -> str:
    """A LoRA run's frozen base, summarised: sha256 over each leaf's path, shape, dtype, and its
    float32 sum and sum of squares (computed where the leaf is; no copy of the base to the host)."""
    digest = hashlib.sha256()
    sums = jax.jit(lambda leaf: jnp.stack([jnp.sum(leaf.astype(jnp.float32)),
                                           jnp.sum(jnp.square(leaf.astype(jnp.float32)))]))
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        placed = getattr(leaf, "sharding", None)
        # an offloaded base (`offload_base`) is summed on the chips, one leaf at a time
        if getattr(placed, "memory_kind", None) == HOST_MEMORY:
            leaf = jax.device_put(leaf, placed.with_memory_kind("device"))
        stats = np.asarray(sums(leaf), np.float64)
        digest.update(f"{jax.tree_util.keystr(path)}|{tuple(leaf.shape)}|{leaf.dtype}|{stats[0]!r}|{stats[1]!r}|"
                      .encode())
    return digest.hexdigest()


def _quiet_write_failures(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of an Orbax writer task that failed on an OS write error."""
    exception = record.exc_info[1] if record.exc_info else None
    if exception is None and isinstance(record.args, dict):
        exception = record.args.get("exception")
    context = getattr(record, "msg", "")
    return not (isinstance(context, str) and "exception was never retrieved" in context
                and "os_error_code" in str(exception or record.getMessage()))


class _OrbaxWriteErrors(logging.Handler):
    """Keeps the OS error number of the last write failure Orbax logged (from the record's exception),
    for a failure that Orbax's save finalizer logs and does not raise."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.number: int | None = None

    def attach(self) -> None:
        for name in ("absl", "orbax"):
            logging.getLogger(name).addHandler(self)

    def detach(self) -> None:
        for name in ("absl", "orbax"):
            logging.getLogger(name).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        from weights.write_errors import write_error_number

        error = record.exc_info[1] if record.exc_info else None
        number = write_error_number(error) if isinstance(error, Exception) else None
        if number is not None:
            self.number = number


class Saver:
    """The run's Orbax `CheckpointManager` in `directory` (two checkpoints kept). base_fingerprint: a
    LoRA run's `fingerprint` of its frozen base (None: a full run, whose state holds every weight)."""

    def __init__(self, directory: str | os.PathLike, every: int, base_fingerprint: str | None = None):
        import orbax.checkpoint as ocp

        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        self.base_fingerprint = base_fingerprint
        options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._started: int | None = None  # the last save started and not yet seen published
        self._log_errors = _OrbaxWriteErrors()
        self._log_errors.attach()
        # A failed write is reported once, by `_write_errors`; Orbax's writer tasks would otherwise each
        # log it again through asyncio ("Task exception was never retrieved"), hundreds of tracebacks,
        # some when the tasks are collected at exit: the filter stays for the process (it drops only those).
        logging.getLogger("asyncio").addFilter(_quiet_write_failures)

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
        if progress.get("base_fingerprint") != self.base_fingerprint:
            raise ValueError(f"the checkpoint at step {step} in {self.directory} was written by a run over a different "
                             f"frozen base (fingerprint {str(progress.get('base_fingerprint'))[:12]}, this run's "
                             f"{str(self.base_fingerprint)[:12]}): resume with the same model and quantize, or use "
                             "another checkpoint_dir")
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
        progress = {"position": {"step": position.step, "drawn": list(position.drawn)}, "metrics": history,
                    "base_fingerprint": self.base_fingerprint}
        with self._write_errors():
            # the previous save's failure surfaces here (Orbax's save would wait for it anyway), before
            # a newer checkpoint could be published over the gap
            self.manager.wait_until_finished()
            self._check_published()
            self._log_errors.number = None  # what Orbax logs from now on belongs to this save
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            progress=ocp.args.JsonSave(progress)), force=final)
            self._started = step
        faults.reached("save", step)

    def close(self, *, failing: bool = False) -> None:
        """Wait for the last save and check that it was published. failing: the run is already ending
        on an error, which stays the one reported (a save's failure is then only logged)."""
        try:
            with self._write_errors():
                self.manager.wait_until_finished()
                self._check_published()
        except Exception:
            if not failing:
                raise
            logger.warning("the last checkpoint save did not finish either", exc_info=True)
        finally:
            self._log_errors.detach()
            try:
                self.manager.close()
            except Exception:  # its waits re-raise a failure already reported above
                if not failing:
                    raise
                logger.debug("closing the checkpoint manager", exc_info=True)

    def _check_published(self) -> None:
        """OSError when the last save started (and waited for) is not complete on disk: Orbax logs
        some failures of its writer threads without raising them (the save's finalizer catches what
        it finds first), so the directory is the authority. The error number is the one Orbax's log
        carried (`_OrbaxWriteErrors`), else EIO."""
        if self._started is None:
            return
        import orbax.checkpoint as ocp

        started, self._started = self._started, None
        path = os.path.join(self.directory, str(started))
        if os.path.isdir(path) and ocp.step.is_checkpoint_finalized(path):
            return
        number = self._log_errors.number or errno.EIO
        raise OSError(number, f"the save of step {started} was not published: {os.strerror(number)}")

    @contextlib.contextmanager
    def _write_errors(self):
        """A save that failed to write (a full disk: TensorStore reports it as a ValueError carrying the
        OS error code, Orbax may wrap it) as one OSError that names the directory and the checkpoint a
        rerun resumes from."""
        try:
            yield
        except Exception as error:
            from weights.write_errors import write_error_number

            number = write_error_number(error)
            if number is None:
                raise
            self._started = None
            try:
                self.manager.reload()  # what is on disk, not what the manager believed it had started
                latest = self.manager.latest_step()
                resume = f"the checkpoint of step {latest} is whole" if latest is not None else "no checkpoint is whole"
            except Exception:  # the write error is the one to report
                resume = "the latest whole checkpoint could not be listed"
            raise OSError(number, f"saving a training checkpoint in {self.directory} failed: {os.strerror(number)} "
                                  f"(a full disk?); {resume}, and the same command resumes from it once there is "
                                  f"room") from error

