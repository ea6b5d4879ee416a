"""The engine's prefix cache (decoding/engine/prefix_cache.py): a request that starts from a cached
prefix decodes what it decodes without the cache — every mode, hits of several lengths (one exactly
at a grid boundary), prompts shorter than one grid, prompts that diverge inside a chunk, after
evictions — and reports the tokens it reused; the trie's byte accounting and LRU eviction over
shared, reference-counted pages; nothing is left held after requests end or are cancelled."""

from __future__ import annotations

import numpy as np
import pytest

from clover_jax.api.serving.responses import prompt_tokens_details
from decoding.engine import Engine, EngineRequest
from decoding.engine.pages import PagePool
from decoding.engine.prefix_cache import PrefixCache

GRID = 8
# one growing transcript (a harness resending it), and a prompt that leaves it inside its second chunk
TRANSCRIPT = [20 + (7 * i) % 90 for i in range(40)]
OTHER = TRANSCRIPT[:10] + [5, 6, 7, 8, 9, 12, 13, 14, 15, 16, 17]
# (prompt, tokens each mode restores: diffusion (B=8), autoregressive, self-speculative)
TURNS = [
    (TRANSCRIPT[:21], (0, 0, 0)),     # stores 16
    (TRANSCRIPT[:30], (16, 16, 16)),  # stores 24
    (TRANSCRIPT[:25], (24, 24, 24)),  # exactly the boundary 24 (autoregressive: P - 1 = 24)
    (TRANSCRIPT[:24], (24, 16, 16)),  # diffusion: its whole prefix; the others stop short of their own
    (TRANSCRIPT[:5], (0, 0, 0)),      # shorter than one grid
    (OTHER, (0, 0, 0)),               # the first chunk is shared, but no state is kept at its end
    (TRANSCRIPT[:40], (24, 24, 24)),  # after the others (none kept 32)
]
MODES = ("diffusion", "autoregressive", "self_speculative")
SHORT = {"max_new_tokens": 10}


def request(prompt, mode) -> EngineRequest:
    return EngineRequest(prompt, mode, overrides=SHORT)


@pytest.fixture(scope="module")
def model(small_clover_checkpoint):
    from clover_jax import CloverModel

    loaded = CloverModel.from_pretrained(small_clover_checkpoint, progress=False)
    params = dict(loaded.params)
    params["lm_head"] = loaded.params["lm_head"] * 4.0
    return CloverModel(loaded.config, params, loaded.dtype, loaded.path)


def follow_up(first_turn) -> list[int]:
    """The next turn of a harness: the first turn's prompt, its response and a tool result."""
    return TURNS[0][0] + first_turn.tokens + [33, 34, 35, 36, 37]


@pytest.fixture(scope="module")
def without_cache(model, controls_config):
    """Every turn of every mode decoded by an engine without a cache, one request at a time, then
    the follow-up of the first turn."""
    with Engine(model, controls_config, max_running=2) as engine:
        results = {mode: [engine.run([request(prompt, mode)], timeout=600)[0] for prompt, _ in TURNS]
                   for mode in MODES}
        for mode in MODES:
            results[mode].append(engine.run([request(follow_up(results[mode][0]), mode)], timeout=600)[0])
        return results


def same(result, reference) -> bool:
    return (result.tokens, result.finish, result.stats.nfe, result.stats.steps_per_block) == \
        (reference.tokens, reference.finish, reference.stats.nfe, reference.stats.steps_per_block)


@pytest.mark.parametrize("mode", MODES)
def test_cached_prefixes_decode_as_without_the_cache(model, controls_config, without_cache, mode):
    with Engine(model, controls_config, max_running=2, prefix_cache_bytes=1 << 30, prefix_cache_grid=GRID) as engine:
        for turn, (prompt, restored) in enumerate(TURNS):
            result = engine.run([request(prompt, mode)], timeout=600)[0]
            assert same(result, without_cache[mode][turn]), (mode, turn)
            assert result.stats.cached_tokens == restored[MODES.index(mode)], (mode, turn)
        # the first turn's prompt, response and more: the finished first turn kept its state at 24
        # (diffusion: its first block committed; autoregressive: 3 response tokens in), where its prompt
        # kept 16; a self-speculative round lands on a grid boundary or not
        result = engine.run([request(follow_up(without_cache[mode][0]), mode)], timeout=600)[0]
        assert same(result, without_cache[mode][-1])
        assert result.stats.cached_tokens == 24 or mode == "self_speculative" and result.stats.cached_tokens >= 16
        assert prompt_tokens_details([result.stats, None]) == {"cached_tokens": result.stats.cached_tokens}
        cache = engine.prefix_cache
        assert cache.hits == sum(restored[MODES.index(mode)] > 0 for _, restored in TURNS) + 1
        assert cache.nbytes == cache.held_bytes() > 0
        assert engine.running() == 0 and engine.queued() == 0
        # with no request running, the pages in use are the cache's, each held once
        assert engine.kv_pages_in_use() == cache.census()["pages"]


