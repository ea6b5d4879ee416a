"""`finetune`: fine-tune a Clover, or convert a Qwen3.5/3.6-MoE checkpoint into one (docs/training.md).

Everything that can be wrong is checked before the first compile: the config (when it is made),
the model and its tokenizer, the generation-config overrides, every data line (read, tokenised,
checked against `seq_len` and packed, per block size). Then the loop: one jitted step per block
size, a progress bar, a metrics record every `log_every` steps (to `on_metrics`, the log, and
`metrics.jsonl`), evaluation on `eval_data`, Orbax checkpoints of the whole train state (the
resumption point: `checkpointing`), and at the end the Hugging Face checkpoint in `out`, with
`metrics.jsonl` and `loss.png` beside it.

A LoRA run (`method="lora"`, `clover_jax.training.lora`) trains only the adapters, the block-mode
tensors and the mask rows; the base stays frozen (quantised with `quantize`: QLoRA). It writes the
adapter (`adapter_io`: `out/adapter`, or `out` itself for QLoRA), the adapter in PEFT's layout
(`peft_export`: `out/peft`), and over a float base the merged checkpoint in `out`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from clover_jax.core import compilation_cache
from clover_jax.core.errors import FieldError
from clover_jax.training import adapter_io, checkpointing, conversion, lora, peft_export, train_sharding
from clover_jax.training.block_pass import training_module
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.data import read_examples
from clover_jax.training.data_cache import cached_examples
from clover_jax.training.dataset import BatchIterator
from clover_jax.training.held_out import evaluate
from clover_jax.training.loss import LossSettings
from clover_jax.training.packing import PackedRows, fit_examples, pack
from clover_jax.training.step import (
    OptimizerSettings,
    StepProgram,
    compute_base,
    init_state,
    normalisers,
    sharded_train_step,
    train_step,
)

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
    from clover_jax.api.clover_model import CloverModel
    from clover_jax.api.tokenization import Tokenizer

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
    packings = {size: _packed(examples, config, size, pad_id) for size in sizes}
    held_out = None if eval_data is None else _packed(read(eval_data), config, sizes[0], pad_id)
    for size, packed in packings.items():
        logger.info("block size %d: %d examples in %d rows of %d tokens", size, len(examples), packed.num_rows,
                    config.seq_len)

    params = model.params
    if target.grown_vocab:
        params = conversion.grow_vocabulary(params, model.config, target.grown_vocab)
    mesh_sharding = None if mesh is None else training_mesh_sharding(mesh, target.config)
    module = training_module(model.module.clone(config=target.config, mesh_sharding=mesh_sharding), remat=config.remat,
                             offload_base=config.offload_base)
    compute_dtype = config.param_dtype or str(model.dtype)
    spec, frozen, trained = None, None, params
    if config.method == "lora":
        spec = lora.LoraSpec(config.lora_rank, float(config.lora_alpha), config.lora_targets, target.mask_token_id,
                             target.config.tie_word_embeddings)
        trained = lora.init_trainable(params, target.config, spec, jax.random.key(config.seed))
        frozen = compute_base(params, compute_dtype, on_device=mesh is None)
        logger.info("LoRA: %d trainable parameters (%s)", lora.parameter_count(trained), ", ".join(config.lora_targets))
    programs = {size: _program(config, module, _loss_settings(config, target.config, size), compute_dtype, spec)
                for size in sizes}
    state = init_state(OptimizerSettings.of(config), trained, on_device=mesh is None)
    layout = None
    if mesh_sharding is not None:
        example_rows = _example_rows(packings[sizes[0]], config, sizes[0])
        layout = train_sharding.train_layout(mesh_sharding, state, example_rows, frozen,
                                             offload_base=config.offload_base)
        state = train_sharding.place(state, layout.state)
        frozen = None if frozen is None else train_sharding.place(frozen, layout.frozen)
        logger.info("training on the mesh %s", dict(mesh.shape))
    batches = BatchIterator(packings, block_sizes=sizes, weights=weights, batch_size=config.batch_size,
                            seed=config.seed, max_noisy_blocks=config.max_noisy_blocks)
    evaluation = None
    if held_out is not None:
        evaluation = functools.partial(_evaluate, program=programs[sizes[0]], held_out=held_out, config=config,
                                       top_p=target.config.moe_block_coreset_top_p, frozen=frozen)
    state, history = _train(state, batches, programs, config=config, top_p=target.config.moe_block_coreset_top_p,
                            evaluation=evaluation, on_metrics=on_metrics, progress=progress, frozen=frozen,
                            layout=layout)
    out = os.fspath(out)
    if spec is None:
        _write(out, model, state.params, target, compute_dtype)
    else:
        _write_lora(out, model, params, state.params, spec, target, compute_dtype, quantized=config.quantize)
    _write_metrics(out, history)
    return FinetuneResult(out, history)


def next_token_training(model, data, *, config: FinetuneConfig, progress: bool = True) -> tuple[dict, list[dict]]:
    """Train `model` (a `CloverModel` of a base checkpoint) on the next-token loss alone: no noisy
    stream, no mask token, the model stays what it was (how the bundled autoregressive base is
    made). returns (parameters in the model's dtype, the logged metrics)."""
    from clover_jax.api.tokenization import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model.path)
    size = config.block_sizes(16)[0]  # examples still start at block boundaries; nothing is denoised
    eos = list(model.config.eos_token_id)
    examples = read_examples(data, tokenizer, end_of_turn=eos, split_turns=config.split_turns)
    packed = _packed(examples, config, size, eos[0])
    settings = _loss_settings(config, model.config, size)._replace(mask_token_id=None, load_balance_weight=float(
        config.load_balance_weight))
    program = _program(config, training_module(model.module, remat=config.remat), settings,
                       str(model.dtype))
    batches = BatchIterator({size: packed}, block_sizes=(size,), weights=(1.0,), batch_size=config.batch_size,
                            seed=config.seed, max_noisy_blocks=None, noisy=False)
    state, history = _train(init_state(OptimizerSettings.of(config), model.params), batches, {size: program},
                            config=config, top_p=1.0, evaluation=None, on_metrics=None, progress=progress)
    return jax.tree_util.tree_map(lambda leaf: leaf.astype(model.dtype), state.params), history


