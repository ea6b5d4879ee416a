"""Compiling the serving engine's programs before any request waits on them.

The set (`Engine.precompile`): for every served mode and allowed block size (step cap equal to the
block size), every cache bucket up to the engine's context (`slots.capacity_bucket`: 64, 128, ...,
`max_context`) and every lane size up to `max_running` (1, 2, 4, ...):

* the prefill chunks (`slots.prefill_chunk`: `unit` times a power of two, up to the model's chunk)
  on a staging state of each bucket, the empty staging states, and the padding of a staging state
  of each bucket to each larger one (`slots.pad_rows`: a request joining a lane of longer rows) —
  compiled by running them once on zeros;
* the lane programs — the step (greedy and sampled where the mode samples; a diffusion step with
  and without a block's commit), the join (`put_slots`) and the resize (`take_slots`) — compiled by
  warm-up traffic through the engine itself, so they are exactly the programs requests meet: per
  bucket, requests joining one by one until the lane holds `max_running` (each doubling of the lane;
  a lane grows one doubling at a time whatever number joins at once, `Lane.add`, so these are all its growths),
  then all but a few of them cancelled (the full lane halving, `lane_shrinks`), then bursts of 1, 2,
  4, ... requests arriving together, then such bursts into a lane that earlier requests hold (a
  burst meeting a busy lane joins with another program; `busy_joins`: with them every lane size
  meets every joining count its joins can pad to, `max_running` a power of two or not);
  `join_shapes` and `lane_resizes` count them. The requests joining one by one and into busy lanes
  decode one token per step and each joins once the last has joined, so that all of them are live
  when the next joins (at the default threshold the short requests of the 64-row bucket finished
  within a few steps: the lanes of 8 and 16 slots never saw their joins, which then compiled under
  serving load). Each warm-up request is cancelled once its lane has stepped (a burst's diffusion
  request once its first block is out and committed). A join's program depends on the lane's shape
  and the joining count alone (the entries come padded to the lane's rows, `slots.at_rows`), so
  requests of one bucket cover the joins of requests of any smaller buckets into that lane.

Patterns outside that (a lane whose rows grow or shrink between buckets under live requests: a
resize from one bucket to another) compile their small program on demand; the engine logs every
program compiled after `precompile` with its shape.
`compiled_programs()` counts the engine's programs (each jitted function's executable cache).

On a CPU, XLA keeps every compiled program's machine code in memory mappings of the process (a
diffusion step of the bundled model holds hundreds), and Linux stops a process at
`vm.max_map_count` mappings (65,530 by default): XLA then crashes in its next compile. Precompiling
stops with a `RuntimeError` naming the flags to narrow before the process comes near that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Sequence

import numpy as np

from decoding.engine import autoregressive_lane, diffusion_lane, slots, speculative_lane
from decoding.engine.lanes import SHRINK_FROM, new_staging, padded_joins, prefix_length, shrunk
from decoding.engine.requests import EngineRequest, LaneKey, rows_needed
from decoding.modes import Mode, strategy

logger = logging.getLogger(__name__)

PROGRAMS = (diffusion_lane.diffusion_step, autoregressive_lane.autoregressive_step, speculative_lane.speculative_step,
            slots.put_slots, slots.take_slots, slots.prefill_chunk, slots.empty_staging, slots.pad_rows)


def compiled_programs() -> int:
    """Programs the engine's jitted functions hold in this process (every shape of each)."""
    return sum(program._cache_size() for program in PROGRAMS)


@dataclasses.dataclass
class Precompiled:
    """What `Engine.precompile` compiled: `programs` (new executables), `seconds`, and the set in
    words (`covers`)."""

    programs: int
    seconds: float
    covers: str


def buckets(limit: int, smallest: int = 64) -> list[int]:
    """The cache rows a lane of at most `limit` rows per slot may hold (`slots.capacity_bucket`)."""
    sizes, size = [], smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def lane_sizes(max_running: int) -> list[int]:
    """Lane sizes: powers of two below `max_running`, and `max_running` (`lanes.power_of_two`, capped)."""
    sizes, size = [], 1
    while size < max_running:
        sizes.append(size)
        size *= 2
    return sizes + [max_running]


