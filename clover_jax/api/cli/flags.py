"""The decoding flags of `generate`: one per `GenerationConfig` field, built from the dataclass
so that none is forgotten, and each flag's value checked on its own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from clover_jax.api.cli.common import UsageError, one_line

FALLBACK_MAX_NEW_TOKENS = 256  # when neither the flags nor generation_config.json set max_new_tokens

# One line of help per GenerationConfig field; a field missing here still gets a flag.
GENERATION_HELP = {
    "max_new_tokens": f"hard limit on response tokens (default: generation_config.json, else "
                      f"{FALLBACK_MAX_NEW_TOKENS})",
    "block_size": "tokens per diffusion block B",
    "threshold": "LowConfidence: fill every masked position whose confidence exceeds this",
    "do_sample": "sample instead of greedy decoding (with --seed, --temperature, --top-k, --top-p)",
    "temperature": "sampling temperature",
    "top_k": "sampling: keep the k most likely tokens (0: off)",
    "top_p": "sampling: nucleus probability mass",
    "presence_penalty": "subtracted from the logit of every token already in the response",
    "frequency_penalty": "subtracted per occurrence of a token in the response",
    "repetition_penalty": "divides positive / multiplies negative logits of repeated tokens (1.0: off)",
    "dllm_length_penalty": "full-strength bias towards EOS once the length ramp is complete",
    "dllm_length_penalty_start": "response length where the EOS bias starts",
    "dllm_length_penalty_window": "tokens over which the EOS bias ramps up",
    "dllm_think_end_bias": "full-strength bias towards </think> while thinking",
    "dllm_think_end_start": "response length where the </think> bias starts",
    "dllm_think_end_window": "tokens over which the </think> bias ramps up",
    "eos_token_id": "end-of-response token ids",
    "mask_token_id": "the mask token id (default: the checkpoint's)",
    "think_start_token_id": "id of <think> (default: from the tokenizer)",
    "think_end_token_id": "id of </think> (default: from the tokenizer)",
    "block_alignment": "'absolute' (blocks at multiples of B) or 'prompt' (blocks start after the prompt)",
    "schedule": "which positions are decided per denoising step",
    "max_steps_per_block": "denoising steps after which a block's remaining masks are filled (default: B)",
    "tokens_per_step": "fixed_k schedule: positions filled per step",
    "margin_threshold": "margin schedule: top-1 minus top-2 probability needed to fill",
    "entropy_bound": "entropy_bounded schedule: nats filled per step",
    "coreset": "block expert selection while denoising (default: the model config's)",
    "coreset_top_p": "coreset: fraction of the aggregated routing mass kept (default: the model config's)",
    "constraint": "the grammar the answer keeps to, as JSON: '{\"regex\": \"[0-9]+\"}', '{\"json_schema\": {...}}', "
                  "'{\"json_object\": true}' or '{\"lark\": \"start: ...\"}' (docs/structured_outputs.md)",
    "constraint_gap_rule": "diffusion under a constraint: commit past an undecided position when this step's "
                           "candidates fill the gap validly (witness), or never (frontier)",
}


# ---------------------------------------------------------------------- flags from GenerationConfig
def _generation_fields():
    from decoding.generation_config import GenerationConfig

    return dataclasses.fields(GenerationConfig)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def float_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"threshold\": 0.8}}', got {text!r} "
                                         f"({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `GenerationConfig` field, its kind read from the field's annotation."""
    from decoding.constraints.spec import GAP_RULES
    from decoding.schedules import BY_NAME as SCHEDULES

    group = parser.add_argument_group("decoding controls (GenerationConfig fields; default: the checkpoint's "
                                      "generation_config.json)")
    for field in _generation_fields():
        kind = str(field.type)
        options: dict[str, Any] = dict(dest=f"gen_{field.name}", default=None,
                                       help=GENERATION_HELP.get(field.name, f"GenerationConfig.{field.name}"))
        names = [flag_name(field.name)]
        if field.name == "max_new_tokens":
            names.append("-n")
        if kind.startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("tuple[int"):
            options.update(type=int_arg, nargs="+", metavar="ID")
        elif field.name == "schedule":
            options.update(choices=sorted(SCHEDULES))
        elif field.name in ("schedule_params", "constraint"):
            options.update(type=_json_object, metavar="JSON")
        elif field.name == "constraint_gap_rule":
            options.update(choices=GAP_RULES)
        elif kind.startswith("int"):
            options.update(type=int_arg, metavar="N")
        elif kind.startswith("float"):
            options.update(type=float_arg, metavar="X")
        else:
            options.update(type=str, metavar=field.name.upper())
        group.add_argument(*names, **options)


def generation_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The GenerationConfig fields given on the command line, each checked on its own so that an
    invalid value is reported with its flag."""
    from decoding.generation_config import GenerationConfig

    overrides = {}
    base = GenerationConfig.for_model_type("clover_moe")
    for field in _generation_fields():
        value = getattr(args, f"gen_{field.name}")
        if value is None:
            continue
        if str(field.type).startswith("tuple"):
            value = tuple(value)
        try:
            base.replace(**{field.name: value})
        except ValueError as error:
            raise UsageError(f"argument {flag_name(field.name)}: {error}") from None
        overrides[field.name] = value
    return overrides


def explain(error: BaseException) -> str:
    """The error in one line, led by the flag of the GenerationConfig field a FieldError names (a
    combination of values, code UNSUPPORTED, names no single flag)."""
    from clover_jax.core.errors import UNSUPPORTED

    field = getattr(error, "field", None)
    if field in {f.name for f in _generation_fields()} and getattr(error, "code", None) != UNSUPPORTED:
        return f"{flag_name(field)}: {one_line(error)}"
    return one_line(error)
