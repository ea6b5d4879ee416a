"""Sharded load benchmark: Hugging Face safetensors -> mesh against Orbax -> mesh, and the host
memory of each process when two processes share the load.

What it does, in one run:

1. Writes the synthetic bfloat16 checkpoint of `benchmarks/load.py` (~`--gigabytes` GB, 32
   experts per layer) and converts it with `weights.convert_to_orbax`.
2. Alternates `--repetitions` times, each in a fresh process with 8 fake CPU devices
   (`--xla_force_host_platform_device_count=8`), one load of each format onto the
   (data, expert, tensor) = (1, 8, 1) mesh with the default sharding rules.
3. Starts two processes of 4 devices each, joined by `jax.distributed` on 127.0.0.1, that load
   the checkpoint onto the 8-device mesh together (each reads only its devices' slices), and
   reports each process's peak resident memory over the checkpoint size.

On the CPU backend a device's memory is host memory: a process's peak includes the shards its
own devices hold. With experts over 8 devices and the rest replicated, one process holding 4 of
8 devices holds about half the experts and a full copy of everything else per device.

Prints one JSON object. Usage: `PYTHONPATH=. python benchmarks/sharded_load.py [--gigabytes 0.3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from benchmarks.load import config_for_size, current_rss_bytes, write_checkpoint  # noqa: E402


def child_load(kind: str, directory: str, process: int, processes: int, port: int) -> None:
    """One load onto the (1, 8, 1) mesh; prints seconds, bytes and memory as one JSON line."""
    import jax

    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                                   process_id=process)
    from clover_jax import MeshSharding, make_mesh
    from clover_jax.core.config import CloverConfig
    from weights import load_orbax_params, load_params

    config = CloverConfig.from_pretrained(directory)
    mesh_sharding = MeshSharding(make_mesh(1, 8, 1), config)
    baseline = current_rss_bytes()
    started = time.perf_counter()
    if kind == "hf":
        params, report = load_params(directory, config, sharding_for=mesh_sharding.param_sharding, progress=False)
    else:
        params, report = load_orbax_params(directory, config, sharding_for=mesh_sharding.param_sharding, progress=False)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(seconds=seconds, bytes_read=report.bytes_read, baseline_rss_bytes=baseline,
                          peak_rss_bytes=peak)))


def _environment(devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return env


def _child(kind: str, directory: str, devices: int = 8, process: int = 0, processes: int = 1, port: int = 0):
    command = [sys.executable, os.path.abspath(__file__), "--child", kind, directory, str(process), str(processes),
               str(port)]
    return subprocess.Popen(command, env=_environment(devices), stdout=subprocess.PIPE, text=True)


def _result(popen) -> dict:
    out, _ = popen.communicate(timeout=1800)
    if popen.returncode:
        raise RuntimeError(f"child failed with exit status {popen.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=0.3)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, directory, process, processes, port = args.child
        child_load(kind, directory, int(process), int(processes), int(port))
        return

    from weights import convert_to_orbax

    root = tempfile.mkdtemp(prefix="clover-sharded-load-")
    try:
        hf_dir, orbax_dir = os.path.join(root, "hf"), os.path.join(root, "orbax")
        path, _ = write_checkpoint(hf_dir, config_for_size(args.gigabytes * 1e9))
        checkpoint_bytes = os.path.getsize(path)
        convert_to_orbax(hf_dir, orbax_dir, progress=False)
        samples = {"hf": [], "orbax": []}
        for _ in range(args.repetitions):
            for kind, directory in (("hf", hf_dir), ("orbax", orbax_dir)):
                samples[kind].append(_result(_child(kind, directory)))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        two = [_child("hf", hf_dir, 4, i, 2, port) for i in range(2)]
        per_process = [_result(p) for p in two]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    seconds = {kind: statistics.median(s["seconds"] for s in runs) for kind, runs in samples.items()}
    print(json.dumps({
        "checkpoint_bytes": checkpoint_bytes,
        "mesh": {"data": 1, "expert": 8, "tensor": 1},
        "hf_to_mesh_seconds": {"median": seconds["hf"], "samples": [s["seconds"] for s in samples["hf"]]},
        "orbax_to_mesh_seconds": {"median": seconds["orbax"], "samples": [s["seconds"] for s in samples["orbax"]]},
        "orbax_over_hf_seconds": seconds["orbax"] / seconds["hf"],
        "one_process_peak_rss_over_checkpoint": {
            kind: statistics.median(s["peak_rss_bytes"] / checkpoint_bytes for s in runs)
            for kind, runs in samples.items()},
        "two_processes": [{"bytes_read_over_checkpoint": p["bytes_read"] / checkpoint_bytes,
                           "peak_rss_over_checkpoint": p["peak_rss_bytes"] / checkpoint_bytes,
                           "peak_rss_over_baseline_over_checkpoint":
                               (p["peak_rss_bytes"] - p["baseline_rss_bytes"]) / checkpoint_bytes}
                          for p in per_process],
    }, indent=2))


if __name__ == "__main__":
    main()
