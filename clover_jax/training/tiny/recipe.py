"""The bundled tiny models' recipes: the tiny Clover, and the autoregressive base it can be made from.

* `train_tiny_clover` trains a Clover from random weights with `finetune` (block sizes 4, 8, 16
  and 32, drawn with weights): the recipe of `clover_jax/bundled/tiny-clover`.
* `train_tiny_editing` fine-tunes the tiny Clover further with LLaDA2.1's token-editing objective
  (`clover_jax/bundled/tiny-clover-editing`), the model `joint_threshold`'s edits are made for.
* `train_tiny_base` trains the same architecture as a plain Qwen3.5-MoE model
  (`qwen3_5_moe_text`, no mask token, no block-mode tensors) on the next-token loss alone:
  `clover_jax/bundled/tiny-qwen-base`, which answers autoregressively and cannot decode by
  diffusion until `clover-jax train` converts it (`make demo-train`).

Both learn the digit-sorting task (`sort_digits.py`) from chat JSONL that `write_task_data` writes, so
each is exactly what a user's own data would go through. Everything that decides a shipped
checkpoint (sizes, seeds, block sizes, decoding controls) is in this file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.bundled import bundled_base_path, bundled_editing_path, bundled_model_path
from clover_jax.core.config import CloverConfig
from clover_jax.core.state import empty_state
from clover_jax.nn.model import CloverTransformer
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.tiny.sort_digits import SortDigits
from clover_jax.training.tiny.vocabulary import (
    ENDOFTEXT,
    IM_END,
    MASK,
    THINK_END,
    THINK_START,
    build_tokenizer,
    special_token_ids,
    write_tokenizer_files,
)

logger = logging.getLogger(__name__)

BUNDLED_DIR = str(bundled_model_path())
BASE_DIR = str(bundled_base_path())
EDITING_DIR = str(bundled_editing_path())


@dataclasses.dataclass(frozen=True)
class Recipe:
    task: SortDigits = SortDigits(min_digits=4, max_digits=8)
    train: FinetuneConfig = FinetuneConfig(
        steps=3000, batch_size=16, seq_len=64, block_size=(4, 8, 16, 32), block_size_weights=(0.15, 0.35, 0.35, 0.15),
        learning_rate=2e-3, warmup_steps=100, weight_decay=0.01, grad_clip=1.0, load_balance_weight=0.0,
        checkpoint_every=500, log_every=25)
    examples: int = 20_000  # training conversations written to the chat JSONL
    thinking_fraction: float = 0.8  # the rest answer without reasoning (an empty thinking segment)
    model_seed: int = 0
    # architecture
    hidden_size: int = 96
    num_groups: int = 1  # groups of (3 GDN + 1 full attention)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64
    # shipped decoding controls (see docs/tiny_model.md for why)
    block_size: int = 16
    threshold: float = 0.9
    max_new_tokens: int = 32


# The autoregressive base: the tiny Clover's architecture, 600 next-token steps of 16 rows of 128 tokens
# (about 40 conversations a step).
BASE_RECIPE = Recipe(train=FinetuneConfig(steps=600, batch_size=16, seq_len=128, block_size=16, learning_rate=2e-3,
                                          warmup_steps=50, load_balance_weight=0.0, log_every=25),
                     examples=20_000)


def model_config(recipe: Recipe, special: dict[str, int | None], vocab_size: int,
                 model_type: str = "clover_moe") -> CloverConfig:
    """The tiny architecture as a Clover (`clover_moe`) or a base Qwen3.5-MoE (`qwen3_5_moe_text`)."""
    hidden = recipe.hidden_size
    clover = model_type == "clover_moe"
    return CloverConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=4 * recipe.num_groups,
        layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=recipe.moe_intermediate_size,
        shared_expert_intermediate_size=recipe.shared_expert_intermediate_size, num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.num_experts_per_tok, rms_norm_eps=1e-6, rope_theta=10_000.0,
        partial_rotary_factor=0.25, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=(special[IM_END], special[ENDOFTEXT]), mask_token_id=special[MASK] if clover else None,
        model_type=model_type)  # the coreset fields: CloverConfig's defaults


def generation_config(recipe: Recipe, special: dict[str, int | None], clover: bool = True) -> dict[str, Any]:
    """generation_config.json: the task's block size and threshold, neutral repetition controls
    (sorted digits and the pad run repeat tokens by design), ramps scaled to the task's lengths.
    The base model's holds only what autoregressive decoding reads."""
    values = {
        "max_new_tokens": recipe.max_new_tokens,
        "do_sample": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "eos_token_id": [special[IM_END], special[ENDOFTEXT]],
        "pad_token_id": special[ENDOFTEXT],
        "think_start_token_id": special[THINK_START],
        "think_end_token_id": special[THINK_END],
    }
    if clover:
        values.update(task_controls(recipe), mask_token_id=special[MASK])
    return values


