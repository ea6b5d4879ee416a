"""Serving: the continuous-batching engine (`decoding.engine`, what `clover-jax serve` runs) against
the same requests through `generate` one at a time.

Two models: the bundled tiny Clover with its task's prompts (it sorts digits; the chat template,
the checkpoint's decoding controls), and the medium random model of `forward_cost.py` (Qwen3.6's
layout at a CPU-sized width, 32 experts top-8, float32) with random prompts. Per model, the same
requests (greedy block diffusion, each with its own prompt) run as:

  * `generate` one request at a time — the baseline;
  * the engine at concurrency 1, 4 and 16: that many clients in a closed loop, each submitting
    its next request the moment its previous one finishes (the engine holds up to 16).

Each method's tokens/s is the response tokens of all requests over the wall time of the run.
Latencies per request: time to first block (submit to the first decided tokens) and time per
token (submit to finish over its response tokens); medians over requests. An untimed run of
each method compiles every shape first (on the medium model over its first 16 requests); then
`--rounds` rounds (medium: `--medium-rounds`) alternate the methods (rotated order) and the
medians of rounds are reported. The medium model runs 48 requests, three per client at
concurrency 16, so that the clients' refills show the engine's steady state rather than one wave
waiting for its slowest request (its request takes seconds on a CPU, hence one round). The bundled
model runs 256: its requests (a sorted list of digits) end within about two passes, so 32 of them
at concurrency 16 were five passes of filling and draining the slots. Every
request's tokens from the engine are compared with `generate`'s for it (they must be equal:
batching changes nothing).

The forward's own batching ceiling (`batching_ceiling`): 16 one-sequence passes over one pass of
16 sequences, the most that batching can gain on this machine when host work costs nothing (on
2 CPU cores the passes are compute-bound well before 16 sequences). Target: at concurrency 16 the
engine's gain over one at a time reaches >= 90% of that ceiling, on each model. (The ceiling counts
a commit pass of all 16 sequences for every plain one; the engine's ragged pass holds a commit's
rows only for the slots that commit, so it can pass 100% of this ceiling.)

The K/V pages the running requests hold are reported against the positions their states hold,
over the passes of the last concurrency-16 run (`Engine.passes`). The first burst after
`clover-jax serve --precompile` is `benchmarks/serving_burst.py`'s.

Usage: `python benchmarks/serving.py [--rounds 2] [--requests 256] [--medium-requests 48]
[--medium-rounds 1] [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    alternate,
    check,
    emit,
    machine,
    ratio,
    setup_environment,
    write_random_checkpoint,
)

setup_environment()

import numpy as np  # noqa: E402

from benchmarks.engine_traffic import BUNDLED_DIR, bundled_requests, closed_loop, random_requests  # noqa: E402

CONCURRENCY = (1, 4, 16)
CEILING_FRACTION = 0.9  # of the forward's batching ceiling, at concurrency 16


def one_at_a_time(model, requests) -> dict:
    """The baseline: `generate` on each request alone, in turn."""
    from decoding import generate

    tokens, times, nfe = [], np.zeros((len(requests), 3)), []
    started = time.perf_counter()
    for index, request in enumerate(requests):
        times[index, 0] = time.perf_counter()
        out = generate(model, [list(request.prompt)], **request.overrides)
        times[index, 1] = times[index, 2] = time.perf_counter()  # alone, the first tokens come with the last
        tokens.append(out.sequences[0])
        nfe.append(out.nfe[0])
    return {"wall": time.perf_counter() - started, "tokens": tokens, "times": times, "nfe": nfe}


def summary(runs: dict, reference: list) -> dict:
    """tokens/s (median over rounds), latencies (medians over requests of the last round), equality."""
    last = runs["last"]
    total = sum(len(t) for t in last["tokens"])
    times = last["times"]
    per_token = (times[:, 2] - times[:, 0]) / np.maximum([len(t) for t in last["tokens"]], 1)
    return {"tokens_per_s": total / runs["median"], "tokens_per_s_samples": [total / s for s in runs["samples"]],
            "response_tokens": total, "mean_nfe": float(np.mean(last["nfe"])),
            "time_to_first_block_ms": 1e3 * float(np.median(times[:, 1] - times[:, 0])),
            "time_per_token_ms": 1e3 * float(np.median(per_token)),
            "request_latency_ms": 1e3 * float(np.median(times[:, 2] - times[:, 0])),
            "equal_to_generate_alone": sum(a == b for a, b in zip(last["tokens"], reference, strict=True))
                                       / len(reference)}


def batching_ceiling(engine, requests, slots: int = max(CONCURRENCY), repeats: int = 30) -> dict:
    """What batching gains in the forward itself: `slots` one-sequence passes over one pass of
    `slots` sequences (a denoising pass and a commit + denoise pass of `generate`'s decode loop,
    each compiled alone, on a contiguous cache of these requests' length). The engine at concurrency `slots` can show at
    most about this ratio over `generate` one at a time, even with no host work at all: its
    requests run the same passes, batched. Medians of `repeats` timed calls."""
    import jax
    import jax.numpy as jnp

    from decoding.engine.requests import rows_needed

    context = engine.context
    prepared = [engine.check(request) for request in requests]  # each request's own config (max_new_tokens)
    rows = max(rows_needed(len(p.prompt), p.config, p.mode) for p in prepared)
    capacity = min(-(-rows // 64) * 64, engine.max_context)  # the requests' rows, as a contiguous cache holds them
    block = prepared[0].config.block_size
    passes, coreset, top_p = context.passes, context.coreset, context.coreset_top_p

    @jax.jit
    def denoise(params, ids, state):
        return passes.denoise(params, ids, state, coreset=coreset, coreset_top_p=top_p).logits

    @jax.jit
    def commit_and_denoise(params, ids, state):
        return passes.commit_and_denoise(params, ids, ids, state, coreset=coreset, coreset_top_p=top_p).logits

    def seconds(program, batch):
        ids = jnp.full((batch, block), int(context.ids.mask), jnp.int32)
        state = jax.jit(lambda: passes.new_state(batch, capacity, jnp.zeros((batch,), jnp.int32)))()
        jax.block_until_ready(program(context.params, ids, state))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            jax.block_until_ready(program(context.params, ids, state))
            times.append(time.perf_counter() - started)
        return float(np.median(times))

    out = {"slots": slots, "cache_rows": capacity}
    for name, program in (("denoise", denoise), ("commit_and_denoise", commit_and_denoise)):
        one, batched = seconds(program, 1), seconds(program, slots)
        out[name] = {"one_sequence_ms": 1e3 * one, "batched_ms": 1e3 * batched, "ceiling": slots * one / batched}
    # a request runs about as many commit passes as plain ones (one block closes every ~2 passes here)
    out["ceiling"] = slots * (out["denoise"]["one_sequence_ms"] + out["commit_and_denoise"]["one_sequence_ms"]) / (
        out["denoise"]["batched_ms"] + out["commit_and_denoise"]["batched_ms"])
    return out


def measure(name: str, model, requests, rounds: int, warmup: int | None = None) -> dict:
    """warmup: the untimed run that compiles every shape runs each method on the first `warmup`
    requests (None: on all of them)."""
    from decoding.engine import Engine

    engine = Engine(model, max_running=max(CONCURRENCY), max_queue=len(requests))
    try:
        def methods_on(chosen):
            methods = {"generate_one_at_a_time": lambda: one_at_a_time(model, chosen)}
            for concurrency in CONCURRENCY:
                methods[f"engine_concurrency_{concurrency}"] = lambda c=concurrency: logged(c, chosen)
            return methods

        kv_records, last_wall = [], [0.0]

        def logged(concurrency, chosen):
            first = len(engine.passes)
            run = closed_loop(engine, chosen, concurrency)
            if concurrency == max(CONCURRENCY):
                kv_records[:] = list(engine.passes)[first:]
                last_wall[0] = run["wall"]
            return run

        print(f"serving: {name}: warm-up (compiles every shape) ...", file=sys.stderr)
        for method in methods_on(requests[:warmup]).values():
            method()
        runs = alternate(methods_on(requests), rounds, warmup=False)
        reference = runs["generate_one_at_a_time"]["last"]["tokens"]
        results = {method: summary(run, reference) for method, run in runs.items()}
        ceiling = batching_ceiling(engine, requests)
        kv = kv_in_use(engine, kv_records)
        host = host_and_device(kv_records, last_wall[0])
    finally:
        engine.close()
    base = results["generate_one_at_a_time"]["tokens_per_s"]
    ratios = {f"concurrency_{c}_over_one_at_a_time": ratio(results[f"engine_concurrency_{c}"]["tokens_per_s"], base)
              for c in CONCURRENCY}
    print(f"serving: {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), file=sys.stderr)
    print(f"serving: {name}: the forward's own batching ceiling at {ceiling['slots']} slots {ceiling['ceiling']:.2f}",
          file=sys.stderr)
    ratios["concurrency_16_over_ceiling_if_host_free"] = ratio(
        ratios[f"concurrency_{max(CONCURRENCY)}_over_one_at_a_time"] / host["device_share"], ceiling["ceiling"])
    return {"requests": len(requests), "results": results, "ratios": ratios, "batching_ceiling": ceiling,
            "kv_cache": kv, "host_and_device": host}


def host_and_device(records, wall: float) -> dict:
    """Where the last concurrency-16 run's wall time went (`Engine.passes`): the host's waits for
    the device's results (the passes' device work, as the host sees it) and the rest, the host's
    own work (admission, planning, the layout, dispatch, each request's events). device_share: the
    waits over the wall; the engine's gain if its host work cost nothing would be the measured gain
    over it (`concurrency_16_over_ceiling_if_host_free`): the most this engine can reach while its
    host work does not overlap the device's."""
    waited = sum(record.waited for record in records)
    passes = max(len(records), 1)
    return {"passes": len(records), "wall_s": wall, "waited_s": waited, "device_share": waited / wall,
            "device_ms_per_pass": 1e3 * waited / passes, "host_ms_per_pass": 1e3 * (wall - waited) / passes}


def kv_in_use(engine, records) -> dict:
    """The K/V pages the running requests held against the positions their states held, over the
    passes of the last run at the highest concurrency (`Engine.passes`): a request takes a page as
    its positions reach it, so the pages follow the positions, up to each request's last page
    and the block it denoises (pages are taken for its rows before they are committed)."""
    page = engine.shapes.page_size
    busy = [record for record in records if record.positions_held]
    over = [record.request_pages * page / record.positions_held for record in busy]
    step = max(1, len(busy) // 24)
    return {"page_size": page, "page_bytes": engine.page_bytes, "pool_pages": engine.shapes.num_pages - 1,
            "passes": len(busy), "max_pages_in_use": max((r.pages_in_use for r in records), default=0),
            "page_positions_over_positions_held": {"median": float(np.median(over)) if over else None,
                                                   "max": max(over, default=None)},
            "samples": [[r.positions_held, r.request_pages, r.pages_in_use] for r in busy[::step]]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=256, help="requests per run on the bundled model")
    parser.add_argument("--medium-requests", type=int, default=48,
                        help="requests per run on the medium model (three per client at concurrency 16)")
    parser.add_argument("--medium-rounds", type=int, default=1, help="timed rounds on the medium model")
    parser.add_argument("--prompt", type=int, default=64, help="longest random prompt (medium model)")
    parser.add_argument("--new", type=int, default=32, help="max_new_tokens of every request")
    parser.add_argument("--quick", action="store_true", help="smoke test: the bundled model only, few requests")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 1, 8

    from benchmarks.forward_cost import MEDIUM
    from clover_jax import CloverModel

    models = {}
    models["bundled"] = measure("bundled tiny Clover", CloverModel.from_pretrained(BUNDLED_DIR, progress=False),
                                bundled_requests(args.requests, args.new), args.rounds)
    if not args.quick:
        workdir = tempfile.mkdtemp(prefix="clover-bench-serving-")
        try:
            paths = write_random_checkpoint(workdir, MEDIUM, seed=0, clover=True,
                                            mask_token_id=MEDIUM["vocab_size"] - 1)
            model = CloverModel.from_pretrained(paths["clover"], progress=False)
            models["medium"] = measure("medium random model", model, random_requests(
                args.medium_requests, MEDIUM["vocab_size"], args.prompt, args.new), args.medium_rounds,
                warmup=max(CONCURRENCY))
            models["medium"]["config"] = {k: MEDIUM[k] for k in ("hidden_size", "num_hidden_layers", "num_experts",
                                                                 "num_experts_per_tok", "vocab_size")}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    for result in models.values():
        result["ratios"]["concurrency_16_over_ceiling"] = ratio(result["ratios"]["concurrency_16_over_one_at_a_time"],
                                                                result["batching_ceiling"]["ceiling"])
    checks = [check(f"serving: engine at concurrency 16 over one at a time, as a fraction of the forward's batching "
                    f"ceiling ({name})", result["ratios"]["concurrency_16_over_ceiling"], CEILING_FRACTION, True,
                    note=f"gain {result['ratios']['concurrency_16_over_one_at_a_time']:.2f}x of a ceiling of "
                         f"{result['batching_ceiling']['ceiling']:.2f}x (16 one-sequence passes over one "
                         "16-sequence pass, measured in this run); the host's own work "
                         f"{result['host_and_device']['host_ms_per_pass']:.1f} ms a pass beside the device's "
                         f"{result['host_and_device']['device_ms_per_pass']:.1f} ms: with none, "
                         f"{result['ratios']['concurrency_16_over_ceiling_if_host_free']:.2f} of the ceiling")
              for name, result in models.items()]
    checks += [check(f"serving tokens equal generate alone ({name}), fraction of requests",
                     result["results"]["engine_concurrency_16"]["equal_to_generate_alone"], 1.0, True)
               for name, result in models.items()]
    emit({"benchmark": "serving", "quick": args.quick, "rounds": args.rounds, "max_new_tokens": args.new,
          "concurrency": list(CONCURRENCY), "models": models, "checks": checks,
          "machine": machine()})


if __name__ == "__main__":
    main()
