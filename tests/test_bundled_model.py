"""The bundled tiny Clover (clover_jax/bundled/tiny-clover): it loads, and it passes its quality gate."""

from __future__ import annotations

import json
import os

import pytest

from clover_jax.training.tiny.chat_format import CHAT_TEMPLATE
from clover_jax.training.tiny.recipe import BUNDLED_DIR, Recipe

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def bundled():
    from clover_jax import CloverModel

    # Prompts are short; a 64-token prefill chunk keeps generate's per-sequence memory estimate small.
    return CloverModel.from_pretrained(BUNDLED_DIR, strict=True, progress=False, chunk_size=64)


def test_bundled_checkpoint_is_complete_and_small():
    for name in FILES:
        assert os.path.isfile(os.path.join(BUNDLED_DIR, name)), name
    total = sum(os.path.getsize(os.path.join(BUNDLED_DIR, name)) for name in os.listdir(BUNDLED_DIR))
    assert total <= 20 * 2**20
    with open(os.path.join(BUNDLED_DIR, "config.json")) as handle:
        config = json.load(handle)
    assert config["model_type"] == "clover_moe" and config["moe_block_coreset_enabled"] is True
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    with open(os.path.join(BUNDLED_DIR, "tokenizer_config.json")) as handle:
        assert json.load(handle)["chat_template"] == CHAT_TEMPLATE


def test_bundled_checkpoint_loads_strictly_with_every_clover_tensor(bundled):
    from decoding import GenerationConfig

    gdn = bundled.params["groups"]["layer_0"]["linear_attn"]
    assert abs(gdn["conv1d_right_weight"]).max() > 0  # trained away from the zero default
    config = GenerationConfig.from_pretrained(BUNDLED_DIR)
    assert config.think_start_token_id == 3 and config.think_end_token_id == 4 and config.mask_token_id == 5


def test_quality_gate_on_200_held_out_prompts(bundled):
    """Greedy block-diffusion decoding with the checkpoint's own generation config: >= 95% exact
    answers and >= 5 response tokens per forward pass on average."""
    from tokenizers import Tokenizer

    from clover_jax.training.tiny.scoring import score_exact_match

    tokenizer = Tokenizer.from_file(os.path.join(BUNDLED_DIR, "tokenizer.json"))
    task = Recipe().task
    result = score_exact_match(bundled, tokenizer, task, task.held_out(200))
    print(json.dumps(result, indent=2))
    assert result["answer_match"] >= 0.95, result["failures"]
    assert result["tokens_per_forward"] >= 5.0


def test_autoregressive_quality_gate_on_200_held_out_prompts(bundled):
    """Greedy autoregressive decoding through the causal backbone (the model is trained on the
    next-token loss as well as block diffusion): >= 95% exact answers, one token per forward."""
    from tokenizers import Tokenizer

    from clover_jax.training.tiny.scoring import score_exact_match

    tokenizer = Tokenizer.from_file(os.path.join(BUNDLED_DIR, "tokenizer.json"))
    task = Recipe().task
    result = score_exact_match(bundled, tokenizer, task, task.held_out(200), mode="autoregressive")
    print(json.dumps(result, indent=2))
    assert result["answer_match"] >= 0.95, result["failures"]
    assert result["tokens_per_forward"] == 1.0


@pytest.mark.parametrize("quantize, min_match", [("int8", 0.95), ("int4-g16", 0.90)])
def test_quantised_bundled_model_keeps_its_accuracy(bundled, quantize, min_match):
    """Weight-only quantisation of the routed experts (int4 in groups of 16: the tiny model's
    input dimensions are 96 and 64). Thresholds: int8 as the float gate, int4 >= 90%."""
    import numpy as np
    from tokenizers import Tokenizer

    from clover_jax import CloverModel
    from clover_jax.training.tiny.scoring import score_exact_match

    quantized = CloverModel.from_pretrained(BUNDLED_DIR, progress=False, chunk_size=64, quantize=quantize)
    tokenizer = Tokenizer.from_file(os.path.join(BUNDLED_DIR, "tokenizer.json"))
    task = Recipe().task
    problems = task.held_out(200)
    result = score_exact_match(quantized, tokenizer, task, problems)
    print(quantize, json.dumps({k: v for k, v in result.items() if k != "failures"}))
    assert result["answer_match"] >= min_match, result["failures"]
    # Logits on one prompt stay close to the float model's (documented in docs/tiny_model.md).
    ids = np.asarray([tokenizer.encode(task.prompt_text(problems[0])).ids])
    drift = np.abs(np.asarray(quantized.forward(ids)) - np.asarray(bundled.forward(ids))).max()
    scale = np.abs(np.asarray(bundled.forward(ids))).max()
    assert drift <= {"int8": 0.005, "int4-g16": 0.1}[quantize] * scale, (drift, scale)


def test_the_editing_variant_was_trained_for_editing_and_its_edits_win_back_answers():
    """tiny-clover-editing (docs/schedules.md, "Token editing"): a complete checkpoint made by the token-editing
    objective; on 32 held-out lists of 9-12 digits at block 32, joint_threshold's edits inside the filling
    steps keep answers that LowConfidence at the same threshold loses (measured on 200: 94.5% against 79%)."""
    from clover_jax import CloverModel
    from clover_jax.api.research_tasks import sort_task
    from clover_jax.core.bundled import bundled_editing_path
    from clover_jax.text.tokenizer import Tokenizer
    from decoding import research

    path = str(bundled_editing_path())
    for name in FILES:
        assert os.path.isfile(os.path.join(path, name)), name
    with open(os.path.join(path, "training_summary.json")) as handle:
        trained = json.load(handle)["recipe"]["train"]
    assert trained["edit_fraction"] > 0 and trained["edit_substitutes"] == "data"
    model = CloverModel.from_pretrained(path, strict=True, progress=False, chunk_size=64)
    task = sort_task(Tokenizer.from_pretrained(path), count=32, min_digits=9, max_digits=12)
    grid = {"low_confidence": {"threshold": [0.7]},
            "joint_threshold": [{"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 0}]}
    plain, editing = research.sweep(model, grid, block_sizes=[32], task=task, progress=False, warmup=False)
    assert editing.accuracy >= plain.accuracy + 5.0, (plain.accuracy, editing.accuracy)
    assert editing.tokens_per_forward >= 0.9 * plain.tokens_per_forward  # the edits rode on the same forwards
