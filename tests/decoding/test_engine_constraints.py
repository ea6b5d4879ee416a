"""The serving engine under constraints against `generate` under the same constraint, each request
alone: in every mode, greedy and sampled, with unconstrained requests in the same passes (and the
same split denoising step), the engine's tokens, NFE and steps per block are `generate`'s, and every
output keeps to the grammar (checked with Python's `re`)."""

from __future__ import annotations

import jax
import pytest

from clover_jax.core.errors import FieldError
from decoding import generate
from decoding.constraints import Constraint
from decoding.engine import Engine, EngineRequest
from tests.decoding.test_constraints_generate import LETTERS, bundled, keeps_to, prompts, tokenizer  # noqa: F401

CONSTRAINED = {"constraint": {"regex": LETTERS}}


def alone(model, request: EngineRequest):
    out = generate(model, [list(request.prompt)], key=jax.random.key(request.seed), mode=request.mode,
                   **request.overrides)
    return out.sequences[0], out.nfe[0], out.steps_per_block[0]


@pytest.fixture(scope="module")
def engine(bundled):  # noqa: F811
    with Engine(bundled, max_running=4, max_queue=32) as engine:
        yield engine


@pytest.mark.parametrize("mode", ["diffusion", "autoregressive", "self_speculative"])
def test_constrained_requests_decode_as_generate_decodes_each_alone(engine, bundled, prompts, tokenizer, mode):  # noqa: F811
    sampled = {"do_sample": True, "temperature": 1.2} if mode != "self_speculative" else {}
    requests = [EngineRequest(prompts[0], mode, overrides=CONSTRAINED),
                EngineRequest(prompts[1], mode, overrides=dict(CONSTRAINED, **sampled), seed=4),
                EngineRequest(prompts[2], mode),  # unconstrained, in the same passes
                EngineRequest(prompts[3], mode, overrides=dict(CONSTRAINED, constraint_gap_rule="frontier")),
                EngineRequest(prompts[4], mode, overrides=CONSTRAINED)]
    results = engine.run(requests, timeout=900)
    for request, result in zip(requests, results, strict=True):
        tokens, nfe, steps = alone(bundled, request)
        assert result.error is None, result.error
        assert (result.tokens, result.stats.nfe, result.stats.steps_per_block) == (tokens, nfe, steps), request
        if "constraint" in request.overrides:
            assert keeps_to(result.tokens, LETTERS, tokenizer, Constraint.regex(LETTERS)), result.tokens
    assert engine.running() == 0


def test_a_grammar_that_does_not_compile_is_refused_at_submission(engine):
    with pytest.raises(FieldError, match="the regex cannot be compiled") as caught:
        engine.submit(EngineRequest([7, 8], overrides={"constraint": {"regex": "[0-9"}}), lambda event: None)
    assert caught.value.field == "constraint" and engine.running() == 0


def test_a_grammar_failing_mid_decoding_fails_its_own_mode_alone(engine, bundled, prompts, monkeypatch):  # noqa: F811
    from decoding.engine import grammars

    def broken(*args, **kwargs):
        raise RuntimeError("the grammar engine failed")

    monkeypatch.setattr(grammars, "next_token_masks", broken)
    requests = [EngineRequest(prompts[0], "autoregressive", overrides=CONSTRAINED), EngineRequest(prompts[1])]
    failed, decoded = engine.run(requests, timeout=900)
    assert "the grammar engine failed" in failed.error
    tokens, nfe, steps = alone(bundled, requests[1])
    assert decoded.error is None and (decoded.tokens, decoded.stats.nfe) == (tokens, nfe)
    assert engine.running() == 0
