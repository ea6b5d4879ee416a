"""Serving: what `clover-jax serve --precompile` with default flags costs on this CPU, and does any
request wait on a compile after it?

In a fresh process with an empty compilation cache (so that nothing was compiled before): load the
model, start the engine `clover-jax serve` starts with its default flags
(`clover_jax.api.serving.server.start_engine`: 8 running, 64 queued, the model's whole context,
block sizes the checkpoint's, 16, 32 and 64, the prefix cache on), precompile every mode at every
served block size (`--precompile`), then time, each over distinct prompts (no two share a
32-token chunk, so that the prefix cache finds nothing):

  * the first burst: 16 requests submitted at once, one by one as 16 clients would (wall time until
    the last finishes; 8 run, 8 wait for a slot);
  * later bursts of the same shape (median of `--later`);
  * the same kind of requests one by one (16 in turn, each waiting for the last).

Two models: the bundled tiny Clover (its task's prompts, 13-16 tokens) and the medium random model
of `forward_cost.py` (random 32-64 token prompts). Reported per model: the programs precompiled
and the seconds it took, the memory mappings the process holds after it against Linux's limit
(`vm.max_map_count`: XLA on a CPU crashes past it), programs compiled on demand during the bursts,
and the bursts' times.

Targets: first burst <= 1.15 x a later burst; no program compiled after the precompile.
`run(model)` starts the fresh process and returns its JSON record; `python
benchmarks/serving_burst.py [--models bundled medium]` prints the records and the checks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BURST = 16
TARGET = 1.15
MODELS = ("bundled", "medium")


def run(model: str = "bundled", later: int = 4, max_new_tokens: int = 32) -> dict:
    """The measurement in a fresh process with its own empty compilation cache."""
    with tempfile.TemporaryDirectory(prefix="clover-bench-burst-cache-") as cache:
        environment = dict(os.environ, CLOVER_JAX_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", model, "--later", str(later),
                              "--new", str(max_new_tokens)],
                             env=environment, capture_output=True, text=True, timeout=3 * 3600)
    if out.returncode:
        raise RuntimeError(f"serving_burst ({model}) exited {out.returncode}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def burst(engine, requests) -> float:
    """Submit every request at once (one `submit` each, as concurrent clients do); seconds until the last finishes."""
    from benchmarks.engine_traffic import closed_loop

    return closed_loop(engine, requests, len(requests))["wall"]


def one_by_one(engine, requests) -> float:
    started = time.perf_counter()
    for request in requests:
        engine.run([request])
    return time.perf_counter() - started


def load(model: str, count: int, max_new_tokens: int, directory: str):
    """The model and `count` requests with distinct prompts."""
    from benchmarks.engine_traffic import BUNDLED_DIR, bundled_requests, random_requests
    from clover_jax import CloverModel

    if model == "bundled":
        return CloverModel.from_pretrained(BUNDLED_DIR, progress=False), bundled_requests(count, max_new_tokens)
    from benchmarks.common import write_random_checkpoint
    from benchmarks.forward_cost import MEDIUM

    path = write_random_checkpoint(directory, MEDIUM, seed=0)["clover"]
    return (CloverModel.from_pretrained(path, progress=False),
            random_requests(count, MEDIUM["vocab_size"], 64, max_new_tokens))


def child(model_name: str, later: int, max_new_tokens: int) -> dict:
    from benchmarks.common import setup_environment

    setup_environment()
    import numpy as np

    from clover_jax.api.serving.server import start_engine
    from decoding.engine import precompile
    from decoding.modes import MODES

    with tempfile.TemporaryDirectory(prefix="clover-bench-burst-model-") as directory:
        model, requests = load(model_name, BURST * (later + 2), max_new_tokens, directory)
        assert not shared_chunks([request.prompt for request in requests]), "the burst's prompts share a chunk"
        groups = [requests[i * BURST:(i + 1) * BURST] for i in range(later + 2)]
        with start_engine(model) as engine:
            done = engine.precompile()  # `clover-jax serve --precompile`: every mode, every served block size
            mappings = precompile.mapping_use()
            after_precompile = precompile.compiled_programs()
            first = burst(engine, groups[0])
            on_demand_first = engine.compiled_on_demand
            laters = [burst(engine, group) for group in groups[1:-1]]
            alone = one_by_one(engine, groups[-1])
            planned = precompile.planned_programs(
                modes=list(MODES), block_sizes=engine.block_sizes, max_running=engine.max_running,
                max_context=engine.max_context, chunk_size=engine.prefill_budget,
                prefix_cache=engine.prefix_cache is not None)
            return {
                "model": model_name, "burst": BURST, "max_new_tokens": max_new_tokens,
                "max_running": engine.max_running, "max_context": engine.max_context,
                "block_sizes": list(engine.block_sizes), "precompiled_programs": done.programs,
                "planned_programs": planned["total"], "planned_with_a_forward": planned["forward"],
                "precompile_seconds": done.seconds, "precompiled_set": done.covers,
                "memory_mappings": None if mappings is None else {"held": mappings[0], "limit": mappings[1]},
                "first_burst_s": first, "later_bursts_s": laters, "one_by_one_s": alone,
                "first_over_later": first / float(np.median(laters)), "first_over_one_by_one": first / alone,
                "later_over_one_by_one": float(np.median(laters)) / alone,
                "compiled_on_demand_first_burst": on_demand_first,
                "compiled_on_demand_total": engine.compiled_on_demand,
                "programs_compiled_after_precompile": precompile.compiled_programs() - after_precompile,
            }


def shared_chunks(prompts, grid: int = 32) -> int:
    """Grid-aligned prompt chunks that more than one prompt starts with (what a prefix cache would find)."""
    seen, shared = set(), 0
    for prompt in prompts:
        for end in range(grid, len(prompt) + 1, grid):
            key = tuple(prompt[:end])
            shared += key in seen
            seen.add(key)
    return shared


def checks_of(record: dict) -> list[dict]:
    from benchmarks.common import check

    name = record["model"]
    return [check(f"serving: first burst of 16 after serve --precompile / a later burst ({name})",
                  record["first_over_later"], TARGET, False,
                  note=f"first burst / one by one {record['first_over_one_by_one']:.2f}; "
                       f"{record['precompiled_programs']} programs precompiled in "
                       f"{record['precompile_seconds']:.0f} s"),
            check(f"serving: programs compiled after serve --precompile, during the bursts ({name})",
                  record["programs_compiled_after_precompile"], 0, False)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=MODELS, help="measure this model in this process (its cache must be empty)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--later", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.later, args.new)))
        return
    from benchmarks.common import emit, machine

    records = [run(model, args.later, args.new) for model in args.models]
    emit({"benchmark": "serving_burst", "records": records,
          "checks": [c for record in records for c in checks_of(record)], "machine": machine()})


if __name__ == "__main__":
    main()
