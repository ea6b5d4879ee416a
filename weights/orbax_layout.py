"""How an Orbax directory written by `weights.convert_to_orbax` is recognised, without importing
Orbax (whose import costs a quarter of a second at every start)."""

from __future__ import annotations

import os

MANIFEST = "clover_orbax.json"
PARAMS_DIR = "params"


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` is a directory made (or being made) by `convert_to_orbax`: it holds the
    manifest or the Orbax parameter directory. Whether it is complete is checked on loading."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isdir(os.path.join(path, PARAMS_DIR))
