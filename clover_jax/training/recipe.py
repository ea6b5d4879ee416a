"""The bundled tiny Clover's recipe: model config, data, generation config, export.

`scripts/train_tiny_clover.py` calls `train_tiny_clover`; everything that decides the shipped
checkpoint (sizes, seeds, block sizes, decoding controls) is in this file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.config import CloverConfig
from clover_jax.core.state import empty_state
from clover_jax.nn.model import CloverTransformer
from clover_jax.training.batches import TrainBatch, make_batch, prefix_width, sequence_width
from clover_jax.training.task import SortDigits
from clover_jax.training.trainer import TrainConfig, Trainer, count_parameters
from clover_jax.training.vocabulary import (
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

BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bundled", "tiny-clover")


@dataclasses.dataclass(frozen=True)
class Recipe:
    task: SortDigits = SortDigits(min_digits=4, max_digits=8)
    train: TrainConfig = TrainConfig()
    # block sizes trained on, and how often each is drawn
    block_sizes: tuple[int, ...] = (4, 8, 16, 32)
    block_size_weights: tuple[float, ...] = (0.15, 0.35, 0.35, 0.15)
    thinking_fraction: float = 0.8  # the rest use enable_thinking=False prompts
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


def model_config(recipe: Recipe, special: dict[str, int], vocab_size: int) -> CloverConfig:
    hidden = recipe.hidden_size
    return CloverConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=4 * recipe.num_groups,
        layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=recipe.moe_intermediate_size,
        shared_expert_intermediate_size=recipe.shared_expert_intermediate_size, num_experts=recipe.num_experts,
        num_experts_per_tok=recipe.num_experts_per_tok, rms_norm_eps=1e-6, rope_theta=10_000.0,
        partial_rotary_factor=0.25, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=(special[IM_END], special[ENDOFTEXT]), mask_token_id=special[MASK],
        moe_block_coreset_enabled=True, moe_block_coreset_top_p=0.9, model_type="clover_moe")


def generation_config(recipe: Recipe, special: dict[str, int]) -> dict[str, Any]:
    """generation_config.json: the task's block size and threshold, neutral repetition controls
    (sorted digits and the pad run repeat tokens by design), ramps scaled to the task's lengths."""
    return {
        "block_size": recipe.block_size,
        "threshold": recipe.threshold,
        "max_new_tokens": recipe.max_new_tokens,
        "do_sample": False,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "dllm_length_penalty": 10.0,
        "dllm_length_penalty_start": 24,
        "dllm_length_penalty_window": 8,
        "dllm_think_end_bias": 10.0,
        "dllm_think_end_start": 12,
        "dllm_think_end_window": 4,
        "eos_token_id": [special[IM_END], special[ENDOFTEXT]],
        "pad_token_id": special[ENDOFTEXT],
        "mask_token_id": special[MASK],
        "think_start_token_id": special[THINK_START],
        "think_end_token_id": special[THINK_END],
    }


def init_params(config: CloverConfig, seed: int) -> dict:
    """Random parameters from the modules' initialisers (Clover block-mode ones at docs/design.md §2 defaults).

    Run eagerly (about 20 s on a loaded CPU): a jitted `init` rounds a few leaves differently
    in the last bit, and the bundled checkpoint was trained from the eager one.
    """
    module = CloverTransformer(config, jnp.float32)
    state = empty_state(config, 1, 1, jnp.float32)
    return module.init(jax.random.key(seed), jnp.zeros((1, 1), jnp.int32), state)["params"]


def batch_source(recipe: Recipe, tokenizer, pad_id: int) -> Callable[[int], TrainBatch]:
    """Step -> batch, a pure function of (seed, step): problems, thinking on/off, block size, block."""
    task, config = recipe.task, recipe.train
    sampler = task.training_sampler(config.seed)
    max_prompt, max_response = task.max_lengths(tokenizer)
    widths = {size: prefix_width(max_prompt, max_response, size) for size in recipe.block_sizes}
    seq_width = sequence_width(max_prompt, max_response)
    weights = np.asarray(recipe.block_size_weights, np.float64) / np.sum(recipe.block_size_weights)

    def batch_for_step(step: int) -> TrainBatch:
        rng = np.random.default_rng([config.seed, step, 1])
        size = recipe.block_sizes[int(rng.choice(len(recipe.block_sizes), p=weights))]
        problems = sampler.problems(step, config.batch_size)
        thinking = rng.random(config.batch_size) < recipe.thinking_fraction
        examples = [task.encode(tokenizer, problem, bool(on)) for problem, on in zip(problems, thinking, strict=True)]
        return make_batch(examples, size, widths[size], pad_id, rng, seq_width=seq_width)

    return batch_for_step


def export(params: dict, config: CloverConfig, recipe: Recipe, out_dir: str, extra: dict[str, Any]) -> None:
    """Write the Hugging Face layout checkpoint: weights, config, generation config, tokenizer."""
    from weights.writer import save_params

    special = write_tokenizer_files(out_dir, model_max_length=config.max_position_embeddings)
    save_params(params, config, out_dir, dtype="float32",
                extra_config={"pad_token_id": special[ENDOFTEXT], "bos_token_id": None})
    with open(os.path.join(out_dir, "generation_config.json"), "w") as handle:
        json.dump(generation_config(recipe, special), handle, indent=2)
        handle.write("\n")
    with open(os.path.join(out_dir, "training_summary.json"), "w") as handle:
        json.dump(extra, handle, indent=2)
        handle.write("\n")
    for name in os.listdir(out_dir):  # safetensors writes its file owner-only; the package data is for everyone
        os.chmod(os.path.join(out_dir, name), 0o644)


def train_tiny_clover(out_dir: str = BUNDLED_DIR, recipe: Recipe = Recipe(), checkpoint_dir: str | None = None,
                      progress: bool = True) -> dict[str, Any]:
    """Train the tiny Clover from its seeds and write it to `out_dir`; returns the training summary."""
    tokenizer = build_tokenizer()
    special = special_token_ids(tokenizer)
    config = model_config(recipe, special, vocab_size=tokenizer.get_vocab_size())
    params = init_params(config, recipe.model_seed)
    module = CloverTransformer(config, jnp.float32)
    logger.info("tiny Clover: %d parameters", count_parameters(params))
    trainer = Trainer(module, recipe.train, mask_token_id=special[MASK], coreset=config.moe_block_coreset_enabled,
                      coreset_top_p=config.moe_block_coreset_top_p)
    started = time.perf_counter()
    state, history = trainer.fit(trainer.init_state(params), batch_source(recipe, tokenizer, special[ENDOFTEXT]),
                                 checkpoint_dir=checkpoint_dir, progress=progress)
    seconds = time.perf_counter() - started
    summary = {
        "parameters": count_parameters(state.params),
        "train_seconds": round(seconds, 1),
        "steps": recipe.train.steps,
        "final": history[-1] if history else None,
        "recipe": _jsonable(dataclasses.asdict(recipe)),
        "history": history,
    }
    export(jax.device_get(state.params), config, recipe, out_dir, summary)
    return summary


def _jsonable(value):
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value
