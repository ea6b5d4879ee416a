"""The serving engine on a mesh of 8 fake CPU devices (experts over 4, heads over 2) decodes what
`generate` decodes on that mesh, for every mode and requests that join a lane
mid-flight, and with its prefix cache (a turn restored from the last one's cached prefix); a mesh
with a data axis is refused before anything compiles."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from tests.clover_jax.parallel.test_sharding import _environment
from tests.decoding import engine_mesh_run


def test_the_engine_on_a_mesh_equals_generate_on_it(small_clover_checkpoint, tmp_path):
    out = tmp_path / "engine_mesh.json"
    subprocess.run([sys.executable, engine_mesh_run.__file__, small_clover_checkpoint, str(out), "--mesh=1,4,2"],
                   check=True, env=_environment(8), timeout=600)
    record = json.loads(out.read_text())
    assert record["mesh"] == {"data": 1, "expert": 4, "tensor": 2}
    assert record["joined_mid_flight"]
    assert record["auto"] == {"data": 1, "expert": 8, "tensor": 1}  # the plan's: 8 experts over 8 devices
    assert [one["mode"] for one in record["requests"]] == engine_mesh_run.MODES
    for one in record["requests"]:
        assert one["error"] is None
        assert (one["engine"], one["nfe"][0]) == (one["generate"], one["nfe"][1]), one
        assert len(one["engine"]) > 1
    # the prefix cache on the mesh: the second turn restores at least the first turn's grid-aligned
    # prompt (8 of its 10 tokens; more where the first turn's response ran on along the transcript)
    # and decodes what generate decodes on the mesh without any cache
    assert [one["mode"] for one in record["prefix_cache"]] == engine_mesh_run.PREFIX_MODES
    for one in record["prefix_cache"]:
        assert one["error"] is None and one["cached_tokens"] >= 8 and one["cached_tokens"] % 4 == 0, one
        assert (one["engine"], one["nfe"]) == (one["generate"], one["generate_nfe"]), one


def test_a_mesh_with_a_data_axis_is_refused(small_clover_checkpoint):
    from jax.sharding import AbstractMesh

    from clover_jax.core.config import CloverConfig
    from clover_jax.parallel.sharding import MESH_AXES, MeshSharding
    from decoding.engine import Engine

    config = CloverConfig.from_pretrained(small_clover_checkpoint)
    model = types.SimpleNamespace(config=config, mesh_sharding=MeshSharding(AbstractMesh((2, 4, 1), MESH_AXES), config))
    with pytest.raises(ValueError, match="data axis is 1"):
        Engine(model, max_running=2)
