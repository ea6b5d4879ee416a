"""Checkpoint load benchmark: `weights.load_params` against a plain read of the same file.

What it does, in one run:

1. Writes a synthetic bfloat16 checkpoint in Hugging Face layout (`config.json` with
   `"model_type": "qwen3_5_moe_text"` and one `model.safetensors`) of about `--gigabytes` GB.
   The config keeps Qwen3.6's layout (3 linear-attention + 1 full-attention layers repeating,
   routed experts stored one tensor per expert, a shared expert, an untied head); its depth is
   chosen so the file comes closest to the requested size, in steps of one 4-layer group
   (about 0.25 GB; the smallest checkpoint is one group, about 0.38 GB). Tensor names and shapes
   come from `weights.name_table.expected_placements`, so the file is exactly what the loader
   expects (optional tensors that take defaults when absent are left out, as in a real
   Qwen3.5/3.6 checkpoint).
2. Reads the file once to warm the page cache (dropping the cache needs root), so that both
   measurements below read from memory, not from disk: the JSON says `"page_cache": "warm"`.
3. Alternates, `--repetitions` times (default 3):
   * raw read: the whole file through `readinto` of a reusable 64 MiB buffer, in this process;
   * load: `load_params(directory, config, dtype=None, progress=False)` plus
     `jax.block_until_ready`, in a fresh subprocess, which also reports its resident memory:
     a baseline taken after importing JAX and the loader and initialising the JAX backend,
     and its peak (`ru_maxrss`) at the end.

It prints one JSON object on stdout (logs go to stderr). How to read it:

* `raw_read_gbps` is the ceiling: bytes per second that plain Python file reads reach from
  the page cache into a reused 64 MiB buffer. `raw_read_into_fresh_memory_gbps` reads the
  whole file, in a fresh process, into newly allocated memory — what any loader has to do,
  since the parameters live in new memory. On the VMs of this project the first touch of new
  memory is the bottleneck (measured about 0.3 GB/s, against ~10 GB/s into a reused buffer),
  so the two differ by an order of magnitude. `load_gbps` is checkpoint bytes / load wall
  time; `load_vs_raw` and `load_vs_raw_into_fresh_memory` divide it by each (target >= 0.8).
* `peak_rss_over_checkpoint` = peak resident memory of the loading process / checkpoint bytes
  (target <= 1.3, `peak_rss_over_checkpoint_max`): the loaded parameters alone are 1.0x, so
  anything above is loader overhead plus the JAX/Python baseline.
  `peak_rss_over_baseline_over_checkpoint` removes the baseline. Resident memory counts
  file pages mapped into the process (safetensors reads through mmap) as well as anonymous
  memory; the child reports both at the end of the load (`rss_file_bytes`, `rss_anon_bytes`).
  The loader reads with `preadv` into its buffers, so no file pages are mapped.
* `targets_met` says whether each target holds for the medians.

Usage: `PYTHONPATH=. python benchmarks/load.py [--gigabytes 1.0] [--directory DIR] [--keep]`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
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
if REPO_ROOT not in sys.path:  # `python benchmarks/load.py` without installing the package
    sys.path.insert(0, REPO_ROOT)

logger = logging.getLogger("benchmarks.load")

GB = 1e9
READ_CHUNK_BYTES = 64 * 1024 * 1024
TARGETS = {"peak_rss_over_checkpoint_max": 1.3, "load_vs_raw_min": 0.8}

# Qwen3.6's shape ratios at a width where ~1 GB needs a few dozen layers (and thousands of
# per-expert tensors, as a real checkpoint has). `num_hidden_layers` / `layer_types` are set
# by `config_for_size`.
BASE_CONFIG = dict(
    model_type="qwen3_5_moe_text", vocab_size=32768, hidden_size=1024, num_attention_heads=8,
    num_key_value_heads=2, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4,
    moe_intermediate_size=256, shared_expert_intermediate_size=512, num_experts=32,
    num_experts_per_tok=4, tie_word_embeddings=False, eos_token_id=1, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    dtype="bfloat16",
)
LAYER_PATTERN = ["linear_attention"] * 3 + ["full_attention"]


# ---------------------------------------------------------------- the synthetic checkpoint
def config_dict(num_groups: int) -> dict:
    """BASE_CONFIG with `num_groups` repetitions of LAYER_PATTERN."""
    layer_types = LAYER_PATTERN * num_groups
    return dict(BASE_CONFIG, num_hidden_layers=len(layer_types), layer_types=layer_types)


def checkpoint_shapes(raw_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name the loader requires for this config.json dict, with its checkpoint shape."""
    from clover_jax.core.config import CloverConfig
    from weights.name_table import expected_placements

    placements = expected_placements(CloverConfig.from_dict(raw_config))
    # Optional tensors (Clover block-mode ones, which take defaults when absent) are not in a
    # Qwen3.5/3.6 checkpoint, so they are not written.
    return {name: tuple(placement.shape) for name, placement in placements.items()
            if getattr(placement, "default", None) is None}


