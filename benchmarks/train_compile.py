"""What fits where for fine-tuning Clover-35B-A3B: the real train step compiled for TPU and GPU
targets from this CPU host, and the compiler's bytes per chip.

Each row is `clover_jax.plan(config, target, task="train", config=FinetuneConfig(...), compile=True)`:
the whole step — 40 layers, the clean stream and both noisy copies (block size 32, complementary
copy on: three streams of rows), the chunked cross-entropy over the 248,320-token vocabulary,
the backward pass, the AdamW update — with abstract sharded arguments, on the mesh and with the
remat the planner chooses, compiled by the target's own compiler. Then the longest sequence
(of `--seq-lens`) whose step still fits.

Rows (`RUNS`): LoRA r16 on attention + GDN + shared expert + routed experts over a bfloat16 base,
v5e-8 and H200x8, 8 x 4,096; full fine-tuning (bfloat16 compute, float32 master, AdamW), v5p-64,
64 x 4,096; QLoRA int4 r16 without routed-expert adapters, v6e-1, 1 x 2,048; the same with them.
Targets (`checks`): the first four fit (total <= 90% of a chip). Besides: the step's temporaries
at 4,096 and 8,192 tokens on one row (`--logits-row`), against the float32 logits of every row.

A full-size compile takes minutes and several GB of host memory: rows run one at a time, each in
its own compile subprocess; `--resume-dir` keeps each finished row (an interrupted run picks up).

Usage: `python benchmarks/train_compile.py [--rows v6e-1-qlora ...] [--seq-lens 4096 8192 ...]
[--remat full ...] [--resume-dir DIR] [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, setup_environment  # noqa: E402

setup_environment()

ADAPTED = ("attention", "gdn", "shared_expert", "routed_experts")
# name: (target, FinetuneConfig fields, must fit)
RUNS = {
    "v5e-8-lora": ("v5e-8", dict(method="lora", lora_rank=16, lora_targets=ADAPTED, batch_size=8, seq_len=4096), True),
    "H200x8-lora": ("H200x8", dict(method="lora", lora_rank=16, lora_targets=ADAPTED, batch_size=8, seq_len=4096),
                    True),
    "v5p-64-full": ("v5p-64", dict(method="full", param_dtype="bfloat16", batch_size=64, seq_len=4096), True),
    "v6e-1-qlora": ("v6e-1", dict(method="lora", lora_rank=16, quantize="int4", batch_size=1, seq_len=2048,
                                  lora_targets=ADAPTED[:3]), True),
    "v6e-1-qlora-experts": ("v6e-1", dict(method="lora", lora_rank=16, quantize="int4", batch_size=1, seq_len=2048,
                                          lora_targets=ADAPTED), False),
}
SEQ_LENS = (4096, 8192, 16384, 32768)


def row_of(name: str, plan, seconds: float) -> dict:
    (option,) = plan.options
    memory = option.compiled["train_step"]
    target, fields, must_fit = RUNS[name]
    return {"row": name, "target": target, "run": option.weights, "batch": fields["batch_size"],
            "seq_len": fields["seq_len"], "mesh": option.mesh, "remat": option.remat,
            "max_seq_len": option.max_seq_len, "must_fit": must_fit, "seconds": seconds,
            "error": memory.error, "argument_bytes": memory.argument_bytes, "temp_bytes": memory.temp_bytes,
            "output_bytes": memory.output_bytes, "alias_bytes": memory.alias_bytes, "total_bytes": memory.total_bytes,
            "device_bytes": option.device_bytes, "fits": option.fits, "kernel_calls": memory.kernel_calls,
            "estimate_bytes": option.total_bytes, "refused_temp_bytes": refused_temp_bytes(memory.error),
            "offload_base": option.offload_base, "host_bytes": memory.host_bytes}


def refused_temp_bytes(error: str | None) -> int | None:
    """The temporaries a TPU compiler names when it refuses a program for memory ("the total memory
    required for HLO temporaries (35.52G) exceeds available HBM"), in bytes; None otherwise."""
    found = re.search(r"HLO temporaries \(([0-9.]+)G\)", error or "")
    return None if found is None else int(float(found.group(1)) * 2**30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seq-lens", nargs="*", type=int, default=list(SEQ_LENS))
    parser.add_argument("--logits-row", default="v6e-1-qlora", help="the row compiled at 4,096 and 8,192 tokens")
    parser.add_argument("--remat", nargs="*", default=None, help="remat choices tried (default: the planner's)")
    parser.add_argument("--resume-dir", default=None)
    parser.add_argument("--quick", action="store_true", help="the v6e-1 QLoRA row at its own length only")
    parser.add_argument("--quick-row", default=None, choices=list(RUNS), help="this row at its own length only")
    args = parser.parse_args()

    import clover_jax
    from clover_jax.core.config import CLOVER_35B_A3B, CloverConfig
    from clover_jax.training.config import FinetuneConfig

    config = CloverConfig.from_dict(CLOVER_35B_A3B)
    quick = args.quick or args.quick_row is not None
    names, seq_lens = ([args.quick_row or "v6e-1-qlora"], []) if quick else (args.rows, args.seq_lens)

    def saved(key: str, compute):
        path = os.path.join(args.resume_dir, f"{key}.json") if args.resume_dir else None
        if path and os.path.exists(path):
            with open(path) as handle:
                return json.load(handle)
        result = compute()
        if path:
            os.makedirs(args.resume_dir, exist_ok=True)
            with open(path, "w") as handle:
                json.dump(result, handle)
        return result

    def compile_row(name: str, **overrides) -> dict:
        target, fields, _ = RUNS[name]
        finetune = FinetuneConfig(block_size=32, complementary=True, **{**fields, **overrides})
        started = time.perf_counter()
        plan = clover_jax.plan(config, target, task="train", config=finetune, compile=True, seq_lens=seq_lens,
                               remat_choices=args.remat)
        row = row_of(name, plan, time.perf_counter() - started)
        print(f"train_compile: {name}: {row['seconds']:.0f} s, {row['error'] or row['total_bytes'] / 2**30}",
              file=sys.stderr)
        return row

    remat = "-".join(args.remat or ["planner"])
    rows = [saved(f"{name}-{remat}-{'-'.join(map(str, seq_lens))}", lambda name=name: compile_row(name))
            for name in names]
    logits = []
    if not quick:
        seq_lens = []
        for length in (4096, 8192):
            row = saved(f"logits-{args.logits_row}-{length}",
                        lambda length=length: compile_row(args.logits_row, seq_len=length, remat="full"))
            refused = refused_temp_bytes(row["error"])  # a refusal for memory still names the temporaries
            logits.append({"seq_len": length, "temp_bytes": row["temp_bytes"] or refused,
                           "error": row["error"] if refused is None else None,
                           "streams_logits_bytes": 3 * length * RUNS[args.logits_row][1]["batch_size"]
                           * config.vocab_size * 4})
    checks = [check(f"{row['row']}: compiled total / chip", None if row["error"] else
                    row["total_bytes"] / row["device_bytes"], 0.9, at_least=False) for row in rows if row["must_fit"]]
    if len(logits) == 2 and not any(entry["error"] for entry in logits):
        added = logits[1]["temp_bytes"] - logits[0]["temp_bytes"]
        checks.append(check("temporaries added by 4,096 more tokens / their float32 logits (three streams)",
                            added / (logits[1]["streams_logits_bytes"] - logits[0]["streams_logits_bytes"]), 0.5,
                            at_least=False))
    emit({"machine": machine(), "model": "Clover-35B-A3B shapes (40 layers, vocabulary 248,320)", "rows": rows,
          "logits": logits, "seq_lens": seq_lens, "checks": checks})


if __name__ == "__main__":
    main()
