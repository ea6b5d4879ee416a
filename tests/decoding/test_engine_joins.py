"""Joins into an engine lane (`Lane.add`, `slots.put_slots`): requests whose staging states hold
K/V caches of different buckets, joining in any order, compile one join program per lane shape and
joining count (their entries come padded to the lane's rows, `slots.at_rows`), and the lane they
leave is bit for bit the one the unpadded join writes (each entry's rows first, zeros after)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.core.state import KVCache, ModelState
from decoding.engine import slots
from decoding.engine.lanes import Lane, ModelContext, Tracked

GROUPS, HEADS, DIM, VOCAB = 2, 2, 4, 16
MAX_CONTEXT = 256  # lane buckets 64, 128, 256


class _Lane(Lane):
    """A lane whose entry is (the staging state as one slot, the last logits, NumPy counts): the
    leaves of each kind a real lane's entry has (a prefix state, device arrays, host arrays)."""

    def _entry(self, prepared, staging, last_logits):
        return slots.one_slot(staging), last_logits, np.full((1, VOCAB), prepared, np.int32)

    def _first_nfe(self, prepared):
        return 0


def _staging(rows: int, fill: int, seed: int) -> ModelState:
    """A one-sequence prefix state of `rows` cache rows whose first `fill` rows hold random keys and
    values (the rest zeros, as a prefill leaves them), and a stand-in recurrent state."""
    keys = jax.random.split(jax.random.key(seed), 3)
    held = (jnp.arange(rows) < fill)[None, None, :, None, None]
    kv = [jnp.where(held, jax.random.normal(k, (GROUPS, 1, rows, HEADS, DIM)), 0.0) for k in keys[:2]]
    state = ModelState(jnp.full((1,), fill, jnp.int32), jnp.zeros((1,), jnp.int32),
                       {"attention": KVCache(*kv), "recurrent": jax.random.normal(keys[2], (GROUPS, 1, 3))})
    return jax.tree_util.tree_map(lambda leaf: jax.device_put(leaf, jax.devices()[0]), state)  # committed, as prefilled


def _join(rows: int, number: int):
    """A request needing `rows` cache rows, with its staging state of that bucket and its logits."""
    bucket = slots.capacity_bucket(rows, MAX_CONTEXT)
    logits = jax.device_put(jax.random.normal(jax.random.key(1000 + number), (1, VOCAB)), jax.devices()[0])
    return Tracked(number, number, None, rows=rows), _staging(bucket, rows - 1, number), logits


def _copy(tree):
    return jax.tree_util.tree_map(lambda leaf: jnp.array(leaf, copy=True), tree)


def test_joins_of_any_cache_buckets_in_any_order_compile_one_program_and_write_the_unpadded_result():
    lane = _Lane(ModelContext(None, None, VOCAB, None, frozenset(), False, np.float32(0.9), max_slots=8),
                 key=None, max_context=MAX_CONTEXT)
    lane.add([_join(200, 0), _join(10, 1)])                 # a lane of 2 slots x 256 rows
    lane.add([_join(20, 2), _join(100, 3)])                 # grows to 4 slots: (64, 128) join
    assert (lane.size, lane.capacity) == (4, 256)
    programs = slots.put_slots._cache_size()
    # the other orders and mixes of buckets, each a join of 2 into the same lane of 4 x 256
    pairs = [(100, 20), (250, 30), (40, 180), (60, 50), (120, 120), (230, 250)]
    joined, number = [], 4
    for first, second in pairs:
        for tracked in lane.requests()[2:]:
            lane.remove(tracked)
        before = _copy(lane.slots)
        joins = [_join(first, number), _join(second, number + 1)]
        number += 2
        lane.add(joins)
        assert (lane.size, lane.capacity, lane.live) == (4, 256, 4)
        joined.append((before, joins, _copy(lane.slots)))
    assert slots.put_slots._cache_size() == programs  # not one more program, whatever the buckets and order

    # the old join, each entry stacked at its own bucket (padded inside put_slots): bit for bit the same
    for before, joins, after in joined:
        entries = [lane._entry(tracked.prepared, staging, logits) for tracked, staging, logits in joins]
        unpadded = slots.put_slots(before, np.array([2, 3], np.int32), *slots.stack_entries(entries))
        for old, new in zip(jax.tree_util.tree_leaves(unpadded), jax.tree_util.tree_leaves(after), strict=True):
            assert old.shape == new.shape and old.dtype == new.dtype
            np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
        slot_kv = np.asarray(after[0].layers["attention"].key)[:, 2]
        held = joins[0][1].layers["attention"].key.shape[2]
        np.testing.assert_array_equal(slot_kv[:, :held], np.asarray(joins[0][1].layers["attention"].key)[:, 0])
        assert not slot_kv[:, held:].any()  # the rows past the entry's are zeros, never read


