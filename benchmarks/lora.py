"""LoRA and QLoRA against full fine-tuning on the bundled tiny Clover: a new variant of its task.

The bundled Clover sorts 4-8 digits. Each method below fine-tunes it for `--steps` steps on
sorting 9-10 digits (a variant it was never trained on), from the same data and seed, and is then
scored on held-out 9-10 digit problems with `decoding.generate` (the checkpoint's generation
config; exact match of thinking + answer, and of the answer alone):

* full: every weight;
* lora: adapters on attention, GDN, the shared expert, the router — no routed-expert adapters
  (the choice MaxText / NeMo / tunix make);
* lora+experts: the same plus one adapter per routed expert (gate|up and down);
* qlora-int8 / qlora-int4: lora+experts over the quantised base (scored on the adapter loaded
  onto the base with the same quantisation).

Reported per method: trainable parameters, median step time (after the compiling first step),
held-out exact match. Out of the test suite; a few minutes per method on 2 CPU cores.

Usage: python benchmarks/lora.py [--steps N] [--problems N] [--methods full,lora,...] [--quick]
(one JSON object, the last line on stdout; `make bench` runs it)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import emit, machine, setup_environment  # noqa: E402

setup_environment()

import numpy as np  # noqa: E402

logger = logging.getLogger("benchmarks.lora")

NO_EXPERTS = ("attention", "gdn", "shared_expert", "router")
WITH_EXPERTS = NO_EXPERTS + ("routed_experts",)
METHODS = {
    "full": {"method": "full"},
    "lora": {"method": "lora", "lora_targets": NO_EXPERTS},
    "lora+experts": {"method": "lora", "lora_targets": WITH_EXPERTS},
    "qlora-int8": {"method": "lora", "lora_targets": WITH_EXPERTS, "quantize": "int8"},
    "qlora-int4": {"method": "lora", "lora_targets": WITH_EXPERTS, "quantize": "int4"},
}


def run_method(name: str, *, data: str, out: str, steps: int, problems, task) -> dict:
    from tokenizers import Tokenizer

    from clover_jax import CloverModel
    from clover_jax.adapters import lora
    from clover_jax.adapters.adapter_io import read_adapter
    from clover_jax.core.params import parameter_counts
    from clover_jax.training import FinetuneConfig, finetune
    from clover_jax.training.tiny.recipe import BUNDLED_DIR
    from clover_jax.training.tiny.scoring import score_exact_match

    fields = dict(METHODS[name])
    # LoRA takes a larger learning rate than full fine-tuning (the factors start at zero / small)
    rate = 1e-3 if fields["method"] == "full" else 5e-3
    config = FinetuneConfig(steps=steps, batch_size=8, seq_len=128, block_size=16, learning_rate=rate, warmup_steps=10,
                            load_balance_weight=0.0, log_every=1, lora_rank=8, lora_alpha=16.0, **fields)
    result = finetune(BUNDLED_DIR, data, out, config=config, progress=False)
    seconds = [record["seconds"] for record in result.metrics if "seconds" in record]
    step_times = np.diff(seconds)[1:] if len(seconds) > 2 else np.diff(seconds)
    if fields["method"] == "full":
        model = CloverModel.from_pretrained(out, progress=False)
        trainable = parameter_counts(model.config)["total"]
    else:
        adapter_dir = out if fields.get("quantize") else os.path.join(out, "adapter")
        trainable = lora.parameter_count(read_adapter(adapter_dir).trainable)
        model = CloverModel.from_pretrained(BUNDLED_DIR, adapter=adapter_dir, quantize=fields.get("quantize"),
                                            progress=False)
    tokenizer = Tokenizer.from_file(os.path.join(model.path, "tokenizer.json"))
    scores = score_exact_match(model, tokenizer, task, problems, batch_size=len(problems), max_new_tokens=64)
    return {"method": name, "trainable_parameters": int(trainable), "step_seconds": float(np.median(step_times)),
            "final_loss": result.metrics[-1]["loss"], "full_match": scores["full_match"],
            "answer_match": scores["answer_match"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--quick", action="store_true", help="20 steps, 20 problems, every method")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.problems = 20, 20
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    from clover_jax.training.tiny.recipe import write_task_data
    from clover_jax.training.tiny.sort_digits import SortDigits

    task = SortDigits(min_digits=9, max_digits=10)
    problems = task.held_out(args.problems)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        data = write_task_data(os.path.join(directory, "train.jsonl"), task, count=4000, seed=1,
                               thinking_fraction=0.8)
        for name in args.methods.split(","):
            rows.append(run_method(name, data=data, out=os.path.join(directory, name), steps=args.steps,
                                   problems=problems, task=task))
            logger.info("%s", json.dumps(rows[-1]))
    emit({"task": dataclasses.asdict(task), "steps": args.steps, "problems": args.problems, "results": rows,
          "checks": [], "machine": machine()})


if __name__ == "__main__":
    main()
