"""`finetune`: fine-tune a Clover, or convert a Qwen3.5/3.6-MoE checkpoint into one (docs/training.md).

Everything that can be wrong is checked before the first compile: the config (when it is made),
the model and its tokenizer, the generation-config overrides, every data line (read, tokenised,
checked against `seq_len` and packed, per block size). Then the set-up this module does — the
run's mesh (one device: a 1x1x1 mesh), the written model (`conversion`), the step of each block
size (`StepProgram.of`), the train state and its layout — and the loop (`loop.run_loop`: one jitted
step per block size, metrics, evaluation on `eval_data`, Orbax checkpoints to resume from). At the
end `outputs` writes the Hugging Face checkpoint in `out`, with `metrics.jsonl` and `loss.png`.

A LoRA run (`method="lora"`, `clover_jax.adapters.lora`) trains only the adapters, the block-mode
tensors and the mask rows; the base stays frozen (quantised with `quantize`: QLoRA) and the run
writes its adapter (`outputs.write_lora_outputs`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, NamedTuple, Sequence

import jax

from clover_jax.adapters import lora
from clover_jax.adapters.vocabulary import grow_vocabulary
from clover_jax.core import compilation_cache
from clover_jax.core.errors import FieldError
from clover_jax.training import conversion, outputs, train_sharding
from clover_jax.training.batches import BatchIterator, TrainRows
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.example_cache import cached_examples
from clover_jax.training.held_out import held_out_metrics
from clover_jax.training.loop import LoopRun, run_loop
from clover_jax.training.packing import PackedRows, fit_examples, pack
from clover_jax.training.state import OptimizerSettings, TrainState, compute_base, init_state
from clover_jax.training.step import StepProgram

logger = logging.getLogger(__name__)

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune"]


class FinetuneResult(NamedTuple):
    """out: the written checkpoint's directory; metrics: one dict per logged step (step, loss,
    diffusion_loss, next_token_loss, masked_accuracy, tokens, seconds, ...; eval_* at evaluations)."""

    out: str
    metrics: list[dict]


def finetune(model, data: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, *,
             config: FinetuneConfig | None = None, eval_data: str | os.PathLike | Sequence | None = None,
             on_metrics: Callable[[dict], None] | None = None, progress: bool = True) -> FinetuneResult:
    """Train `model` on `data` (JSONL file(s)) and write the result to `out`.

    model: a checkpoint directory or Hub id of a Clover or Qwen3.5/3.6-MoE model, or a `CloverModel`
    (its `path` gives the tokenizer and generation config); config: `FinetuneConfig()` when None;
    on_metrics: called with each metrics record as it is made."""
    from clover_jax.model.clover_model import CloverModel
    from clover_jax.text.tokenizer import Tokenizer

    config = config or FinetuneConfig()
    mesh = training_mesh(config)
    if not isinstance(model, CloverModel):
        model = CloverModel.from_pretrained(model, progress=progress, quantize=config.quantize)
    elif config.quantize is not None:
        raise ValueError("FinetuneConfig.quantize quantises the base while it is read: pass the checkpoint's "
                         "directory or Hub id, not a loaded CloverModel")
    if model.path is None:
        raise ValueError("the model has no checkpoint directory (CloverModel.path): its tokenizer and generation "
                         "config come from there")
    tokenizer = Tokenizer.from_pretrained(model.path)
    target = conversion.plan_target(model.config, tokenizer, model.path, config.generation_config)
    default_block = int(target.generation_config.get("block_size", 32))
    sizes, weights = config.block_sizes(default_block), config.block_weights(default_block)
    pad_id = _pad_id(tokenizer, target)
    end_of_turn = list(target.config.eos_token_id) or [pad_id]

    read = functools.partial(cached_examples, tokenizer=tokenizer, end_of_turn=end_of_turn,
                             split_turns=config.split_turns, directory=_data_directory(config))
    examples = read(data)
    packings = {size: packed_rows(examples, config, size, pad_id) for size in sizes}
    held_out = None if eval_data is None else packed_rows(read(eval_data), config, sizes[0], pad_id)
    for size, packed in packings.items():
        logger.info("block size %d: %d examples in %d rows of %d tokens", size, len(examples), packed.num_rows,
                    config.seq_len)

    params = model.params
    if target.grown_vocab:
        params = grow_vocabulary(params, model.config, target.grown_vocab)
    mesh_sharding = training_mesh_sharding(mesh, target.config)
    module = model.module.clone(config=target.config, mesh_sharding=mesh_sharding)
    compute_dtype = config.param_dtype or str(model.dtype)
    vocabulary = substitute_vocabulary(tokenizer, target.config) if config.edit_fraction > 0 else None
    programs = {size: StepProgram.of(config, module, block_size=size, compute_dtype=compute_dtype,
                                     substitute_vocabulary=vocabulary) for size in sizes}
    spec = programs[sizes[0]].lora
    frozen, trained = None, params
    if spec is not None:
        trained = lora.init_trainable(params, target.config, spec, jax.random.key(config.seed))
        frozen = compute_base(params, compute_dtype)
        logger.info("LoRA: %d trainable parameters (%s)", lora.parameter_count(trained), ", ".join(config.lora_targets))
    state, layout, frozen = placed_state(mesh_sharding, init_state(OptimizerSettings.of(config), trained), frozen,
                                         example_rows(packings[sizes[0]], config, sizes[0]),
                                         offload_base=config.offload_base)
    logger.info("training on the mesh %s", dict(mesh.shape))
    batches = BatchIterator(packings, block_sizes=sizes, weights=weights, batch_size=config.batch_size,
                            seed=config.seed, max_noisy_blocks=config.max_noisy_blocks)
    top_p = target.config.moe_block_coreset_top_p
    evaluation = None
    if held_out is not None:
        evaluation = functools.partial(_held_out, program=programs[sizes[0]], held_out=held_out, config=config,
                                       top_p=top_p, frozen=frozen)
    state, history = run_loop(state, batches, LoopRun(programs, layout, frozen, top_p, evaluation), config,
                              on_metrics=on_metrics, progress=progress)
    out = os.fspath(out)
    if spec is None:
        outputs.write_checkpoint(out, model.path, state.params, target, compute_dtype)
    else:
        outputs.write_lora_outputs(out, model, params, state.params, spec, target, compute_dtype,
                                   quantized=config.quantize)
    outputs.write_metrics(out, history)
    return FinetuneResult(out, history)


def training_mesh(config: FinetuneConfig):
    """The (data, expert, tensor) mesh of `config.mesh` over all devices of the run, or with no mesh
    asked for, a 1x1x1 mesh of the first device; FieldError when the sizes do not multiply to the
    device count."""
    from clover_jax.parallel.sharding import make_mesh

    if config.mesh is None:
        return make_mesh(1, 1, 1, devices=jax.devices()[:1])
    try:
        return make_mesh(*config.mesh)
    except ValueError as error:
        raise FieldError("mesh", f"FinetuneConfig.mesh={config.mesh}: {error}") from None


def training_mesh_sharding(mesh, model_config):
    """The rules a train step runs under on `mesh` (the planner's inference rules; FSDP is the
    layout's, `train_sharding`); FieldError when the experts do not divide over the expert axis."""
    from clover_jax.parallel.planner import inference_rules
    from clover_jax.parallel.sharding import MeshSharding

    try:
        return MeshSharding(mesh, model_config, inference_rules(dict(mesh.shape)))
    except ValueError as error:
        raise FieldError("mesh", f"FinetuneConfig.mesh: {error}") from None


def placed_state(mesh_sharding, state: TrainState, frozen, rows: TrainRows, *, offload_base: bool = False):
    """(state, layout, frozen): the layout of the run on `mesh_sharding`'s mesh (`train_sharding`),
    and the state and a LoRA run's frozen base put there."""
    layout = train_sharding.train_layout(mesh_sharding, state, rows, frozen, offload_base=offload_base)
    state = train_sharding.place(state, layout.state)
    frozen = None if frozen is None else train_sharding.place(frozen, layout.frozen)
    return state, layout, frozen


def example_rows(packed: PackedRows, config: FinetuneConfig, block_size: int) -> TrainRows:
    """One batch's `TrainRows` (the layout needs only their shapes)."""
    rows = BatchIterator({block_size: packed}, block_sizes=(block_size,), weights=(1.0,),
                         batch_size=config.batch_size, seed=config.seed, max_noisy_blocks=config.max_noisy_blocks)
    return rows.next().rows


def packed_rows(examples, config: FinetuneConfig, block_size: int, pad_id: int) -> PackedRows:
    """The examples fitted to `config.seq_len` and packed at `block_size`; ValueError when none has
    a trained token."""
    fitted = fit_examples(examples, seq_len=config.seq_len, block_size=block_size, truncate=config.truncate)
    if not fitted:
        raise ValueError("no example holds a trained token (loss tokens): nothing to train on")
    return pack(fitted, seq_len=config.seq_len, block_size=block_size, pad_id=pad_id, seed=config.seed)


def _data_directory(config: FinetuneConfig) -> str | None:
    """Where tokenised data is kept: the run's checkpoint directory, else the cache directory."""
    if config.checkpoint_dir:
        return os.path.join(os.fspath(config.checkpoint_dir), "data")
    return compilation_cache.data_directory()


def substitute_vocabulary(tokenizer, model_config) -> tuple[tuple[int, int], ...]:
    """Token editing's uniform substitutes: the tokenizer's ids that are not special (its added
    tokens marked special, its named special tokens, the mask token), below the model's
    vocabulary, as ranges [start, stop)."""
    special = set(tokenizer.all_special_ids) | {model_config.mask_token_id}
    special |= {index for index, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    stop = min(len(tokenizer), model_config.vocab_size)
    ranges, start = [], None
    for index in range(stop + 1):
        ordinary = index < stop and index not in special
        if ordinary and start is None:
            start = index
        elif not ordinary and start is not None:
            ranges.append((start, index))
            start = None
    if not ranges:
        raise ValueError("token editing: the tokenizer has no ordinary (non-special) token to substitute")
    return tuple(ranges)


def _pad_id(tokenizer, target: conversion.Target) -> int:
    """The pad token after an example's end: `pad_token_id` of the tokenizer, else the first EOS."""
    pad = tokenizer.config.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    pad_id = tokenizer.token_to_id(pad) if isinstance(pad, str) else None
    if pad_id is None:
        if not target.config.eos_token_id:
            raise ValueError("the tokenizer has no pad token and config.json no eos_token_id: nothing can fill the "
                             "positions after an example's end")
        pad_id = target.config.eos_token_id[0]
    return int(pad_id)


def _held_out(state: TrainState, *, program: StepProgram, held_out: PackedRows, config: FinetuneConfig,
              top_p: float, frozen=None) -> dict:
    compute = program.run_params(state.params, frozen)
    return held_out_metrics(compute, program.module, held_out, settings=program.settings,
                            batch_size=config.micro_batch, coreset_top_p=top_p)
