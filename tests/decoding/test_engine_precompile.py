"""`Engine.precompile`: after it, requests of the precompiled set (modes, block size, lane sizes up
to max_running, cache buckets up to max_context) compile nothing; a request outside it (another
block size) compiles on demand, and the engine logs that with its shape."""

from __future__ import annotations

import logging

from decoding.engine import Engine, EngineRequest, precompile
from tests.decoding import test_engine
from tests.decoding.test_engine import PROMPTS

model = test_engine.model  # the engine tests' model (a fixture)


def test_after_precompile_the_set_compiles_nothing_and_the_rest_is_logged(model, controls_config, caplog):
    with Engine(model, controls_config, max_running=2, max_context=64) as engine:
        done = engine.precompile(["diffusion", "autoregressive", "self_speculative"], [8], sample=False)
        assert done.programs > 0 and done.seconds > 0
        assert precompile.buckets(64) == [64] and precompile.lane_sizes(2) == [1, 2]
        before = precompile.compiled_programs()
        # every mode, one then two at once, prompts of several lengths, other controls and seeds
        traffic = [EngineRequest(PROMPTS[0]), EngineRequest(PROMPTS[2], "autoregressive", seed=3),
                   EngineRequest(PROMPTS[4], "self_speculative"),
                   EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 12, "threshold": 0.3})]
        for request in traffic:
            assert engine.run([request], timeout=600)[0].error is None
        results = engine.run(traffic, timeout=600)
        assert all(result.error is None for result in results)
        assert precompile.compiled_programs() == before
        assert engine.compiled_on_demand == 0
        with caplog.at_level(logging.WARNING, logger="decoding.engine.precompile"):
            [result] = engine.run([EngineRequest(PROMPTS[0], overrides={"block_size": 4})], timeout=600)
        assert result.error is None
        assert engine.compiled_on_demand > 0 and precompile.compiled_programs() > before
        logged = " ".join(record.getMessage() for record in caplog.records)
        assert "on demand" in logged and "block_size=4" in logged and "slots x 64 rows" in logged
