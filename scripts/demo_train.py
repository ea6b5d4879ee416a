"""`make demo-train`: Clover's own story in miniature — an autoregressive Qwen3.5-MoE base becomes a Clover.

    python scripts/demo_train.py [--data FILE.jsonl] [--out DIR]

1. The bundled autoregressive base (`clover_jax/bundled/tiny-qwen-base`, `qwen3_5_moe_text`, no mask
   token) is scored on the task's 200 held-out prompts: it answers autoregressively and cannot decode
   by diffusion at all (no mask token).
2. `clover-jax train` converts it on the task's chat JSONL (written here unless --data is given),
   with the task's decoding controls as the written generation config (neutral penalties, block 16,
   threshold 0.9) — the command is printed before it runs.
3. The result is scored by diffusion (its generation config) and autoregressively.

Prints one JSON object with the accuracies, tokens per forward and the wall time of each part;
exits 1 if the converted model misses the demo's bar (>= 95% exact by diffusion with >= 5 tokens per
forward, >= 95% autoregressively).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clover_jax.training.tiny.recipe import BASE_DIR, CONVERSION, Recipe, conversion_flags, write_task_data  # noqa: E402

BAR = {"diffusion_exact": 0.95, "tokens_per_forward": 5.0, "autoregressive_exact": 0.95}


def score(checkpoint: str, prompts: int, modes: tuple[str, ...]) -> dict:
    from tokenizers import Tokenizer

    from clover_jax import CloverModel
    from clover_jax.training.tiny.scoring import score_exact_match

    model = CloverModel.from_pretrained(checkpoint, progress=False, chunk_size=64)
    tokenizer = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    task = Recipe().task
    problems = task.held_out(prompts)
    results = {}
    for mode in modes:
        result = score_exact_match(model, tokenizer, task, problems, mode=mode)
        results[mode] = {key: result[key] for key in ("answer_match", "full_match", "tokens_per_forward", "seconds")}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="training chat JSONL (default: the task's, generated)")
    parser.add_argument("--out", default=os.path.join("build", "demo-clover"), help="where the Clover is written")
    parser.add_argument("--prompts", type=int, default=200, help="held-out prompts scored")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    started = time.perf_counter()
    report: dict = {"base": BASE_DIR, "out": os.path.abspath(args.out)}
    report["base_scores"] = score(BASE_DIR, args.prompts, ("autoregressive",))
    report["base_scores"]["diffusion"] = "not possible: the base has no mask token (model_type qwen3_5_moe_text)"
    with tempfile.TemporaryDirectory(prefix="demo-train-") as scratch:
        data = args.data or write_task_data(os.path.join(scratch, "train.jsonl"), Recipe().task, count=20_000, seed=1,
                                            thinking_fraction=0.8)
        overrides = os.path.join(scratch, "generation_config.json")
        with open(overrides, "w") as handle:
            json.dump(CONVERSION.generation_config, handle)
        command = [sys.executable, "-m", "clover_jax", "train", "--model", BASE_DIR, "--data", data, "--out", args.out,
                   "--generation-config", overrides, *conversion_flags()]
        print("$ " + " ".join(shlex.quote(part) for part in command), file=sys.stderr, flush=True)
        train_started = time.perf_counter()
        metrics = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout.splitlines()
        report["train_seconds"] = round(time.perf_counter() - train_started, 1)
    report["train_metrics"] = [json.loads(line) for line in metrics if '"loss"' in line][-1:]
    report["clover_scores"] = score(args.out, args.prompts, ("diffusion", "autoregressive"))
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    clover = report["clover_scores"]
    report["bar"] = BAR
    report["met"] = (clover["diffusion"]["answer_match"] >= BAR["diffusion_exact"]
                     and clover["diffusion"]["tokens_per_forward"] >= BAR["tokens_per_forward"]
                     and clover["autoregressive"]["answer_match"] >= BAR["autoregressive_exact"])
    print(json.dumps(report, indent=2))
    return 0 if report["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
