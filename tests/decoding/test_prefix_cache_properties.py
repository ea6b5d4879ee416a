"""The prefix cache's trie and budget under generated traffic (`hypothesis` rule-based state machine).

Any sequence of stores (some whose K/V or GDN copy fails, as a device copy can), lookups and clears,
over prompts drawn from a small alphabet so that they share beginnings: the byte count equals the
bytes of the arrays held, never exceeds the budget, no K/V chunk is kept that no kept GDN state
needs, a lookup answers the longest kept prefix within its limit with the K/V of exactly those
tokens, and the prefix stored last is found at once when it fits the budget alone.

The arrays are NumPy stand-ins that encode what they were cut from (a chunk's K/V holds its tokens,
a state its prefix length), so a lookup's answer is checked against the tokens it claims.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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
        self.cache = PrefixCache(budget, grid=GRID)
        self.last: tuple[int, ...] | None = None

    @rule(tokens=TOKENS, cut=st.integers(1, 6), fail=st.sampled_from([None, "kv", "gdn"]),
          state_size=st.integers(1, 24))
    def store(self, tokens, cut, fail, state_size):
        length = min(cut, len(tokens) // GRID) * GRID

        def kv_rows(row):
            if fail == "kv" and row > 0:
                raise CopyFailed("kv")
            return {"layer": np.asarray(tokens[row:row + GRID], np.int64)}

        def gdn():
            if fail == "gdn":
                raise CopyFailed("gdn")
            return {"layer": np.full((state_size,), length, np.int32)}

        try:
            self.cache.store(tokens, length, kv_rows=kv_rows, gdn=gdn)
        except CopyFailed:
            self.last = None
            return
        prefix = tuple(tokens[:length])
        bytes_alone = length // GRID * GRID * 8 + state_size * 4
        # the newest prefix is kept unless it alone (or with what it shares) exceeds the budget
        self.last = prefix if bytes_alone <= self.cache.budget else None

    @precondition(lambda self: self.last is not None)
    @rule()
    def the_prefix_stored_last_is_found(self):
        hit = self.cache.lookup(list(self.last), limit=len(self.last))
        assert hit is not None and hit.length == len(self.last)

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
        restored = [int(t) for chunk in hit.kv for t in chunk["layer"]]
        assert restored == list(tokens[:best])
        assert int(hit.gdn["layer"][0]) == best

    @rule()
    def clear(self):
        self.cache.clear()
        self.last = None

    @invariant()
    def the_byte_count_is_what_is_held_and_within_the_budget(self):
        assert self.cache.nbytes == self.cache.held_bytes()
        assert self.cache.nbytes <= self.cache.budget

    @invariant()
    def every_kept_chunk_leads_to_a_kept_state(self):
        census = self.cache.census()
        assert census["unneeded"] == 0, "a K/V chunk no kept state needs"
        assert (census["nodes"], census["states"]) == (self.cache.nodes, self.cache.states)

PrefixCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                                derandomize=True, suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_under_generated_traffic = PrefixCacheMachine.TestCase
