"""Kernel benchmark: each Pallas kernel against its XLA oracle, side by side, in one run.

What it does:

* GDN chunked rule, forward: `pallas_kernels.gdn_chunk` against `clover_jax.nn.gated_delta.
  chunked_gated_delta_rule` (the XLA path the model uses) and `gdn_chunk_reference` (token by
  token, the oracle).
* Routed-expert grouped matmul at the gate_up and down shapes: `pallas_kernels.grouped_matmul`
  (every expert, and the coreset form with `--active-experts` listed), `grouped_matmul_for_platform`
  (megablox on TPU), `grouped_matmul_reference` (the oracle) and plain `jax.lax.ragged_dot` on
  weights already in its [experts, in, out] layout. The group sizes come from random top-k routing.

Each entry is the median wall time of `--repeats` calls after one warm-up call (which compiles).
On an accelerator it also reports achieved FLOP/s and bytes/s and their fraction of the device's
peak (a small table keyed by `device_kind`: H100, H200, TPU v5e, TPU v6e). The FLOP counts are the
kernel's own matmuls (for the GDN rule: the UT-transform form with its log2(chunk) inverse
squarings); the byte counts are what must cross HBM at least once (inputs, the weights of experts
that receive rows, outputs). GDN runs float32 matmuls at HIGHEST precision, so the bf16 peak is not
its ceiling.

On CPU Pallas only interprets, and interpret-mode timing says nothing about a kernel, so the
Pallas entries are skipped and the XLA paths are timed at reduced shapes (the JSON says so).

Prints one JSON object on stdout. Usage: `PYTHONPATH=. python benchmarks/kernels.py [--repeats 5]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python benchmarks/kernels.py` without installing the package
    sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import (  # noqa: E402
    gdn_chunk,
    gdn_chunk_reference,
    grouped_matmul,
    grouped_matmul_for_platform,
    grouped_matmul_reference,
)

# Dense bf16 matmul FLOP/s and HBM bytes/s, from the vendors' data sheets (H100/H200 SXM).
PEAKS = {
    "H100": {"flops": 989e12, "bytes_per_s": 3.35e12},
    "H200": {"flops": 989e12, "bytes_per_s": 4.8e12},
    "TPU v5 lite": {"flops": 197e12, "bytes_per_s": 819e9},  # v5e
    "TPU v5e": {"flops": 197e12, "bytes_per_s": 819e9},
    "TPU v6 lite": {"flops": 918e12, "bytes_per_s": 1640e9},  # v6e (Trillium)
    "TPU v6e": {"flops": 918e12, "bytes_per_s": 1640e9},
}

# Qwen3.6-35B-A3B shapes on an accelerator; the CPU run keeps head/expert structure but shrinks it.
ACCELERATOR_SHAPES = dict(batch=1, tokens=4096, key_heads=16, value_heads=32, head_dim=128,
                          hidden=2048, experts=256, intermediate=512, top_k=8, routed_tokens=512)
CPU_SHAPES = dict(batch=1, tokens=512, key_heads=16, value_heads=32, head_dim=128,
                  hidden=512, experts=32, intermediate=256, top_k=8, routed_tokens=128)


def peak_for(device_kind: str) -> dict | None:
    for name, peak in PEAKS.items():
        if name.lower() in device_kind.lower():
            return {"matched": name, **peak}
    return None


def median_seconds(function, args, repeats: int) -> float:
    jax.block_until_ready(function(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def entry(name, function, args, repeats, flops, bytes_moved, peak):
    try:
        seconds = median_seconds(jax.jit(function), args, repeats)
    except Exception as error:  # report and go on: one failing path should not hide the others
        return {"name": name, "error": f"{type(error).__name__}: {str(error)[:500]}"}
    result = {"name": name, "median_ms": round(seconds * 1e3, 4),
              "tflop_per_s": round(flops / seconds / 1e12, 4), "gb_per_s": round(bytes_moved / seconds / 1e9, 3)}
    if peak:
        result["fraction_of_peak_flops"] = round(flops / seconds / peak["flops"], 4)
        result["fraction_of_peak_bandwidth"] = round(bytes_moved / seconds / peak["bytes_per_s"], 4)
    return result


# ------------------------------------------------------------------------------- GDN chunked rule
def gdn_inputs(shapes, dtype, seed=0):
    rng = np.random.RandomState(seed)
    b, t, kh, vh, d = (shapes[n] for n in ("batch", "tokens", "key_heads", "value_heads", "head_dim"))
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    return (jnp.asarray(unit(rng.randn(b, t, kh, d)) * d ** -0.5, dtype),
            jnp.asarray(unit(rng.randn(b, t, kh, d)), dtype),
            jnp.asarray(rng.randn(b, t, vh, d), dtype), jnp.asarray(-np.log1p(np.exp(rng.randn(b, t, vh))), dtype),
            jnp.asarray(1 / (1 + np.exp(-rng.randn(b, t, vh))), dtype), jnp.zeros((b, vh, d, d), jnp.float32))


def gdn_cost(shapes, itemsize, chunk=64):
    b, t, kh, vh, d = (shapes[n] for n in ("batch", "tokens", "key_heads", "value_heads", "head_dim"))
    c, chunks = chunk, -(-t // chunk)
    squarings = max(0, int(math.log2(c)) - 1)
    per_chunk = (2 * c * c * d * 2            # (βk)kᵀ and qkᵀ
                 + squarings * 2 * 2 * c ** 3  # the (I + A)^-1 squarings
                 + 2 * c * c * d * 2          # the UT solves for values and keys
                 + 2 * c * d * d * 3          # W S, q S, kᵀ δ
                 + 2 * c * c * d)             # intra-chunk attention times δ
    flops = b * vh * chunks * per_chunk
    bytes_moved = (b * t * (2 * kh * d + vh * d + 2 * vh) * itemsize + b * t * vh * d * 4
                   + 2 * b * vh * d * d * 4)
    return flops, bytes_moved


def bench_gdn(shapes, dtype, accelerator, repeats, peak):
    args = gdn_inputs(shapes, dtype)
    flops, bytes_moved = gdn_cost(shapes, jnp.dtype(dtype).itemsize)
    results = []
    if accelerator:
        results.append(entry("pallas gdn_chunk", lambda *a: gdn_chunk(*a, interpret=False), args, repeats,
                             flops, bytes_moved, peak))
    try:
        from clover_jax.nn.gated_delta import chunked_gated_delta_rule
        results.append(entry("xla clover_jax.nn.gated_delta.chunked_gated_delta_rule", chunked_gated_delta_rule, args,
                             repeats, flops, bytes_moved, peak))
    except ImportError as error:
        results.append({"name": "xla clover_jax.nn.gated_delta.chunked_gated_delta_rule", "error": repr(error)})
    results.append(entry("oracle gdn_chunk_reference (token by token)", gdn_chunk_reference, args, repeats,
                         flops, bytes_moved, peak))
    return {"shapes": {k: shapes[k] for k in ("batch", "tokens", "key_heads", "value_heads", "head_dim")},
            "dtype": jnp.dtype(dtype).name, "flops": flops, "bytes": bytes_moved, "results": results}


# --------------------------------------------------------------------------- routed grouped matmul
def routed_group_sizes(shapes, seed=0) -> np.ndarray:
    """Rows per expert of random top-k routing (each token picks k distinct experts)."""
    rng = np.random.RandomState(seed)
    logits = rng.randn(shapes["routed_tokens"], shapes["experts"])
    chosen = np.argsort(-logits, axis=1)[:, :shapes["top_k"]]
    return np.bincount(chosen.reshape(-1), minlength=shapes["experts"]).astype(np.int32)


def bench_grouped(shapes, dtype, accelerator, repeats, peak, active_experts):
    sizes = routed_group_sizes(shapes)
    rows = int(sizes.sum())
    rng = np.random.RandomState(1)
    active = np.sort(np.argsort(-sizes)[:active_experts]).astype(np.int32)  # the busiest experts, as the coreset keeps
    itemsize = jnp.dtype(dtype).itemsize
    report = {"routed_rows": rows, "experts_with_rows": int((sizes > 0).sum()), "active_experts": active_experts,
              "dtype": jnp.dtype(dtype).name, "matmuls": {}}
    platform = jax.default_backend()
    for name, (cols, depth) in {"gate_up": (2 * shapes["intermediate"], shapes["hidden"]),
                                "down": (shapes["hidden"], shapes["intermediate"])}.items():
        lhs = jnp.asarray(rng.randn(rows, depth), dtype)
        rhs = jnp.asarray(rng.randn(shapes["experts"], cols, depth) * depth ** -0.5, dtype)
        rhs_in_out = jnp.swapaxes(rhs, 1, 2)  # ragged_dot's layout, transposed once outside the timing
        group_sizes, active_groups = jnp.asarray(sizes), jnp.asarray(active)

        def cost(groups, cols=cols, depth=depth):  # this iteration's shapes, bound
            used_rows = int(sizes[groups].sum())
            return (2 * used_rows * cols * depth,
                    (rows * depth + int((sizes[groups] > 0).sum()) * cols * depth + rows * cols) * itemsize)

        every, coreset = cost(np.arange(shapes["experts"])), cost(active)
        results = []
        if accelerator:
            results += [
                entry("pallas grouped_matmul", lambda x, w, g: grouped_matmul(x, w, g, interpret=False),
                      (lhs, rhs, group_sizes), repeats, *every, peak),
                entry(f"pallas grouped_matmul, {active_experts} active experts",
                      lambda x, w, g, a: grouped_matmul(x, w, g, active_groups=a, interpret=False),
                      (lhs, rhs, group_sizes, active_groups), repeats, *coreset, peak),
                entry(f"grouped_matmul_for_platform({platform!r}) auto",
                      lambda x, w, g: grouped_matmul_for_platform(platform, x, w, g),
                      (lhs, rhs, group_sizes), repeats, *every, peak),
            ]
        results += [
            entry("oracle grouped_matmul_reference (ragged_dot + masks)", grouped_matmul_reference,
                  (lhs, rhs, group_sizes), repeats, *every, peak),
            entry("xla jax.lax.ragged_dot, rhs pre-transposed", lambda x, w, g: jax.lax.ragged_dot(x, w, g),
                  (lhs, rhs_in_out, group_sizes), repeats, *every, peak),
        ]
        report["matmuls"][name] = {"lhs": list(lhs.shape), "rhs": list(rhs.shape), "flops_every_expert": every[0],
                                   "bytes_every_expert": every[1], "results": results}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=None, help="GDN sequence length (default per platform)")
    parser.add_argument("--active-experts", type=int, default=64)
    options = parser.parse_args()

    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    shapes = dict(ACCELERATOR_SHAPES if accelerator else CPU_SHAPES)
    if options.tokens:
        shapes["tokens"] = options.tokens
    dtype = jnp.bfloat16 if accelerator else jnp.float32  # XLA:CPU has no fast bf16 matmul
    peak = peak_for(device.device_kind) if accelerator else None
    report = {
        "backend": device.platform, "device_kind": device.device_kind, "jax": jax.__version__,
        "repeats": options.repeats, "statistic": "median wall time after one warm-up call",
        "pallas_kernels_timed": accelerator,
        "peak": peak,
    }
    if not accelerator:
        report["note"] = ("CPU: Pallas runs only in interpret mode here, whose timing says nothing about the "
                          "kernels, so only the XLA paths are timed, at reduced shapes (see 'shapes').")
    elif peak is None:
        report["note"] = f"no peak numbers for device_kind {device.device_kind!r}; fractions of peak omitted"
    started = time.perf_counter()
    report["gdn_chunk"] = bench_gdn(shapes, dtype, accelerator, options.repeats, peak)
    report["grouped_matmul"] = bench_grouped(shapes, dtype, accelerator, options.repeats, peak,
                                             min(options.active_experts, shapes["experts"]))
    report["shapes"] = shapes
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