def test_a_tiny_budget_evicts_least_recently_used_and_decodes_as_without(model, controls_config, without_cache):
    with Engine(model, controls_config, max_running=2, prefix_cache_bytes=1 << 30, prefix_cache_grid=GRID) as engine:
        engine.run([request(TRANSCRIPT[:21], "autoregressive")], timeout=600)
        two_chunks = engine.prefix_cache.nbytes  # 16 tokens' K/V and one set of GDN states
    budget = two_chunks + two_chunks // 2
    with Engine(model, controls_config, max_running=2, prefix_cache_bytes=budget, prefix_cache_grid=GRID) as engine:
        cache = engine.prefix_cache
        for turn in (0, 1, 2, 6):  # a store evicts the oldest state (the newest restored at each turn)
            prompt, _ = TURNS[turn]
            result = engine.run([request(prompt, "autoregressive")], timeout=600)[0]
            assert same(result, without_cache["autoregressive"][turn]), turn
            assert cache.nbytes == cache.held_bytes() <= budget
            assert result.stats.cached_tokens == (0, 16, 24, 24)[[0, 1, 2, 6].index(turn)]
        assert cache.evicted > 0


def test_cancelled_and_concurrent_requests_leave_nothing_held(model, controls_config, without_cache):
    with Engine(model, controls_config, max_running=2, max_queue=8, prefix_cache_bytes=1 << 30,
                prefix_cache_grid=GRID) as engine:
        done = []
        handle = engine.submit(EngineRequest(TRANSCRIPT[:40], "autoregressive", overrides={"max_new_tokens": 20}),
                               lambda event: done.append(event) if event.finish else None)
        handle.cancel()
        # requests at once, sharing prefixes, joining mid-flight
        results = engine.run([request(prompt, "autoregressive") for prompt, _ in TURNS[:3]], timeout=600)
        for turn, result in enumerate(results):
            assert same(result, without_cache["autoregressive"][turn]), turn
        assert engine.running() == 0 and engine.queued() == 0
        assert [event.finish for event in done] in (["cancelled"], ["length"], ["eos"])
        cache = engine.prefix_cache
        assert cache.nbytes == cache.held_bytes()
        assert engine.kv_pages_in_use() == cache.census()["pages"]
        cache.clear()
        assert engine.kv_pages_in_use() == 0


def held_pages(pool: PagePool, count: int) -> list[int]:
    """`count` pages taken from `pool`, as a request holds the pages it wrote."""
    return [pool.take() for _ in range(count)]


def test_the_trie_keeps_bytes_and_evicts_the_least_recently_used():
    pool = PagePool(64)
    cache = PrefixCache(budget=1000, grid=2, pool=pool, page_size=1, page_bytes=50)  # 100 bytes a chunk
    gdn = lambda: {"gdn": np.zeros(50, np.float32)}            # 200 bytes a state

    def store(tokens, length):
        pages = held_pages(pool, length)
        cache.store(tokens, length, pages, gdn)
        pool.release(pages)                                    # the request that wrote them ends
        return pages

    first = store([1, 2, 3, 4], 4)                             # 2 chunks + a state: 400
    store([1, 2, 5, 6], 4)                                     # shares chunk [1, 2]: 700 (its own copy freed)
    assert (cache.nbytes, cache.nodes) == (700, 3) and pool.in_use == 6
    hit = cache.lookup([1, 2, 3, 4, 9], limit=5)               # [1, 2, 3, 4] is now the most recent
    assert hit.length == 4 and hit.pages == tuple(first)
    assert pool.references(first[0]) == 2                      # the cache's and the caller's
    pool.release(hit.pages)
    assert cache.lookup([1, 2, 3], limit=3) is None            # no state at 2
    assert cache.lookup([1, 2, 3, 4], limit=3) is None         # the state at 4 passes the limit
    store([7, 8], 2)                                           # 1000: fits
    store([9, 9], 2)                                           # 1300: [5, 6] (the oldest state) goes
    assert cache.lookup([1, 2, 5, 6], limit=4) is None
    for tokens in ([7, 8], [1, 2, 3, 4], [9, 9]):
        hit = cache.lookup(tokens, limit=len(tokens))
        assert hit.length == len(tokens)
        pool.release(hit.pages)
    assert cache.nbytes == cache.held_bytes() == 1000 and (cache.evicted, cache.nodes) == (1, 4)
    # counted afresh: chunks [1,2] [3,4] [7,8] [9,9], states at the last three, no chunk [5, 6] left behind
    assert cache.census() == {"bytes": 1000, "nodes": 4, "states": 3, "unneeded": 0, "pages": 8}
    assert pool.in_use == 8 and cache.states == 3
    store([5] * 12, 12)                                        # 800 alone: everything older goes
    assert cache.nbytes == cache.held_bytes() == 800 and cache.lookup([1, 2, 3, 4], limit=4) is None
    assert pool.in_use == 12
    store([6] * 20, 20)                                        # 1200 alone: over budget, kept nowhere
    assert cache.nbytes == cache.held_bytes() == 0 and cache.lookup([6] * 20, limit=20) is None
    assert pool.in_use == 0                                    # every page back in the pool
    with pytest.raises(ValueError, match="multiple of the grid"):
        cache.store([1, 2, 3], 3, [1, 2, 3], gdn)
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(budget=0, pool=pool, page_size=1, page_bytes=1)
    with pytest.raises(ValueError, match="multiple of the page size"):
        PrefixCache(budget=10, grid=6, pool=pool, page_size=4, page_bytes=1)
