"""`clover-jax train`: `clover_jax.training.trainer` from the command line.

Every `FinetuneConfig` field is a flag of the same name in kebab case (`--learning-rate 1e-4`,
`--block-size 4,8,16,32`, `--no-complementary`); `--generation-config FILE` reads the overrides of
the written generation_config.json from a JSON file. A progress bar goes to stderr; each logged
step is one JSON object on stdout, flushed as it is written, so `| jq` or a log collector can
follow a run. Nothing is compiled before the flags, the model and every data line are checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from clover_jax.core.errors import FieldError

# Fields whose flag is not simply their value.
SPECIAL = {"generation_config", "mesh"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    from clover_jax.training.config import FinetuneConfig

    parser = subparsers.add_parser(
        "train", help="fine-tune a Clover, or convert a Qwen3.5/3.6-MoE checkpoint into one",
        description="Block-diffusion fine-tuning (docs/training.md). Every FinetuneConfig field is a flag.")
    parser.add_argument("--model", required=True, help="checkpoint directory or Hub id (Clover or Qwen3.5/3.6-MoE)")
    parser.add_argument("--data", required=True, nargs="+", help="training JSONL file(s)")
    parser.add_argument("--out", required=True, help="directory the trained checkpoint is written to")
    parser.add_argument("--eval-data", nargs="+", default=None, help="held-out JSONL file(s) evaluated while training")
    parser.add_argument("--generation-config", metavar="FILE", default=None,
                        help="JSON file of generation_config.json overrides for the written model")
    parser.add_argument("--mesh", default=None, metavar="DATA,EXPERT,TENSOR",
                        help="train on a (data, expert, tensor) mesh of all devices, e.g. 2,4,1 (docs/parallelism.md)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)
    hints = typing.get_type_hints(FinetuneConfig)
    for field in dataclasses.fields(FinetuneConfig):
        if field.name in SPECIAL:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                                help=f"(default: {field.default})")
        else:
            parser.add_argument(flag, dest=field.name, default=None, metavar=_metavar(kind),
                                help=f"(default: {field.default})")
    return parser


def _metavar(kind) -> str:
    text = str(kind)
    if "tuple" in text:
        return "A,B,..."
    for name in ("int", "float", "str"):
        if name in text:
            return name.upper()
    return "VALUE"


def config_from_flags(args: argparse.Namespace):
    """The `FinetuneConfig` the flags describe (flags not given keep the defaults)."""
    from clover_jax.training.config import FinetuneConfig

    hints = typing.get_type_hints(FinetuneConfig)
    values = {}
    for field in dataclasses.fields(FinetuneConfig):
        raw = getattr(args, field.name, None)
        if field.name in SPECIAL or raw is None:
            continue
        values[field.name] = _parse(field.name, raw, hints[field.name])
    if args.generation_config:
        try:
            with open(args.generation_config, encoding="utf-8") as handle:
                values["generation_config"] = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise FieldError("generation_config", f"--generation-config {args.generation_config}: {error}") from None
    if args.mesh is not None:
        values["mesh"] = args.mesh
    return FinetuneConfig(**values)


def _parse(name: str, raw, kind):
    if isinstance(raw, bool):
        return raw
    text = str(kind)
    flag = "--" + name.replace("_", "-")
    try:
        if raw.lower() == "none" and "None" in text:
            return None
        if "tuple" in text:
            items = [item.strip() for item in raw.split(",") if item.strip()]
            if "tuple[str" in text:
                return tuple(items)
            if "float" in text.split("tuple")[1]:
                return tuple(float(item) for item in items)
            values = tuple(int(item) for item in items)
            return values[0] if len(values) == 1 and "int |" in text else values
        if "int" in text and "float" not in text:
            return int(raw)
        if "float" in text:
            return float(raw)
        return raw
    except ValueError:
        raise FieldError(name, f"{flag}: cannot read {raw!r} as {_metavar(kind).lower()}",
                         code="invalid_type") from None


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
