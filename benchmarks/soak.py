"""Soak: one server of the bundled model under thousands of mixed requests, and what is left after.

The traffic (`benchmarks/soak_traffic.py`, a fixed random mix for a `--seed`): single requests —
chat and completions, the three decoding modes, greedy and sampled, streamed and whole, some
cancelled mid-stream, some invalid — and multi-turn conversations that resend their growing
transcript (prefix-cache hits). The engine's prefix cache has a small budget (`--prefix-cache-mb`)
that the warm-up fills, so that it evicts all through the soak. `--concurrency` clients each send
their next request when the last one ends.

Measured after a warm-up (`--warmup` requests) and after each phase of `--phase` requests (the
phases send the warm-up's requests again, or new ones with `--fresh`), the engine idle: the
server's resident memory (RSS), then RSS again after glibc's free heap pages are handed back
(`malloc_trim`: pages glibc keeps after a free are not a leak), the compiled programs (the
engine's jitted functions', and every executable the process compiled or loaded, eager operations
included), the live JAX arrays (count and bytes), the Python heap (`--tracemalloc`), and the prefix
cache's bytes, entries, hits and evictions. Then every compiled program is freed
(`jax.clear_caches()`) and RSS read once more: the memory without the programs; then the engine
precompiles its set again, from the persistent compilation cache, as a restarted server would
(`--keep-programs` skips both).

The server precompiles its set first (`Engine.precompile`: every mode at block sizes 16 and 32),
so no request should meet a program it did not compile: the engine's shapes are fixed for its life
(one ragged forward per token padding, decisions per mode and block size), whatever the prompt
lengths, the modes that meet in a pass or the cache's hits.

Checked at the end: no 5xx or transport failure; nothing running, queued or held, and every K/V page
back in the pool but the prefix cache's; the prefix cache within its budget, its byte, chunk and
state counts equal to the trie counted afresh, and no chunk that no kept state needs; no program
compiled on demand after the precompile, and each engine function's programs at any reading within
the precompiled set (`program_bound`); resident memory without the programs grown by at most 10%
from the end of the warm-up (after `malloc_trim` with `--keep-programs`).

Usage: `python benchmarks/soak.py [--requests 1500] [--warmup 150] [--phase 300] [--concurrency 8]
[--prefix-cache-mb 1] [--fresh] [--keep-programs] [--tracemalloc] [--quick]` — exits 1 naming every
missed target; `tests/test_soak.py` runs a short version.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import REPO_ROOT, check, emit, machine, setup_environment  # noqa: E402
from benchmarks.soak_traffic import request_count, request_mix, run_phase  # noqa: E402

setup_environment()

BUNDLED_DIR = os.path.join(REPO_ROOT, "clover_jax", "bundled", "tiny-clover")
GROWTH_TARGET = 0.10
BLOCK_SIZES = (16, 32)   # the block sizes the mix asks for
MODES = ("diffusion", "autoregressive", "self_speculative")
PROGRESS = ("requests", "seconds", "rss_bytes", "rss_trimmed_bytes", "rss_without_programs_bytes", "programs",
            "process_compiles", "live_arrays", "prefix_cache")
logger = logging.getLogger("soak")
# JAX's event for each executable it compiles or loads from the persistent cache (jax._src.dispatch)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Every executable this process compiles or loads from the persistent cache after `start`
    (JAX's backend-compile event, eager operations included), by function name."""

    def __init__(self):
        self.by_name: collections.Counter = collections.Counter()
        self.active = False

    def start(self) -> "CompileCounter":
        import jax

        def listen(event, _duration, fun_name="?", **_):
            if self.active and event == BACKEND_COMPILE_EVENT:
                self.by_name[fun_name] += 1

        self.active, self._listener = True, listen
        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def stop(self) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._listener)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


def engine_programs() -> dict[str, int]:
    """Compiled programs each of the engine's jitted functions holds."""
    from decoding.engine.precompile import PROGRAMS

    return {function.__name__: function._cache_size() for function in PROGRAMS}


def program_bound(engine, modes=MODES, block_sizes=BLOCK_SIZES) -> dict[str, int]:
    """The most programs each engine function can compile: the precompiled set's
    (`precompile.planned_programs`), function by function — a forward pass per token padding; a
    denoising step per block size, greedy and sampled, with and without log-probabilities; a
    self-speculative round's drafts and acceptance per block size; the autoregressive choice greedy
    and sampled; the admitted slots' write per mode; their GDN states zeroed; a slot's GDN states
    read and restored."""
    sizes = len(set(block_sizes))
    return {"forward": len(engine.shapes.paddings), "decide_diffusion": 4 * sizes, "decide_drafts": sizes,
            "decide_verified": sizes, "decide_autoregressive": 2, "put_slots": len(modes), "slot_gdn": 1,
            "put_slot_gdn": 1, "clear_slots_gdn": 1}


