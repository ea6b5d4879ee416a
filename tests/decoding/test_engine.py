"""The serving engine (decoding/engine) against `generate` on each request alone: continuous
batching changes nothing — tokens, NFE and denoising steps per block are those of the request
decoded by itself — for block diffusion with every control and several schedules, sampled
requests, autoregressive and self-speculative requests, requests that join while others are
mid-block and leave at different steps; steady traffic never recompiles; cancellation, a failing
listener and bad requests are confined to their request."""

from __future__ import annotations

import threading

import pytest

from decoding import generate
from decoding.engine import Engine, EngineRequest, QueueFull, diffusion_lane, slots
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
    with Engine(model, controls_config, max_running=4, max_queue=32) as engine:
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


def test_a_burst_joining_a_busy_lane_grows_it_one_doubling_at_a_time(engine, model, controls_config, monkeypatch):
    """Three requests joining a lane that one request holds, in one write: the lane grows 1 -> 2 -> 4
    slots, each a growth that requests joining one by one make (the precompiled set), never 1 -> 4
    (a resize program of its own, which a closed loop of clients met after the precompile); the
    requests decode as alone."""
    from decoding.engine import lanes

    growths, joins = [], []
    reshape, add = lanes.Lane._reshape, lanes.Lane.add

    def recording_reshape(self, size, capacity):
        if size > self.size:
            growths.append((self.size, size))
        reshape(self, size, capacity)

    def recording_add(self, joining):
        joins.append(len(joining))
        add(self, joining)

    monkeypatch.setattr(lanes.Lane, "_reshape", recording_reshape)
    monkeypatch.setattr(lanes.Lane, "add", recording_add)
    long = EngineRequest(PROMPTS[3], overrides={"max_new_tokens": 48, "dllm_length_penalty": 0.0}, seed=2)
    burst = [EngineRequest(prompt) for prompt in PROMPTS[:3]]
    started = threading.Event()
    handle = engine.submit(long, lambda event: started.set())
    started.wait(600)
    results = engine.run(burst, timeout=600)
    handle.cancel()
    assert joins[:2] == [1, 3] and growths == [(1, 2), (2, 4)], (joins, growths)
    for request, result in zip(burst, results, strict=True):
        tokens, nfe, steps = alone(model, controls_config, request)
        assert (result.error, result.tokens, result.stats.nfe, result.stats.steps_per_block) == (
            None, tokens, nfe, steps)


def test_steady_traffic_never_recompiles(engine):
    """Prompts of other lengths in the same buckets, other controls, schedules and seeds: no new program."""
    def traffic(offset: int):
        return [EngineRequest([30 + offset + i for i in range(9 + offset)], overrides=variant, seed=offset + k)
                for k, variant in enumerate(VARIANTS[:4])]

    engine.run(traffic(0), timeout=600)
    programs = [diffusion_lane.diffusion_step, slots.put_slots, slots.take_slots, slots.prefill_chunk]
    compiled = [program._cache_size() for program in programs]
    engine.run(traffic(3), timeout=600)
    assert [program._cache_size() for program in programs] == compiled


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
])
def test_bad_requests_are_refused_before_compute(model, controls_config, request_, message):
    with Engine(model, controls_config, max_running=2, max_context=256) as engine:
        with pytest.raises(ValueError, match=message):
            engine.submit(request_, lambda event: None)
        assert engine.steps == 0 and engine.running() == 0


def test_chunk_plan_covers_the_prompt_with_few_shapes():
    assert slots.chunk_plan(0, 8, 64) == (0, [])
    assert slots.chunk_plan(13, 8, 64) == (3, [16])
    assert slots.chunk_plan(200, 8, 64) == (0, [64, 64, 64, 8])
    assert slots.chunk_plan(48, 16, 2048) == (0, [32, 16])
    for length in range(1, 300):
        padding, sizes = slots.chunk_plan(length, 8, 64)
        assert sum(sizes) == length + padding and padding < 8 and all(s in (8, 16, 32, 64) for s in sizes)


