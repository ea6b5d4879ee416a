"""The fault-injection seam (`clover_jax.training.faults`): nothing happens until a test injects a
handler; a handler sees every point with its step until it is removed; `kill_at` kills at its own
point and step only; unknown points are refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clover_jax.training import faults


def test_a_handler_sees_each_point_until_it_is_removed():
    seen = []
    faults.reached("step", 1)  # no handler: nothing happens
    remove = faults.inject(lambda point, step: seen.append((point, step)))
    try:
        faults.reached("step", 2)
        faults.reached("save", 2)
    finally:
        remove()
    faults.reached("step", 3)
    assert seen == [("step", 2), ("save", 2)]


def test_an_unknown_point_is_refused():
    with pytest.raises(ValueError, match="unknown fault point 'saving': the run reports step, save"):
        faults.reached("saving", 1)
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.kill_at("saving", 1)


KILL = """
import sys
from clover_jax.training import faults

faults.inject(faults.kill_at("save", 4))
for point, step in (("step", 4), ("save", 3), ("save", 4)):
    print(point, step, flush=True)
    faults.reached(point, step)
print("alive")
"""


def test_kill_at_kills_the_process_at_its_point_and_step_only():
    killed = subprocess.run([sys.executable, "-c", KILL], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    assert killed.stdout.split("\n")[:-1] == ["step 4", "save 3", "save 4"]