def malloc_trim() -> bool:
    """Hand glibc's free heap pages back to the system; False where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def reading(service, compiles: CompileCounter, outcomes: dict, requests: int, started: float,
            drop_programs: bool) -> dict:
    """Memory, programs and cache after a phase (the engine idle, the garbage collected first);
    drop_programs: then free every compiled program, read the memory without them, and precompile
    the set again (from the persistent compilation cache: seconds), as a restarted server would, so
    that a program a later phase compiles is still one outside the precompiled set."""
    import tracemalloc

    import jax

    deadline = time.monotonic() + 60  # cancellations are seen at the engine's next step
    while service.engine.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    rss = rss_bytes()
    trimmed = rss_bytes() if malloc_trim() else None
    arrays = jax.live_arrays()
    cache = service.engine.prefix_cache
    programs = engine_programs()
    without = None
    if drop_programs:
        jax.clear_caches()
        gc.collect()
        without = rss_bytes() if malloc_trim() else None
        try:
            service.engine.precompile(MODES, BLOCK_SIZES)
        except RuntimeError:  # requests still held: the end's check reports them (later programs: on demand)
            logger.exception("soak: the engine is not idle after the phase; its programs are not precompiled again")
    return {"requests": requests, "outcomes": outcomes, "seconds": round(time.perf_counter() - started, 1),
            "rss_bytes": rss, "rss_trimmed_bytes": trimmed, "rss_without_programs_bytes": without,
            "programs": sum(programs.values()), "programs_by_function": programs, "process_compiles": compiles.total,
            "live_arrays": len(arrays), "live_array_bytes": sum(array.nbytes for array in arrays),
            "python_heap_bytes": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None,
            "prefix_cache": {"bytes": cache.nbytes, "nodes": cache.nodes, "states": cache.states, "hits": cache.hits,
                             "hit_tokens": cache.hit_tokens, "evicted": cache.evicted}}


def soak(*, requests: int, warmup: int, phase: int, concurrency: int, seed: int = 0, max_running: int = 8,
         prefix_cache_bytes: int = 1 << 20, python_heap: bool = False, fresh: bool = False,
         drop_programs: bool = True) -> dict:
    """See the module docstring. fresh: the phases send new requests of the same kinds (a mix of
    another seed) rather than the warm-up's again, so that new shapes, and programs, keep arriving;
    drop_programs: free the compiled programs after each reading (see `reading`)."""
    import tracemalloc

    import httpx
    import jax

    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread, build_service

    service = build_service(BUNDLED_DIR, name="tiny-clover", max_running=max_running,
                            prefix_cache_bytes=prefix_cache_bytes, block_sizes=BLOCK_SIZES)
    engine, cache = service.engine, service.engine.prefix_cache
    compiles = CompileCounter().start()
    precompiled = engine.precompile(MODES, BLOCK_SIZES)
    logger.info("soak: precompiled %d programs in %.1f s", precompiled.programs, precompiled.seconds)
    if drop_programs:  # dropped and loaded again once before the warm-up, as after every reading, so that
        jax.clear_caches()  # the warm-up's reading (the baseline of the growth) follows the same cycle
        engine.precompile(MODES, BLOCK_SIZES)
    gc.collect()
    loaded = rss_bytes() if malloc_trim() else None  # the model loaded, no program compiled yet
    if python_heap:
        tracemalloc.start()
    warm_items = request_mix(warmup, seed)
    items = request_mix(requests, seed + 1) if fresh else _replayed(warm_items, requests)
    phases = []
    with ServerThread(create_app(service)) as server:
        started = time.perf_counter()
        after_warmup = reading(service, compiles, run_phase(server.url, warm_items, concurrency),
                               request_count(warm_items), started, drop_programs)
        heap_at_warmup = tracemalloc.take_snapshot() if python_heap else None
        logger.info("soak: the warm-up: %s", {key: after_warmup[key] for key in PROGRESS})
        done = 0
        while done < len(items):
            chunk, total = [], 0
            while done < len(items) and total < phase:
                chunk.append(items[done])
                total += request_count([items[done]])
                done += 1
            phases.append(reading(service, compiles, run_phase(server.url, chunk, concurrency), total, started,
                                  drop_programs))
            logger.info("soak: %s", {key: phases[-1][key] for key in PROGRESS})
        deadline = time.monotonic() + 60  # cancellations are seen at the engine's next step
        while engine.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health", timeout=60).json()
    heap_growth = None
    if python_heap:
        heap_growth = [str(stat) for stat in tracemalloc.take_snapshot().compare_to(heap_at_warmup, "lineno")[:10]]
        tracemalloc.stop()
    left = {"running": health["running"], "queued": health["queued"], "held": len(engine._held),
            "pages": engine.kv_pages_in_use() - cache.census()["pages"]}
    census = cache.census()
    cache_state = {"budget": cache.budget, "bytes": cache.nbytes, "nodes": cache.nodes, "states": cache.states,
                   "counted": census, "evicted": cache.evicted, "hits": cache.hits, "hit_tokens": cache.hit_tokens}
    programs = collections.Counter()  # each function's most programs at any reading
    for one in [after_warmup, *phases]:
        programs |= collections.Counter(one["programs_by_function"])
    bound = program_bound(engine)
    engine.close()
    before_free = rss_bytes() if malloc_trim() else None
    jax.clear_caches()
    gc.collect()
    malloc_trim()
    compiles.stop()
    end = phases[-1] if phases else after_warmup
    measure = "rss_without_programs_bytes" if drop_programs else "rss_trimmed_bytes"
    server_errors = sum(count for phase_ in [after_warmup, *phases] for key, count in phase_["outcomes"].items()
                        if key.split()[-1].startswith(("5", "transport")))
    return {"requests": request_count(items), "warmup": request_count(warm_items), "concurrency": concurrency,
            "after_warmup": after_warmup, "phases": phases, "left_in_engine": left, "server_errors": server_errors,
            "rss_growth": (end[measure] or end["rss_bytes"]) / (after_warmup[measure] or after_warmup["rss_bytes"]) - 1,
            "rss_growth_measured_on": measure if end[measure] else "rss_bytes",
            "rss_growth_with_programs": end["rss_bytes"] / after_warmup["rss_bytes"] - 1,
            "prefix_cache": cache_state, "programs_by_function": dict(programs), "program_bound": bound,
            "precompiled": {"programs": precompiled.programs, "seconds": round(precompiled.seconds, 1)},
            "compiled_on_demand": engine.compiled_on_demand,
            "process_compiles_by_function": dict(compiles.by_name.most_common(40)),
            "python_heap_growth_top": heap_growth, "traffic": "fresh" if fresh else "the warm-up's, again",
            "rss_loaded_bytes": loaded, "rss_without_programs_bytes": rss_bytes(),
            "bytes_freed_by_dropping_programs": before_free - rss_bytes() if before_free else None,
            "finished": dict(health["finished"])}


def _replayed(items: list[dict], requests: int) -> list[dict]:
    """`items` again and again, up to `requests` requests (a conversation is kept whole)."""
    replayed, total = [], 0
    while items and total < requests:
        for item in items:
            if total >= requests:
                break
            replayed.append(item)
            total += request_count([item])
    return replayed


def checks(result: dict) -> list[dict]:
    """The soak's targets (see the module docstring), each a `check`."""
    cache = result["prefix_cache"]
    counted = cache["counted"]
    mismatched = sum(cache[name] != counted[name] for name in ("bytes", "nodes", "states")) + counted["unneeded"]
    over_bound = sum(max(0, count - result["program_bound"].get(name, 0))
                     for name, count in result["programs_by_function"].items())
    return [
        check(f"soak: resident memory growth after the warm-up ({result['rss_growth_measured_on']})",
              result["rss_growth"], GROWTH_TARGET, at_least=False),
        check("soak: responses with a 5xx or a transport failure", result["server_errors"], 0, at_least=False),
        check("soak: requests or K/V pages (but the prefix cache's) left in the engine",
              sum(result["left_in_engine"].values()), 0, at_least=False),
        check("soak: programs compiled on demand after the precompile", result["compiled_on_demand"], 0,
              at_least=False),
        check("soak: prefix cache bytes over its budget", max(0, cache["bytes"] - cache["budget"]), 0, at_least=False),
        check("soak: prefix cache counts unlike the trie counted afresh, or chunks no state needs", mismatched, 0,
              at_least=False),
        check("soak: engine programs beyond the precompiled set", over_bound, 0, at_least=False),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--phase", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-cache-mb", type=float, default=1.0)
    parser.add_argument("--fresh", action="store_true", help="phases of new requests, not the warm-up's again")
    parser.add_argument("--keep-programs", action="store_true",
                        help="never free the compiled programs between phases (resident memory then grows with them)")
    parser.add_argument("--tracemalloc", action="store_true", help="also follow the Python heap (slower)")
    parser.add_argument("--quick", action="store_true", help="400 requests after a 100-request warm-up")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.quick:
        args.requests, args.warmup, args.phase = 400, 100, 100
    result = soak(requests=args.requests, warmup=args.warmup, phase=args.phase, concurrency=args.concurrency,
                  seed=args.seed, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20), python_heap=args.tracemalloc,
                  fresh=args.fresh, drop_programs=not args.keep_programs)
    result["checks"] = checks(result)
    result["machine"] = machine()
    emit(result)
    missed = [one["name"] for one in result["checks"] if not one["passed"]]
    for name in missed:
        print(f"soak: target missed: {name}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
