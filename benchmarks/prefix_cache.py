"""Prefix cache: an agent's growing transcript, turn after turn, with and without the engine's cache.

An agent harness resends the whole transcript every turn. Here a conversation of `--turns` turns on
the medium random model of `forward_cost.py`: turn 1's prompt is `--base` random tokens; each later
turn's prompt is the previous one plus `--step` tokens — the model's reply to the previous turn
(its response tokens, up to `--new`) and a tool result (random tokens filling the rest). With the
defaults, turn 8's prompt is 256 + 7 x 256 = 2,048 tokens.

The same conversations run through two engines over the one model in this process: one with the
prefix cache (the default budget and grid), one without. Measured per turn: time from submit to
the first response tokens the engine hands back (for the server, the first content byte of a
streamed response), and the prompt tokens the cache restored. An untimed conversation per engine
compiles every shape first; then `--rounds` rounds, each a fresh transcript (another seed, the
cache emptied), alternate the two engines; medians over rounds. Both engines' replies must be
equal, turn by turn (the cache changes no response).

Target (`make bench`): autoregressive decoding, turn 8's time to first token without the cache
over with it >= 4. Diffusion decoding is reported beside it. Exits non-zero naming a missed figure.

Usage: `python benchmarks/prefix_cache.py [--rounds 3] [--quick]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, ratio, setup_environment, write_random_checkpoint  # noqa: E402

setup_environment()

import numpy as np  # noqa: E402

TARGET = 4.0


def turn(engine, prompt: list[int], mode: str, new: int) -> dict:
    """One request: its seconds to the first response tokens, its tokens and the tokens it restored."""
    from decoding.engine import EngineRequest

    done, tokens, first, final = threading.Event(), [], [], []

    def listen(event) -> None:
        if event.tokens and not first:
            first.append(time.perf_counter())
        tokens.extend(event.tokens)
        if event.finish is not None:
            final.append(event)
            done.set()

    started = time.perf_counter()
    engine.submit(EngineRequest(prompt, mode, overrides={"max_new_tokens": new}), listen)
    done.wait()
    if final[0].error:
        raise RuntimeError(final[0].error)
    return {"first_token_s": (first[0] if first else time.perf_counter()) - started, "tokens": tokens,
            "cached_tokens": final[0].stats.cached_tokens, "prompt_tokens": len(prompt)}


def conversation(engine, seed: int, mode: str, vocab: int, turns: int, base: int, step: int, new: int) -> list[dict]:
    """Every turn of one conversation (the same transcript for a seed, given the same replies)."""
    rng = np.random.default_rng(seed)
    transcript = rng.integers(2, vocab - 1, base).tolist()
    results = []
    for index in range(turns):
        if index:
            reply = results[-1]["tokens"][:step]
            transcript = transcript + reply + rng.integers(2, vocab - 1, step - len(reply)).tolist()
        results.append(turn(engine, transcript, mode, new))
    return results


def measure(model, mode: str, args, vocab: int) -> dict:
    from decoding.engine import Engine
    from decoding.serving_defaults import DEFAULT_GRID, DEFAULT_PREFIX_CACHE_BYTES

    engines = {"with_cache": Engine(model, max_running=4, prefix_cache_bytes=DEFAULT_PREFIX_CACHE_BYTES,
                                    prefix_cache_grid=DEFAULT_GRID),
               "without_cache": Engine(model, max_running=4)}
    shape = dict(vocab=vocab, turns=args.turns, base=args.base, step=args.step, new=args.new)
    try:
        print(f"prefix_cache: {mode}: warm-up (compiles every shape) ...", file=sys.stderr)
        for engine in engines.values():
            conversation(engine, 10_000, mode, **shape)
        runs: dict[str, list] = {name: [] for name in engines}
        for round_ in range(args.rounds):
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                if engines[name].prefix_cache is not None:
                    engines[name].prefix_cache.clear()
                runs[name].append(conversation(engines[name], round_, mode, **shape))
                last = runs[name][-1][-1]
                print(f"prefix_cache: {mode}: round {round_ + 1} {name}: turn {args.turns} first token "
                      f"{last['first_token_s']:.3f} s ({last['cached_tokens']} of {last['prompt_tokens']} "
                      "prompt tokens restored)", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.close()
    per_turn = {name: [{"first_token_s": statistics.median(run[t]["first_token_s"] for run in rounds),
                        "cached_tokens": statistics.median(run[t]["cached_tokens"] for run in rounds),
                        "prompt_tokens": rounds[0][t]["prompt_tokens"]} for t in range(args.turns)]
                for name, rounds in runs.items()}
    equal = [a["tokens"] == b["tokens"] for x, y in zip(runs["with_cache"], runs["without_cache"], strict=True)
             for a, b in zip(x, y, strict=True)]
    last = args.turns - 1
    speedup = ratio(per_turn["without_cache"][last]["first_token_s"], per_turn["with_cache"][last]["first_token_s"])
    print(f"prefix_cache: {mode}: turn {args.turns} first token without / with the cache {speedup:.2f}",
          file=sys.stderr)
    return {"per_turn": per_turn, "last_turn_speedup": speedup, "replies_equal_fraction": sum(equal) / len(equal)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--base", type=int, default=256, help="turn 1's prompt tokens")
    parser.add_argument("--step", type=int, default=256, help="tokens each turn adds (the reply and a tool result)")
    parser.add_argument("--new", type=int, default=16, help="max_new_tokens of every turn")
    parser.add_argument("--quick", action="store_true", help="smoke test: a small model, short turns, one round")
    args = parser.parse_args(argv)
    from benchmarks.forward_cost import MEDIUM, QUICK
    from clover_jax import CloverModel

    fields = QUICK if args.quick else MEDIUM
    if args.quick:
        args.rounds, args.turns, args.base, args.step, args.new = 1, 3, 64, 64, 8
    load_before = os.getloadavg()
    workdir = tempfile.mkdtemp(prefix="clover-bench-prefix-cache-")
    try:
        paths = write_random_checkpoint(workdir, fields, seed=0, clover=True, mask_token_id=fields["vocab_size"] - 1)
        model = CloverModel.from_pretrained(paths["clover"], progress=False)
        modes = {mode: measure(model, mode, args, fields["vocab_size"]) for mode in ("autoregressive", "diffusion")}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    checks = [check(f"turn {args.turns} time to first token, without the prefix cache / with it (autoregressive)",
                    modes["autoregressive"]["last_turn_speedup"], TARGET, True)]
    checks += [check(f"replies equal with and without the prefix cache ({mode}), fraction of turns",
                     result["replies_equal_fraction"], 1.0, True) for mode, result in modes.items()]
    emit({"benchmark": "prefix_cache", "quick": args.quick, "rounds": args.rounds, "turns": args.turns,
          "base": args.base, "step": args.step, "max_new_tokens": args.new, "modes": modes,
          "load_average_before": load_before, "load_average_after": os.getloadavg(),
          "config": {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "vocab_size")},
          "checks": checks, "machine": machine()})
    missed = [c["name"] for c in checks if not c["passed"]]
    if missed:
        print("prefix_cache: missed: " + "; ".join(missed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