def task_controls(recipe: Recipe) -> dict[str, Any]:
    """The decoding controls that suit the task (a converted model's generation-config overrides)."""
    return {
        "block_size": recipe.block_size,
        "threshold": recipe.threshold,
        "max_new_tokens": recipe.max_new_tokens,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "dllm_length_penalty": 10.0,
        "dllm_length_penalty_start": 24,
        "dllm_length_penalty_window": 8,
        "dllm_think_end_bias": 10.0,
        "dllm_think_end_start": 12,
        "dllm_think_end_window": 4,
    }


# The editing variant: the shipped tiny Clover trained further on lists of 4 to 12 digits with token editing
# (docs/training.md, "Token editing"): 20% of the corrupted positions hold a token drawn from the batch's loss
# tokens (a wrong digit for a digit, the errors a parallel decoder makes) and the kept positions add a keep
# term at weight 0.5. The lists of 9 to 12 digits are new to it: the split where a falling threshold costs
# accuracy, which editing can win back (docs/schedules.md). `EDITING_CONTROL` is the same run without
# editing, the comparison that tells what the objective did. A data seed of its own.
EDITING_RECIPE = Recipe(task=SortDigits(min_digits=4, max_digits=12))
EDITING = FinetuneConfig(
    steps=1500, batch_size=16, seq_len=64, block_size=(4, 8, 16, 32), block_size_weights=(0.15, 0.35, 0.35, 0.15),
    learning_rate=1e-3, warmup_steps=50, weight_decay=0.01, grad_clip=1.0, load_balance_weight=0.0,
    edit_fraction=0.2, edit_substitutes="data", edit_keep_weight=0.5, seed=1, checkpoint_every=500, log_every=25)
EDITING_CONTROL = dataclasses.replace(EDITING, edit_fraction=0.0, edit_keep_weight=0.0)


# `make demo-train`: the base converted into a Clover with `clover-jax train` (scripts/demo_train.py).
CONVERSION = FinetuneConfig(steps=750, batch_size=8, seq_len=128, block_size=16, learning_rate=3e-3,
                            warmup_steps=20, load_balance_weight=0.0, log_every=25,
                            generation_config=task_controls(Recipe()))


def conversion_flags(config: FinetuneConfig = CONVERSION) -> list[str]:
    """`clover-jax train` flags for the fields of `config` that differ from the defaults."""
    flags = []
    for field in dataclasses.fields(FinetuneConfig):
        value = getattr(config, field.name)
        if field.name in ("generation_config", "mesh") or value == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + field.name.replace("_", "-"))
        else:
            flags += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return flags


def init_params(config: CloverConfig, seed: int) -> dict:
    """Random parameters from the modules' initialisers (Clover block-mode ones at their defaults).

    Run eagerly (about 20 s on a loaded CPU): a jitted `init` rounds a few leaves differently
    in the last bit, and the bundled checkpoint was trained from the eager one.
    """
    module = CloverTransformer(config, jnp.float32)
    state = empty_state(config, 1, 1, jnp.float32)
    return module.init(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32), state)["params"]


