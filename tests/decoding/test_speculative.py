"""Self-speculative decoding (docs/design.md §8) against a naive reading of the rule, against autoregressive
decoding token for token, on the test checkpoint and on the bundled model, and its contracts."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

import decoding.layouts as layouts_module  # where generate finds the compiled loops
from decoding import GenerationConfig, generate
from decoding.speculative import run_self_speculative
from tests.decoding.conftest import EOS, THINK_START
from tests.decoding.reference_decoder import process

# lengths: 8, 12 (ending in an open <think>), 3 and 1 (no prefill): left padding in one batch
PROMPTS = [list(range(20, 28)), list(range(30, 41)) + [THINK_START], [40, 41, 42], [50]]


class NaiveSelfSpeculative:
    """docs/design.md §8 round by round on the public API, one prompt, NumPy `process`. The state only ever
    holds emitted tokens, appended one at a time (no rollback, no block-sized causal pass): a
    round drafts with `denoise` after them and verifies by appending the drafts one by one to a
    copy of that state. Every call has one shape, so it compiles once."""

    def __init__(self, model, cfg: GenerationConfig, capacity: int = 64):
        self.model, self.cfg, self.capacity = model, cfg, capacity
        self.min_margin = np.inf  # smallest top-1 / top-2 gap of any greedy decision

    def choose(self, logits, counts: Counter, t: int) -> int:
        cfg = self.cfg
        thinking = (self.prompt_thinking or counts[cfg.think_start_token_id] > 0) and \
            counts[cfg.think_end_token_id] == 0
        scores = process(logits, counts, t, thinking, cfg)
        order = np.argsort(-scores, kind="stable")
        self.min_margin = min(self.min_margin, scores[order[0]] - scores[order[1]])
        return int(order[0])

    def append(self, state, token: int):
        """(causal logits after `token` [vocab], the state with it appended)."""
        logits, state = self.model.extend(state, np.asarray([[token]]), logits="last")
        return np.asarray(logits)[0, -1], state

    def generate(self, prompt: list[int]):
        cfg, model = self.cfg, self.model
        size, new = cfg.block_size, cfg.max_new_tokens
        opened = max((i for i, t in enumerate(prompt) if t == cfg.think_start_token_id), default=-1)
        closed = max((i for i, t in enumerate(prompt) if t == cfg.think_end_token_id), default=-1)
        self.prompt_thinking = opened > closed
        state = model.init_state(1, self.capacity)
        for token in prompt:
            logits, state = self.append(state, token)
        response, rounds, nfe = [], [], int(len(prompt) > 1)
        while len(response) < new:
            # state: the prompt and every emitted token; logits: the causal logits after them
            block = np.asarray(model.denoise(state, np.full((1, size), cfg.mask_token_id)).logits)[0]
            drafts = [self.choose(block[j], Counter(response), len(response) + j) for j in range(size)]
            counts, choices, verify, before = Counter(response), [], state, logits
            for j in range(size + 1):
                choices.append(self.choose(before, counts, len(response) + j))
                if j < size:
                    counts[drafts[j]] += 1
                    before, verify = self.append(verify, drafts[j])
            accepted = next((j for j in range(size) if drafts[j] != choices[j]), size)
            emitted = choices[:accepted + 1][:new - len(response)]
            emitted = emitted[:next((n + 1 for n, t in enumerate(emitted) if t in cfg.eos_token_id), len(emitted))]
            for token in emitted:
                logits, state = self.append(state, token)
            response += emitted
            nfe += 2
            rounds.append((drafts, accepted, len(emitted)))
            if emitted[-1] in cfg.eos_token_id:
                break
        return response, nfe, rounds


@pytest.mark.parametrize("length_penalty", [2.0, 8.0])  # the stronger one ends responses early on EOS
def test_rounds_follow_the_naive_rule_and_equal_autoregressive_decoding(peaked, controls_config, length_penalty):
    config = controls_config.replace(dllm_length_penalty=length_penalty)
    reference = NaiveSelfSpeculative(peaked, config)
    expected = [reference.generate(prompt) for prompt in PROMPTS]
    assert reference.min_margin > 1e-3  # every greedy decision (draft and causal) is far from a tie
    out = generate(peaked, PROMPTS, config, mode="self_speculative", return_trajectory=True)
    autoregressive = generate(peaked, PROMPTS, config, mode="autoregressive")
    assert out.sequences == autoregressive.sequences  # lossless
    for i, (tokens, nfe, rounds) in enumerate(expected):
        assert out.sequences[i] == tokens
        assert out.nfe[i] == nfe
        assert out.tokens_per_forward[i] == pytest.approx(len(tokens) / nfe)
        assert out.steps_per_block[i] == [1] * len(rounds)
        trajectory = out.trajectory[i]
        assert trajectory["drafts"] == [drafts for drafts, _, _ in rounds]
        assert trajectory["accepted"] == [accepted for _, accepted, _ in rounds]
        assert trajectory["emitted"] == [emitted for _, _, emitted in rounds]
    if length_penalty == 8.0:
        assert any(len(s) < config.max_new_tokens and s[-1] == EOS for s in out.sequences)
    else:
        assert any(len(s) == config.max_new_tokens for s in out.sequences)


def test_compilation_is_reused_within_buckets(peaked, controls_config):
    generate(peaked, PROMPTS, controls_config, mode="self_speculative")
    compiled = run_self_speculative._cache_size()
    other = [list(range(60, 66)), [70, 71], list(range(80, 93)), [90, 91, 92, 93]]  # same buckets
    generate(peaked, other, controls_config, mode="self_speculative", presence_penalty=0.2, max_new_tokens=17)
    assert run_self_speculative._cache_size() == compiled


@pytest.mark.parametrize("overrides, message", [
    ({"do_sample": True}, "self-speculative decoding is greedy: do_sample=True is not supported"),
    ({"return_history": True}, "self-speculative decoding records its rounds with return_trajectory=True"),
    ({"on_step": print}, "return_history, on_block, streamer, on_step and progress are for diffusion"),
    ({"max_new_tokens": 4094}, "P \\+ N = 4097 positions"),
])
def test_bad_requests_are_refused_before_compute(peaked, controls_config, monkeypatch, overrides, message):
    calls = []
    monkeypatch.setattr(layouts_module, "run_self_speculative", lambda *args: calls.append(args))
    options = {key: overrides.pop(key) for key in ("return_history", "on_step") if key in overrides}
    config = controls_config.replace(**overrides)
    with pytest.raises(ValueError, match=message):
        generate(peaked, [[1, 2, 3]], config, mode="self_speculative", key=None, **options)
    assert calls == []
    with pytest.raises(ValueError, match="mode must be one of 'diffusion', 'autoregressive', 'self_speculative'"):
        generate(peaked, [[1, 2, 3]], controls_config, mode="speculative")


def test_a_model_without_a_mask_token_is_refused_before_compute(clover_model, monkeypatch):
    calls = []
    monkeypatch.setattr(layouts_module, "run_self_speculative", lambda *args: calls.append(args))
    with pytest.raises(ValueError, match="self-speculative decoding needs mask_token_id"):
        generate(clover_model, [[1, 2, 3]], max_new_tokens=4, mode="self_speculative")
    assert calls == []


# ---------------------------------------------------------------------- the bundled model
@pytest.fixture(scope="module")
def bundled():
    from clover_jax import CloverModel
    from clover_jax.training.tiny.recipe import BUNDLED_DIR

    # Prompts are short; a 64-token prefill chunk keeps generate's per-sequence memory estimate small.
    return CloverModel.from_pretrained(BUNDLED_DIR, strict=True, progress=False, chunk_size=64)


@pytest.fixture(scope="module")
def held_out(bundled):
    from tokenizers import Tokenizer

    from clover_jax.training.tiny.recipe import Recipe

    tokenizer = Tokenizer.from_file(os.path.join(bundled.path, "tokenizer.json"))
    task = Recipe().task
    problems = task.held_out(200)
    return task, tokenizer, problems, [task.encode(tokenizer, problem, True).prompt for problem in problems]


def test_bundled_model_self_speculative_equals_autoregressive_on_200_held_out_prompts(bundled, held_out):
    """Lossless on the model it was built for: >= 95% exact (the autoregressive answers), >= 2
    response tokens per forward pass, drafts accepted in full and in part."""
    task, tokenizer, problems, prompts = held_out
    out = generate(bundled, prompts, mode="self_speculative", return_trajectory=True)
    autoregressive = generate(bundled, prompts, mode="autoregressive")
    assert out.sequences == autoregressive.sequences
    exact = np.mean([task.is_correct(problem, tokenizer.decode(sequence, skip_special_tokens=False))
                     for problem, sequence in zip(problems, out.sequences, strict=True)])
    assert exact >= 0.95
    assert np.mean(out.tokens_per_forward) >= 2.0
    accepted = Counter(a for trajectory in out.trajectory for a in trajectory["accepted"])
    size = GenerationConfig.from_pretrained(bundled.path).block_size
    assert accepted[size] > 0 and sum(n for a, n in accepted.items() if 0 < a < size) > 0


def test_bundled_model_with_controls_equals_autoregressive_and_the_naive_rule(bundled, held_out):
    """Penalties and ramps that act inside a round (the verify pass counts the drafts before each
    position; the drafts do not); rounds that accept part of their draft follow the naive rule."""
    prompts = held_out[3]
    controls = dict(repetition_penalty=1.5, frequency_penalty=3.0, presence_penalty=6.0, dllm_length_penalty=15.0,
                    dllm_length_penalty_start=10, dllm_length_penalty_window=4, dllm_think_end_bias=15.0,
                    dllm_think_end_start=3, dllm_think_end_window=2)
    out = generate(bundled, prompts, mode="self_speculative", return_trajectory=True, **controls)
    autoregressive = generate(bundled, prompts, mode="autoregressive", **controls)
    assert out.sequences == autoregressive.sequences
    plain = generate(bundled, prompts, mode="autoregressive")
    assert out.sequences != plain.sequences  # the controls changed what is emitted

    config = GenerationConfig.from_pretrained(bundled.path, **controls)
    size = config.block_size
    partial = [i for i, t in enumerate(out.trajectory) if any(0 < a < size for a in t["accepted"])][:4]
    assert len(partial) == 4
    reference = NaiveSelfSpeculative(bundled, config, capacity=128)
    for i in partial:
        tokens, nfe, rounds = reference.generate(prompts[i])
        assert (out.sequences[i], out.nfe[i]) == (tokens, nfe)
        assert out.trajectory[i]["accepted"] == [accepted for _, accepted, _ in rounds]
        assert out.trajectory[i]["drafts"] == [drafts for drafts, _, _ in rounds]
    assert reference.min_margin > 1e-3
