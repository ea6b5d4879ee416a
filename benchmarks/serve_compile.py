"""Clover-35B's served set compiled for its documented accelerators from this CPU host: what
`clover-jax serve --precompile` costs there with a cold cache, and what each program needs.

For each documented serving command (docs/serving.md, "The engine's shapes"), the engine's served
set (`decoding.engine.precompile.served_set`: a ragged forward per token padding, the decisions of
every served mode and block size, the slot writes, the GDN state copies; the prefix cache on, as
the server's default) is laid out with abstract
arguments on the target's mesh (`decoding.engine.abstract_programs`) and compiled by the target's
own compiler in a subprocess (`clover_jax.api.compile.served_set`):

| set | target | weights, mesh | modes, block sizes | running | context |
|---|---|---|---|---|---|
| H200 | one H200 | bfloat16, one GPU | all three, 16/32/64 | 16 | 131,072 |
| v5e-8 int8 | TPU v5e-8 | int8 experts, experts over 8 | all three, 32 | 8 | 32,768 |
| v6e-1 int4 | TPU v6e-1 | int4 experts + dense, one chip | all three, 32 | 8 | 32,768 |

Targets: the whole set compiles in at most 20 minutes for the H200 and v5e-8 sets and 60 minutes
for v6e-1's, on this host; no program is refused (each program's bytes per device are reported,
the forward at the largest padding the peak). Reported: per set, the programs, those holding a
forward pass, compile seconds (total and the largest program), the largest program's bytes.

Usage: `python benchmarks/serve_compile.py [--sets h200 v5e-8 v6e-1] [--quick]` (`--quick`: the
v6e-1 set at one mode and two paddings' worth of budget); prints JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, setup_environment  # noqa: E402

setup_environment()

EVERY_MODE = ("diffusion", "autoregressive", "self_speculative")
SETS = {
    "h200": dict(target="H200", quantize=None, mesh={"data": 1, "expert": 1, "tensor": 1}, modes=EVERY_MODE,
                 block_sizes=(16, 32, 64), max_running=16, max_context=131072, minutes=20),
    "v5e-8": dict(target="v5e-8", quantize="int8", mesh={"data": 1, "expert": 8, "tensor": 1}, modes=EVERY_MODE,
                  block_sizes=(32,), max_running=8, max_context=32768, minutes=20),
    "v6e-1": dict(target="v6e-1", quantize="int4+dense", mesh={"data": 1, "expert": 1, "tensor": 1},
                  modes=EVERY_MODE, block_sizes=(32,), max_running=8, max_context=32768, minutes=60),
}


def measure(name: str, settings: dict, *, prefill_budget: int, modes=None) -> dict:
    from clover_jax.api.compile.served_set import ServedSetJob
    from clover_jax.api.compile.worker import compile_in_subprocess
    from clover_jax.core.config import CLOVER_35B_A3B, CloverConfig
    from clover_jax.parallel.sharding import ShardingRules
    from decoding.serving_defaults import DEFAULT_PREFIX_CACHE_BYTES

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    job = ServedSetJob(config={field.name: getattr(config, field.name) for field in dataclasses.fields(config)},
                       target=settings["target"], quantize=settings["quantize"], mesh=settings["mesh"],
                       rules=dataclasses.asdict(ShardingRules()), max_running=settings["max_running"],
                       max_context=settings["max_context"], block_sizes=settings["block_sizes"],
                       modes=tuple(modes or settings["modes"]), prefill_budget=prefill_budget,
                       kv_cache_bytes=None, prefix_cache_bytes=DEFAULT_PREFIX_CACHE_BYTES)
    started = time.perf_counter()
    [programs] = compile_in_subprocess([job], timeout=4 * 3600)
    wall = time.perf_counter() - started
    forwards = {key: memory for key, memory in programs.items() if key.startswith("forward")}
    largest = max(programs.items(), key=lambda item: item[1].compile_seconds)
    peak = max(programs.items(), key=lambda item: item[1].total_bytes)
    print(f"serve_compile: {name}: {len(programs)} programs in {wall:.0f} s", file=sys.stderr)
    return {"set": name, **{key: value for key, value in settings.items() if key != "minutes"},
            "programs": len(programs), "with_a_forward": len(forwards),
            "compile_seconds": sum(memory.compile_seconds for memory in programs.values()),
            "wall_seconds": wall, "slowest": [largest[0], largest[1].compile_seconds],
            "peak_bytes": [peak[0], peak[1].total_bytes],
            "refused": {key: memory.error for key, memory in programs.items() if memory.error},
            "by_program": {key: {"compile_s": round(memory.compile_seconds, 1), "total_bytes": memory.total_bytes,
                                 "temp_bytes": memory.temp_bytes, "error": memory.error}
                           for key, memory in programs.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="*", choices=sorted(SETS), default=sorted(SETS))
    parser.add_argument("--prefill-budget", type=int, default=2048, help="the engine's prefill chunk per pass")
    parser.add_argument("--quick", action="store_true", help="the v6e-1 set, diffusion, a prefill budget of 24")
    args = parser.parse_args(argv)
    if args.quick:
        runs = [measure("v6e-1", SETS["v6e-1"], prefill_budget=24, modes=("diffusion",))]
    else:
        runs = [measure(name, SETS[name], prefill_budget=args.prefill_budget) for name in args.sets]
    checks = []
    for run in runs:
        minutes = SETS[run["set"]]["minutes"]
        if not args.quick:
            checks.append(check(f"serve_compile: {run['set']}: the served set's compile minutes on this host",
                                run["compile_seconds"] / 60, minutes, at_least=False))
        checks.append(check(f"serve_compile: {run['set']}: programs the compiler refused", len(run["refused"]), 0,
                            at_least=False))
    emit({"benchmark": "serve_compile", "quick": args.quick, "runs": runs, "checks": checks, "machine": machine()})


if __name__ == "__main__":
    main()
