"""`clover-jax info` (a checkpoint's config, parameters and memory) and `clover-jax plan` (which
weight format and mesh fit an accelerator)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from clover_jax.api.cli.common import BUNDLED_MODEL, UsageError, config_record, count, human_bytes, resolve_model_dir


def run_info(args: argparse.Namespace) -> int:
    path = resolve_model_dir(args.model, args.revision, quiet=args.json)
    if args.batch < 1:
        raise UsageError("argument --batch: must be >= 1")
    from clover_jax.core.config import CloverConfig

    config = CloverConfig.from_pretrained(path)
    context = args.context or config.max_position_embeddings
    if context < 1:
        raise UsageError("argument --context: must be >= 1")
    record = describe(path, config, args.batch, context)
    if args.json:
        print(json.dumps(record))
    else:
        print(format_info(record))
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from clover_jax.parallel.targets import target

    try:
        target(args.target)
    except ValueError as error:
        raise UsageError(f"argument --target: {error}") from None
    if (args.batch is not None and args.batch < 1) or args.context_length < 1:
        raise UsageError("arguments --batch and --context-length must be >= 1")
    if args.model is None and args.revision is not None:
        raise UsageError("--revision applies to a Hub id given as MODEL")
    if args.task == "decode":
        from clover_jax.api.cli.finetune_flags import flag_name, values_from_flags

        given = values_from_flags(args, skip=("batch_size", "generation_config"))
        if given:
            raise UsageError(f"{', '.join(map(flag_name, given))}: a fine-tuning run's, for --task train")
    from clover_jax.api.plan import plan as make_plan

    if args.task == "train":
        config = _finetune_config(args)
        result = make_plan(args.model or BUNDLED_MODEL, args.target, task="train", config=config,
                           compile=args.compile, revision=args.revision, block_size=config.block_sizes(32)[0],
                           remat_choices=None if args.remat is None else (config.remat,))
    else:
        result = make_plan(args.model or BUNDLED_MODEL, args.target, context_length=args.context_length,
                           batch=1 if args.batch is None else args.batch, compile=args.compile,
                           revision=args.revision)
    print(json.dumps(plan_record(result)) if args.json else result)
    return 0


def _finetune_config(args: argparse.Namespace):
    """The `FinetuneConfig` of `plan --task train`'s flags, read as `clover-jax train` reads them, with
    --batch as its batch_size; an offloaded base without --remat takes the first remat that allows it
    (the planner's choice). A bad value: a FieldError naming it."""
    from clover_jax.api.cli.finetune_flags import values_from_flags
    from clover_jax.training.config import OFFLOAD_REMAT, FinetuneConfig

    values = values_from_flags(args, skip=("batch_size", "generation_config"))
    if args.batch is not None:
        values["batch_size"] = args.batch
    if values.get("offload_base") and "remat" not in values:
        values["remat"] = OFFLOAD_REMAT[0]
    return FinetuneConfig(**values)


def plan_record(result) -> dict[str, Any]:
    """A plan as JSON: each option's format, mesh, bytes per device (estimated and, when compiled,
    each loop's compiler figures or error) and whether it fits."""
    from clover_jax.api.train_plan import TrainOption

    def option_record(option) -> dict[str, Any]:
        record = {"weights": option.weights, "quantize": None if option.quantize is None else option.quantize.name,
                  "mesh": option.mesh, "weight_bytes": option.weight_bytes, "state_bytes": option.state_bytes,
                  "estimate_bytes": option.total_bytes, "device_bytes": option.device_bytes, "fits": option.fits}
        if isinstance(option, TrainOption):
            record.update(remat=option.remat, max_seq_len=option.max_seq_len, offload_base=option.offload_base)
        if option.compiled is not None:
            record["compiled"] = {mode: {**dataclasses.asdict(memory), "total_bytes": memory.total_bytes}
                                  for mode, memory in option.compiled.items()}
        return record

    chosen = None if result.recommendation is None else result.options.index(result.recommendation)
    return {"target": result.target, "options": [option_record(option) for option in result.options],
            "recommendation": chosen, "reason": result.reason}


def parameter_counts(config) -> dict[str, int]:
    """Total parameters, the routed experts' share, and those one token uses (top-k of the experts),
    from the parameter table (`clover_jax.core.params.parameter_counts`)."""
    from clover_jax.core.params import parameter_counts as table_counts

    return table_counts(config)


def describe(path: Path, config, batch: int, context: int) -> dict[str, Any]:
    from clover_jax.parallel.memory import estimate_memory
    from clover_jax.text.tokenizer import has_chat_template

    files = sorted(path.glob("*.safetensors"))
    has_template = has_chat_template(path)
    memory = {}
    for dtype in ("float32", "bfloat16"):
        estimate = estimate_memory(config, batch, context, dtype)
        memory[dtype] = {**dataclasses.asdict(estimate), "total": estimate.total}
    try:
        from decoding.generation_config import GenerationConfig

        generation = config_record(GenerationConfig.from_pretrained(path))
    except ValueError as error:
        generation = {"error": str(error)}
    return {
        "path": str(path),
        "model_type": config.model_type,
        "checkpoint_dtype": config.checkpoint_dtype,
        "layers": config.num_hidden_layers,
        "layer_pattern": list(config.group_pattern),
        "layer_groups": config.num_groups,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "context": config.max_position_embeddings,
        "attention": {"heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                      "head_dim": config.head_dim, "rotary_dim": config.rotary_dim, "rope_theta": config.rope_theta},
        "gdn": {"key_heads": config.linear_num_key_heads, "value_heads": config.linear_num_value_heads,
                "key_head_dim": config.linear_key_head_dim, "value_head_dim": config.linear_value_head_dim,
                "conv_kernel": config.linear_conv_kernel_dim},
        "moe": {"experts": config.num_experts, "top_k": config.num_experts_per_tok,
                "expert_intermediate": config.moe_intermediate_size,
                "shared_expert_intermediate": config.shared_expert_intermediate_size},
        "clover": {"mask_token_id": config.mask_token_id, "coreset": config.moe_block_coreset_enabled,
                   "coreset_top_p": config.moe_block_coreset_top_p},
        "parameters": parameter_counts(config),
        "files": {"safetensors": len(files), "bytes": sum(f.stat().st_size for f in files),
                  "tokenizer": (path / "tokenizer.json").is_file(), "chat_template": has_template},
        "generation_config": generation,
        "memory": {"batch": batch, "context": context, "by_dtype": memory},
    }


def format_info(record: dict[str, Any]) -> str:
    att, gdn, moe, clover = record["attention"], record["gdn"], record["moe"], record["clover"]
    params, files, mem = record["parameters"], record["files"], record["memory"]
    pattern = ", ".join(record["layer_pattern"])
    generation = record["generation_config"]
    shown = ("block_size", "threshold", "max_new_tokens", "schedule", "presence_penalty", "repetition_penalty",
             "dllm_length_penalty", "dllm_think_end_bias", "eos_token_id")
    lines = [
        f"model         {record['path']}",
        f"type          {record['model_type']} ({record['checkpoint_dtype'] or 'dtype not stated'})",
        f"layers        {record['layers']} = {record['layer_groups']} x ({pattern})",
        f"sizes         hidden {record['hidden_size']}, vocab {record['vocab_size']}, "
        f"context {record['context']} tokens",
        f"attention     {att['heads']} query heads, {att['kv_heads']} K/V heads, head_dim {att['head_dim']}, "
        f"{att['rotary_dim']} rotary dims, rope_theta {att['rope_theta']:g}",
        f"gated delta   {gdn['key_heads']} key heads x {gdn['key_head_dim']}, {gdn['value_heads']} value heads x "
        f"{gdn['value_head_dim']}, conv kernel {gdn['conv_kernel']}",
        f"experts       {moe['experts']} routed (top-{moe['top_k']}, intermediate {moe['expert_intermediate']}) "
        f"+ 1 shared (intermediate {moe['shared_expert_intermediate']})",
        f"clover        mask_token_id {clover['mask_token_id']}, block coreset "
        f"{'on' if clover['coreset'] else 'off'} (top_p {clover['coreset_top_p']})",
        f"parameters    {count(params['total'])} total, {count(params['active_per_token'])} active per token "
        f"(routed experts {count(params['routed_experts'])}, embeddings + head {count(params['embeddings'])})",
        f"files         {files['safetensors']} safetensors file(s), {human_bytes(files['bytes'])}; tokenizer.json "
        f"{'yes' if files['tokenizer'] else 'no'}; chat template {'yes' if files['chat_template'] else 'no'}",
    ]
    if "error" in generation:
        lines.append(f"generation    {generation['error']}")
    else:
        lines.append("generation    " + ", ".join(f"{k} {generation[k]}" for k in shown if k in generation))
    lines.append(f"memory        batch {mem['batch']}, {mem['context']} positions (prompt + response):")
    lines.append(f"  {'dtype':<10}{'parameters':>12}{'K/V cache':>12}{'GDN state':>12}{'activations':>13}"
                 f"{'total':>12}")
    for dtype, estimate in mem["by_dtype"].items():
        lines.append(f"  {dtype:<10}{human_bytes(estimate['parameters']):>12}{human_bytes(estimate['kv_cache']):>12}"
                     f"{human_bytes(estimate['gdn_state']):>12}{human_bytes(estimate['activations']):>13}"
                     f"{human_bytes(estimate['total']):>12}")
    return "\n".join(lines)
