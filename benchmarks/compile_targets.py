"""Clover-35B-A3B compiled for every named accelerator from this CPU host: compile time, bytes per
device (the compiler's), headroom, and the arithmetic estimate beside them.

For each target of `clover_jax.parallel.targets`, `clover_jax.plan(..., compile=True)` compiles the
block-diffusion, autoregressive and self-speculative loops at the real shapes (40 layers,
vocabulary 248,320, 256 experts of 512, top-8; bfloat16 activations), context 32,768, batch 1,
with abstract parameters, by the target's own compiler (libtpu / XLA's CUDA compiler), on the
mesh the plan chooses. Which formats (`--formats`):
  * `checked` (default): the formats the targets below name, and on every other target the
    format the arithmetic recommends;
  * `all`: every format whose weights alone fit the device (about an hour on 2 cores).

Targets (`checks`), by the compiler:
  * one TPU v6e: int4 experts compile, arguments + temporaries <= 90% of the chip;
  * TPU v5e-8, TPU v6e-8, one H200: bfloat16 fits;
  * quantised loops' temporaries <= 1.1x the bfloat16 loop's on the same mesh (v5e-8, H200);
  * the arithmetic estimate within 15% of the compiler's bytes, every compiled target and format.

Usage: `python benchmarks/compile_targets.py [--formats checked|all] [--targets v6e-1 H200 ...]
[--context-length 32768] [--resume-dir DIR]`. With `--resume-dir`, each target's rows are written to
DIR/<target>.json as soon as it is compiled, and a target already there is read back instead of
compiled again (the whole run takes over an hour on 2 cores; an interrupted one picks up where it
stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, setup_environment  # noqa: E402

setup_environment()

# Formats the targets name (the rest take the arithmetic's recommendation under `checked`).
NAMED = {"v6e-1": ["int4 experts (g128)"], "v5e-8": ["bfloat16", "int8 experts", "int4 experts (g128)"],
         "v6e-8": ["bfloat16"], "H200": ["bfloat16", "int4 experts (g128)"]}
ESTIMATE_TOLERANCE = 0.15
TEMP_RATIO = 1.1


def chosen_formats(target: str, estimate, formats: str) -> list[str]:
    fitting = [option.weights for option in estimate.options if option.weight_bytes <= option.device_bytes]
    if formats == "all":
        return fitting
    named = NAMED.get(target) or ([estimate.recommendation.weights] if estimate.recommendation else [])
    return [name for name in named if name in fitting]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", choices=["checked", "all"], default="checked")
    parser.add_argument("--targets", nargs="*", default=None)
    parser.add_argument("--context-length", type=int, default=32768)
    parser.add_argument("--quick", action="store_true", help="one target (v6e-1), its int4 loops only")
    parser.add_argument("--resume-dir", default=None, help="keep each target's rows here; reuse those found")
    args = parser.parse_args()

    import clover_jax
    from clover_jax.core.config import CLOVER_35B_A3B, CloverConfig
    from clover_jax.parallel.planner import HEADROOM, estimate
    from clover_jax.parallel.targets import TARGETS

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    targets = ["v6e-1"] if args.quick else (args.targets or list(TARGETS))
    rows, checks, recommendations = [], [], {}
    for name in targets:
        saved = os.path.join(args.resume_dir, f"{name}.json") if args.resume_dir else None
        if saved and os.path.exists(saved):
            with open(saved) as f:
                done = json.load(f)
            if done["context_length"] == args.context_length and done["formats"] == args.formats:
                rows += done["rows"]
                recommendations[name] = done["recommendation"]
                print(f"compile_targets: {name}: read back from {saved}", file=sys.stderr)
                continue
        target_rows = []
        wanted = chosen_formats(name, estimate(config, name, args.context_length), args.formats)
        if args.quick:
            wanted = wanted[:1]
        started = time.perf_counter()
        planned = clover_jax.plan(config, name, context_length=args.context_length, compile=True, formats=wanted)
        recommendations[name] = planned.recommendation.weights if planned.recommendation else None
        print(f"compile_targets: {name}: {len(wanted)} formats in {time.perf_counter() - started:.0f} s",
              file=sys.stderr)
        for option in planned.options:
            if option.weights not in wanted:
                continue
            for mode, memory in option.compiled.items():
                target_rows.append({
                    "target": name, "weights": option.weights, "mesh": option.mesh, "loop": mode,
                    "compile_s": memory.compile_seconds, "error": memory.error,
                    "kernel_calls": memory.kernel_calls,
                    "argument_bytes": memory.argument_bytes, "temp_bytes": memory.temp_bytes,
                    "output_bytes": memory.output_bytes, "alias_bytes": memory.alias_bytes,
                    "total_bytes": memory.total_bytes, "device_bytes": option.device_bytes,
                    "fraction_of_device": memory.total_bytes / option.device_bytes if not memory.error else None,
                    "estimate_bytes": option.total_bytes,
                    "estimate_error": (option.total_bytes / memory.total_bytes - 1) if not memory.error else None,
                    "fits": option.fits,
                })
        rows += target_rows
        if saved:
            os.makedirs(args.resume_dir, exist_ok=True)
            with open(saved, "w") as f:
                json.dump({"context_length": args.context_length, "formats": args.formats,
                           "rows": target_rows, "recommendation": recommendations[name]}, f)
    by = lambda target, weights: [r for r in rows if r["target"] == target and r["weights"] == weights]

    def worst_fraction(target, weights):
        found = by(target, weights)
        return None if not found or any(r["error"] for r in found) else max(r["fraction_of_device"] for r in found)

    if "v6e-1" in recommendations:
        checks.append(check("v6e-1 int4: arguments + temporaries / chip (every loop, by the compiler)",
                            worst_fraction("v6e-1", "int4 experts (g128)"), HEADROOM, at_least=False))
    for target in ("v5e-8", "v6e-8", "H200"):
        if target in recommendations:
            checks.append(check(f"{target} bf16: bytes / usable device memory (every loop, by the compiler)",
                                worst_fraction(target, "bfloat16"), HEADROOM, at_least=False))
    for target in ("v5e-8", "H200"):
        bf16 = {r["loop"]: r["temp_bytes"] for r in by(target, "bfloat16") if not r["error"]}
        for weights in ("int8 experts", "int4 experts (g128)"):
            quantised = [r["temp_bytes"] / bf16[r["loop"]] for r in by(target, weights)
                         if not r["error"] and r["loop"] in bf16]
            if quantised:
                checks.append(check(f"{target} {weights}: temporaries / bf16 temporaries (worst loop)",
                                    max(quantised), TEMP_RATIO, at_least=False))
    errors = [abs(r["estimate_error"]) for r in rows if r["estimate_error"] is not None]
    if errors:
        worst = max(rows, key=lambda r: abs(r["estimate_error"] or 0))
        checks.append(check("arithmetic estimate vs compiler bytes, worst absolute error over targets and formats",
                            max(errors), ESTIMATE_TOLERANCE, at_least=False,
                            note=f"worst: {worst['target']} {worst['weights']} {worst['loop']}"))
    refused = [f"{r['target']} {r['weights']} {r['loop']}: {r['error']}" for r in rows if r["error"]]
    emit({"machine": machine(), "model": "Clover-35B-A3B shapes (40 layers)", "context_length": args.context_length,
          "batch": 1, "formats": args.formats, "rows": rows, "refused": refused,
          "recommendations": recommendations,
          "checks": checks})


if __name__ == "__main__":
    main()
