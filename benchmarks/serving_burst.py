"""Serving: does any request wait on a compile after `Engine.precompile` (`clover-jax serve --precompile`)?

In a fresh process with an empty compilation cache (so that nothing was compiled before): load the
bundled model, start the engine (16 slots), precompile its set (block diffusion at the checkpoint's
block size, greedy and sampled, every lane size up to 16 and cache bucket up to `--max-context`),
then time, each over distinct prompts:

  * the first burst: 16 requests submitted at once, one by one as 16 clients would (wall time until
    the last finishes);
  * later bursts of the same shape (median of `--later`);
  * the same kind of requests one by one (16 in turn, each waiting for the last).

The context is 128 positions (buckets 64 and 128: the bundled requests need 64 rows): at 512 the
set was 184 programs (192 now), whose machine code on a CPU passed Linux's 65,530 memory mappings per process
and crashed XLA half an hour in (`decoding.engine.precompile.check_mapping_headroom` now stops
before that).

Target: first burst <= 1.15 x a later burst. Reported beside it: first burst over one by one, the
programs precompiled and the seconds it took, and programs compiled on demand during the bursts.
`run()` starts the fresh process and returns its JSON record; `python benchmarks/serving_burst.py`
prints it.
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


def run(max_context: int = 128, later: int = 2, max_new_tokens: int = 32) -> dict:
    """The measurement in a fresh process with its own empty compilation cache."""
    with tempfile.TemporaryDirectory(prefix="clover-bench-burst-cache-") as cache:
        environment = dict(os.environ, CLOVER_JAX_CACHE_DIR=cache)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--max-context", str(max_context),
                              "--later", str(later), "--new", str(max_new_tokens)],
                             env=environment, check=True, capture_output=True, text=True, timeout=3600)
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


def child(max_context: int, later: int, max_new_tokens: int) -> dict:
    from benchmarks.common import setup_environment

    setup_environment()
    import numpy as np

    from benchmarks.engine_traffic import BUNDLED_DIR, bundled_requests
    from clover_jax import CloverModel
    from decoding.engine import Engine, precompile

    requests = bundled_requests(BURST * (later + 2), max_new_tokens)
    groups = [requests[i * BURST:(i + 1) * BURST] for i in range(later + 2)]
    model = CloverModel.from_pretrained(BUNDLED_DIR, progress=False)
    with Engine(model, max_running=BURST, max_queue=4 * BURST, max_context=max_context) as engine:
        done = engine.precompile(["diffusion"])
        after_precompile = precompile.compiled_programs()
        first = burst(engine, groups[0])
        on_demand_first = engine.compiled_on_demand
        laters = [burst(engine, group) for group in groups[1:-1]]
        alone = one_by_one(engine, groups[-1])
        record = {
            "burst": BURST, "max_context": max_context, "max_new_tokens": max_new_tokens,
            "precompiled_programs": done.programs, "precompile_seconds": done.seconds, "precompiled_set": done.covers,
            "planned_programs": precompile.planned_programs(
                modes=["diffusion"], block_sizes=engine.block_sizes, max_running=BURST, max_context=max_context,
                chunk_size=engine.prefill_budget, prefix_cache=engine.prefix_cache is not None)["total"],
            "first_burst_s": first, "later_bursts_s": laters, "one_by_one_s": alone,
            "first_over_later": first / float(np.median(laters)), "first_over_one_by_one": first / alone,
            "later_over_one_by_one": float(np.median(laters)) / alone,
            "compiled_on_demand_first_burst": on_demand_first, "compiled_on_demand_total": engine.compiled_on_demand,
            "programs_compiled_after_precompile": precompile.compiled_programs() - after_precompile,
        }
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help="measure in this process (its cache must be empty)")
    parser.add_argument("--max-context", type=int, default=128)
    parser.add_argument("--later", type=int, default=2)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args(argv)
    record = child(args.max_context, args.later, args.new) if args.child else run(args.max_context, args.later,
                                                                                  args.new)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
