"""Block diffusion under a grammar: does the commit rule keep diffusion's parallelism?

The bundled tiny Clover on held-out 8-digit lists at block 32 (blocks take several steps), under
LowConfidence and under fixed_k with 2, 3 and 4 tokens per step, each decoded three ways: without a
constraint, under the answer line as a regular expression of digits (which the model's own answers
satisfy) with the "witness" gap rule (commits past an undecided position when this step's
candidates fill the gap validly), and with the "frontier" rule (one contiguous run from the
leftmost undecided position); and, under LowConfidence, an answer grammar the model was never
trained to write (letters), where the rule's fallbacks decide. Per cell: accuracy, response tokens
per forward, the host's grammar time per step and the share of steps each option of the commit rule
decided. Check: under the
witness rule, tokens per forward >= 0.8x the unconstrained decode's for every schedule. Then the
serving engine: the same prompts as concurrent requests (LowConfidence, 16 running), without and
under the digits grammar — tokens per second of each, the ratio, and how many responses equal
`generate`'s (reported, no target). Prints one JSON object.

    python benchmarks/constrained_decoding.py [--prompts 100] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, setup_environment  # noqa: E402

setup_environment()

BLOCK_SIZE = 32
DIGITS = 8
ANSWER = r"<think>\n[0-9]+ digits\n</think>\n\n[0-9]( [0-9])*"
SCHEDULES = [("low_confidence", {}), ("fixed_k", {"tokens_per_step": 2}), ("fixed_k", {"tokens_per_step": 3}),
             ("fixed_k", {"tokens_per_step": 4})]
# an answer the model was never trained to write: the grammar vetoes, and the rule's fallbacks decide
FOREIGN = r"<think>\n[0-9]+ digits\n</think>\n\n(a|bb)( (a|bb))*"
TARGET = 0.8


def run_cell(model, task, schedule: str, params: dict, constraint, gap_rule: str) -> dict:
    from decoding import GenerationConfig, generate

    config = GenerationConfig.from_pretrained(model.path, block_size=BLOCK_SIZE, schedule=schedule,
                                              max_new_tokens=task.max_new_tokens, constraint=constraint,
                                              constraint_gap_rule=gap_rule, **params)
    generate(model, task.prompts, config)  # compiled outside the timing
    started = time.perf_counter()
    out = generate(model, task.prompts, config)
    seconds = time.perf_counter() - started
    correct = [task.score(i, tokens) for i, tokens in enumerate(out.sequences)]
    tokens = sum(len(s) for s in out.sequences)
    cell = {"schedule": schedule, **params, "constraint": None if constraint is None else gap_rule,
            "accuracy": sum(correct) / len(correct), "tokens_per_forward": tokens / sum(out.nfe),
            "seconds": round(seconds, 2)}
    if out.constraint is not None:
        options = out.constraint["options"]
        total = max(sum(options.values()), 1)
        cell.update(grammar_ms_per_step=round(1e3 * out.constraint["grammar_seconds_per_step"], 3),
                    steps=out.constraint["steps"], options={k: round(v / total, 4) for k, v in sorted(options.items())})
    return cell


def run_engine(model, task, constraint, rounds: int = 5) -> dict:
    """The task's prompts through the serving engine at once (LowConfidence, block 32), greedy, with
    and without `constraint`, in alternating rounds (the median round's tokens per second of each)."""
    import contextlib
    import statistics

    from decoding import GenerationConfig, generate
    from decoding.engine import Engine, EngineRequest

    config = GenerationConfig.from_pretrained(model.path, block_size=BLOCK_SIZE, max_new_tokens=task.max_new_tokens)
    variants = {"none": None, "constrained": constraint}
    out = {}
    with contextlib.ExitStack() as stack:
        engines, requests, seconds, results = {}, {}, {name: [] for name in variants}, {}
        for name, value in variants.items():
            engines[name] = stack.enter_context(Engine(model, config, max_running=16, max_queue=len(task.prompts),
                                                       block_sizes=[BLOCK_SIZE]))
            overrides = {} if value is None else {"constraint": value}
            requests[name] = [EngineRequest(prompt, generation_config=config, overrides=overrides)
                              for prompt in task.prompts]
            engines[name].run(requests[name], timeout=1800)  # compiled outside the timing
        for _ in range(rounds):
            for name in variants:
                started = time.perf_counter()
                results[name] = engines[name].run(requests[name], timeout=1800)
                seconds[name].append(time.perf_counter() - started)
    for name, value in variants.items():
        expected = generate(model, task.prompts, config, constraint=value).sequences
        tokens = sum(len(result.tokens) for result in results[name])
        out[name] = {"tokens_per_s": round(tokens / statistics.median(seconds[name]), 1),
                     "seconds_per_round": [round(x, 3) for x in seconds[name]],
                     "equal_to_generate": sum(result.tokens == want
                                              for result, want in zip(results[name], expected, strict=True))}
    out["constrained_over_none_tokens_per_s"] = round(out["constrained"]["tokens_per_s"] / out["none"]["tokens_per_s"],
                                                      3)
    out["requests"] = len(task.prompts)
    return out


def main(argv=None) -> None:
    from clover_jax import CloverModel
    from clover_jax.api.research_tasks import sort_task
    from clover_jax.core.bundled import bundled_model_path
    from clover_jax.text.tokenizer import Tokenizer
    from decoding.constraints import Constraint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="16 prompts")
    args = parser.parse_args(argv)
    prompts = 16 if args.quick else args.prompts
    path = str(bundled_model_path())
    model = CloverModel.from_pretrained(path, progress=False, chunk_size=64)
    task = sort_task(Tokenizer.from_pretrained(path), count=prompts, min_digits=DIGITS, max_digits=DIGITS)
    constraint = Constraint.regex(ANSWER)
    started = time.perf_counter()
    cells, checks = [], []
    for schedule, params in SCHEDULES:
        free = run_cell(model, task, schedule, params, None, "witness")
        witness = run_cell(model, task, schedule, params, constraint, "witness")
        frontier = run_cell(model, task, schedule, params, constraint, "frontier")
        cells += [free, witness, frontier]
        label = schedule + "".join(f" {k}={v}" for k, v in params.items())
        checks.append(check(f"constrained diffusion ({label}): witness-rule tokens per forward / unconstrained",
                            witness["tokens_per_forward"] / free["tokens_per_forward"], TARGET, at_least=True,
                            note=f"frontier rule: {frontier['tokens_per_forward'] / free['tokens_per_forward']:.3f}"))
    foreign = Constraint.regex(FOREIGN)
    for gap_rule in ("witness", "frontier"):
        cell = run_cell(model, task, "low_confidence", {}, foreign, gap_rule)
        cells.append(dict(cell, constraint=f"{gap_rule}, foreign answer"))
    engine = run_engine(model, task, constraint)
    emit({"benchmark": "constrained_decoding", "block_size": BLOCK_SIZE, "digits": DIGITS, "prompts": prompts,
          "constraint": ANSWER, "cells": cells, "engine": engine,
          "seconds": round(time.perf_counter() - started, 1),
          "checks": checks, "machine": machine()})


if __name__ == "__main__":
    main()