def write_task_data(path: str | os.PathLike, task: SortDigits, *, count: int, seed: int,
                    thinking_fraction: float, also_excluded: tuple[SortDigits, ...] = ()) -> str:
    """`count` training conversations of the task as chat JSONL (held-out problems excluded, and those
    of `also_excluded`'s tasks); a fraction answers with reasoning, the rest with an empty thinking segment."""
    rng = np.random.default_rng([seed, 3])
    sampler = task.training_sampler(seed)
    if also_excluded:
        sampler.excluded = sampler.excluded.union(*(frozenset(other.held_out(1000)) for other in also_excluded))
    problems = sampler.problems(0, count)
    with open(path, "w", encoding="utf-8") as handle:
        for problem in problems:
            thinking = bool(rng.random() < thinking_fraction)
            reply = {"role": "assistant", "content": task.answer(problem),
                     "reasoning_content": task.reasoning(problem) if thinking else ""}
            handle.write(json.dumps({"messages": task.messages(problem) + [reply]}) + "\n")
    return os.fspath(path)


def write_checkpoint(out_dir: str, params: dict, config: CloverConfig, recipe: Recipe,
                     extra: dict[str, Any] | None = None) -> None:
    """Write a Hugging Face layout checkpoint: weights, config, generation config, tokenizer (with
    the mask token for a Clover), and `training_summary.json` when `extra` is given."""
    from weights.writer import save_params

    clover = config.model_type == "clover_moe"
    special = write_tokenizer_files(out_dir, model_max_length=config.max_position_embeddings, with_mask=clover)
    save_params(params, config, out_dir, dtype="float32",
                extra_config={"pad_token_id": special[ENDOFTEXT], "bos_token_id": None})
    with open(os.path.join(out_dir, "generation_config.json"), "w") as handle:
        json.dump(generation_config(recipe, special, clover), handle, indent=2)
        handle.write("\n")
    if extra is not None:
        with open(os.path.join(out_dir, "training_summary.json"), "w") as handle:
            json.dump(extra, handle, indent=2)
            handle.write("\n")
    for name in os.listdir(out_dir):  # safetensors writes its file owner-only; the package data is for everyone
        os.chmod(os.path.join(out_dir, name), 0o644)


def initial_checkpoint(out_dir: str, recipe: Recipe, *, clover: bool) -> CloverConfig:
    """The random-weight starting point of a recipe, written as a checkpoint; returns its config."""
    tokenizer = build_tokenizer(with_mask=clover)
    special = special_token_ids(tokenizer)
    vocab_size = 128  # the tokenizer's 128 (127 without the mask token), padded as Qwen pads its embeddings
    config = model_config(recipe, special, vocab_size, "clover_moe" if clover else "qwen3_5_moe_text")
    write_checkpoint(out_dir, init_params(config, recipe.model_seed), config, recipe)
    return config


