"""Where token editing pays: LowConfidence and LLaDA2.1's joint_threshold on the shipped tiny Clover, on
its token-editing variant (`clover_jax/bundled/tiny-clover-editing`) and, given `--control DIR`, on the
same further training without editing (`python scripts/train_tiny_clover.py --editing-control --out DIR`).

The split: held-out lists of 9 to 12 digits at block 32 (the whole response one block). The editing
variant learned those lists (the shipped model answers none of them; on its own hardest lists, 8
digits, it keeps 99.5% at every threshold, so nothing is there to win back), and on them
LowConfidence loses accuracy as its threshold drops. Each model decodes the same prompts under
LowConfidence at falling thresholds and under joint_threshold at the same thresholds for every
(edit_threshold, max_post_edit_steps) setting. Each curve (LowConfidence, or one joint_threshold
setting, the threshold swept) is scored by d3LLM's AUP with one y_max, the best accuracy of any cell
of any model. Checks: the editing model's best joint_threshold curve has a higher AUP than
LowConfidence on the same model, than the best joint_threshold curve of the shipped model and (with
`--control`) than that of the control. Prints one JSON object (every cell, every curve's AUP).

    python benchmarks/editing_schedules.py [--prompts 200] [--editing DIR] [--control DIR] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check, emit, machine, setup_environment  # noqa: E402

setup_environment()

BLOCK_SIZE = 32
DIGITS = (9, 12)
THRESHOLDS = (0.95, 0.9, 0.7, 0.5, 0.3, 0.1)
EDIT_THRESHOLDS = (0.5, 0.7, 0.9)
POST_EDIT_STEPS = (0, 1, 2)
QUICK = {"thresholds": (0.9, 0.5, 0.1), "edit_thresholds": (0.5,), "post_edit_steps": (0, 2), "prompts": 32}


def curves(records) -> dict[str, list]:
    """Records grouped into curves: LowConfidence, and one per joint_threshold (edit_threshold, post steps)."""
    grouped: dict[str, list] = {}
    for record in records:
        if record.schedule == "low_confidence":
            name = "low_confidence"
        else:
            name = (f"joint_threshold edit>{record.params['edit_threshold']:g} "
                    f"post_edit_steps={int(record.params['max_post_edit_steps'])}")
        grouped.setdefault(name, []).append(record)
    return grouped


def sweep_model(path: str, *, prompts: int, thresholds, edit_thresholds, post_edit_steps) -> list:
    from clover_jax import CloverModel
    from clover_jax.api.research_tasks import sort_task
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import research

    model = CloverModel.from_pretrained(path, progress=False, chunk_size=64)
    task = sort_task(Tokenizer.from_pretrained(path), count=prompts, min_digits=DIGITS[0], max_digits=DIGITS[1])
    joint = [{"threshold": t, "edit_threshold": e, "max_post_edit_steps": s}
             for e, s, t in itertools.product(edit_thresholds, post_edit_steps, thresholds)]
    grid = {"low_confidence": {"threshold": list(thresholds)}, "joint_threshold": joint}
    return research.sweep(model, grid, block_sizes=[BLOCK_SIZE], task=task, progress=False)


def main(argv=None) -> None:
    from clover_jax.core.bundled import bundled_editing_path, bundled_model_path
    from decoding import research

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--shipped", default=str(bundled_model_path()))
    parser.add_argument("--editing", default=str(bundled_editing_path()))
    parser.add_argument("--control", default=None, help="the editing variant's training without editing")
    parser.add_argument("--quick", action="store_true", help="32 prompts, three thresholds, two editing settings")
    args = parser.parse_args(argv)
    settings = dict(thresholds=THRESHOLDS, edit_thresholds=EDIT_THRESHOLDS, post_edit_steps=POST_EDIT_STEPS)
    prompts = args.prompts
    if args.quick:
        settings = {key: value for key, value in QUICK.items() if key != "prompts"}
        prompts = QUICK["prompts"]
    started = time.perf_counter()
    models = [("shipped", args.shipped), ("editing", args.editing)] + ([("control", args.control)] if args.control
                                                                       else [])
    records = {name: sweep_model(path, prompts=prompts, **settings) for name, path in models}
    y_max = max(record.accuracy for cells in records.values() for record in cells)
    scores = {}
    for name, cells in records.items():
        scores[name] = {curve: research.aup([r.tokens_per_forward for r in points], [r.accuracy for r in points],
                                            y_max) for curve, points in curves(cells).items()}

    def best_joint(name: str) -> tuple[str, float]:
        return max(((curve, score) for curve, score in scores[name].items() if curve != "low_confidence"),
                   key=lambda item: item[1])

    best = {name: best_joint(name) for name in records}
    editing_joint = best["editing"][1]
    cells = {name: [{"schedule": r.schedule, **{k: v for k, v in r.params.items()
                                                if k in ("threshold", "edit_threshold", "max_post_edit_steps")},
                     "accuracy": r.accuracy, "tokens_per_forward": r.tokens_per_forward, "mean_nfe": r.mean_nfe}
                    for r in recs] for name, recs in records.items()}
    # AUP differences, not ratios: the shipped model's AUP on these lists is 0
    checks = [check("token editing: AUP of joint_threshold minus LowConfidence, on the editing model",
                    editing_joint - scores["editing"]["low_confidence"], 1e-9, at_least=True)]
    checks += [check(f"token editing: AUP of joint_threshold, the editing model minus the {name} model",
                     editing_joint - best[name][1], 1e-9, at_least=True) for name in records if name != "editing"]
    emit({"benchmark": "editing_schedules", "block_size": BLOCK_SIZE, "digits": DIGITS, "prompts": prompts,
          "y_max": y_max, "aup": scores, "best_joint_threshold": {name: curve for name, (curve, _) in best.items()},
          "cells": cells, "seconds": round(time.perf_counter() - started, 1), "checks": checks,
          "machine": machine()})


if __name__ == "__main__":
    main()
