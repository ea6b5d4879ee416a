"""A full disk while writing weights: the write fails with an error that says what was being written
where, and leaves the source and what was there before untouched.

The disk is filled for one subprocess by `RLIMIT_FSIZE` (no file it writes may grow past a few
kilobytes; SIGXFSZ ignored, so a write fails with EFBIG as on a full disk rather than killing the
process). Orbax writes through TensorStore, in C++, which a Python patch could not reach; the
limit reaches it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 64 << 10  # bytes per file: config and JSON files fit, the tensors do not

RUN = """
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
what, source, target, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from clover_jax.core.config import CloverConfig
from weights.loader import load_params
from weights.orbax_checkpoint import convert_to_orbax
from weights.writer import save_params
config = CloverConfig.from_pretrained(source)
params = load_params(source, config, progress=False)[0] if what == "save" else None
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    if what == "convert":
        convert_to_orbax(source, target, progress=False, overwrite=True)
    else:
        save_params(params, config, target)
    print(json.dumps({"error": None}))
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
"""


def _digest(directory: str) -> dict[str, str]:
    digests = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                digests[os.path.relpath(path, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return digests


def _run(what: str, source: str, target: str) -> dict:
    environment = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get(
        "PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", RUN, what, source, target, str(LIMIT)], capture_output=True,
                          text=True, timeout=600, env=environment, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("what", ["convert", "save"])
def test_a_full_disk_fails_the_write_clearly_and_keeps_the_source_and_the_previous_output(clover_checkpoint,
                                                                                          tmp_path, what):
    from weights.orbax_checkpoint import convert_to_orbax

    source = str(tmp_path / "source")
    shutil.copytree(clover_checkpoint, source)
    target = str(tmp_path / "out")
    if what == "convert":  # an earlier conversion, which overwrite=True would replace on success
        convert_to_orbax(source, target, progress=False)
    else:  # an earlier trained model in the output directory
        shutil.copytree(clover_checkpoint, target)
    before_source, before_target = _digest(source), _digest(target)
    result = _run(what, source, target)
    assert result["error"] == "OSError", result
    assert "File too large" in result["message"] or "No space" in result["message"], result
    assert target in result["message"] or os.path.realpath(target) in result["message"], result
    assert _digest(source) == before_source
    assert _digest(target) == before_target  # the previous output, bit for bit
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]  # no staging left beside it