def test_a_request_whose_left_padding_crosses_a_cache_bucket_decodes_as_alone(model, controls_config):
    """A request's cache rows include its prompt's left padding: without them, a request that needs
    64 rows and is padded by 3 would get a 64-row lane and write past its end. A fresh engine, so
    that no earlier request has grown the lane already."""
    import dataclasses

    config = dataclasses.replace(controls_config, eos_token_id=(), dllm_length_penalty=0.0)  # runs to the end
    # 13 prompt tokens + 51 = 64 rows; the prompt is left-padded by 3 to a multiple of 8: 67 rows, past 64
    prompt_length, max_new_tokens = 13, 51
    request = EngineRequest(list(range(20, 20 + prompt_length)), "autoregressive",
                            overrides={"max_new_tokens": max_new_tokens})
    with Engine(model, config, max_running=1) as engine:
        [result] = engine.run([request], timeout=900)
    tokens, nfe, _ = alone(model, config, request)
    assert len(tokens) == max_new_tokens  # the whole response is written: the last rows are used
    assert (result.error, result.tokens, result.stats.nfe) == (None, tokens, nfe)


def test_a_slot_committing_alone_in_a_pass_of_its_own_matches_the_whole_lane_pass(model):
    # the CPU's commit step (`_commit_pass` with lone_commits) against the one-pass form: four slots
    # at different lengths, one committing (its own pass) and two committing (the whole lane's pass)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from clover_jax.core.state import KVCache

    size = 8
    layout = diffusion_lane.DiffusionLayout(size, size, model.config.moe_block_coreset_enabled)
    top_p = jnp.float32(model.config.moe_block_coreset_top_p)
    rng = np.random.default_rng(0)
    blocks = lambda: jnp.asarray(rng.integers(20, 90, (4, size)), jnp.int32)
    masks = jnp.full((4, size), MASK_ID, jnp.int32)

    @jax.jit
    def lane_state():
        state = model.passes.new_state(4, 64)
        for grows in ([True] * 4, [True, False, True, False], [False, True, True, False]):
            state = model.passes.commit_and_denoise(model.run_params, blocks(), masks, state, coreset=layout.coreset,
                                                    coreset_top_p=top_p, commit=jnp.asarray(grows)).state
        return state

    state, block, rows = lane_state(), blocks(), masks.at[:, size // 2:].set(blocks()[:, size // 2:])
    assert jax.device_get(state.length).tolist() == [2 * size, 2 * size, 3 * size, size]
    step = jax.jit(diffusion_lane._commit_pass, static_argnames=("passes", "layout", "lone_commits"))
    for pending in ([False, True, False, False], [True, False, False, True]):
        pending = jnp.asarray(pending)
        block_rows = jnp.where(pending[:, None], rows, block)
        apart, whole = (step(model.passes, model.run_params, layout, block, block_rows, state, pending, top_p,
                             lone_commits=lone) for lone in (True, False))
        np.testing.assert_allclose(apart[0], whole[0], rtol=1e-5, atol=1e-5)
        lengths = jax.device_get(apart[1].length)
        assert lengths.tolist() == jax.device_get(whole[1].length).tolist()
        for name, layer in apart[1].layers.items():
            other = whole[1].layers[name]
            if isinstance(layer, KVCache):  # [groups, slots, rows, ...]: rows past a slot's fill are never read
                for slot, fill in enumerate(lengths):
                    for left, right in ((layer.key, other.key), (layer.value, other.value)):
                        np.testing.assert_allclose(left[:, slot, :fill], right[:, slot, :fill], rtol=1e-5, atol=1e-5)
            else:
                for left, right in zip(jax.tree_util.tree_leaves(layer), jax.tree_util.tree_leaves(other), strict=True):
                    np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-5)
