"""The serving engine (decoding/engine) against `generate` on each request alone: continuous
batching changes nothing — tokens, NFE and denoising steps per block are those of the request
decoded by itself — for block diffusion with every control and several schedules, sampled
requests, autoregressive and self-speculative requests, requests of two block sizes in the same
passes, requests that join while others are mid-block and leave at different steps, a long
prompt prefilled in chunks beside running requests; pages follow the tokens held and all come
back; cancellation, a failing listener and bad requests are confined to their request."""

from __future__ import annotations

import threading
import time

import pytest

from decoding import generate
from decoding.engine import Engine, EngineClosed, EngineRequest, QueueFull
from tests.conftest import MASK_ID
from tests.decoding.conftest import THINK_START

# lengths 3..27 with block size 8: no prefix, a tail, one prefix block, three (prefilled in two chunks),
# one ending in an open <think>
PROMPTS = [list(range(20, 28)), list(range(30, 41)) + [THINK_START], [40, 41, 42], list(range(50, 77)),
           [60, 61, 62, 63, 64], list(range(70, 79))]
# per request: its schedule and controls (a sampled one draws with its seed)
VARIANTS = [{}, {"schedule": "fixed_k", "schedule_params": {"tokens_per_step": 3}},
            {"threshold": 0.3, "presence_penalty": 0.0}, {"schedule": "joint_threshold"},
            {"do_sample": True, "temperature": 1.3, "top_k": 20, "top_p": 0.9}, {"schedule": "fixed_k"}]


@pytest.fixture(scope="module")
def model(small_clover_checkpoint):
    """The two-layer random Clover with its LM head scaled up, so that denoising steps decide
    several positions (random weights alone give flat distributions)."""
    from clover_jax import CloverModel

    loaded = CloverModel.from_pretrained(small_clover_checkpoint, progress=False)
    params = dict(loaded.params)
    params["lm_head"] = loaded.params["lm_head"] * 4.0
    return CloverModel(loaded.config, params, loaded.dtype, loaded.path)


@pytest.fixture(scope="module")
def engine(model, controls_config):
    with Engine(model, controls_config, max_running=4, max_queue=32, block_sizes=[8, 16]) as engine:
        yield engine


def alone(model, config, request: EngineRequest):
    """`generate` on the request by itself (its seed as generate's key)."""
    import jax

    out = generate(model, [list(request.prompt)], config, key=jax.random.key(request.seed), mode=request.mode,
                   **request.overrides)
    return out.sequences[0], out.nfe[0], out.steps_per_block[0]


def test_batched_requests_equal_each_request_alone(engine, model, controls_config):
    # nine requests of three modes, at most four running: the later ones join while the others are in
    # the middle of their blocks, and each leaves at its own step
    requests = [EngineRequest(prompt, overrides=variant, seed=seed)
                for seed, (prompt, variant) in enumerate(zip(PROMPTS, VARIANTS, strict=True))]
    requests += [EngineRequest(PROMPTS[0], "autoregressive"),
                 EngineRequest(PROMPTS[1], "autoregressive", overrides={"do_sample": True, "temperature": 0.8}, seed=5),
                 EngineRequest(PROMPTS[3], "self_speculative")]
    results = engine.run(requests, timeout=900)
    for request, result in zip(requests, results, strict=True):
        tokens, nfe, steps = alone(model, controls_config, request)
        assert result.error is None
        assert (result.tokens, result.stats.nfe, len(result.stats.steps_per_block)) == (tokens, nfe, len(steps)), \
            request
        if request.mode == "diffusion":
            assert result.stats.steps_per_block == steps
        assert result.finish == ("eos" if tokens[-1] in controls_config.eos_token_id else "length")
    assert any(len(result.stats.steps_per_block) > 1 for result in results[:6])  # several blocks each
    assert engine.running() == 0


