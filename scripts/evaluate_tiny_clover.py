"""Score the bundled tiny Clover on its 200 held-out prompts; print JSON, optionally write the table.

    python scripts/evaluate_tiny_clover.py            # diffusion, autoregressive, self-speculative; shipped config
    python scripts/evaluate_tiny_clover.py --grid     # + thresholds x block sizes
    python scripts/evaluate_tiny_clover.py --grid --write-table docs/tiny_model.md

With --write-table, the markdown table of exact match and tokens per forward replaces the text
between `<!-- eval-table:start -->` and `<!-- eval-table:end -->` in the given file.

Self-speculative decoding is `generate(mode="self_speculative")` (the shipped block size drafts
each round); besides its score, the report says whether its output equals the autoregressive
output on every prompt (it is lossless) and what its rounds did (drafts accepted, tokens
emitted per round).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clover_jax.training.tiny.recipe import BUNDLED_DIR, Recipe  # noqa: E402

START, END = "<!-- eval-table:start -->", "<!-- eval-table:end -->"


def markdown_table(grid: list[dict], thresholds: list[float], block_sizes: list[int]) -> str:
    cell = {(r["block_size"], r["threshold"]): r for r in grid}
    header = "| threshold | " + " | ".join(f"B = {b}" for b in block_sizes) + " |"
    lines = [header, "|---" * (len(block_sizes) + 1) + "|"]
    for threshold in thresholds:
        row = [f"{threshold:g}"]
        for size in block_sizes:
            r = cell[(size, threshold)]
            row.append(f"{100 * r['answer_match']:.1f}% · {r['tokens_per_forward']:.2f} tok/fwd")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_table(path: str, table: str) -> None:
    with open(path) as handle:
        text = handle.read()
    if START not in text or END not in text:
        raise SystemExit(f"{path} has no {START} ... {END} markers")
    text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: f"{START}\n{table}\n{END}", text, flags=re.S)
    with open(path, "w") as handle:
        handle.write(text)


def self_speculative_rounds(model, prompts: list[list[int]], autoregressive: list[list[int]]) -> dict:
    """What self-speculative decoding's rounds did on `prompts` (greedy, the shipped config), and
    whether its output equals the greedy autoregressive output `autoregressive` prompt by prompt."""
    import numpy as np

    from decoding import generate

    out = generate(model, prompts, mode="self_speculative", return_trajectory=True)
    rounds = [len(t["accepted"]) for t in out.trajectory]
    accepted = [a for t in out.trajectory for a in t["accepted"]]
    emitted = [e for t in out.trajectory for e in t["emitted"]]
    return {
        "equals_autoregressive": float(np.mean([a == b for a, b in zip(out.sequences, autoregressive, strict=True)])),
        "mean_rounds": float(np.mean(rounds)),
        "mean_drafts_accepted_per_round": float(np.mean(accepted)),
        "mean_tokens_emitted_per_round": float(np.mean(emitted)),
        "whole_draft_accepted_fraction": float(np.mean([a == len(t["drafts"][0]) for t in out.trajectory
                                                        for a in t["accepted"]])),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=BUNDLED_DIR)
    parser.add_argument("--prompts", type=int, default=200, help="held-out prompts to score")
    parser.add_argument("--no-thinking", action="store_true", help="prompts rendered with enable_thinking=False")
    parser.add_argument("--grid", action="store_true", help="also score every threshold x block size")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9, 0.95, 0.99])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--write-table", metavar="FILE", help="replace the table between the markers in FILE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from tokenizers import Tokenizer

    from clover_jax import CloverModel
    from clover_jax.training.tiny.scoring import score_exact_match
    from decoding import GenerationConfig, generate

    # Prompts are a few dozen tokens: a 64-token prefill chunk keeps generate's memory estimate
    # (one chunk of activations per sequence) small enough for a batch of 200.
    model = CloverModel.from_pretrained(args.checkpoint, strict=True, progress=False, chunk_size=64)
    tokenizer = Tokenizer.from_file(os.path.join(args.checkpoint, "tokenizer.json"))
    task = Recipe().task
    problems = task.held_out(args.prompts)
    shipped = GenerationConfig.from_pretrained(args.checkpoint)
    thinking = not args.no_thinking
    report = {"checkpoint": os.path.abspath(args.checkpoint), "thinking": thinking,
              "generation_config": {"block_size": shipped.block_size, "threshold": shipped.threshold,
                                    "max_new_tokens": shipped.max_new_tokens},
              "shipped": score_exact_match(model, tokenizer, task, problems, thinking),
              "autoregressive": score_exact_match(model, tokenizer, task, problems, thinking, mode="autoregressive"),
              "self_speculative": score_exact_match(model, tokenizer, task, problems, thinking,
                                                    mode="self_speculative")}
    prompts = [task.encode(tokenizer, problem, thinking).prompt for problem in problems]
    autoregressive = generate(model, prompts, mode="autoregressive").sequences
    report["self_speculative"].update(self_speculative_rounds(model, prompts, autoregressive))
    if args.grid:
        report["grid"] = []
        for size in args.block_sizes:
            for threshold in args.thresholds:
                result = score_exact_match(model, tokenizer, task, problems, thinking, block_size=size,
                                           threshold=threshold)
                result.pop("failures")
                report["grid"].append({"block_size": size, "threshold": threshold, **result})
                print(f"B={size} threshold={threshold}: answer match {result['answer_match']:.3f}, "
                      f"{result['tokens_per_forward']:.2f} tokens/forward", file=sys.stderr)
        table = markdown_table(report["grid"], args.thresholds, args.block_sizes)
        report["table"] = table
        if args.write_table:
            write_table(args.write_table, table)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
