"""The test seam for fault injection: named points of a training run where a test may act — kill
the process, fill the disk — to check what a rerun recovers.

    from clover_jax.training import faults
    remove = faults.inject(faults.kill_at("save", 4))  # SIGKILL once step 4's save has started
    ...
    remove()

The points (`POINTS`), each reported with the step it belongs to:

* "step": a train step has been dispatched and its result not read yet (`loop.run_loop`; the step's
  number counts from 1);
* "save": an asynchronous checkpoint save has started and is not finished, so not published
  (`checkpointing.Saver.maybe_save`).

The run reports each point to `reached`, which does nothing until a test injects a handler. A test
that kills a run injects in the process it kills before starting the run: tests/training/
test_finetune.py runs `clover-jax train` through a three-line script that does.
"""

from __future__ import annotations

import os
import signal
from typing import Callable

POINTS = ("step", "save")

Handler = Callable[[str, int], None]
_handlers: list[Handler] = []


def _check(point: str) -> None:
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}: the run reports {', '.join(POINTS)}")


def reached(point: str, step: int) -> None:
    """The run has reached `point` at `step`: every injected handler is called with both."""
    _check(point)
    for handler in tuple(_handlers):
        handler(point, step)


def inject(handler: Handler) -> Callable[[], None]:
    """Call `handler(point, step)` at every point the run reaches from now on; returns what removes it."""
    _handlers.append(handler)
    return lambda: _handlers.remove(handler)


def kill_at(point: str, step: int) -> Handler:
    """A handler that sends this process SIGKILL at `point` of `step` (nothing is flushed or closed,
    as when a machine is lost)."""
    _check(point)

    def kill(reached_point: str, reached_step: int) -> None:
        if (reached_point, reached_step) == (point, step):
            os.kill(os.getpid(), signal.SIGKILL)

    return kill