def test_two_block_sizes_and_a_request_joining_mid_block_share_passes(engine, model, controls_config):
    """A long request of block size 8 in flight, then requests of block size 16 and 8 joining in its
    middle: they decode in the same passes (one forward each step) and each as alone."""
    long = EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 48, "dllm_length_penalty": 0.0}, seed=2)
    joining = [EngineRequest(PROMPTS[0], overrides={"block_size": 16}), EngineRequest(PROMPTS[2]),
               EngineRequest(PROMPTS[5], overrides={"block_size": 16, "schedule": "fixed_k"})]
    started = threading.Event()
    handle = engine.submit(long, lambda event: started.set())
    started.wait(600)
    steps = engine.steps
    results = engine.run(joining, timeout=600)
    handle.cancel()
    for request, result in zip(joining, results, strict=True):
        tokens, nfe, steps_per_block = alone(model, controls_config, request)
        assert (result.error, result.tokens, result.stats.nfe, result.stats.steps_per_block) == (
            None, tokens, nfe, steps_per_block), request
    # the three shared their passes: fewer passes than their forwards together
    assert engine.steps - steps < sum(result.stats.nfe for result in results)


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_requests(model, controls_config):
    """With a prefill budget of 8 tokens a pass, a prompt of 27 tokens takes several passes, each
    beside the running requests' steps, and every request decodes as alone."""
    requests = [EngineRequest(PROMPTS[0], overrides={"max_new_tokens": 24, "dllm_length_penalty": 0.0}),
                EngineRequest(PROMPTS[3], "autoregressive"), EngineRequest(PROMPTS[3]),
                EngineRequest(PROMPTS[3], "self_speculative")]
    with Engine(model, controls_config, max_running=4, prefill_budget=8, block_sizes=[8]) as engine:
        results = engine.run(requests, timeout=600)
        assert engine.kv_pages_in_use() == 0  # every page came back
    for request, result in zip(requests, results, strict=True):
        tokens, nfe, steps = alone(model, controls_config, request)
        assert (result.error, result.tokens, result.stats.nfe, len(result.stats.steps_per_block)) == (
            None, tokens, nfe, len(steps)), request


def test_a_short_request_starts_beside_a_long_prefill_that_took_the_prefill_budget(model, controls_config):
    """A diffusion prompt shorter than its block has no prompt rows to prefill: it decodes in the
    passes that carry a long prompt's chunks (it once waited for that prefill to end)."""
    long = EngineRequest(PROMPTS[3], "autoregressive", overrides={"max_new_tokens": 2})
    short = EngineRequest(PROMPTS[2], overrides={"schedule": "fixed_k", "schedule_params": {"tokens_per_step": 8},
                                                 "max_new_tokens": 8})
    order, finished = [], threading.Semaphore(0)

    def listener(name):
        def listen(event):
            order.append(name)
            if event.finish is not None:
                finished.release()
        return listen

    with Engine(model, controls_config, max_running=2, prefill_budget=4, block_sizes=[8]) as engine:
        engine.submit_all([long, short], [listener("long"), listener("short")])
        assert finished.acquire(timeout=600) and finished.acquire(timeout=600)
    # 27 prompt tokens at 4 a pass: the long request's first token comes with its seventh pass
    assert order.index("short") < order.index("long"), order


def test_pages_in_use_follow_the_tokens_held(model, controls_config):
    """A request holds the pages of the positions it has written, not of its whole reservation, and
    gives them all back when it ends."""
    seen = []
    with Engine(model, controls_config, max_running=1, block_sizes=[8], page_size=4) as engine:
        request = EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 48, "dllm_length_penalty": 0.0}, seed=2)
        [result] = engine.run([request], timeout=600)
        engine.submit(request, lambda event: seen.append(engine.kv_pages_in_use()))
        engine.run([EngineRequest(PROMPTS[2], overrides={"max_new_tokens": 1})], timeout=600)
        assert engine.kv_pages_in_use() == 0
    # 27 prompt tokens, blocks of 8 on pages of 4: 24 prefilled (6 pages), then 2 pages a block, each
    # event a block closed (the block after it not yet written); the last event comes after the release
    blocks = len(result.stats.steps_per_block)
    assert blocks >= 3 and seen == [6 + 2 * (k + 1) for k in range(blocks - 1)] + [0], seen


def test_a_cancelled_request_frees_its_slot_and_the_others_decode_as_alone(engine, model, controls_config):
    started = threading.Event()
    handle_box = []

    def listen(event):
        started.set()

    long = EngineRequest(PROMPTS[0], overrides={"max_new_tokens": 40, "dllm_length_penalty": 0.0})
    handle_box.append(engine.submit(long, listen))
    started.wait(300)
    handle_box[0].cancel()
    others = [EngineRequest(PROMPTS[0]), EngineRequest(PROMPTS[2])]
    for request, result in zip(others, engine.run(others, timeout=600), strict=True):
        assert result.tokens == alone(model, controls_config, request)[0]
    assert engine.running() == 0


def test_a_failing_listener_ends_its_request_alone(engine, model, controls_config):
    def fail(event):
        raise RuntimeError("listener bug")

    engine.submit(EngineRequest(PROMPTS[1]), fail)
    request = EngineRequest(PROMPTS[0])
    assert engine.run([request], timeout=600)[0].tokens == alone(model, controls_config, request)[0]
    assert engine.running() == 0


