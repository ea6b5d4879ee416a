"""Time of one denoising step against the prefix length (1K, 4K, 16K, 64K tokens) on a tiny
random Clover (one group of 3 GDN + 1 attention layers, hidden 64).

Per length L: a state of capacity L + block is filled by a real causal prefill of L random tokens
(`CloverModel.extend`, chunked; its time is reported too), then `CloverModel.denoise` of a block
of masks after it is timed. The lengths alternate within each round (rotated order), medians
over rounds; the first call at each length compiles and is not timed (each capacity is its own
compiled shape, as in `generate`, whose buckets are powers of two).

What to expect: GDN layers read a fixed-size recurrent state whatever the prefix, attention
layers read the whole K/V prefix, so the step time grows with L at a rate set by the share of
attention in the step; `step_ratio_longest_over_shortest` is time(64K) / time(1K).

Per length the JSON also gives the K/V bytes the step reads and the step's roofline bound
(`benchmarks/cost_model.py`: the attention over a long prefix is 4 × block × heads × head_dim
FLOPs per prefix token, so a step after 64K tokens can be bound by compute, not by the K/V read).
Target (`checks`): the step after the longest prefix <= 2x the step after the shortest; the
hardware bound of that ratio is the ratio of the two roofline times.

Usage: `python benchmarks/context_scaling.py [--quick] [--lengths 1024 4096 16384 65536]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (  # noqa: E402
    TINY_FIELDS,
    alternate,
    check,
    emit,
    machine,
    ratio,
    setup_environment,
    timed,
    write_random_checkpoint,
)

setup_environment()

import numpy as np  # noqa: E402

TINY = dict(TINY_FIELDS, num_hidden_layers=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 256 and 1024 tokens, 2 rounds")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.rounds = [256, 1024], 2

    import jax

    from benchmarks import cost_model, machine_rates
    from clover_jax import CloverModel

    rates = machine_rates.measure()
    workdir = tempfile.mkdtemp(prefix="clover-bench-context-")
    try:
        fields = dict(TINY, max_position_embeddings=max(args.lengths) + args.block)
        path = write_random_checkpoint(workdir, fields, seed=0)["clover"]
        model = CloverModel.from_pretrained(path, progress=False)
        rng = np.random.default_rng(0)
        block = np.full((1, args.block), model.config.mask_token_id, np.int32)
        states, prefill = {}, {}
        for length in args.lengths:
            ids = rng.integers(2, fields["vocab_size"] - 1, (1, length)).astype(np.int32)
            state = model.init_state(1, length + args.block)
            model.extend(state, ids, logits="none")  # compile this shape
            seconds, (_, states[length]) = timed(lambda state=state, ids=ids: jax.block_until_ready(
                model.extend(state, ids, logits="none")))
            prefill[length] = {"seconds": seconds, "tokens_per_s": length / seconds}
            print(f"context_scaling: prefill {length} tokens in {seconds:.2f}s", file=sys.stderr)

        distinct = {}

        def step(length):
            def run():
                out = model.denoise(states[length], block)
                jax.block_until_ready(out.logits)
                distinct[length] = np.asarray(out.distinct_experts)[:, 0]
            return run

        timings = alternate({str(length): step(length) for length in args.lengths}, args.rounds)
        shortest, longest = str(min(args.lengths)), str(max(args.lengths))
        curve = []
        for length in args.lengths:
            cost = cost_model.pass_cost(model.config, 0, args.block, length, distinct[length], args.block)
            seconds = timings[str(length)]["median"]
            curve.append({"prefix": length, "denoise_step_ms": 1e3 * seconds,
                          "samples_ms": [1e3 * s for s in timings[str(length)]["samples"]],
                          "over_shortest": ratio(seconds, timings[shortest]["median"]), "prefill": prefill[length],
                          "kv_bytes_read": cost["kv_cache_bytes"],
                          "kv_read_gb_per_s": cost["kv_cache_bytes"] / seconds / 1e9,
                          "cost": cost, "bound": cost_model.bound(cost, rates)})
        bound_ratio = ratio(curve[-1]["bound"]["seconds"], curve[0]["bound"]["seconds"])
        step_ratio = ratio(timings[longest]["median"], timings[shortest]["median"])
        checks = [check(f"denoising step after {longest} / after {shortest} prefix tokens", step_ratio, 2.0, False,
                        bound_ratio)]
        emit({"benchmark": "context_scaling", "quick": args.quick,
              "config": {k: fields[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "head_dim",
                                                "num_key_value_heads")},
              "layers": "3 GDN + 1 full attention", "block": args.block, "rounds": args.rounds,
              "chunk_size": model.chunk_size, "curve": curve,
              "machine_rates": rates, "step_ratio_longest_over_shortest": step_ratio,
              "bound_ratio_longest_over_shortest": bound_ratio, "lengths": [int(shortest), int(longest)],
              "checks": checks, "machine": machine()})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
