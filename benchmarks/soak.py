"""Soak: one server of the bundled model under thousands of mixed requests, and what is left after.

The requests (a fixed random mix, `--seed`): chat and completions; the three decoding modes;
greedy and sampled; streamed and whole; a tenth cancelled mid-stream (the client closes the
stream after its first chunk); a tenth invalid (one bad field: a 4xx); prompts of 1 to 24 digits,
so that prompt lengths, batch sizes and cache sizes keep changing. `--concurrency` clients each
send their next request when the last one ends.

Measured: after a warm-up (`--warmup` requests), the server's resident memory (RSS) and the
number of compiled programs the engine holds, then again after each phase of `--phase` requests.
At the end: nothing running or queued, no lane or held request left, no 5xx. To tell a leak from
compiled programs, the engine's compiled programs are then freed (`jax.clear_caches()`) and the
memory read once more: what that frees is what the programs held.

The server runs with its default prefix cache; what the cache holds (bounded by its budget) is
taken out of the memory growth and reported beside it.

Targets (`make bench`): memory growth from the end of the warm-up to the end <= 10%; no 5xx; nothing
left in the engine. Usage: `python benchmarks/soak.py [--requests 1000] [--warmup 300] [--phase 250]
[--concurrency 8] [--quick]`; `tests/test_soak.py` runs a short version.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import REPO_ROOT, check, emit, machine, setup_environment  # noqa: E402

setup_environment()

BUNDLED_DIR = os.path.join(REPO_ROOT, "clover_jax", "bundled", "tiny-clover")
GROWTH_TARGET = 0.10


def request_mix(count: int, seed: int) -> list[dict]:
    """`count` requests: {"path", "body", "cancel", "invalid"}, the same for a seed."""
    chooser = random.Random(seed)
    requests = []
    for _ in range(count):
        digits = " ".join(str(chooser.randrange(10)) for _ in range(chooser.randint(1, 24)))
        mode = chooser.choice(["diffusion", "diffusion", "autoregressive", "self_speculative"])
        body = {"model": "tiny-clover", "max_tokens": chooser.choice([8, 16, 32, 48]), "mode": mode}
        if mode != "self_speculative" and chooser.random() < 0.3:
            body.update(temperature=0.8, seed=chooser.randrange(2**31))
        chat = chooser.random() < 0.7
        if chat:
            body["messages"] = [{"role": "user", "content": "sort " + digits}]
        else:
            body["prompt"] = "sort " + digits
        stream = chooser.random() < 0.5
        body["stream"] = stream
        cancel = stream and chooser.random() < 0.2
        invalid = chooser.random() < 0.1
        if invalid:
            body[chooser.choice(["temperature", "top_p", "max_tokens", "mode"])] = chooser.choice([-1, "many", 1e9])
        requests.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
                         "cancel": cancel and not invalid, "invalid": invalid})
    return requests


def engine_programs() -> int:
    """Compiled programs the serving engine's jitted functions hold in this process."""
    from decoding.engine import autoregressive_lane, diffusion_lane, slots, speculative_lane

    return sum(value._cache_size() for module in (autoregressive_lane, diffusion_lane, slots, speculative_lane)
               for value in vars(module).values() if hasattr(value, "_cache_size"))


def _return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc keeps them otherwise, and RSS would
    not show what freeing the programs freed)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def cache_bytes(service) -> int:
    """Bytes the engine's prefix cache holds (0 without one)."""
    cache = service.engine.prefix_cache
    return 0 if cache is None else cache.nbytes


def send(url: str, request: dict, outcomes: dict, lock: threading.Lock) -> None:
    import httpx

    kind = "cancelled" if request["cancel"] else "invalid" if request["invalid"] else "served"
    try:
        with httpx.Client(timeout=600) as http:
            if request["body"]["stream"]:
                with http.stream("POST", url + request["path"], json=request["body"]) as response:
                    status = response.status_code
                    for _ in response.iter_lines():
                        if request["cancel"]:
                            break  # leave mid-stream: the server cancels the request
            else:
                status = http.post(url + request["path"], json=request["body"]).status_code
    except Exception as error:  # a transport failure is an outcome too
        status = f"transport: {type(error).__name__}"
    with lock:
        outcomes[(kind, status)] = outcomes.get((kind, status), 0) + 1


