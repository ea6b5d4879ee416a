"""Compile time of `decoding.generate`: cold, from the on-disk caches, and warm; the CLI's startup;
and which changes to a call recompile.

On a tiny random Clover checkpoint (written once by the parent), each measurement of "first
call" runs in a fresh subprocess, so nothing is shared through memory:
  * `cold`: caches off (`CLOVER_JAX_CACHE_DIR=""`) — the first `generate` call traces, lowers and
    compiles;
  * `persistent_cache`: the default caches (`clover_jax.core.compilation_cache`: JAX's persistent
    compilation cache and the compiled decoders of `clover_jax.core.executable_cache`) in a directory
    filled beforehand by an untimed child running the same call;
  * `warm`: the second identical call in the same process (jit's in-memory cache).

CLI startup: `clover-jax generate --show-steps` on the bundled model in a new process, with an
empty cache directory and then again with the directory the first run filled (alternating over
rounds, a new directory each round). Target (`checks`): the second run <= 25% of the first's
wall time.
Children alternate (cold, cache, cold, cache, ...); medians. Each child also reports how many
backend compilations its first call asked for and how many the persistent cache answered
(`jax.monitoring` events `/jax/core/compile/backend_compile_duration` and
`/jax/compilation_cache/cache_hits`).

Recompile triggers (one child, no persistent cache): after a base call (prompt of 40 tokens,
block 32, max_new_tokens 32, batch 1, greedy) is warm, each variant call is made and we count
the backend compilations it caused and the growth of the decoder loop's jit cache
(`run_block_decoder._cache_size()`), with its wall time. Expected from the design: the prompt
length bucket, block size, batch, max_new_tokens bucket and do_sample recompile; threshold,
temperature, the prompt length inside a bucket and max_new_tokens inside a bucket do not. The
decoded-blocks bucket is ceil((P + N) / B) - floor(P / B) rounded up to a power of two, so with
P = 40, B = 32: N = 32 and N = 40 both need 2 blocks (same bucket), N = 24 needs 1 (a new one).

Usage: `python benchmarks/compile.py [--quick] [--rounds 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    TINY_FIELDS,
    check,
    emit,
    machine,
    ratio,
    setup_environment,
    write_random_checkpoint,
)

setup_environment()

FIELDS = dict(TINY_FIELDS, num_hidden_layers=8, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
BASE = dict(prompt_length=40, max_new_tokens=32, block_size=32, threshold=0.95, batch=1)


class CompileCounter:
    """Counts backend compile requests and persistent-cache hits through jax.monitoring."""

    def __init__(self):
        import jax

        self.compiles = 0
        self.cache_hits = 0
        self.compile_seconds = 0.0

        def on_duration(event, duration, **_):
            if event == "/jax/core/compile/backend_compile_duration":
                self.compiles += 1
                self.compile_seconds += duration

        def on_event(event, **_):
            if event == "/jax/compilation_cache/cache_hits":
                self.cache_hits += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)

    def snapshot(self):
        return self.compiles, self.cache_hits, self.compile_seconds


def prompts_for(length: int, batch: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(2, FIELDS["vocab_size"] - 1, length).tolist() for _ in range(batch)]


def child(checkpoint: str, kind: str) -> None:
    """One fresh process (its caches set by CLOVER_JAX_CACHE_DIR): load, first call, second call."""
    counter = CompileCounter()
    from clover_jax import CloverModel
    from decoding import generate

    model = CloverModel.from_pretrained(checkpoint, progress=False)
    prompts = prompts_for(BASE["prompt_length"], BASE["batch"])
    call = lambda: generate(model, prompts, max_new_tokens=BASE["max_new_tokens"], block_size=BASE["block_size"],
                            threshold=BASE["threshold"])
    before = counter.snapshot()
    started = time.perf_counter()
    call()
    first = time.perf_counter() - started
    after_first = counter.snapshot()
    started = time.perf_counter()
    call()
    second = time.perf_counter() - started
    after_second = counter.snapshot()
    print(json.dumps({"kind": kind, "first_call_s": first, "second_call_s": second,
                      "first_call_compiles": after_first[0] - before[0],
                      "first_call_cache_hits": after_first[1] - before[1],
                      "first_call_backend_compile_s": after_first[2] - before[2],
                      "second_call_compiles": after_second[0] - after_first[0]}))


def child_triggers(checkpoint: str) -> None:
    """Which changes recompile: compiles and decoder-cache growth per variant call."""
    counter = CompileCounter()
    from clover_jax import CloverModel
    from decoding import generate
    from decoding.block_loop import run_block_decoder

    model = CloverModel.from_pretrained(checkpoint, progress=False)

    def call(prompt_length=BASE["prompt_length"], batch=BASE["batch"], **overrides):
        settings = dict(max_new_tokens=BASE["max_new_tokens"], block_size=BASE["block_size"],
                        threshold=BASE["threshold"])
        settings.update(overrides)
        key = None
        if settings.get("do_sample"):
            import jax

            key = jax.random.key(0)
        return generate(model, prompts_for(prompt_length, batch), key=key, **settings)

    call()
    call()  # every eager helper compiled too
    streamed = lambda **overrides: call(on_block=lambda *_: None, **overrides)
    variants = [
        ("same call again", {}),
        ("threshold 0.95 -> 0.5 (traced)", {"threshold": 0.5}),
        ("temperature 1.0 -> 0.7, greedy (traced)", {"temperature": 0.7}),
        ("prompt 40 -> 50 tokens, same prefix bucket", {"prompt_length": 50}),
        ("max_new_tokens 32 -> 40, same bucket (2 decoded blocks)", {"max_new_tokens": 40}),
        ("prompt 40 -> 200 tokens, new prefix bucket", {"prompt_length": 200}),
        ("max_new_tokens 32 -> 128, new bucket (2 -> 8 decoded blocks)", {"max_new_tokens": 128}),
        ("block_size 32 -> 16", {"block_size": 16}),
        ("batch 1 -> 2", {"batch": 2}),
        ("do_sample False -> True", {"do_sample": True}),
        ("do_sample True, temperature 1.0 -> 0.7 (traced)", {"do_sample": True, "temperature": 0.7}),
        ("streamed (on_block): host-driven block programs", {"streamed": True}),
        ("not streamed again after streaming", {}),
    ]
    rows = []
    for name, overrides in variants:
        before, cache_before = counter.snapshot(), run_block_decoder._cache_size()
        started = time.perf_counter()
        (streamed if overrides.pop("streamed", False) else call)(**overrides)
        seconds = time.perf_counter() - started
        after = counter.snapshot()
        rows.append({"change": name, "backend_compiles": after[0] - before[0],
                     "decoder_loop_compiled": run_block_decoder._cache_size() - cache_before,
                     "backend_compile_s": after[2] - before[2], "call_s": seconds})
    print(json.dumps({"triggers": rows}))


def run_child(args: list[str], cache_dir: str | None) -> dict:
    env = dict(os.environ, CLOVER_JAX_CACHE_DIR=cache_dir or "")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    completed = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env, stdout=subprocess.PIPE,
                               check=True, text=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def cli_seconds(cache_dir: str) -> float:
    """Wall time of one `clover-jax generate --show-steps` on the bundled model in a new process."""
    env = dict(os.environ, CLOVER_JAX_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "clover_jax", "generate", "--show-steps", "sort 3 1 4 1 5 9 2 6"], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=REPO_ROOT)
    return time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 round, no trigger table")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=["cold", "persistent_cache", "triggers"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "triggers":
        child_triggers(args.checkpoint)
        return
    if args.child:
        child(args.checkpoint, args.child)
        return
    if args.quick:
        args.rounds = 1

    workdir = tempfile.mkdtemp(prefix="clover-bench-compile-")
    try:
        checkpoint = write_random_checkpoint(workdir, FIELDS, seed=0)["clover"]
        cache_dir = os.path.join(workdir, "cache")
        fill = run_child(["--child", "persistent_cache", "--checkpoint", checkpoint], cache_dir)
        cache_files = sum(len(files) for _, _, files in os.walk(cache_dir))
        samples = {"cold": [], "persistent_cache": []}
        for round_index in range(args.rounds):
            order = ["cold", "persistent_cache"] if round_index % 2 == 0 else ["persistent_cache", "cold"]
            for kind in order:
                samples[kind].append(run_child(["--child", kind, "--checkpoint", checkpoint],
                                               cache_dir if kind == "persistent_cache" else None))
                print(f"compile: {kind} first call {samples[kind][-1]['first_call_s']:.2f}s", file=sys.stderr)
        cli = {"first_s": [], "second_s": []}
        for round_index in range(args.rounds):
            fresh = os.path.join(workdir, f"cli-cache-{round_index}")
            cli["first_s"].append(cli_seconds(fresh))
            cli["second_s"].append(cli_seconds(fresh))
            print(f"compile: CLI first {cli['first_s'][-1]:.1f}s, second {cli['second_s'][-1]:.1f}s", file=sys.stderr)
        cli["second_over_first"] = ratio(statistics.median(cli["second_s"]), statistics.median(cli["first_s"]))
        summary = {}
        for kind, runs in samples.items():
            summary[kind] = {
                "first_call_s": statistics.median(r["first_call_s"] for r in runs),
                "warm_call_s": statistics.median(r["second_call_s"] for r in runs),
                "first_call_compiles": runs[-1]["first_call_compiles"],
                "first_call_cache_hits": runs[-1]["first_call_cache_hits"],
                "second_call_compiles": runs[-1]["second_call_compiles"],
                "samples": runs,
            }
        result = {
            "benchmark": "compile", "quick": args.quick, "rounds": args.rounds, "call": BASE,
            "config": {k: FIELDS[k] for k in ("hidden_size", "num_hidden_layers", "num_experts")},
            "cache_fill_child": fill, "cache_files": cache_files, **summary,
            "persistent_over_cold_first_call": ratio(summary["persistent_cache"]["first_call_s"],
                                                     summary["cold"]["first_call_s"]),
            "warm_over_cold_first_call": ratio(summary["cold"]["warm_call_s"], summary["cold"]["first_call_s"]),
            "cli_show_steps": cli,
        }
        checks = [check("second clover-jax generate --show-steps / first (wall time)", cli["second_over_first"],
                        0.25, False)]
        if not args.quick:
            result.update(run_child(["--child", "triggers", "--checkpoint", checkpoint], None))
            again = next(row for row in result["triggers"] if row["change"] == "not streamed again after streaming")
            checks.append(check("decoder loop compilations when streaming is toggled off again",
                                again["decoder_loop_compiled"], 0, False))
        result["checks"] = checks
        result["machine"] = machine()
        emit(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