def train_tiny_clover(out_dir: str = BUNDLED_DIR, recipe: Recipe = Recipe(), checkpoint_dir: str | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """Train the tiny Clover from its seeds with `finetune` and write it to `out_dir`."""
    from clover_jax.training.trainer import finetune

    with tempfile.TemporaryDirectory(prefix="tiny-clover-") as scratch:
        start = os.path.join(scratch, "initial")
        initial_checkpoint(start, recipe, clover=True)
        data = write_task_data(os.path.join(scratch, "train.jsonl"), recipe.task, count=recipe.examples,
                               seed=recipe.train.seed, thinking_fraction=recipe.thinking_fraction)
        config = dataclasses.replace(recipe.train, checkpoint_dir=checkpoint_dir or recipe.train.checkpoint_dir,
                                     generation_config=task_controls(recipe))
        started = time.perf_counter()
        result = finetune(start, data, out_dir, config=config, progress=progress)
    return _summary(out_dir, recipe, result.metrics, time.perf_counter() - started)


def train_tiny_editing(out_dir: str = EDITING_DIR, recipe: Recipe = EDITING_RECIPE, config: FinetuneConfig = EDITING,
                       checkpoint_dir: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Train the shipped tiny Clover further with `config` (`EDITING`, or `EDITING_CONTROL`) on
    `recipe`'s task and write it to `out_dir`. The held-out lists of the shipped task (4-8 digits) and
    of the longer ones (9-12) stay out of its data."""
    from clover_jax.training.trainer import finetune

    with tempfile.TemporaryDirectory(prefix="tiny-editing-") as scratch:
        data = write_task_data(os.path.join(scratch, "train.jsonl"), recipe.task, count=recipe.examples,
                               seed=config.seed, thinking_fraction=recipe.thinking_fraction,
                               also_excluded=(Recipe().task, SortDigits(min_digits=9, max_digits=12)))
        config = dataclasses.replace(config, checkpoint_dir=checkpoint_dir or config.checkpoint_dir,
                                     generation_config=task_controls(recipe))
        started = time.perf_counter()
        result = finetune(BUNDLED_DIR, data, out_dir, config=config, progress=progress)
    return _summary(out_dir, dataclasses.replace(recipe, train=config), result.metrics,
                    time.perf_counter() - started)


def train_tiny_base(out_dir: str = BASE_DIR, recipe: Recipe = BASE_RECIPE, progress: bool = True) -> dict[str, Any]:
    """Train the autoregressive base (next-token loss only) and write it to `out_dir` as a
    `qwen3_5_moe_text` checkpoint."""
    from clover_jax.model.clover_model import CloverModel

    with tempfile.TemporaryDirectory(prefix="tiny-base-") as scratch:
        start = os.path.join(scratch, "initial")
        config = initial_checkpoint(start, recipe, clover=False)
        data = write_task_data(os.path.join(scratch, "train.jsonl"), recipe.task, count=recipe.examples,
                               seed=recipe.train.seed, thinking_fraction=recipe.thinking_fraction)
        started = time.perf_counter()
        params, history = next_token_training(CloverModel.from_pretrained(start, progress=False), data,
                                              config=recipe.train, progress=progress)
        seconds = time.perf_counter() - started
    os.makedirs(out_dir, exist_ok=True)
    write_checkpoint(out_dir, jax.device_get(params), config, recipe)
    return _summary(out_dir, recipe, history, seconds)


def next_token_training(model, data, *, config: FinetuneConfig, progress: bool = True) -> tuple[dict, list[dict]]:
    """Train `model` (a `CloverModel` of a base checkpoint) on the next-token loss alone: no noisy
    stream, no mask token, the model stays what it was (how the bundled autoregressive base is
    made). returns (parameters in the model's dtype, the logged metrics)."""
    from clover_jax.text.tokenizer import Tokenizer
    from clover_jax.training.batches import BatchIterator
    from clover_jax.training.examples import read_examples
    from clover_jax.training.loop import LoopRun, run_loop
    from clover_jax.training.state import OptimizerSettings, init_state
    from clover_jax.training.step import StepProgram
    from clover_jax.training.trainer import (
        example_rows,
        packed_rows,
        placed_state,
        training_mesh,
        training_mesh_sharding,
    )

    tokenizer = Tokenizer.from_pretrained(model.path)
    size = config.block_sizes(16)[0]  # examples still start at block boundaries; nothing is denoised
    eos = list(model.config.eos_token_id)
    examples = read_examples(data, tokenizer, end_of_turn=eos, split_turns=config.split_turns)
    packed = packed_rows(examples, config, size, eos[0])
    mesh_sharding = training_mesh_sharding(training_mesh(config), model.config)
    program = StepProgram.of(config, model.module.clone(mesh_sharding=mesh_sharding), block_size=size,
                             compute_dtype=str(model.dtype))
    program = dataclasses.replace(program, settings=program.settings._replace(mask_token_id=None))
    batches = BatchIterator({size: packed}, block_sizes=(size,), weights=(1.0,), batch_size=config.batch_size,
                            seed=config.seed, max_noisy_blocks=None, noisy=False)
    state, layout, _ = placed_state(mesh_sharding, init_state(OptimizerSettings.of(config), model.params), None,
                                    example_rows(packed, config, size))
    state, history = run_loop(state, batches, LoopRun({size: program}, layout, None, 1.0), config, progress=progress)
    return jax.tree_util.tree_map(lambda leaf: leaf.astype(model.dtype), state.params), history


def _summary(out_dir: str, recipe: Recipe, history: list[dict], seconds: float) -> dict[str, Any]:
    summary = {"train_seconds": round(seconds, 1), "steps": recipe.train.steps,
               "final": history[-1] if history else None, "recipe": _jsonable(dataclasses.asdict(recipe)),
               "history": history}
    with open(os.path.join(out_dir, "training_summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
        handle.write("\n")
    os.chmod(os.path.join(out_dir, "training_summary.json"), 0o644)
    return summary


def _jsonable(value):
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value
