"""Decoding fixtures: a tiny Clover whose logits are peaked enough for confident fills."""

from __future__ import annotations

import pytest

from clover_jax import CloverModel
from decoding import GenerationConfig
from tests.conftest import MASK_ID

THINK_START, THINK_END, EOS = 10, 11, 1


@pytest.fixture(scope="session")
def peaked(clover):
    """The clover test model with its LM head scaled up: random weights otherwise give flat
    distributions in which no position is ever confident."""
    params = dict(clover.params)
    params["lm_head"] = clover.params["lm_head"] * 4.0
    return CloverModel(clover.config, params, clover.dtype, clover.path)


@pytest.fixture(scope="session")
def controls_config() -> GenerationConfig:
    """Every control active, with small ramp starts and windows so they act within 20 tokens."""
    return GenerationConfig(
        max_new_tokens=20, block_size=8, threshold=0.6, presence_penalty=0.9, frequency_penalty=0.3,
        repetition_penalty=1.05, dllm_length_penalty=2.0, dllm_length_penalty_start=6,
        dllm_length_penalty_window=8, dllm_think_end_bias=3.0, dllm_think_end_start=2, dllm_think_end_window=4,
        eos_token_id=(EOS,), mask_token_id=MASK_ID, think_start_token_id=THINK_START,
        think_end_token_id=THINK_END)
