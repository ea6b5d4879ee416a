"""MoE layer time against the number of experts, at fixed top-k and tokens, two implementations
side by side: clover's tiled XLA dispatch (`clover_jax.nn.expert_dispatch.routed_expert_mlp`, what
the model runs on CPU) and `jax.lax.ragged_dot` (sort by expert, two ragged matmuls).

The layer timed is the router (`softmax(x Wᵀ)`, top-k, renormalised) plus the routed experts;
the shared expert is left out (dense, independent of the expert count). Each expert count runs
at a decode-sized batch (32 rows: one block of 32, or 32 sequences decoding) and a
prefill-sized one (2048 rows). The claim checked: the cost follows top-k × tokens, not the
number of experts, so `time(256) / time(8)` should stay near 1 for the clover dispatch.
Weights are float32 random, `ragged_dot`'s copies pre-transposed to its `[experts, in, out]`
layout outside the timing. Timing: alternating, medians (`benchmarks/common.py`).

A `ragged_dot` call (after compiling) that takes more than `--ragged-limit-s` seconds is timed
with that one sample, and the larger expert counts at the same rows skip `ragged_dot` (it grows
with the expert count on XLA:CPU, see the results), so the script's time stays bounded; the
JSON says so. `distinct_experts_used` is how many experts the routed pairs touch: at 32 rows it
grows with the expert count (random routing spreads 256 pairs over more experts), and each
touched expert's weights must be read once, so some growth is inherent to the problem.

Target (`checks`): at 32 rows, clover's time at the most experts <= 1.5x its time at the fewest.
The hardware bound of that ratio is the ratio of the two roofline times (the distinct experts'
bytes over the read bandwidth, or the FLOPs over the matmul rate, whichever is larger).

Usage: `python benchmarks/moe_scaling.py [--quick] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import alternate, check, emit, machine, ratio, setup_environment, timed  # noqa: E402

setup_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from clover_jax.nn.expert_dispatch import routed_expert_mlp  # noqa: E402


def route(x, router, top_k):
    probabilities = jax.nn.softmax(jnp.einsum("th,eh->te", x, router, preferred_element_type=jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probabilities, top_k)
    return expert_ids, weights / jnp.sum(weights, axis=-1, keepdims=True)


@jax.jit
def clover_layer(x, router, gate_up_proj, down_proj):
    expert_ids, weights = route(x, router, TOP_K)
    return routed_expert_mlp(x, expert_ids, weights, gate_up_proj, down_proj)


@jax.jit
def ragged_layer(x, router, gate_up_in_out, down_in_out):
    """The same layer with `jax.lax.ragged_dot`; weights [experts, in, out]."""
    num_experts = gate_up_in_out.shape[0]
    expert_ids, weights = route(x, router, TOP_K)
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // TOP_K]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    gate, up = jnp.split(jax.lax.ragged_dot(rows, gate_up_in_out, group_sizes), 2, axis=-1)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_in_out, group_sizes)
    pair_weights = weights.reshape(-1)[order].astype(x.dtype)
    return jnp.zeros_like(x).at[order // TOP_K].add(out * pair_weights[:, None])


TOP_K = 8


def measure(num_experts: int, rows: int, hidden: int, intermediate: int, rounds: int, ragged_limit_s: float,
            run_ragged_dot: bool = True, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed + num_experts), 4)
    x = jax.random.normal(keys[0], (rows, hidden), jnp.float32)
    router = jax.random.normal(keys[1], (num_experts, hidden), jnp.float32) / hidden ** 0.5
    gate_up = jax.random.normal(keys[2], (num_experts, 2 * intermediate, hidden), jnp.float32) / hidden ** 0.5
    down = jax.random.normal(keys[3], (num_experts, hidden, intermediate), jnp.float32) / intermediate ** 0.5
    gate_up_t, down_t = jnp.swapaxes(gate_up, 1, 2), jnp.swapaxes(down, 1, 2)
    jax.block_until_ready((gate_up_t, down_t))

    run_clover = lambda: jax.block_until_ready(clover_layer(x, router, gate_up, down))
    run_ragged = lambda: jax.block_until_ready(ragged_layer(x, router, gate_up_t, down_t))
    clover_out = run_clover()  # compile
    expert_ids = np.asarray(jax.jit(route, static_argnums=2)(x, router, TOP_K)[0])
    distinct = int(len(np.unique(expert_ids)))
    expert_params = 3 * intermediate * hidden
    entry = {"experts": num_experts, "rows": rows, "top_k": TOP_K, "pairs": rows * TOP_K,
             "distinct_experts_used": distinct,
             "bytes": 4 * (distinct * expert_params + num_experts * hidden + 2 * rows * hidden),
             "flops": 2 * rows * TOP_K * expert_params + 2 * rows * num_experts * hidden}
    if not run_ragged_dot:
        times = alternate({"clover_xla": run_clover}, rounds, warmup=False)
        times["ragged_dot"] = {"median": None, "samples": [], "last": None,
                               "note": "not run: the previous expert count already took more than "
                                       f"{ragged_limit_s}s per call"}
        entry.update({name + "_s": {k: v for k, v in value.items() if k != "last"} for name, value in times.items()})
        entry["ragged_over_clover"] = None
        return entry
    jax.block_until_ready(ragged_layer.lower(x, router, gate_up_t, down_t).compile()(x, router, gate_up_t, down_t))
    first_ragged, reference = timed(run_ragged)
    entry["max_relative_difference"] = float(jnp.max(jnp.abs(clover_out - reference))
                                             / (jnp.max(jnp.abs(reference)) + 1e-30))
    if first_ragged > ragged_limit_s:
        times = alternate({"clover_xla": run_clover}, rounds, warmup=False)
        times["ragged_dot"] = {"median": first_ragged, "samples": [first_ragged], "last": None,
                               "note": f"one sample: a call took more than {ragged_limit_s}s"}
    else:
        times = alternate({"clover_xla": run_clover, "ragged_dot": run_ragged}, rounds, warmup=False)
    for name, value in times.items():
        value.pop("last", None)
        entry[name + "_s"] = value
    entry["ragged_over_clover"] = ratio(times["ragged_dot"]["median"], times["clover_xla"]["median"])
    return entry  # the arrays are freed with this frame (the closures above hold them until then)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: small shapes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--ragged-limit-s", type=float, default=5.0,
                        help="ragged_dot slower than this: one sample, and larger expert counts at the same rows "
                             "are not run")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.experts, args.rows, args.hidden, args.intermediate = 2, [8, 16], [32], 64, 32

    from benchmarks import machine_rates

    rates = machine_rates.measure()
    results = []
    for rows in args.rows:
        run_ragged_dot = True
        for experts in args.experts:
            results.append(measure(experts, rows, args.hidden, args.intermediate, args.rounds, args.ragged_limit_s,
                                   run_ragged_dot))
            ragged = results[-1]["ragged_dot_s"]["median"]
            run_ragged_dot = ragged is not None and ragged <= args.ragged_limit_s
            print(f"moe_scaling rows={rows} experts={experts}: clover {results[-1]['clover_xla_s']['median']:.4f}s "
                  f"ragged_dot {ragged}", file=sys.stderr)
    for entry in results:
        entry["bound_s"] = max(entry["bytes"] / rates["read_bytes_per_s"], entry["flops"] / rates["matmul_flops_per_s"])
        entry["clover_over_bound"] = entry["clover_xla_s"]["median"] / entry["bound_s"]
    scaling, checks = {}, []
    for rows in args.rows:
        by_experts = {r["experts"]: r for r in results if r["rows"] == rows}
        low, high = min(by_experts), max(by_experts)
        scaling[str(rows)] = {
            "experts": [low, high],
            "clover_xla_time_ratio": ratio(by_experts[high]["clover_xla_s"]["median"],
                                           by_experts[low]["clover_xla_s"]["median"]),
            "ragged_dot_time_ratio": ratio(by_experts[high]["ragged_dot_s"]["median"] or 0.0,
                                           by_experts[low]["ragged_dot_s"]["median"]) or None,
            "bound_time_ratio": ratio(by_experts[high]["bound_s"], by_experts[low]["bound_s"]),
        }
        if rows == 32:
            checks.append(check(f"MoE time at 32 rows, {high} / {low} experts", scaling["32"]["clover_xla_time_ratio"],
                                1.5, False, scaling["32"]["bound_time_ratio"],
                                f"{by_experts[high]['distinct_experts_used']} distinct experts to read against "
                                f"{by_experts[low]['distinct_experts_used']}"))
    emit({"benchmark": "moe_scaling", "quick": args.quick,
          "shape": {"hidden": args.hidden, "intermediate": args.intermediate, "top_k": TOP_K, "dtype": "float32"},
          "layer": "router + routed experts (shared expert excluded)", "rounds": args.rounds,
          "machine_rates": rates, "results": results, "time_ratio_most_over_fewest_experts": scaling,
          "checks": checks, "machine": machine()})


if __name__ == "__main__":
    main()