def test_precompile_refuses_a_busy_engine_and_run_cancels_what_it_stops_waiting_for(model, controls_config):
    with Engine(model, controls_config, max_running=1, block_sizes=[8]) as engine:
        long = EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 64, "dllm_length_penalty": 0.0})
        with pytest.raises(TimeoutError, match="cancelled"):
            engine.run([long], timeout=0.01)
        with pytest.raises(RuntimeError, match="precompile needs an idle engine"):  # the cancel is not seen yet
            engine.precompile(["diffusion"])
        deadline = time.monotonic() + 120
        while engine.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.running() == 0 and engine.kv_pages_in_use() == 0


def test_an_engine_that_cannot_start_again_stops_and_says_so(model, controls_config, monkeypatch):
    """The loop failing, and then its fresh start failing too: every request ends with an error, and
    the engine refuses new ones (its thread had died, leaving submitters waiting forever)."""
    with Engine(model, controls_config, max_running=1, block_sizes=[8]) as engine:
        def broken(*args, **kwargs):
            raise RuntimeError("broken for the test")

        monkeypatch.setattr(engine, "_run", broken)
        monkeypatch.setattr(engine, "_new_device_state", broken)
        held, queued = engine.run([EngineRequest(PROMPTS[0]), EngineRequest(PROMPTS[1])], timeout=120)
        assert (held.finish, held.error) == ("error", "internal error in the serving engine")
        assert (queued.finish, queued.error) == ("error", "the serving engine failed and stopped")
        with pytest.raises(EngineClosed):
            engine.submit(EngineRequest(PROMPTS[0]), lambda event: None)


def test_requests_admitted_together_are_written_into_their_slots_by_one_program(engine):
    """`put_slots` with two requests' rows for slots 2 and 0: those slots hold exactly each
    request's entry (its counts and scores zeroed over what the slot held before, its key the one
    `generate` draws from), the other slots keep what they held."""
    import jax
    import numpy as np

    from decoding.engine.slot_states import put_slots, stacked_rows

    engine.run([EngineRequest(PROMPTS[0], overrides={"max_new_tokens": 8})], timeout=300)
    before = jax.tree_util.tree_map(lambda leaf: leaf.copy(), engine.slots.diffusion)
    # slot 0 still holds what a request left there (alone, this one; after the module's others, theirs):
    # a slot is cleared only by the next admission into it
    assert np.asarray(before.progress.counts[0]).any()
    entries = [engine.entry_for(engine.check(EngineRequest(prompt, seed=seed)))[1]
               for prompt, seed in ((PROMPTS[1], 7), (PROMPTS[2], 11))]
    indices, rows = stacked_rows(entries, [2, 0], slots=engine.shapes.slots)
    assert indices.tolist() == [2, 0, 4, 4]
    after = put_slots(jax.tree_util.tree_map(lambda leaf: leaf.copy(), engine.slots.diffusion), indices, rows)
    paths_and_leaves, _ = jax.tree_util.tree_flatten_with_path(after, is_leaf=_is_key)
    leaves = [jax.tree_util.tree_leaves(tree, is_leaf=_is_key) for tree in (before, entries[0], entries[1])]
    for (path, new), old, first, second in zip(paths_and_leaves, *leaves, strict=True):
        new, old = (np.asarray(jax.random.key_data(leaf)) if _is_key(leaf) else np.asarray(leaf) for leaf in (new, old))
        assert (new[2] == first[0]).all() and (new[0] == second[0]).all(), path
        assert (new[[1, 3]] == old[[1, 3]]).all(), path
    assert (np.asarray(jax.random.key_data(after.facts.key[2]))
            == np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(7), 0)))).all()


def _is_key(leaf) -> bool:
    import jax

    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def test_bounded_queue(model, controls_config):
    release = threading.Event()
    with Engine(model, controls_config, max_running=1, max_queue=1) as engine:
        engine.submit(EngineRequest(PROMPTS[0]), lambda event: release.wait(60))  # holds the engine's thread
        engine.submit(EngineRequest(PROMPTS[1]), lambda event: None)             # waits in the queue
        with pytest.raises(QueueFull):
            engine.submit(EngineRequest(PROMPTS[2]), lambda event: None)
        release.set()


