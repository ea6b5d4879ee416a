"""Load benchmark: Hugging Face safetensors -> device against an Orbax copy -> device.

What it does, in one run:

1. Writes the synthetic bfloat16 Qwen3.6-layout checkpoint of `benchmarks/load.py`
   (its `config_for_size` / `write_checkpoint`) of about `--gigabytes` GB (default 0.4).
2. Converts it with `weights.convert_to_orbax` in a fresh subprocess, recording the
   conversion's wall time and peak resident memory.
3. Reads every file of both directories once, so both loads read from a warm page cache.
4. Alternates, `--repetitions` times (default 3), one load of each in a fresh subprocess:
   `load_params(hf_dir, config)` and `load_orbax_params(orbax_dir, config)`, each followed by
   `jax.block_until_ready`. Each child reports its wall time, its resident memory after
   initialising JAX (baseline) and its peak (`ru_maxrss`).

It prints one JSON object (logs go to stderr). Per format: `seconds` and `gbps` (checkpoint
bytes / wall time; medians and samples), `peak_rss_over_checkpoint` (peak resident memory /
checkpoint bytes; the parameters alone are 1.0x on the CPU backend) and
`peak_rss_over_baseline_over_checkpoint` (the same without the JAX/Python baseline).
`orbax_over_hf_seconds` < 1 means the Orbax copy loads faster.

Usage: `PYTHONPATH=. python benchmarks/load_orbax.py [--gigabytes 0.4] [--repetitions 3]`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python benchmarks/load_orbax.py` without installing the package
    sys.path.insert(0, REPO_ROOT)

from benchmarks.load import (  # noqa: E402
    GB,
    READ_CHUNK_BYTES,
    config_for_size,
    current_rss_bytes,
    read_whole_file,
    rss_breakdown_bytes,
    write_checkpoint,
)

logger = logging.getLogger("benchmarks.load_orbax")

FORMATS = ("hf", "orbax")


# ---------------------------------------------------------------- children (fresh processes)
def child_load(kind: str, directory: str) -> None:
    """Load `directory` once as `kind` ("hf" or "orbax"); print timing and memory as one JSON line."""
    import jax

    from clover_jax.core.config import CloverConfig
    from weights import load_orbax_params, load_params

    config = CloverConfig.from_pretrained(directory)
    jax.devices()  # initialise the backend before the baseline, so it is not counted as loading
    baseline = current_rss_bytes()
    started = time.perf_counter()
    if kind == "hf":
        params, report = load_params(directory, config, progress=False)
    else:
        params, report = load_orbax_params(directory, config, progress=False)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    print(json.dumps(dict(seconds=seconds, bytes_read=report.bytes_read, baseline_rss_bytes=baseline,
                          peak_rss_bytes=peak, dtype=report.dtype, **rss_breakdown_bytes())))


def child_convert(hf_dir: str, out_dir: str) -> None:
    """Convert once; print wall time and memory as one JSON line."""
    import jax

    from weights import convert_to_orbax

    jax.devices()
    baseline = current_rss_bytes()
    started = time.perf_counter()
    manifest = convert_to_orbax(hf_dir, out_dir, progress=False)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(dict(seconds=seconds, bytes=manifest.bytes, baseline_rss_bytes=baseline, peak_rss_bytes=peak)))


def run_child(*args: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    completed = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env,
                               stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the run
def directory_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, files in os.walk(directory) for name in files)


def warm_page_cache(directories: list[str]) -> None:
    buffer = bytearray(READ_CHUNK_BYTES)
    for directory in directories:
        for root, _, files in os.walk(directory):
            for name in files:
                read_whole_file(os.path.join(root, name), buffer)


def summarise_loads(samples: list[dict], checkpoint_bytes: int) -> dict:
    seconds = [sample["seconds"] for sample in samples]
    peaks = [sample["peak_rss_bytes"] for sample in samples]
    over_baseline = [sample["peak_rss_bytes"] - sample["baseline_rss_bytes"] for sample in samples]
    return {
        "seconds": {"median": statistics.median(seconds), "samples": seconds},
        "gbps": checkpoint_bytes / statistics.median(seconds) / GB,
        "peak_rss_bytes": {"median": statistics.median(peaks), "samples": peaks},
        "peak_rss_over_checkpoint": statistics.median(peaks) / checkpoint_bytes,
        "peak_rss_over_baseline_over_checkpoint": statistics.median(over_baseline) / checkpoint_bytes,
        "rss_at_end_of_load": {key: statistics.median(sample[key] for sample in samples)
                               for key in ("rss_anon_bytes", "rss_file_bytes") if key in samples[0]},
    }


def measure(workdir: str, gigabytes: float, repetitions: int) -> dict:
    import jax

    hf_dir, orbax_dir = os.path.join(workdir, "hf"), os.path.join(workdir, "orbax")
    raw_config = config_for_size(gigabytes * GB)
    path, num_tensors = write_checkpoint(hf_dir, raw_config)
    checkpoint_bytes = os.path.getsize(path)
    logger.info("wrote %s: %.3f GB, %d tensors", path, checkpoint_bytes / GB, num_tensors)
    conversion = run_child("--child-convert", hf_dir, orbax_dir)
    logger.info("converted in %.1fs, peak RSS %.2f GB", conversion["seconds"], conversion["peak_rss_bytes"] / GB)
    warm_page_cache([hf_dir, orbax_dir])
    samples: dict[str, list[dict]] = {kind: [] for kind in FORMATS}
    for repetition in range(repetitions):
        for kind in FORMATS:
            samples[kind].append(run_child("--child-load", kind, hf_dir if kind == "hf" else orbax_dir))
            logger.info("[%d/%d] %s: %.2fs, peak RSS %.2f GB", repetition + 1, repetitions, kind,
                        samples[kind][-1]["seconds"], samples[kind][-1]["peak_rss_bytes"] / GB)
    loads = {kind: summarise_loads(samples[kind], checkpoint_bytes) for kind in FORMATS}
    return {
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_gigabytes": round(checkpoint_bytes / GB, 3),
        "orbax_directory_bytes": directory_bytes(orbax_dir),
        "num_tensors": num_tensors,
        "layers": raw_config["num_hidden_layers"],
        "dtype": "bfloat16",
        "page_cache": "warm",
        "repetitions": repetitions,
        "hf": loads["hf"],
        "orbax": loads["orbax"],
        "orbax_over_hf_seconds": loads["orbax"]["seconds"]["median"] / loads["hf"]["seconds"]["median"],
        "conversion": {"seconds": conversion["seconds"],
                       "peak_rss_over_checkpoint": conversion["peak_rss_bytes"] / checkpoint_bytes,
                       "peak_rss_over_baseline_over_checkpoint":
                           (conversion["peak_rss_bytes"] - conversion["baseline_rss_bytes"]) / checkpoint_bytes},
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=0.4, help="checkpoint size to write (default 0.4)")
    parser.add_argument("--repetitions", type=int, default=3, help="loads of each format (default 3)")
    parser.add_argument("--child-load", nargs=2, metavar=("KIND", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--child-convert", nargs=2, metavar=("HF_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child_load:
        child_load(*args.child_load)
        return
    if args.child_convert:
        child_convert(*args.child_convert)
        return
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    workdir = tempfile.mkdtemp(prefix="clover-load-orbax-bench-")
    try:
        print(json.dumps(measure(workdir, args.gigabytes, args.repetitions), indent=2))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