def test_padding_compiles_one_program_per_smaller_bucket_and_lane_rows():
    before = slots.pad_rows._cache_size()
    buckets = [64, 128, 256]
    for _ in range(2):  # again: nothing new
        for smaller, larger in itertools.combinations(buckets, 2):
            entry = (slots.one_slot(_staging(smaller, 5, smaller)),)
            padded = slots.at_rows(entry, larger)
            assert padded[0].layers["attention"].key.shape == (GROUPS, 1, larger, HEADS, DIM)
            assert slots.at_rows(padded, larger)[0] is padded[0]  # already at the lane's rows: untouched
    assert slots.pad_rows._cache_size() - before <= 3  # b(b - 1)/2 for b buckets (fewer if compiled earlier)
    with pytest.raises(ValueError, match="256 cache rows cannot join a lane of 128 rows"):
        slots.at_rows((slots.one_slot(_staging(256, 5, 0)),), 128)



@pytest.mark.parametrize("max_running", [3, 6])
def test_precompile_sends_every_joining_count_each_lane_size_can_meet(max_running):
    """Joins into a lane of each size (`precompile.lane_sizes`) pad their count to any power of two
    up to the size rounded up to one; `precompile`'s traffic (one by one, bursts, `busy_joins`) meets
    each, as a lane (`Lane.add`, which grows it) places them — a `max_running` that is no power of
    two included (3 requests into a lane of 6 was compiled on demand before `busy_joins` sent it)."""
    from decoding.engine import precompile

    context = ModelContext(None, None, VOCAB, None, frozenset(), False, np.float32(0.9), max_slots=max_running)
    sizes = precompile.lane_sizes(max_running)
    reachable = {(size, 1 << (joining - 1).bit_length()) for size in sizes for joining in range(1, size + 1)}
    # one by one, then a burst of each size into a fresh lane
    sent = {(size, 1) for size in sizes} | {(size, 1 << (size - 1).bit_length()) for size in sizes}
    number = 0
    for size, live, joining in precompile.busy_joins(max_running):
        lane = _Lane(context, key=None, max_context=MAX_CONTEXT)
        for _ in range(live):
            lane.add([_join(10, number)])
            number += 1
        lane.add([_join(10, number + index) for index in range(joining)])
        number += joining
        assert (lane.size, lane.live) == (size, live + joining)
        sent.add((lane.size, 1 << (joining - 1).bit_length()))
    assert sent == reachable


def test_a_lane_of_a_max_running_no_power_of_two_shrinks_to_lane_sizes_the_precompile_steps():
    """A full lane of 12 slots that all but two requests leave halves to 8 slots, then 4
    (`lanes.shrunk`): the shrinks `precompile.lane_shrinks` warms, into lane sizes whose steps the
    set holds (it halved to 6 slots, a size no precompiled step had)."""
    from decoding.engine import precompile

    context = ModelContext(None, None, VOCAB, None, frozenset(), False, np.float32(0.9), max_slots=12)
    lane = _Lane(context, key=None, max_context=MAX_CONTEXT)
    joins = [_join(10, number) for number in range(12)]
    for join in joins:
        lane.add([join])  # one by one: 1, 2, 4, 8, 12 slots
    for tracked, _, _ in joins[:-2]:
        lane.remove(tracked)
    sizes = []
    for _ in range(3):  # one halving per step, none below SHRINK_FROM
        lane.fit()
        sizes.append(lane.size)
    assert sizes == [8, 4, 4] and precompile.lane_shrinks(12) == [(12, 8), (8, 4)]
    assert {size for _, size in precompile.lane_shrinks(12)} <= set(precompile.lane_sizes(12))
    assert [tracked.number for tracked in lane.requests()] == [10, 11]
