"""What a run writes when it ends: the Hugging Face checkpoint, a LoRA run's adapter (our layout and
PEFT's) and the metrics (`metrics.jsonl`, and `loss.png` with matplotlib).

A full run writes the checkpoint in `out`. A LoRA run writes its adapter (`out/adapter`; QLoRA:
`out` itself, its only output), the adapter in PEFT's layout (`out/peft`), and over a float base
the merged checkpoint in `out`. Each directory that loads as a model holds the written model's
config, tokenizer and generation config (`conversion`).
"""

from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np

from clover_jax.adapters import adapter_io, lora, peft_export
from clover_jax.core.config import CloverConfig
from clover_jax.training import conversion

logger = logging.getLogger(__name__)


def write_checkpoint(out: str, source_dir: str, params: dict, target: conversion.Target, dtype: str) -> None:
    """The Hugging Face checkpoint: weights in `dtype`, config.json, generation_config.json, and the
    tokenizer files of `source_dir` (with the mask token the target adds)."""
    from weights.writer import save_params

    os.makedirs(out, exist_ok=True)
    pad = {"pad_token_id": target.generation_config.get("pad_token_id")} if "pad_token_id" in \
        target.generation_config else {}
    save_params(on_host(params), target.config, out, dtype=dtype, extra_config=pad)
    conversion.write_tokenizer(source_dir, out, target)
    conversion.write_generation_config(out, target)
    logger.info("wrote the trained checkpoint to %s", out)


def write_adapter(out: str, trainable: dict, spec: lora.LoraSpec, *, base_config: CloverConfig,
                  target: conversion.Target, tokenizer_source: str) -> str:
    """A LoRA run's adapter directory (`adapter_io`): the adapter over a base of `base_config`, and
    the written model's config, tokenizer (from `tokenizer_source`) and generation config, so that it
    loads as `adapter=` of its base."""
    adapter_io.save_adapter(out, trainable, spec, base_config=base_config, written_config=target.config,
                            grown_vocab=target.grown_vocab)
    conversion.write_tokenizer(tokenizer_source, out, target)
    conversion.write_generation_config(out, target)
    logger.info("wrote the adapter (rank %d, %s) to %s", spec.rank, ", ".join(spec.targets), out)
    return out


def write_lora_outputs(out: str, model, base: dict, trainable: dict, spec: lora.LoraSpec, target: conversion.Target,
                       dtype: str, *, quantized: str | None) -> None:
    """A LoRA run's outputs over `model` (its float or quantised `base`): the adapter, PEFT's layout
    of it for a Qwen3.5-MoE base, and over a float base the merged checkpoint in `out`."""
    trainable = on_host(trainable)
    write_adapter(out if quantized else os.path.join(out, "adapter"), trainable, spec, base_config=model.config,
                  target=target, tokenizer_source=model.path)
    peft_export.save_peft_adapter(os.path.join(out, "peft"), trainable, spec, config=model.config,
                                  base_name=model.path)
    if quantized is None:
        write_checkpoint(out, model.path, lora.merge(base, trainable, spec), target, dtype)


def on_host(tree):
    """A pytree of (possibly sharded, possibly multi-process) arrays as NumPy arrays on this host."""
    from jax.experimental import multihost_utils

    def one(leaf):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(jax.device_get(leaf))

    return jax.tree_util.tree_map(one, tree)


def write_metrics(out: str, history: list[dict]) -> None:
    """`metrics.jsonl` (one record a line) and, with matplotlib, `loss.png`."""
    with open(os.path.join(out, "metrics.jsonl"), "w") as handle:
        for record in history:
            handle.write(json.dumps(record) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no loss.png (pip install 'clover-jax[train]')")
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [record["step"] for record in history if "loss" in record]
    for name in ("loss", "diffusion_loss", "next_token_loss"):
        axis.plot(steps, [record[name] for record in history if "loss" in record], label=name)
    evaluated = [record for record in history if "eval_diffusion_loss" in record]
    if evaluated:
        axis.plot([r["step"] for r in evaluated], [r["eval_diffusion_loss"] for r in evaluated], "o--",
                  label="eval_diffusion_loss")
    axis.set_xlabel("step")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, "loss.png"), dpi=100)
    plt.close(figure)