def bf16_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes.values():
        count = 1
        for size in shape:
            count *= size
        total += 2 * count
    return total


def config_for_size(target_bytes: float) -> dict:
    """The config.json dict whose checkpoint is closest to `target_bytes` (at least one layer group)."""
    one, two = bf16_bytes(checkpoint_shapes(config_dict(1))), bf16_bytes(checkpoint_shapes(config_dict(2)))
    per_group, fixed = two - one, 2 * one - two
    return config_dict(max(1, round((target_bytes - fixed) / per_group)))


def write_checkpoint(directory: str, raw_config: dict, seed: int = 0) -> tuple[str, int]:
    """Write config.json and model.safetensors (random bfloat16) into `directory`.

    Returns the safetensors path and its tensor count. `save_file` needs every tensor in
    memory at once (about the checkpoint's size); it is all freed before returning.
    """
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(raw_config, handle, indent=2)
    rng = np.random.default_rng(seed)
    tensors = {name: (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
               for name, shape in checkpoint_shapes(raw_config).items()}
    path = os.path.join(directory, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    count = len(tensors)
    del tensors
    gc.collect()
    flush_to_disk(path)
    return path, count


def flush_to_disk(path: str) -> None:
    """fsync, so that writeback of the new file does not run during the measurements."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- measurements
def read_whole_file(path: str, buffer: bytearray) -> int:
    """Read `path` start to end into `buffer` (reused), returning the bytes read."""
    view = memoryview(buffer)
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(view)
            if not count:
                return total
            total += count


def measure_raw_read(path: str, buffer: bytearray) -> float:
    """GB/s of one plain sequential read of `path`."""
    started = time.perf_counter()
    count = read_whole_file(path, buffer)
    return count / (time.perf_counter() - started) / GB


def child_raw_read_fresh(path: str) -> None:
    """In a fresh process: read `path` into newly allocated memory (where a loader must put it)."""
    import numpy as np

    buffer = np.empty(os.path.getsize(path), np.uint8)
    view = memoryview(buffer)
    started = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while total < len(buffer):
            count = handle.readinto(view[total:total + READ_CHUNK_BYTES])
            if not count:
                break
            total += count
    print(json.dumps({"gbps": total / (time.perf_counter() - started) / GB}))


def measure_raw_read_fresh_in_subprocess(path: str) -> float:
    completed = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-raw-fresh", path],
                               stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])["gbps"]


def measure_load_in_subprocess(directory: str) -> dict:
    """Run `child_load` in a fresh interpreter; returns its JSON report."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    completed = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-load", directory],
                               env=env, stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_breakdown_bytes() -> dict:
    """RssAnon / RssFile / VmHWM of this process now, in bytes (Linux /proc)."""
    wanted = {"RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes", "VmHWM": "vm_hwm_bytes"}
    found = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in wanted:
                found[wanted[key]] = int(value.split()[0]) * 1024
    return found


def child_load(directory: str) -> None:
    """In a fresh process: load the checkpoint once, print timing and memory as one JSON line."""
    import jax

    from clover_jax.core.config import CloverConfig
    from weights import load_params

    config = CloverConfig.from_pretrained(directory)
    jax.devices()  # initialise the backend before the baseline, so it is not counted as loading
    baseline = current_rss_bytes()
    started = time.perf_counter()
    params, report = load_params(directory, config, dtype=None, progress=False)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    print(json.dumps(dict(seconds=seconds, bytes_read=report.bytes_read, baseline_rss_bytes=baseline,
                          peak_rss_bytes=peak, loader_seconds=report.seconds, dtype=report.dtype,
                          **rss_breakdown_bytes())))


def warm_page_cache(path: str, buffer: bytearray) -> None:
    started = time.perf_counter()
    read_whole_file(path, buffer)
    logger.info("warm-up read of %s took %.2fs", path, time.perf_counter() - started)


def alternate_measurements(directory: str, path: str, checkpoint_bytes: int, repetitions: int):
    """raw, raw into fresh memory, load, ...; returns (raw GB/s, fresh raw GB/s, load child reports)."""
    buffer = bytearray(READ_CHUNK_BYTES)
    warm_page_cache(path, buffer)
    raw, fresh, loads = [], [], []
    for repetition in range(repetitions):
        raw.append(measure_raw_read(path, buffer))
        fresh.append(measure_raw_read_fresh_in_subprocess(path))
        logger.info("[%d/%d] raw read: %.2f GB/s into a reused buffer, %.2f GB/s into fresh memory",
                    repetition + 1, repetitions, raw[-1], fresh[-1])
        loads.append(measure_load_in_subprocess(directory))
        logger.info("[%d/%d] load: %.2f GB/s (%.2fs), peak RSS %.2f GB (baseline %.2f GB)",
                    repetition + 1, repetitions, checkpoint_bytes / loads[-1]["seconds"] / GB,
                    loads[-1]["seconds"], loads[-1]["peak_rss_bytes"] / GB, loads[-1]["baseline_rss_bytes"] / GB)
    return raw, fresh, loads


# ---------------------------------------------------------------- the result
def summarise(raw_config: dict, checkpoint_bytes: int, num_tensors: int, raw: list[float],
              fresh: list[float], loads: list[dict]) -> dict:
    import jax

    load_gbps = [checkpoint_bytes / sample["seconds"] / GB for sample in loads]
    peaks = [sample["peak_rss_bytes"] for sample in loads]
    over_baseline = [sample["peak_rss_bytes"] - sample["baseline_rss_bytes"] for sample in loads]
    raw_median, load_median = statistics.median(raw), statistics.median(load_gbps)
    peak_median, over_baseline_median = statistics.median(peaks), statistics.median(over_baseline)
    load_vs_raw = load_median / raw_median
    fresh_median = statistics.median(fresh)
    load_vs_fresh = load_median / fresh_median
    peak_over_checkpoint = peak_median / checkpoint_bytes
    return {
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_gigabytes": round(checkpoint_bytes / GB, 3),
        "num_tensors": num_tensors,
        "dtype": "bfloat16",
        "config": {"hidden_size": raw_config["hidden_size"], "layers": raw_config["num_hidden_layers"],
                   "experts": raw_config["num_experts"], "moe_intermediate_size": raw_config["moe_intermediate_size"],
                   "vocab_size": raw_config["vocab_size"]},
        "page_cache": "warm",
        "raw_read_gbps": {"median": raw_median, "samples": raw},
        "load_gbps": {"median": load_median, "samples": load_gbps},
        "raw_read_into_fresh_memory_gbps": {"median": fresh_median, "samples": fresh},
        "load_vs_raw": load_vs_raw,
        "load_vs_raw_into_fresh_memory": load_vs_fresh,
        "peak_rss_bytes": {"median": peak_median, "samples": peaks},
        "baseline_rss_bytes": {"median": statistics.median(s["baseline_rss_bytes"] for s in loads),
                               "samples": [s["baseline_rss_bytes"] for s in loads]},
        "peak_rss_over_baseline_bytes": {"median": over_baseline_median, "samples": over_baseline},
        "peak_rss_over_checkpoint": peak_over_checkpoint,
        "peak_rss_over_baseline_over_checkpoint": over_baseline_median / checkpoint_bytes,
        "rss_at_end_of_load": {key: statistics.median(s[key] for s in loads)
                               for key in ("rss_anon_bytes", "rss_file_bytes") if key in loads[0]},
        "targets": TARGETS,
        "targets_met": {"peak_rss_over_checkpoint": peak_over_checkpoint <= TARGETS["peak_rss_over_checkpoint_max"],
                        "load_vs_raw": load_vs_raw >= TARGETS["load_vs_raw_min"],
                        "load_vs_raw_into_fresh_memory": load_vs_fresh >= TARGETS["load_vs_raw_min"]},
        "jax_version": jax.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def remove_checkpoint(directory: str, whole_directory: bool) -> None:
    """Delete what `write_checkpoint` wrote; a user-given directory itself goes only if left empty."""
    if whole_directory:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for name in ("config.json", "model.safetensors"):
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except OSError:  # not empty: it held other files before
        pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0, help="checkpoint size to write (default 1.0)")
    parser.add_argument("--directory", help="where to write the checkpoint (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    parser.add_argument("--repetitions", type=int, default=3, help="raw/load pairs to measure (default 3)")
    parser.add_argument("--child-load", metavar="DIR", help=argparse.SUPPRESS)  # internal: one load, in a subprocess
    parser.add_argument("--child-raw-fresh", metavar="FILE", help=argparse.SUPPRESS)  # internal: one fresh read
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child_load:
        child_load(args.child_load)
        return
    if args.child_raw_fresh:
        child_raw_read_fresh(args.child_raw_fresh)
        return
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    directory = args.directory or tempfile.mkdtemp(prefix="clover-load-bench-")
    try:
        raw_config = config_for_size(args.gigabytes * GB)
        started = time.perf_counter()
        path, num_tensors = write_checkpoint(directory, raw_config)
        checkpoint_bytes = os.path.getsize(path)
        logger.info("wrote %s: %.3f GB, %d tensors, %d layers in %.1fs", path, checkpoint_bytes / GB,
                    num_tensors, raw_config["num_hidden_layers"], time.perf_counter() - started)
        raw, fresh, loads = alternate_measurements(directory, path, checkpoint_bytes, args.repetitions)
        print(json.dumps(summarise(raw_config, checkpoint_bytes, num_tensors, raw, fresh, loads), indent=2))
    finally:
        if args.keep:
            logger.info("kept the checkpoint in %s", directory)
        else:
            remove_checkpoint(directory, whole_directory=args.directory is None)


if __name__ == "__main__":
    main()