def test_queued_requests_are_admitted_when_every_running_one_finishes_in_the_same_step(model, controls_config):
    """Two slots and six equal requests: the running pair finishes in one step, and the four that
    wait are admitted without a new arrival to wake the engine (it once slept with them queued)."""
    with Engine(model, controls_config, max_running=2, max_queue=8) as engine:
        requests = [EngineRequest(PROMPTS[2], overrides={"max_new_tokens": 8})] * 6
        results = engine.run(requests, timeout=120)
    assert [result.finish for result in results] == [results[0].finish] * 6
    assert all(result.tokens == results[0].tokens for result in results)


@pytest.mark.parametrize("request_, message", [
    (EngineRequest([1, MASK_ID]), "contains the mask token id"),
    (EngineRequest([1, 2, 3], overrides={"max_new_tokens": 300}), "exceeds the engine's context of 256"),
    (EngineRequest([1, 2, 3], "self_speculative", overrides={"do_sample": True}),
     "self-speculative decoding is greedy"),
    (EngineRequest([1, 2], overrides={"schedule": lambda view, params: view.decided}), "named schedules"),
    (EngineRequest([1, 2], overrides={"block_alignment": "prompt"}), "absolute positions"),
    (EngineRequest([1, 2], overrides={"coreset": False}), "coreset setting"),
    (EngineRequest([1, 2], overrides={"eos_token_id": 3}), "eos_token_id is the engine's"),
    (EngineRequest([1, 2], overrides={"schedule": "fixed_k", "schedule_params": {"tokens_per_step": 0}}),
     "tokens_per_step must be >= 1"),
    (EngineRequest([1, 2], mode="beam"), "mode must be one of"),
    (EngineRequest([1, 2], seed=-1), "seed must be an integer"),
    (EngineRequest([1, 2], overrides={"block_size": 4}), r"block_size must be one of \[8\] on this engine"),
    (EngineRequest([1, 2], overrides={"constraint": {"regex": "[0-9]+"}}), "directory with tokenizer"),
])
def test_bad_requests_are_refused_before_compute(model, controls_config, request_, message):
    with Engine(model, controls_config, max_running=2, max_context=256) as engine:
        with pytest.raises(ValueError, match=message):
            engine.submit(request_, lambda event: None)
        assert engine.steps == 0 and engine.running() == 0


def test_a_request_whose_last_position_ends_the_context_decodes_as_alone(model, controls_config):
    """A request that needs every position of the engine's context (prompt and response end on its
    last page): its last rows are written and read through the page table like the others."""
    import dataclasses

    config = dataclasses.replace(controls_config, eos_token_id=(), dllm_length_penalty=0.0)  # runs to the end
    request = EngineRequest(list(range(20, 33)), "autoregressive", overrides={"max_new_tokens": 51})
    with Engine(model, config, max_running=1, max_context=64, block_sizes=[8]) as engine:
        [result] = engine.run([request], timeout=900)
    tokens, nfe, _ = alone(model, config, request)
    assert len(tokens) == 51  # 13 + 51 = 64 positions
    assert (result.error, result.tokens, result.stats.nfe) == (None, tokens, nfe)


def test_schedule_rows_are_shared_by_equal_configs_and_read_only(controls_config):
    """A request's schedule parameters are resolved once per config (every named schedule's, for
    the engine's switch): equal configs share read-only rows equal to a fresh resolution; a config
    that differs in a field a schedule reads, or holds unhashable schedule_params, gets its own."""
    import jax
    import numpy as np

    from decoding.engine.requests import schedule_rows
    from decoding.engine.slot_states import SCHEDULES

    def fresh(config):
        return jax.tree_util.tree_map(lambda value: np.asarray(value)[None],
                                      SCHEDULES.params(config.schedule, config.schedule_params, config))

    config = controls_config.replace(schedule="fast_dllm_threshold", max_new_tokens=4)
    rows = schedule_rows(config, whole_blocks=True)
    assert schedule_rows(config.replace(max_new_tokens=4), whole_blocks=True) is rows
    jax.tree_util.tree_map(np.testing.assert_array_equal, rows, fresh(config))
    assert not any(leaf.flags.writeable for leaf in jax.tree_util.tree_leaves(rows))
    other = config.replace(threshold=0.25)
    assert float(schedule_rows(other, whole_blocks=True)["fast_dllm_threshold"]["threshold"][0]) == 0.25
    given = config.replace(schedule="fixed_k", schedule_params={"tokens_per_step": 3})
    jax.tree_util.tree_map(np.testing.assert_array_equal, schedule_rows(given, whole_blocks=True), fresh(given))
    assert schedule_rows(config, whole_blocks=False) is None
