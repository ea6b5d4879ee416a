"""The prefix cache's trie and budget under generated traffic (`hypothesis` rule-based state machine).

Any sequence of stores (some whose GDN copy fails, as a device copy can), lookups and clears, over
prompts drawn from a small alphabet so that they share beginnings: the byte count equals the bytes
of the pages and arrays held, never exceeds the budget, no chunk is kept that no kept GDN state
needs, the pool's pages in use are exactly the cache's (each request that wrote or read pages has
let them go), a lookup answers the longest kept prefix within its limit with the pages of exactly
those tokens, and the prefix stored last is found at once when it fits the budget alone.

Pages are the pool's (one position each), and the test remembers which token each page holds; a
state is a NumPy stand-in that holds its prefix length, so a lookup's answer is checked against the
tokens it claims.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from decoding.engine.pages import PagePool
from decoding.engine.prefix_cache import PrefixCache

GRID = 2
TOKENS = st.lists(st.integers(0, 2), min_size=GRID, max_size=6 * GRID)


class CopyFailed(RuntimeError):
    pass


def kept_prefixes(cache: PrefixCache) -> dict[tuple[int, ...], object]:
    """Every kept GDN state's prefix (the chunks from the root down to its node) -> its node."""
    kept = {}
    for node in cache._states:
        chunks, walk = [], node
        while walk.parent is not None:
            chunks.append(walk.chunk)
            walk = walk.parent
        kept[tuple(token for chunk in reversed(chunks) for token in chunk)] = node
    return kept


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(budget=st.integers(1, 400))
    def start(self, budget):
        self.pool = PagePool(4096)
        self.cache = PrefixCache(budget, grid=GRID, pool=self.pool, page_size=1, page_bytes=8)
        self.token_of: dict[int, int] = {}   # page -> the token it holds
        self.last: tuple[int, ...] | None = None

    @rule(tokens=TOKENS, cut=st.integers(1, 6), fail=st.sampled_from([None, "gdn"]),
          state_size=st.integers(1, 24))
    def store(self, tokens, cut, fail, state_size):
        length = min(cut, len(tokens) // GRID) * GRID
        pages = [self.pool.take() for _ in range(length)]  # a request's pages, one position each
        self.token_of.update(zip(pages, tokens, strict=False))

        def gdn():
            if fail == "gdn":
                raise CopyFailed("gdn")
            return {"layer": np.full((state_size,), length, np.int32)}

        try:
            self.cache.store(tokens, length, pages, gdn=gdn)
        except CopyFailed:
            self.last = None
            return
        finally:
            self.pool.release(pages)  # the request ends
        prefix = tuple(tokens[:length])
        bytes_alone = length // GRID * GRID * 8 + state_size * 4
        # the newest prefix is kept unless it alone (or with what it shares) exceeds the budget
        self.last = prefix if bytes_alone <= self.cache.budget else None

    @precondition(lambda self: self.last is not None)
    @rule()
    def the_prefix_stored_last_is_found(self):
        hit = self.cache.lookup(list(self.last), limit=len(self.last))
        assert hit is not None and hit.length == len(self.last)
        self.pool.release(hit.pages)

    @rule(tokens=TOKENS, limit=st.integers(0, 12))
    def lookup(self, tokens, limit):
        kept = kept_prefixes(self.cache)
        best = max((len(p) for p in kept if len(p) <= min(limit, len(tokens)) and tuple(tokens[:len(p)]) == p),
                   default=0)
        hit = self.cache.lookup(tokens, limit)
        if best == 0:
            assert hit is None
            return
        assert hit is not None and hit.length == best
        assert [self.token_of[page] for page in hit.pages] == list(tokens[:best])
        assert int(hit.gdn["layer"][0]) == best
        self.pool.release(hit.pages)  # the request that read them ends

    @rule()
    def clear(self):
        self.cache.clear()
        self.last = None

    @invariant()
    def the_byte_count_is_what_is_held_and_within_the_budget(self):
        assert self.cache.nbytes == self.cache.held_bytes()
        assert self.cache.nbytes <= self.cache.budget

    @invariant()
    def the_pages_in_use_are_the_caches(self):
        assert self.pool.in_use == self.cache.census()["pages"]

    @invariant()
    def every_kept_chunk_leads_to_a_kept_state(self):
        census = self.cache.census()
        assert census["unneeded"] == 0, "a K/V chunk no kept state needs"
        assert (census["nodes"], census["states"]) == (self.cache.nodes, self.cache.states)

PrefixCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                                derandomize=True, suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_under_generated_traffic = PrefixCacheMachine.TestCase
