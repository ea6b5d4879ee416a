"""`generate` against the naive reference decoder of docs/design.md §4 and transformers, and its contracts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import decoding.layouts as layouts_module  # where generate finds the compiled loops
from decoding import GenerationConfig, generate
from decoding.block_loop import run_block_decoder
from tests.conftest import MASK_ID
from tests.decoding.conftest import EOS, THINK_START
from tests.decoding.reference_decoder import ReferenceDecoder

# lengths: a whole block, a tail of 4 ending in an open <think>, a prompt shorter than a block
PROMPTS = [list(range(20, 28)), list(range(30, 41)) + [THINK_START], [40, 41, 42]]


@pytest.mark.parametrize("length_penalty", [2.0, 8.0])  # the stronger one ends responses early on EOS
def test_block_decoder_equals_naive_reference(peaked, controls_config, length_penalty):
    config = controls_config.replace(dllm_length_penalty=length_penalty)
    reference = ReferenceDecoder(peaked, config)
    expected = [reference.generate(prompt) for prompt in PROMPTS]
    assert reference.fill_paths["threshold"] > 0 and reference.fill_paths["most_confident"] > 0
    assert reference.min_margin > 1e-4  # every greedy decision is far from a tie
    out = generate(peaked, PROMPTS, config, return_trajectory=True)
    for i, (tokens, nfe, steps) in enumerate(expected):
        assert out.sequences[i] == tokens
        assert out.nfe[i] == nfe and out.steps_per_block[i] == steps
        assert out.tokens_per_forward[i] == pytest.approx(len(tokens) / nfe)
        trajectory = out.trajectory[i]
        assert len(trajectory["step"]) == len(tokens)
        assert all(1 <= s <= max(steps) for s in trajectory["step"])
        assert all(0 < c <= 1 for c in trajectory["confidence"])
    if length_penalty == 8.0:
        assert any(len(s) < config.max_new_tokens and s[-1] == EOS for s in out.sequences)


def test_batch_equals_single_prompts(peaked, controls_config):
    batch = generate(peaked, PROMPTS, controls_config)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(peaked, [prompt], controls_config)
        assert alone.sequences[0] == batch.sequences[i]
        assert alone.nfe[0] == batch.nfe[i] and alone.steps_per_block[0] == batch.steps_per_block[i]
        np.testing.assert_allclose(alone.distinct_experts_per_block[0], batch.distinct_experts_per_block[i],
                                   rtol=1e-6)


def test_prompt_alignment_starts_blocks_after_the_prompt(peaked, controls_config):
    out = generate(peaked, PROMPTS[1:2], controls_config, block_alignment="prompt", return_trajectory=True)
    # every block starts fully masked: the first response token is decided by a denoising step
    assert out.steps_per_block[0][0] >= 1 and out.trajectory[0]["step"][0] >= 1
    assert out.nfe[0] == 1 + sum(out.steps_per_block[0])


def test_sampling_is_reproducible_per_key_and_folds_in_the_prompt_index(peaked, controls_config):
    config = controls_config.replace(do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    key = jax.random.key(7)
    first = generate(peaked, [PROMPTS[0], PROMPTS[0]], config, key=key)
    again = generate(peaked, [PROMPTS[0], PROMPTS[0]], config, key=key)
    other = generate(peaked, [PROMPTS[0], PROMPTS[0]], config, key=jax.random.key(8))
    assert first.sequences == again.sequences
    assert first.sequences[0] != first.sequences[1]  # prompt i samples with fold_in(key, i)
    assert first.sequences != other.sequences


def test_greedy_autoregressive_equals_transformers_generate(qwen36_checkpoint, clover_model, hf_model):
    prompts = [[5, 17, 33, 2, 90], [7, 7, 64, 3, 12, 99, 41, 8, 8, 120]]
    config = GenerationConfig.from_pretrained(qwen36_checkpoint, max_new_tokens=12)
    assert config.repetition_penalty == 1.0 and config.presence_penalty == 0.0  # neutral for base Qwen
    ours = generate(clover_model, prompts, config, mode="autoregressive")
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=EOS, pad_token_id=0)
        assert ours.sequences[i] == reference[0, len(prompt):].tolist()
        assert ours.nfe[i] == len(ours.sequences[i])  # prefill + one call per further token
    alone = generate(clover_model, prompts[:1], config, mode="autoregressive")
    assert alone.sequences[0] == ours.sequences[0]


def test_compilation_is_reused_within_buckets(peaked, controls_config):
    generate(peaked, [list(range(20, 29))], controls_config)  # P = 9: 1 prefix block, 4 decoded blocks
    compiled = run_block_decoder._cache_size()
    generate(peaked, [list(range(20, 35))], controls_config, threshold=0.7, presence_penalty=0.5)  # P = 15
    assert run_block_decoder._cache_size() == compiled


@pytest.mark.parametrize("prompts, overrides, message", [
    ([[1, 2, 3]], {"max_new_tokens": 5000}, "exceeds the model's context of 4096"),
    ([[1, 2, 3]], {"max_new_tokens": 4094, "block_alignment": "prompt"}, "P \\+ ceil\\(N / B\\) \\* B = 4099"),
    ([[1, MASK_ID]], {}, "contains the mask token id"),
    ([[1, 128]], {}, "outside the vocabulary"),
    ([[]], {}, "must be a non-empty list of int token ids"),
    ([], {}, "non-empty list"),
    ([[1, 2]], {"threshold": 0.0}, "threshold must be in \\(0, 1\\]"),
    ([[1, 2]], {"block_size": 0}, "block_size must be an integer >= 1"),
    ([[1, 2]], {"presence_penalty": -1.0}, "presence_penalty must be >= 0"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ([[1, 2]], {"schedule": "fastest"}, "schedule must be one of"),
    ([[1, 2]], {"do_sample": True}, "needs a PRNG key"),
    ([[1, 2]], {"beam_width": 4}, "unknown generation options \\['beam_width'\\]"),
    ([[1, 2]], {"eos_token_id": ["a"]}, "eos_token_id must be an int or a list of ints"),
    ([[1, 2]], {"eos_token_id": 500}, "eos_token_id \\[500\\] outside the vocabulary"),
    ([[1, 2]], {"do_sample": True, "top_k": 129}, "top_k=129 is larger than the vocabulary \\(128\\)"),
    ([[1, 2]], {"do_sample": True, "temperature": 0.0}, "temperature must be > 0 when do_sample=True"),
])
def test_bad_requests_are_refused_before_compute(peaked, controls_config, monkeypatch, prompts, overrides, message):
    calls = []
    monkeypatch.setattr(layouts_module, "run_block_decoder", lambda *args: calls.append(args))
    with pytest.raises(ValueError, match=message):
        generate(peaked, prompts, controls_config, **overrides)
    assert calls == []


def test_max_new_tokens_is_required(peaked):
    with pytest.raises(ValueError, match="max_new_tokens is not set"):
        generate(peaked, [[1, 2]], GenerationConfig(mask_token_id=MASK_ID))


def test_generation_config_defaults_follow_the_model_type(clover_checkpoint, qwen36_checkpoint, tmp_path):
    clover = GenerationConfig.from_pretrained(clover_checkpoint)
    assert (clover.block_size, clover.threshold, clover.presence_penalty, clover.repetition_penalty,
            clover.dllm_length_penalty, clover.dllm_think_end_start) == (32, 0.95, 0.9, 1.05, 10.0, 4096)
    assert clover.mask_token_id == MASK_ID and clover.eos_token_id == (EOS,)
    base = GenerationConfig.from_pretrained(qwen36_checkpoint)
    assert (base.presence_penalty, base.repetition_penalty, base.dllm_length_penalty, base.dllm_think_end_bias) == \
        (0.0, 1.0, 0.0, 0.0)
    assert GenerationConfig.from_pretrained(clover_checkpoint, threshold=0.5).threshold == 0.5


def test_trajectory_is_refused_in_autoregressive_mode_and_a_missing_checkpoint_is_named(peaked, tmp_path):
    with pytest.raises(ValueError, match="return_trajectory, return_history, on_block, streamer, on_step and progress "
                                         "are for diffusion decoding"):
        generate(peaked, [[1, 2]], max_new_tokens=4, mode="autoregressive", return_trajectory=True)
    with pytest.raises(ValueError, match="no config.json in"):
        GenerationConfig.from_pretrained(tmp_path)


def test_on_block_streams_each_decided_block_once(peaked, controls_config):
    seen: dict[int, list] = {0: [], 1: []}
    out = generate(peaked, PROMPTS[:2], controls_config,
                   on_block=lambda index, tokens, number: seen[index].append((number, tokens)))
    for index in range(2):
        numbers = [number for number, _ in seen[index]]
        assert numbers == sorted(set(numbers)) and len(numbers) == len(out.steps_per_block[index])
        streamed = [token for _, tokens in seen[index] for token in tokens]
        assert streamed[:len(out.sequences[index])] == out.sequences[index]


def test_bucket_policy_is_powers_of_two_then_whole_chunks():
    from decoding.generation import bucket

    assert [bucket(n, 64) for n in (0, 1, 3, 5, 64, 65, 129, 2049)] == [0, 1, 4, 8, 64, 128, 192, 2112]


@pytest.mark.parametrize("field, value", [("block_size", True), ("threshold", "0.9"), ("top_k", 2.0),
                                          ("temperature", None)])
def test_generation_config_refuses_values_of_the_wrong_type(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value}).validate()