def run_phase(url: str, requests: list[dict], concurrency: int) -> dict:
    outcomes: dict = {}
    lock = threading.Lock()
    pending = iter(requests)
    take = threading.Lock()

    def client():
        while True:
            with take:
                request = next(pending, None)
            if request is None:
                return
            send(url, request, outcomes, lock)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {f"{kind} {status}": count for (kind, status), count in sorted(outcomes.items(), key=str)}


def soak(*, requests: int, warmup: int, phase: int, concurrency: int, seed: int = 0, max_running: int = 8) -> dict:
    import httpx

    from clover_jax.api.serving.app import create_app
    from clover_jax.api.serving.server import ServerThread, build_service

    service = build_service(BUNDLED_DIR, name="tiny-clover", max_running=max_running)
    mix = request_mix(warmup + requests, seed)
    phases = []
    with ServerThread(create_app(service)) as server:
        started = time.perf_counter()
        warm = run_phase(server.url, mix[:warmup], concurrency)
        gc.collect()
        after_warmup = {"rss_bytes": rss_bytes(), "programs": engine_programs(), "outcomes": warm,
                        "prefix_cache_bytes": cache_bytes(service)}
        for start in range(warmup, warmup + requests, phase):
            chunk = mix[start:start + phase]
            outcomes = run_phase(server.url, chunk, concurrency)
            gc.collect()
            phases.append({"requests": len(chunk), "rss_bytes": rss_bytes(), "programs": engine_programs(),
                           "outcomes": outcomes, "seconds": round(time.perf_counter() - started, 1),
                           "prefix_cache_bytes": cache_bytes(service)})
        deadline = time.monotonic() + 60  # cancellations are seen at the engine's next step
        while service.engine.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(server.url + "/health", timeout=60).json()
    engine = service.engine
    left = {"running": health["running"], "queued": health["queued"], "held": len(engine._held),
            "lanes": len(engine._lanes), "prefills": len(engine._prefills)}
    service.engine.close()
    before_free = rss_bytes()
    import jax

    jax.clear_caches()
    gc.collect()
    _return_free_heap()
    freed = before_free - rss_bytes()
    end = phases[-1] if phases else after_warmup
    # the prefix cache holds what it keeps on purpose, within its budget: its own bytes are not a leak
    cache_growth = end["prefix_cache_bytes"] - after_warmup["prefix_cache_bytes"]
    growth = (end["rss_bytes"] - cache_growth) / after_warmup["rss_bytes"] - 1
    server_errors = sum(count for phase_ in [after_warmup, *phases] for key, count in phase_["outcomes"].items()
                        if key.split()[-1].startswith(("5", "transport")))
    return {"requests": requests, "warmup": warmup, "concurrency": concurrency, "after_warmup": after_warmup,
            "phases": phases, "left_in_engine": left, "server_errors": server_errors, "rss_growth": growth,
            "rss_growth_with_prefix_cache": end["rss_bytes"] / after_warmup["rss_bytes"] - 1,
            "bytes_freed_by_dropping_programs": freed, "finished": dict(health["finished"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--phase", type=int, default=250)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="400 requests after a 100-request warm-up")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.warmup, args.phase = 400, 100, 100
    result = soak(requests=args.requests, warmup=args.warmup, phase=args.phase, concurrency=args.concurrency,
                  seed=args.seed)
    left = sum(result["left_in_engine"].values())
    result["checks"] = [
        check("soak: resident memory growth after the warm-up", result["rss_growth"], GROWTH_TARGET, at_least=False),
        check("soak: responses with a 5xx or a transport failure", result["server_errors"], 0, at_least=False),
        check("soak: requests, lanes or prefills left in the engine", left, 0, at_least=False),
    ]
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
