"""`Engine.precompile`: after it, requests of the precompiled set (mode, block size, lane sizes up
to max_running, cache buckets up to max_context) compile nothing — requests of different cache
buckets joining one lane included, which then decode as alone; a request outside it (another block
size, another mode) compiles on demand, and the engine logs that with its shape."""

from __future__ import annotations

import logging
import threading

import pytest

from decoding.engine import Engine, EngineRequest, precompile
from tests.decoding import test_engine
from tests.decoding.test_engine import PROMPTS

model = test_engine.model  # the engine tests' model (a fixture)


def test_after_precompile_the_set_compiles_nothing_and_the_rest_is_logged(model, controls_config, caplog):
    with Engine(model, controls_config, max_running=2, max_context=128) as engine:
        done = engine.precompile(["diffusion"], [8], sample=False)
        planned = precompile.planned_programs(modes=["diffusion"], block_sizes=[8], max_running=2, max_context=128,
                                              chunk_size=model.chunk_size, sample=False)
        # in a fresh process exactly the plan; fewer where earlier tests compiled some of them
        assert done.programs <= planned["total"] == 28 and planned["paddings"] == 1 and done.seconds > 0
        before = precompile.compiled_programs()
        # one at a time, then together: prompts of several lengths, other controls and schedules
        traffic = [EngineRequest(PROMPTS[0]), EngineRequest(PROMPTS[2], overrides={"schedule": "fixed_k"}),
                   EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 12, "threshold": 0.3})]
        for request in traffic:
            assert engine.run([request], timeout=600)[0].error is None
        assert all(result.error is None for result in engine.run(traffic[:2], timeout=600))
        # a request of the 128-row bucket and one of the 64-row bucket joining one lane together, then
        # one of 64 rows joining a busy lane of 128: the padding and join programs of the set
        long = EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 48, "dllm_length_penalty": 0.0}, seed=2)
        mixed = engine.run([long, traffic[0]], timeout=600)
        started = threading.Event()
        handle = engine.submit(long, lambda event: started.set())
        started.wait(600)
        [joined] = engine.run([traffic[1]], timeout=600)
        handle.cancel()
        assert (precompile.compiled_programs(), engine.compiled_on_demand) == (before, 0)
        assert joined.error is None
        for request, result in [(long, mixed[0]), (traffic[0], mixed[1])]:
            tokens, nfe, steps = test_engine.alone(model, controls_config, request)
            assert (result.error, result.tokens, result.stats.nfe, result.stats.steps_per_block) == (
                None, tokens, nfe, steps)
        with caplog.at_level(logging.WARNING, logger="decoding.engine.precompile"):
            results = engine.run([EngineRequest(PROMPTS[0], overrides={"block_size": 4}),
                                  EngineRequest(PROMPTS[2], "autoregressive")], timeout=600)
        assert all(result.error is None for result in results)
        assert engine.compiled_on_demand > 0 and precompile.compiled_programs() == before + engine.compiled_on_demand
        logged = " ".join(record.getMessage() for record in caplog.records)
        assert "outside the precompiled set: step of" in logged and "block_size=4" in logged
        assert "AUTOREGRESSIVE" in logged and "slots x 64 rows" in logged


def test_precompiling_stops_with_a_clear_error_before_the_process_runs_out_of_memory_mappings(model, monkeypatch):
    """XLA on a CPU crashes (SIGSEGV, seen: the bundled model's 184-program set reached Linux's 65,530
    mappings) once compiled programs hold more memory mappings than vm.max_map_count: precompiling a
    set past the headroom stops with an error naming the flags to narrow, before compiling more."""
    with Engine(model, max_running=2, max_context=64) as engine:
        monkeypatch.setattr(precompile, "mapping_use", lambda: (60_000, 65_530))
        before = precompile.compiled_programs()
        with pytest.raises(RuntimeError, match=r"60,000 memory mappings of this process's limit of 65,530.*"
                                               r"--max-context"):
            engine.precompile(["diffusion"], [8], sample=False)
        assert precompile.compiled_programs() == before  # stopped before the first program
        monkeypatch.setattr(precompile, "mapping_use", lambda: (50_000, 65_530))  # within the headroom: no error
        precompile.check_mapping_headroom()
    assert precompile.mapping_use() is None or precompile.mapping_use()[0] > 0  # the real reading, on Linux