def _train(state, batches: BatchIterator, programs: dict, *, config: FinetuneConfig, top_p: float, evaluation,
           on_metrics, progress: bool, frozen=None, layout: train_sharding.TrainLayout | None = None):
    """The loop: steps from the state's (or the latest checkpoint's) to `config.steps`; returns the
    final state and the logged metrics. frozen: a LoRA run's base (its fingerprint is checked on
    resume); layout: the shardings of a run on a mesh (`train_sharding`), None on one device."""
    history: list[dict] = []
    saver = None
    if config.checkpoint_dir:
        saver = checkpointing.Saver(config.checkpoint_dir, config.checkpoint_every,
                                    base_fingerprint=None if frozen is None else checkpointing.fingerprint(frozen))
    if saver is not None:
        try:
            state, batches.position, history = saver.restore_latest(state, batches.position, history)
        except BaseException:
            saver.close(failing=True)  # its log handler and manager go with it
            raise
    key = jax.random.key(config.seed)
    top_p = jnp.float32(top_p)
    step_function = lambda program: functools.partial(train_step, program=program)
    if layout is not None:
        state = jax.device_put(state, layout.state)
        replicated = layout.replicated
        key = jax.jit(lambda: jax.random.key(config.seed), out_shardings=replicated)()
        top_p = train_sharding.place(np.float32(top_p), replicated)
        step_function = lambda program: sharded_train_step(program, layout)
    started = time.perf_counter()
    tokens_seen = 0
    try:
        with tqdm(total=config.steps, initial=int(state.step), desc="training", unit="step",
                  disable=not progress) as bar:
            for step in range(int(state.step), config.steps):
                batch = batches.next()
                norm = normalisers(batch.rows, batch.block_size)
                rows = batch.rows
                if layout is not None:
                    rows = train_sharding.place(rows, layout.rows)
                    norm = train_sharding.place(norm, type(norm)(layout.replicated, layout.replicated))
                state, metrics = step_function(programs[batch.block_size])(state, rows, key, norm, top_p, frozen)
                checkpointing.fault_point("step", step + 1)
                tokens_seen += int(np.sum(batch.rows.segment > 0))
                done = step + 1
                if done % config.log_every == 0 or done == config.steps:
                    record = _record(metrics, done, norm, batch.block_size, tokens_seen, time.perf_counter() - started)
                    if evaluation is not None and config.eval_every and done % config.eval_every == 0:
                        record.update(evaluation(state))
                    history.append(record)
                    shown = {"loss": f"{record['loss']:.4f}"}
                    if record["masked_tokens"]:
                        shown["masked_acc"] = f"{record['masked_accuracy']:.3f}"
                    bar.set_postfix(shown)
                    logger.debug("step %d: %s", done, record)
                    if on_metrics is not None:
                        on_metrics(record)
                if saver is not None:
                    saver.maybe_save(done, state, batches.position, history, final=done == config.steps)
                bar.update(1)
        if evaluation is not None and not (config.eval_every and config.steps % config.eval_every == 0):
            final = evaluation(state)
            if history and history[-1]["step"] == config.steps:
                history[-1].update(final)
            else:
                history.append({"step": config.steps, **final})
            if on_metrics is not None:
                on_metrics(history[-1])
    except BaseException:
        if saver is not None:
            saver.close(failing=True)  # the error that ended the run stays the one reported
        raise
    if saver is not None:
        saver.close()
    return state, history


# ---------------------------------------------------------------------- before the loop
def training_mesh(config: FinetuneConfig):
    """The (data, expert, tensor) mesh of `config.mesh` over all devices of the run, or None (one
    device; with `offload_base`, a mesh of the first device: the base's memory kind is a sharding's);
    FieldError when the sizes do not multiply to the device count."""
    from clover_jax.parallel.sharding import make_mesh

    if config.mesh is None:
        return make_mesh(1, 1, 1, devices=jax.devices()[:1]) if config.offload_base else None
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


