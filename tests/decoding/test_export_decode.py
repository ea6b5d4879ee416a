"""The whole compiled decoders (block diffusion and autoregressive) lower for TPU and CUDA with the
Pallas kernels, at Clover-35B's layer shapes (two layer groups), on a mesh of 8 fake devices.

A kernel that lowers alone can fail inside `scan`, `while_loop` or `shard_map` (seen: megablox
inside shard_map needed `check_vma=False`; a Pallas custom call on a sharded array cannot be
partitioned by XLA and must run inside shard_map). The export runs in a subprocess
(`export_decode_run.py`), because the fake device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.decoding import export_decode_run


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export") / "exports.json")
    environment = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
                       OMP_NUM_THREADS="1", CLOVER_JAX_CACHE_DIR="")
    subprocess.run([sys.executable, "-m", "tests.decoding.export_decode_run", out], check=True, env=environment,
                   timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with open(out) as handle:
        return json.load(handle)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("loop", ["block_diffusion", "autoregressive"])
def test_the_whole_decoder_exports_with_the_kernels_on_a_mesh(exports, platform, loop):
    result = exports[f"{platform}/{loop}"]
    assert result["platforms"] == [platform]
    assert all(count > 0 for count in result["custom_calls"].values()), result["custom_calls"]
    assert result["shard_map"]  # the routed experts and the GDN kernel run per device
    batch = export_decode_run.BATCH
    if loop == "block_diffusion":  # tokens [b, max_blocks, B], ..., nfe [b]
        assert result["out_shapes"][0] == [batch, export_decode_run.MAX_BLOCKS, export_decode_run.BLOCK]
    else:  # tokens [b, max_new_tokens], lengths [b], nfe [b]
        assert result["out_shapes"] == [[batch, 64], [batch], [batch]]
