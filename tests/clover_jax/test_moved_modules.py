"""Module paths and names from before the layers still work for one release, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import sys

import pytest

from clover_jax._moved import MOVED


@pytest.mark.parametrize("old", ["clover_jax.model", "clover_jax.tokenization", "clover_jax.sharding"])
def test_an_old_module_path_warns_and_is_the_same_module(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__spec__.name == MOVED[old]  # the module keeps its own spec


def test_every_moved_path_names_an_existing_module():
    for new in MOVED.values():
        importlib.import_module(new)


def test_mesh_plan_is_the_old_name_of_mesh_sharding():
    import clover_jax
    from clover_jax.parallel import sharding

    with pytest.warns(DeprecationWarning, match="MeshPlan is now MeshSharding"):
        assert sharding.MeshPlan is clover_jax.MeshSharding