def chunk_sizes(unit: int, chunk: int) -> list[int]:
    """Prefill chunk lengths `slots.chunk_plan` may cut: `unit` times a power of two up to `chunk`, and `chunk`."""
    top = max(unit, chunk // unit * unit)
    sizes, size = [], unit
    while size < top:
        sizes.append(size)
        size *= 2
    return sizes + [top]


def precompile(engine, *, modes: Sequence[str], block_sizes: Sequence[int], sample: bool = True,
               timeout: float = 3600.0) -> Precompiled:
    """See the module docstring; `engine` is idle (nothing submitted yet)."""
    started, before = time.perf_counter(), compiled_programs()
    warm = _warm_up_engine(engine)
    try:
        kinds = _compile(warm, modes=modes, block_sizes=block_sizes, sample=sample, timeout=timeout)
    finally:
        warm.close()
    programs, seconds = compiled_programs() - before, time.perf_counter() - started
    covers = (f"{', '.join(f'{m}' + (f' B={b}' if b else '') for m, b in kinds)}; lanes of "
              f"{lane_sizes(engine.max_running)} slots; cache buckets {buckets(engine.max_context)}")
    logger.info("precompiled %d programs in %.1f s (%s)", programs, seconds, covers)
    return Precompiled(programs, seconds, covers)


def _warm_up_engine(engine):
    """An engine of the same model, shapes and limits whose end-of-response ids are the mask token
    (which no step ever writes: its logit is -inf), so that warm-up requests run until they are
    cancelled. Its programs are the engine's: they take the token ids as arguments of equal shape."""
    from decoding.engine.engine import Engine

    defaults = engine.defaults
    config = defaults.replace(eos_token_id=(defaults.mask_token_id,) * len(defaults.eos_token_id))
    return Engine(engine.model, config, max_running=engine.max_running, max_queue=engine.max_running,
                  max_context=engine.max_context, prefill_budget=engine.prefill_budget)


def _compile(warm, *, modes, block_sizes, sample: bool, timeout: float) -> list:
    kinds = []
    for mode in dict.fromkeys(Mode(mode) for mode in modes):
        decoder = strategy(mode)
        for block in (sorted(set(block_sizes)) if decoder.decodes_blocks else [None]):
            kinds.append((mode, block))
    for mode, block in kinds:
        key = LaneKey(mode, block, block if strategy(mode).whole_blocks else None)
        check_mapping_headroom()
        _prefills(warm, key)
        _paddings(warm, key)
        samples = (False, True) if sample and strategy(mode).mode != Mode.SELF_SPECULATIVE else (False,)
        for capacity in buckets(warm._capacity(key)):
            traffic = _Traffic(warm, key, capacity, timeout)
            if not traffic.possible:
                continue
            check_mapping_headroom()
            traffic.one_by_one()
            for lanes in lane_sizes(warm.max_running):
                for sampled in samples:
                    check_mapping_headroom()
                    traffic.burst(lanes, sampled)
            for size, live, joining in busy_joins(warm.max_running):
                check_mapping_headroom()
                traffic.joins_into(size, live, joining)
    return kinds


MAPPING_HEADROOM = 0.8  # of vm.max_map_count: the rest is left for the programs of one more phase and the requests'


def mapping_use() -> tuple[int, int] | None:
    """(memory mappings this process holds, the most Linux allows it), or None where unknown."""
    try:
        with open("/proc/sys/vm/max_map_count") as handle:
            limit = int(handle.read())
        with open(f"/proc/{os.getpid()}/maps") as handle:
            used = sum(1 for _ in handle)
    except (OSError, ValueError):
        return None
    return used, limit


def check_mapping_headroom() -> None:
    """RuntimeError when the CPU programs compiled so far hold more than `MAPPING_HEADROOM` of the
    process's memory-mapping limit (only on the CPU backend: elsewhere a program's code lives on the
    accelerator)."""
    import jax

    if jax.default_backend() != "cpu":
        return
    use = mapping_use()
    if use is None or use[0] <= MAPPING_HEADROOM * use[1]:
        return
    raise RuntimeError(
        f"precompiling stopped: the programs compiled so far hold {use[0]:,} memory mappings of this process's "
        f"limit of {use[1]:,} (vm.max_map_count), and XLA on a CPU crashes past it; precompile a narrower set "
        f"(fewer --block-sizes, a smaller --max-context or --max-running), or raise vm.max_map_count")


def planned_programs(*, modes: Sequence[str], block_sizes: Sequence[int], max_running: int, max_context: int,
                     chunk_size: int, sample: bool = True) -> dict[str, int]:
    """How many programs `precompile` compiles in a fresh process, by kind, without compiling them
    (the count depends on the shapes only, never on the model's size): steps (diffusion: with and
    without a commit; greedy and sampled where the mode samples), joins (per bucket one per
    `join_shapes`) and resizes (per bucket `lane_resizes`), prefill chunks (one per chunk length and
    bucket: a prompt's first chunk and a later one share it; shared by lane kinds of one unit),
    empty staging states and paddings (a staging state of each bucket to each larger bucket;
    shared by lane kinds)."""
    from decoding.engine.engine import UNIT

    sizes = len(lane_sizes(max_running))
    counts = {"steps": 0, "joins": 0, "resizes": 0}
    prefills, staging, paddings = set(), set(), set()
    for mode in dict.fromkeys(Mode(mode) for mode in modes):
        decoder = strategy(mode)
        for block in (sorted(set(block_sizes)) if decoder.decodes_blocks else [None]):
            unit = block if decoder.whole_blocks else UNIT
            caps = buckets(max_context + (0 if decoder.whole_blocks else UNIT))
            variants = (2 if decoder.whole_blocks else 1) * (2 if sample and mode != Mode.SELF_SPECULATIVE else 1)
            counts["steps"] += len(caps) * sizes * variants
            counts["joins"] += len(caps) * len(join_shapes(max_running))
            counts["resizes"] += len(caps) * lane_resizes(max_running)
            staging.update(caps)
            paddings.update(itertools.combinations(caps, 2))
            chunk = max(unit, chunk_size // unit * unit)
            for capacity in caps:
                # a later chunk (unit + size < capacity) runs the first chunk's program: the same shapes
                prefills.update((size, capacity) for size in chunk_sizes(unit, chunk) if size < capacity)
    counts.update(prefills=len(prefills), staging=len(staging), paddings=len(paddings))
    counts["total"] = sum(counts.values())
    return counts


def join_shapes(max_running: int) -> set[tuple[int, int]]:
    """(lane size, entries written: `lanes.padded_joins`) of the joins the warm-up traffic sends per
    bucket, one `put_slots` program each: one by one (one joining each size), the bursts (a fresh
    lane of each size) and `busy_joins`."""
    sizes = lane_sizes(max_running)
    shapes = {(size, padded_joins(size, 1)) for size in sizes} | {(size, padded_joins(size, size)) for size in sizes}
    return shapes | {(size, padded_joins(size, joining)) for size, _, joining in busy_joins(max_running)}


def lane_resizes(max_running: int) -> int:
    """`take_slots` programs of the warm-up traffic per bucket: a fresh lane of each size made from
    one entry (whose NumPy leaves make it another program than a lane's), each growth to the next
    size (a lane grows one doubling at a time, `Lane.add`, so busy joins grow by these too) and
    each shrink (`lane_shrinks`)."""
    sizes = len(lane_sizes(max_running))
    return sizes + (sizes - 1) + len(lane_shrinks(max_running))


def lane_shrinks(max_running: int) -> list[tuple[int, int]]:
    """(size, size it halves to) of a full lane whose requests all but a few finish (`Lane.fit`:
    from `SHRINK_FROM` slots up)."""
    shrinks, size = [], max_running
    while size >= SHRINK_FROM:
        shrinks.append((size, shrunk(size)))
        size = shrunk(size)
    return shrinks


def busy_joins(max_running: int) -> list[tuple[int, int, int]]:
    """(lane size, requests live in it, requests joining together) of each join `_Traffic.joins_into`
    sends into a busy lane, beside one-by-one's (1 joining) and the bursts' (a fresh lane): for each
    lane size after the first, with the size before it live, 2, 4, ... joining while they fit; and
    where the size is not a power of two, the joining counts that this misses, whose power of two
    is below the size's (a burst of the size gives that one): the fewest requests padded to it,
    into a lane that the rest of the size holds. So each lane size meets every joining count k = 1,
    2, 4, ... up to the size rounded up to a power of two."""
    patterns = []
    for previous, size in itertools.pairwise(lane_sizes(max_running)):
        count = 2
        while previous + count <= size:
            patterns.append((size, previous, count))
            count *= 2
        while count < 1 << (size - 1).bit_length():
            patterns.append((size, size - (count // 2 + 1), count // 2 + 1))
            count *= 2
    return patterns


@contextlib.contextmanager
def on_demand(engine, what: str, lane=None):
    """Around engine work after `precompile`: log the programs it compiled (`what`, and the lane's
    shape after it) and count them in `engine.compiled_on_demand`."""
    if engine.precompiled is None:
        yield
        return
    before, started = _programs_by_function(), time.perf_counter()
    yield
    grown = {name: count - before[name] for name, count in _programs_by_function().items() if count > before[name]}
    new = sum(grown.values())
    if new:
        engine.compiled_on_demand += new
        logger.warning("compiled %d program(s) on demand in %.1f s (%s), outside the precompiled set: %s", new,
                       time.perf_counter() - started, ", ".join(f"{name} x{count}" for name, count in grown.items()),
                       what if lane is None else f"{what}, lane of {lane.size} slots x {lane.capacity} rows")


def _programs_by_function() -> dict[str, int]:
    """{jitted function's name: programs it holds} for the engine's functions (`PROGRAMS`)."""
    return {program.__name__: program._cache_size() for program in PROGRAMS}


def _unit(key: LaneKey) -> int:
    """The prefill unit of a lane kind (the engine's `_admit`)."""
    from decoding.engine.engine import UNIT

    return key.block_size if strategy(key.mode).whole_blocks else UNIT


def _prefills(engine, key: LaneKey) -> None:
    """Every prefill chunk on a staging state of every bucket it fits, run once on zeros."""

    unit = _unit(key)
    chunk = max(unit, engine.model.chunk_size // unit * unit)
    def run(state, size):
        return slots.prefill_chunk(engine.context.passes, engine.context.params, np.zeros((1, size), np.int32),
                                   state)[1]

    for capacity in buckets(engine._capacity(key)):
        for size in chunk_sizes(unit, chunk):
            if size < capacity:  # a prompt's first chunk on a fresh state, a later one on a prefilled state
                run(new_staging(engine.context, capacity, 0), size)
            if unit + size < capacity:
                run(run(new_staging(engine.context, capacity, 0), unit), size)


def _paddings(engine, key: LaneKey) -> None:
    """`slots.pad_rows` of a staging state of every bucket to every larger bucket, run once on zeros
    (a join's entry as `slots.at_rows` pads it: its slot axis as `slots.one_slot` gives it)."""
    capacities = buckets(engine._capacity(key))
    for smaller, larger in itertools.combinations(capacities, 2):
        slots.pad_rows(slots.one_slot(new_staging(engine.context, smaller, 0)), larger)


class _Traffic:
    """Warm-up requests of one lane kind whose cache rows fall in one bucket."""

    def __init__(self, engine, key: LaneKey, capacity: int, timeout: float):
        self.engine, self.key, self.capacity, self.timeout = engine, key, capacity, timeout
        self.unit = _unit(key)
        self.plain = _plain_tokens(engine)
        self.prompt = [self.plain[0]] * (self.unit + 1)
        self.max_new_tokens = self._fill(capacity)
        self.possible = self.max_new_tokens is not None

    def _fill(self, capacity: int) -> int | None:
        """The largest max_new_tokens whose rows land in `capacity`'s bucket (None: none does)."""
        lane_rows = self.engine._capacity(self.key)
        low, high, best = 1, capacity, None
        while low <= high:
            middle = (low + high) // 2
            rows = self._rows(middle)
            if rows is not None and rows <= min(capacity, lane_rows):
                best, low = middle, middle + 1
            else:
                high = middle - 1
        if best is None or slots.capacity_bucket(self._rows(best), lane_rows) != capacity:
            return None
        return best

    def _rows(self, max_new_tokens: int) -> int | None:
        try:
            prepared = self.engine.check(self._request(max_new_tokens, False))
        except ValueError:
            return None
        padding = (-prefix_length(self.key, len(prepared.prompt))) % self.unit
        return padding + rows_needed(len(prepared.prompt), prepared.config, prepared.mode)

    def _request(self, max_new_tokens: int, sampled: bool, variant: int = 0, slow: bool = False) -> EngineRequest:
        prompt = self.prompt[:-1] + [self.plain[variant % len(self.plain)]]
        overrides = {"max_new_tokens": max_new_tokens, "dllm_length_penalty": 0.0, "do_sample": sampled}
        if self.key.block_size:
            overrides["block_size"] = self.key.block_size
        if sampled:
            overrides["temperature"] = 1.0
        if slow and strategy(self.key.mode).whole_blocks:
            # one token per step (the schedule is data, not a program): the request lives for about
            # max_new_tokens steps, longer than the joins after it take, so the lane holds every request
            # a pattern joins (at the default threshold the bucket's short requests finished within a few
            # steps, and the lanes of 8 and 16 slots never saw the joins meant for them)
            overrides.update(schedule="fixed_k", tokens_per_step=1)
        return EngineRequest(prompt, self.key.mode, overrides=overrides)

    def _join_one(self, index: int) -> tuple:
        """Submit one slow request and return (handle, listener) once it has joined its lane (the
        lane steps before the next request joins)."""
        wait = _Wait(1)
        handle = self.engine.submit(self._request(self.max_new_tokens, False, index, slow=True), wait)
        self._until_joined([handle], [wait])
        return handle, wait

    def _until_joined(self, handles, waits) -> None:
        """Wait until every request has joined its lane or finished (a failed prefill or join)."""
        self._until(lambda: all(handle.joined or wait.finished.is_set()
                                for handle, wait in zip(handles, waits, strict=True)), "a warm-up request to join")

    def _until(self, condition, what: str) -> None:
        """Poll `condition` (engine state no event reports) until it holds; TimeoutError after `timeout`."""
        deadline = time.monotonic() + self.timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout} s for {what}")
            time.sleep(0.001)

    def one_by_one(self) -> None:
        """Requests joining one at a time, each after the last has joined (and its lane stepped), up
        to `max_running`; then the full lane shrinking (`shrink`)."""
        handles, waits = [], []
        for index in range(self.engine.max_running):
            handle, wait = self._join_one(index)
            handles.append(handle)
            waits.append(wait)
        self.shrink(handles, waits)
        self._end(handles, waits)

    def shrink(self, handles, waits) -> None:
        """Cancel all but the last `SHRINK_FROM // 4` requests of the full lane: it halves at each of
        its next steps (`Lane.fit`) until it is smaller than `SHRINK_FROM` (`lane_shrinks`), as a lane
        does when most of its requests finish."""
        if self.engine.max_running < SHRINK_FROM:
            return
        kept = max(1, SHRINK_FROM // 4)
        for handle in handles[:-kept]:
            handle.cancel()
        def shrunk_below() -> bool:
            # read on this thread while the engine's thread resizes the lane: a stale read only polls again
            lane = self.engine._lanes.get(self.key)
            return lane is None or lane.size < SHRINK_FROM or all(wait.finished.is_set() for wait in waits[-kept:])

        self._until(shrunk_below, "the warm-up lane to shrink")

    def burst(self, size: int, sampled: bool) -> None:
        """`size` requests arriving together; in diffusion each waits for its second block, so that
        the step committing its first block has run."""
        waits = [_Wait(2 if strategy(self.key.mode).whole_blocks else 1) for _ in range(size)]
        handles = self.engine.submit_all([self._request(self.max_new_tokens, sampled, index)
                                          for index in range(size)], waits)
        for wait in waits:
            wait.until(self.timeout)
        self._end(handles, waits)

    def joins_into(self, size: int, live: int, joining: int) -> None:
        """`joining` requests arriving together into a lane of `size` slots that `live` requests
        hold (they join one by one first): one of `busy_joins`' patterns (a burst meeting a busy lane).
        Every request is slow (`_request`): the `live` ones are all still decoding when the others join."""
        handles, waits = [], []
        for index in range(live):
            handle, wait = self._join_one(index)
            handles.append(handle)
            waits.append(wait)
        group = [_Wait(1) for _ in range(joining)]
        joined = self.engine.submit_all([self._request(self.max_new_tokens, False, live + index, slow=True)
                                         for index in range(joining)], group)
        self._until_joined(joined, group)
        self._end(joined + handles, group + waits)

    def _end(self, handles, waits) -> None:
        for handle in handles:
            handle.cancel()
        for wait in waits:
            wait.finished.wait(self.timeout)


class _Wait:
    """A listener that counts events: `until` returns after `events` of them, or the finish."""

    def __init__(self, events: int):
        self.events, self.seen = events, 0
        self.reached, self.finished = threading.Event(), threading.Event()

    def __call__(self, event) -> None:
        self.seen += 1
        if event.finish is not None:
            self.finished.set()
        if self.seen >= self.events or event.finish is not None:
            self.reached.set()

    def until(self, timeout: float) -> None:
        if not self.reached.wait(timeout):
            raise TimeoutError(f"a warm-up request saw no event in {timeout} s")


def _plain_tokens(engine, count: int = 64) -> list[int]:
    """Prompt tokens that are none of the special ones (mask, EOS, think markers)."""
    defaults = engine.defaults
    special = set(defaults.eos_token_id) | {defaults.mask_token_id, defaults.think_start_token_id,
                                            defaults.think_end_token_id}
    return [token for token in range(2, engine.model.config.vocab_size) if token not in special][:count]
