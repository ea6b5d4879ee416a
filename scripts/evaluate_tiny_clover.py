"""Score the bundled tiny Clover on its 200 held-out prompts; print JSON, optionally write the table.

    python scripts/evaluate_tiny_clover.py                        # diffusion and autoregressive, shipped config
    python scripts/evaluate_tiny_clover.py --grid                 # + thresholds x block sizes
    python scripts/evaluate_tiny_clover.py --grid --write-table docs/tiny_model.md
    python scripts/evaluate_tiny_clover.py --self-speculative-estimate

With --write-table, the markdown table of exact match and tokens per forward replaces the text
between `<!-- eval-table:start -->` and `<!-- eval-table:end -->` in the given file.

--self-speculative-estimate is a SIMULATION, not a decoder: it estimates what lossless
self-speculative decoding (one denoising pass drafts a block, one causal pass verifies it)
would achieve, from the model's real draft passes and its real autoregressive output. Per
round, the draft is the greedy choice (after the generation config's `process` controls)
of one denoising pass over B positions after the committed tokens (in the first round, the
prompt tail and masks, laid out as `generate` lays out the first block); the verify pass is
not run: its greedy tokens are, by definition, the autoregressive ones, so a round accepts
the longest run of draft tokens equal to the autoregressive continuation, plus one. Forwards
are 2 per round, plus the prefill when the prompt has whole blocks (as `generate` counts
NFE); tokens per forward = response tokens / forwards.
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

from clover_jax.training.recipe import BUNDLED_DIR, Recipe  # noqa: E402

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


def self_speculative_estimate(model, prompts: list[list[int]], config, autoregressive: list[list[int]]) -> dict:
    """Simulated self-speculative decoding (see the module docstring) of `prompts`, whose greedy
    autoregressive responses are `autoregressive`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from decoding.controls import choose, process
    from decoding.generation import _controls, _prompt_thinking, _token_ids  # the controls generate uses

    size, mask = config.block_size, config.mask_token_id
    controls, ids = _controls(config), _token_ids(model, config)
    vocab = model.config.vocab_size
    draft_tokens = jax.jit(jax.vmap(lambda logits, counts, index, thinking: choose(
        process(logits, counts, index, thinking, controls, ids), controls, False, None).token))
    batch = len(prompts)
    # One width for every round, so the prefill and the draft pass compile once.
    width = max(len(p) for p in prompts) + config.max_new_tokens
    tails = [len(p) % size for p in prompts]
    done = np.zeros(batch, np.int64)  # response tokens committed so far
    forwards = np.array([len(p) - t > 0 for p, t in zip(prompts, tails)], np.int64)
    rounds, accepted_runs = np.zeros(batch, np.int64), []
    first_round = True
    while any(done[i] < len(autoregressive[i]) for i in range(batch)):
        prefix = np.zeros((batch, width), np.int32)  # left padding: any id, masked by `start`
        start = np.zeros(batch, np.int32)
        blocks = np.full((batch, size), mask, np.int32)
        index = np.zeros((batch, size), np.int32)  # response index t of each block row
        counts = np.zeros((batch, vocab), np.int32)
        thinking = np.zeros(batch, bool)
        for i, prompt in enumerate(prompts):
            committed = autoregressive[i][:done[i]]
            if first_round:
                known = prompt[:len(prompt) - tails[i]]
                blocks[i, :tails[i]] = prompt[len(prompt) - tails[i]:]
                index[i] = np.arange(size) - tails[i]
            else:
                known = prompt + committed
                index[i] = done[i] + np.arange(size)
            start[i] = width - len(known)
            prefix[i, start[i]:] = known
            np.add.at(counts[i], committed, 1)
            thinking[i] = _prompt_thinking(prompt + committed, config)
        state = model.init_state(batch, width + size, start)
        _, state = model.extend(state, prefix, logits="none")
        drafts = np.asarray(draft_tokens(model.denoise(state, blocks).logits, jnp.asarray(counts),
                                         jnp.asarray(index), jnp.asarray(thinking)))
        for i in range(batch):
            target = autoregressive[i][done[i]:]
            if not target:
                continue
            drafted = drafts[i, tails[i] if first_round else 0:]
            run = 0
            while run < min(len(drafted), len(target)) and drafted[run] == target[run]:
                run += 1
            accepted = min(run + 1, len(target))
            accepted_runs.append(accepted)
            done[i] += accepted
            forwards[i] += 2
            rounds[i] += 1
        first_round = False
    tokens = np.array([len(a) for a in autoregressive])
    return {
        "simulation": "self-speculative estimate: real draft passes, verify = autoregressive greedy tokens",
        "block_size": size,
        "tokens_per_forward": float(np.mean(tokens / np.maximum(forwards, 1))),
        "tokens_per_forward_pooled": float(tokens.sum() / max(forwards.sum(), 1)),
        "mean_forwards": float(np.mean(forwards)),
        "mean_rounds": float(np.mean(rounds)),
        "mean_accepted_per_round": float(np.mean(accepted_runs)),
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
    parser.add_argument("--self-speculative-estimate", action="store_true",
                        help="simulate self-speculative decoding (a labelled estimate, see above)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from tokenizers import Tokenizer

    from clover_jax import CloverModel
    from clover_jax.training.evaluation import evaluate
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
              "shipped": evaluate(model, tokenizer, task, problems, thinking),
              "autoregressive": evaluate(model, tokenizer, task, problems, thinking, mode="autoregressive")}
    if args.self_speculative_estimate:
        prompts = [task.encode(tokenizer, problem, thinking).prompt for problem in problems]
        autoregressive = generate(model, prompts, mode="autoregressive").sequences
        report["self_speculative_estimate"] = {
            "exact_match": report["autoregressive"]["answer_match"],  # lossless: the autoregressive output
            **self_speculative_estimate(model, prompts, shipped, autoregressive)}
    if args.grid:
        report["grid"] = []
        for size in args.block_sizes:
            for threshold in args.thresholds:
                result = evaluate(model, tokenizer, task, problems, thinking, block_size=size, threshold=threshold)
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
