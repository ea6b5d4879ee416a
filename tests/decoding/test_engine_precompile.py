"""`Engine.precompile` and the served set: after it, traffic of every precompiled mode and block
size — prompts of many lengths, prefill chunks, requests joining and leaving at any point,
sampled ones, log-probabilities, prefix-cache hits — compiles nothing; a request outside it (a
block size or mode not precompiled) compiles on demand, logged with its shape. The set's size
depends on the engine's shapes alone: the same for one mode or three, one block size or three,
a context of 4K or 128K, and within the documented bounds for the Clover-35B commands."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from decoding.engine import Engine, EngineRequest, precompile
from tests.decoding import test_engine
from tests.decoding.test_engine import PROMPTS

model = test_engine.model  # the engine tests' model (a fixture)


def test_after_precompile_the_set_compiles_nothing_and_the_rest_is_logged(model, controls_config, caplog):
    with Engine(model, controls_config, max_running=3, max_context=128, prefill_budget=48, block_sizes=[8, 16],
                prefix_cache_bytes=1 << 24, prefix_cache_grid=8) as engine:
        modes = ["diffusion", "self_speculative"]
        done = engine.precompile(modes, [8])
        planned = precompile.planned_programs(modes=modes, block_sizes=[8], served_block_sizes=[8, 16],
                                              max_running=3, chunk_size=48)
        # in a fresh process exactly the plan; fewer where earlier tests compiled some of them
        assert done.programs <= planned["total"] and done.seconds > 0
        assert planned == {"forward": 4, "decisions": 4 + 2, "slots": 2, "gdn_states": 3, "total": 15}, planned
        before = precompile.compiled_programs()
        traffic = [EngineRequest(PROMPTS[0]), EngineRequest(PROMPTS[2], overrides={"schedule": "fixed_k"}),
                   EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 12, "threshold": 0.3}),
                   EngineRequest(PROMPTS[1], overrides={"do_sample": True, "temperature": 0.9}, seed=3),
                   EngineRequest(PROMPTS[5], "self_speculative"),
                   EngineRequest(list(range(20, 70)), overrides={"max_new_tokens": 8}),  # prefilled in 2 chunks
                   EngineRequest(PROMPTS[0], logprobs=2)]
        for request in traffic[:3]:  # one at a time
            assert engine.run([request], timeout=600)[0].error is None
        results = engine.run(traffic, timeout=600)  # together: joining and leaving as they go; prefix hits
        assert all(result.error is None for result in results)
        assert (precompile.compiled_programs(), engine.compiled_on_demand) == (before, 0)
        for request, result in zip(traffic[:6], results, strict=False):
            tokens, nfe, steps = test_engine.alone(model, controls_config, request)
            assert (result.tokens, result.stats.nfe, len(result.stats.steps_per_block)) == (tokens, nfe, len(steps))
        with caplog.at_level(logging.WARNING, logger="decoding.engine.precompile"):
            results = engine.run([EngineRequest(PROMPTS[0], overrides={"block_size": 16}),
                                  EngineRequest(PROMPTS[2], "autoregressive")], timeout=600)
        assert all(result.error is None for result in results)
        assert engine.compiled_on_demand > 0 and precompile.compiled_programs() == before + engine.compiled_on_demand
        logged = " ".join(record.getMessage() for record in caplog.records)
        assert "outside the precompiled set" in logged and "decide_diffusion" in logged
        assert "('diffusion', 16)" in logged and "('autoregressive', 16)" not in logged


def test_the_served_set_depends_on_the_engines_shapes_alone():
    count = lambda **settings: precompile.planned_programs(chunk_size=2048, **settings)
    every_mode = ["diffusion", "autoregressive", "self_speculative"]
    # the documented Clover-35B commands (docs/serving.md): H200 all modes, block sizes 16/32/64, 16
    # running, 131,072 positions; v6e-1 int4 and v5e-8 one block size, 8 running, 32,768
    h200 = count(modes=every_mode, block_sizes=[16, 32, 64], max_running=16, max_context=131072)
    one_size = count(modes=["diffusion"], block_sizes=[32], max_running=8, max_context=32768)
    assert h200["forward"] <= 24 and h200["total"] <= 64, h200
    assert one_size["forward"] <= 24 and one_size["total"] <= 64, one_size
    # the programs holding a forward pass: the same for one mode or three, one block size or three
    # (served beside the widest), 4K or 128K positions, 1 or 16 running
    forwards = {count(modes=modes, block_sizes=sizes, served_block_sizes=[16, 32, 64], max_running=running,
                      max_context=context)["forward"]
                for modes in (["diffusion"], every_mode) for sizes in ([32], [16, 32, 64])
                for context in (4096, 131072) for running in (1, 16)}
    assert forwards == {h200["forward"]}


def test_a_balanced_prefill_fills_the_padding_of_twice_the_running_rows():
    from decoding.engine.shapes import EngineShapes, token_paddings

    paddings = token_paddings(512)                                    # 16, 24, 32, 48, ..., 384, 512
    shapes = EngineShapes(slots=9, max_context=4096, block_sizes=(16,), page_size=16, pages_per_slot=256,
                          num_pages=2305, prefill_budget=512, max_tokens=512, paddings=paddings)
    # 8 requests' blocks and commits (136 rows): twice that pads to 384, so the prompt takes 248 rows
    # (it took 136, and the pass padded 272 rows to 384 all the same)
    assert shapes.balanced_prefill(136, floor=64) == 248
    for rows in range(1, 512):
        prompt = shapes.balanced_prefill(rows, floor=64)
        assert prompt >= 64 and (rows + prompt <= shapes.padding_for(min(2 * rows, 512)) or prompt == 64)
        assert rows + prompt >= min(2 * rows, 512) or prompt == 64


@pytest.mark.parametrize("slots", [1, 3, 16, 40])
def test_precompile_passes_run_every_width_of_the_forward(slots):
    """`exercising_works`: at every token padding, passes whose live blocks and live attention tiles
    pick each width `on_live` can run (none, one, all: on a CPU XLA readies a branch's code the
    first time it runs, so a width left out would stall the first request that needs it), all
    within the trash page and the engine's context."""
    from clover_jax.core.ragged import ATTENTION_TILE, layout, live_widths
    from decoding.engine.precompile import exercising_works
    from decoding.engine.shapes import EngineShapes, token_paddings

    paddings = token_paddings(512)
    shapes = EngineShapes(slots=slots, max_context=256, block_sizes=(16,), page_size=16, pages_per_slot=16,
                          num_pages=17, prefill_budget=512, max_tokens=512, paddings=paddings)
    page_table = np.zeros((slots, shapes.pages_per_slot), np.int32)
    width = lambda count, size: min(w for w in live_widths(size) if w >= count)
    for tokens in paddings:
        blocks, tiles = set(), set()
        for works in exercising_works(shapes, tokens, mask=5):
            _, batch = layout(works, num_tokens=tokens, page_table=page_table, max_block=16, logit_width=17,
                              chunk=64)
            blocks.add(width(int((batch.block_length > 0).sum()), slots))
            tiles.add(width(int((batch.tile_rows[:, 0] < tokens).sum()), batch.tile_rows.shape[0]))
            assert all(work.start + len(work.causal) + len(work.block) <= shapes.max_context for work in works)
        # more than one live tile (the widest width) where a pass can hold more: two slots' rows, or one's past a tile
        reachable = live_widths(batch.tile_rows.shape[0]) if slots > 1 or tokens > ATTENTION_TILE else (0, 1)
        assert blocks == set(live_widths(slots)) and tiles == set(reachable), tokens


def test_precompiling_stops_with_a_clear_error_before_the_process_runs_out_of_memory_mappings(model, monkeypatch):
    """XLA on a CPU crashes (SIGSEGV, seen: the bundled model's 184-program set reached Linux's 65,530
    mappings) once compiled programs hold more memory mappings than vm.max_map_count: precompiling a
    set past the headroom stops with an error naming what to narrow, before compiling more."""
    with Engine(model, max_running=2, max_context=64, block_sizes=[8]) as engine:
        monkeypatch.setattr(precompile, "mapping_use", lambda: (60_000, 65_530))
        before = precompile.compiled_programs()
        with pytest.raises(RuntimeError, match=r"60,000 memory mappings of this process's limit of 65,530.*"
                                               r"--block-sizes"):
            engine.precompile(["diffusion"], [8], sample=False)
        assert precompile.compiled_programs() == before  # stopped before the first program
        monkeypatch.setattr(precompile, "mapping_use", lambda: (50_000, 65_530))  # within the headroom: no error
        precompile.check_mapping_headroom()
    assert precompile.mapping_use() is None or precompile.mapping_use()[0] > 0  # the real reading, on Linux
