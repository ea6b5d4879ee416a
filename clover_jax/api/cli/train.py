"""`clover-jax train`: `clover_jax.training.trainer` from the command line.

Every `FinetuneConfig` field is a flag of the same name in kebab case (`--learning-rate 1e-4`,
`--block-size 4,8,16,32`, `--no-complementary`); `--generation-config FILE` reads the overrides of
the written generation_config.json from a JSON file. A progress bar goes to stderr; each logged
step is one JSON object on stdout, flushed as it is written, so `| jq` or a log collector can
follow a run. Nothing is compiled before the flags, the model and every data line are checked.
"""

from __future__ import annotations

import argparse
import json
import sys

from clover_jax.api.cli.finetune_flags import add_finetune_flags, values_from_flags
from clover_jax.core.errors import FieldError


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="fine-tune a Clover, or convert a Qwen3.5/3.6-MoE checkpoint into one",
        description="Block-diffusion fine-tuning (docs/training.md). Every FinetuneConfig field is a flag.")
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id (Clover or Qwen3.5/3.6-MoE)")
    parser.add_argument("--data", required=True, nargs="+", help="training JSONL file(s)")
    parser.add_argument("--out", required=True, help="directory the trained checkpoint is written to")
    parser.add_argument("--eval-data", nargs="+", default=None, help="held-out JSONL file(s) evaluated while training")
    parser.add_argument("--generation-config", metavar="FILE", default=None,
                        help="JSON file of generation_config.json overrides for the written model")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
    add_finetune_flags(parser, skip=("generation_config",))
    return parser


def config_from_flags(args: argparse.Namespace):
    """The `FinetuneConfig` the flags describe (flags not given keep the defaults)."""
    from clover_jax.training.config import FinetuneConfig

    values = values_from_flags(args, skip=("generation_config",))
    if args.generation_config:
        try:
            with open(args.generation_config, encoding="utf-8") as handle:
                values["generation_config"] = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise FieldError("generation_config", f"--generation-config {args.generation_config}: {error}") from None
    return FinetuneConfig(**values)


def run(args: argparse.Namespace) -> int:
    """Run the training the flags describe; JSON lines on stdout."""
    from clover_jax.training import finetune

    config = config_from_flags(args)

    def emit(record: dict) -> None:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()

    result = finetune(args.model, args.data, args.out, config=config, eval_data=args.eval_data, on_metrics=emit,
                      progress=not args.no_progress)
    emit({"out": result.out, "steps": config.steps})
    return 0