def _example_rows(packed: PackedRows, config: FinetuneConfig, block_size: int):
    """One batch's `TrainRows` shapes (the layout needs only their ranks)."""
    rows = BatchIterator({block_size: packed}, block_sizes=(block_size,), weights=(1.0,),
                         batch_size=config.batch_size, seed=config.seed, max_noisy_blocks=config.max_noisy_blocks)
    return rows.next().rows


def _data_directory(config: FinetuneConfig) -> str | None:
    """Where tokenised data is kept: the run's checkpoint directory, else the cache directory."""
    if config.checkpoint_dir:
        return os.path.join(os.fspath(config.checkpoint_dir), "data")
    return compilation_cache.data_directory()


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


def _packed(examples, config: FinetuneConfig, block_size: int, pad_id: int) -> PackedRows:
    fitted = fit_examples(examples, seq_len=config.seq_len, block_size=block_size, truncate=config.truncate)
    if not fitted:
        raise ValueError("no example holds a trained token (loss tokens): nothing to train on")
    return pack(fitted, seq_len=config.seq_len, block_size=block_size, pad_id=pad_id, seed=config.seed)


def _program(config: FinetuneConfig, module, settings: LossSettings, compute_dtype: str,
             spec: lora.LoraSpec | None = None) -> StepProgram:
    return StepProgram(module, settings, OptimizerSettings.of(config), config.mask_ratio_floor, compute_dtype,
                       config.grad_accum_steps, spec)


def _loss_settings(config: FinetuneConfig, model_config, block_size: int) -> LossSettings:
    return LossSettings(block_size=block_size, mask_token_id=model_config.mask_token_id,
                        coreset=model_config.moe_block_coreset_enabled, complementary=config.complementary,
                        loss_weighting=config.weighting, next_token_weight=float(config.next_token_weight),
                        load_balance_weight=float(config.load_balance_weight),
                        router_z_weight=float(config.router_z_weight))


# ---------------------------------------------------------------------- in the loop
def _record(metrics: dict, step: int, norm, block_size: int, tokens_seen: int, seconds: float) -> dict:
    values = jax.device_get(metrics)
    record: dict[str, Any] = {"step": step}
    for name, value in values.items():
        value = np.asarray(value)
        record[name] = float(value) if value.ndim == 0 else [round(float(v), 6) for v in value]
    record.update(block_size=block_size, loss_tokens=int(norm.loss_tokens), next_token_targets=int(norm.next_tokens),
                  tokens=tokens_seen, seconds=round(seconds, 3))
    return record


def _evaluate(state, *, program: StepProgram, held_out: PackedRows, config: FinetuneConfig, top_p: float,
              frozen=None) -> dict:
    compute = program.run_params(state.params, frozen)
    return evaluate(compute, program.module, held_out, settings=program.settings, batch_size=config.micro_batch,
                    coreset_top_p=top_p)


# ---------------------------------------------------------------------- after the loop
def _write(out: str, model, master: dict, target: conversion.Target, dtype: str) -> None:
    """The Hugging Face checkpoint: weights in `dtype`, config.json, generation_config.json, tokenizer files."""
    from weights.writer import save_params

    os.makedirs(out, exist_ok=True)
    params = _on_host(master)
    pad = {"pad_token_id": target.generation_config.get("pad_token_id")} if "pad_token_id" in \
        target.generation_config else {}
    save_params(params, target.config, out, dtype=dtype, extra_config=pad)
    conversion.write_tokenizer(model.path, out, target)
    conversion.write_generation_config(out, target)
    logger.info("wrote the trained checkpoint to %s", out)


def _write_lora(out: str, model, base: dict, trainable: dict, spec: lora.LoraSpec, target: conversion.Target,
                dtype: str, *, quantized: str | None) -> None:
    """A LoRA run's outputs: the adapter (in `out/adapter`; QLoRA: in `out`, the only output), PEFT's
    layout of it for a Qwen3.5-MoE base (`out/peft`), and over a float base the merged checkpoint in `out`."""
    trainable = _on_host(trainable)
    adapter_dir = out if quantized else os.path.join(out, "adapter")
    adapter_io.save_adapter(adapter_dir, trainable, spec, base_config=model.config, target=target,
                            tokenizer_source=model.path)
    peft_export.save_peft_adapter(os.path.join(out, "peft"), trainable, spec, config=model.config,
                                  base_name=model.path)
    if quantized is None:
        _write(out, model, lora.merge(base, trainable, spec), target, dtype)


def _on_host(tree):
    """A pytree of (possibly sharded, possibly multi-process) arrays as NumPy arrays on this host."""
    from jax.experimental import multihost_utils

    def one(leaf):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return np.asarray(jax.device_get(leaf))

    return jax.tree_util.tree_map(one, tree)


def _write_metrics(out: str, history: list[dict]) -> None:
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
