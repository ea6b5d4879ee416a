"""The serving engine: one thread owns the model and runs every request in continuous batches.

    engine = Engine(model, max_running=16)
    handle = engine.submit(EngineRequest(prompt_ids, overrides={"max_new_tokens": 64}), listener)
    results = engine.run([EngineRequest(...), ...])     # or wait for a list of requests

Each iteration of the engine's loop, at a step boundary:

1. takes new requests and cancellations (`submit`, `cancel` are thread-safe);
2. admits queued requests while fewer than `max_running` are held (a bounded queue waits
   beyond; `submit` raises `QueueFull` past `max_queue`);
3. prefills: causal chunks of admitted prompts on one-sequence staging states, up to
   `prefill_budget` tokens per iteration (`decoding.engine.slots.chunk_plan`); a prompt whose
   prefill is done joins a lane (`decoding.engine.lanes`); with a prefix cache
   (`decoding.engine.prefix_cache`) a prompt starts from the longest prefix the cache keeps
   within its causal prefix, and the state at its last grid boundary is kept;
4. steps every lane that holds requests: one compiled call each (a denoising step of every
   block in flight, a token of every autoregressive request, a self-speculative round), and
   hands each request its new tokens; a finished or cancelled request leaves its slot (with a
   prefix cache, a finished one's prompt and response are kept first, to their last grid boundary).

Requests never wait for each other: a request that joins starts at the next step, and one that
finishes frees its slot for the next in the queue. Each request decodes exactly what `generate`
decodes for it alone (the same steps, through the same step functions); the batched forward
computes its rows to float rounding of the one-sequence forward.

Failures are confined: a request whose prefill or listener raises fails alone (an event with
`finish="error"`); a lane whose step raises fails the requests it held, and is made again for the
next ones. The engine keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

from clover_jax.core.errors import UNSUPPORTED, FieldError
from decoding.engine import precompile as precompiling
from decoding.engine.lanes import LANES, Lane, ModelContext, Outcome, Tracked, new_staging, prefix_length
from decoding.engine.prefix_cache import DEFAULT_GRID, Boundary, PrefixCache, cached_staging, follow_step, store_prefix
from decoding.engine.requests import (
    EngineEvent,
    EngineRequest,
    LaneKey,
    Listener,
    PreparedRequest,
    RequestStats,
    prepare,
    rows_needed,
)
from decoding.engine.slots import chunk_plan, prefill_chunk
from decoding.generation_config import TOKEN_ID_FIELDS
from decoding.layouts import token_ids_of
from decoding.modes import strategy
from decoding.validation import model_defaults

logger = logging.getLogger(__name__)

# AR and self-speculative prompts are left-padded to a multiple of this before their prefill
# chunks (at most UNIT - 1 rows of padding), so prefill compiles at most log2(chunk / UNIT) + 1 shapes.
UNIT = 8


class QueueFull(Exception):
    """The engine holds `max_running` requests and `max_queue` more wait: try again later."""


class EngineClosed(Exception):
    """The engine was closed."""


@dataclasses.dataclass
class Result:
    """A finished request: its response tokens, how it finished, its figures, and the error
    message when the engine failed it."""

    tokens: list[int]
    finish: str
    stats: RequestStats
    error: str | None = None


class Handle:
    """A submitted request: `cancel()` it (thread-safe; its slot is freed at the next step)."""

    def __init__(self, engine: "Engine", tracked: Tracked):
        self._engine, self._tracked = engine, tracked

    @property
    def number(self) -> int:
        return self._tracked.number

    @property
    def joined(self) -> bool:
        """Whether the request has joined its lane (its prompt prefilled, a slot written); the
        lane steps right after, before any request submitted from now on joins."""
        return self._tracked.lane is not None

    def cancel(self) -> None:
        self._engine.cancel(self)


@dataclasses.dataclass
class _Prefill:
    """An admitted request whose prompt is being prefilled on its staging state."""

    tracked: Tracked
    lane: LaneKey
    ids: np.ndarray          # int32 [1, padding + prefix]
    sizes: list[int] | None  # chunk lengths still to run (None: planned after the prefix cache's lookup)
    staging: Any = None
    last_logits: Any = None
    done_rows: int = 0
    store_at: int = 0        # the prefix cache keeps the state after this many rows (0: none)


class Engine:
    """Continuous batching of block diffusion, autoregressive and self-speculative requests.

    model: a `CloverModel` (or anything with its `passes`, `run_params`, `config`, `path`,
    `chunk_size`, `check_memory`); generation_config: the defaults of every request (None: the
    checkpoint's `generation_config.json`); max_running: requests decoding at once (each lane's
    largest batch); max_queue: requests waiting beyond them; max_context: cache rows per request
    (default: the model's `max_position_embeddings`); prefill_budget: prompt tokens prefilled
    per iteration (default: the model's prefill chunk); prefix_cache_bytes: the prefix cache's
    budget (0: no cache; `decoding.engine.prefix_cache`); prefix_cache_grid: its grid, in tokens.
    """

    def __init__(self, model, generation_config=None, max_running: int = 8, max_queue: int = 64,
                 max_context: int | None = None, prefill_budget: int | None = None, prefix_cache_bytes: int = 0,
                 prefix_cache_grid: int = DEFAULT_GRID):
        for name, value, low in (("max_running", max_running, 1), ("max_queue", max_queue, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        limit = model.config.max_position_embeddings
        max_context = limit if max_context is None else max_context
        if isinstance(max_context, bool) or not isinstance(max_context, int) or not 1 <= max_context <= limit:
            raise ValueError(f"max_context must be an integer in [1, {limit}] (max_position_embeddings), "
                             f"got {max_context!r}")
        mesh_sharding = getattr(model, "mesh_sharding", None)
        if mesh_sharding is not None and mesh_sharding.axis_size(mesh_sharding.rules.batch) > 1:
            # a request's staging state holds one sequence, which a data axis cannot split
            raise ValueError(f"the engine runs on a mesh whose data axis is 1 (its lanes are not split over a batch "
                             f"axis), got {dict(mesh_sharding.mesh.shape)}; put the devices on expert and tensor")
        self.model, self.max_running, self.max_queue, self.max_context = model, max_running, max_queue, max_context
        self.prefill_budget = prefill_budget or model.chunk_size
        for name, value, low in (("prefix_cache_bytes", prefix_cache_bytes, 0),
                                 ("prefix_cache_grid", prefix_cache_grid, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_grid) if prefix_cache_bytes else None
        # every request's defaults, with the special token ids the checkpoint gives them
        self.defaults = model_defaults(model) if generation_config is None else \
            generation_config.with_token_ids(model.config, getattr(model, "path", None))
        model.check_memory(max_running, max_context, self.defaults.block_size)
        ids = token_ids_of(self.defaults)
        self.context = ModelContext(passes=model.passes, params=model.run_params, vocab=model.config.vocab_size,
                                    ids=ids, eos=frozenset(self.defaults.eos_token_id),
                                    coreset=model.config.moe_block_coreset_enabled,
                                    coreset_top_p=np.float32(model.config.moe_block_coreset_top_p),
                                    max_slots=max_running,
                                    # where a pass is compute-bound, a lone commit is cheaper in a pass of its own
                                    lone_commits=jax.default_backend() == "cpu")
        self._lock = threading.Condition()
        self._inbox: collections.deque = collections.deque()     # (Tracked) submitted, not yet seen by the loop
        self._cancels: set[int] = set()
        self._queue: collections.deque = collections.deque()     # admitted to wait, in order
        self._prefills: collections.deque = collections.deque()  # _Prefill, in order
        self._lanes: dict[LaneKey, Lane] = {}
        self._empty_states: dict[tuple[int, int], Any] = {}
        self._held: dict[int, Tracked] = {}                        # prefilling or in a lane
        self._waiting = 0                                          # inbox + queue
        self._numbers = itertools.count()
        self._closed = False
        self.steps = 0                                             # lane steps run
        self.precompiled: precompiling.Precompiled | None = None   # what `precompile` did
        self.compiled_on_demand = 0                                 # programs compiled after it (logged)
        self.finished: collections.Counter = collections.Counter()  # requests ended, by finish reason
        self._thread = threading.Thread(target=self._loop, name="clover-jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side (any thread)
    def submit(self, request: EngineRequest, listener: Listener) -> Handle:
        """Check `request` (ValueError before any compute) and queue it; `listener(EngineEvent)` is
        called on the engine's thread. Raises QueueFull when `max_queue` requests already wait."""
        return self.submit_all([request], [listener])[0]

    def submit_all(self, requests: Sequence[EngineRequest], listeners: Sequence[Listener]) -> list[Handle]:
        """Check every request, then queue them together (the engine sees them at one step
        boundary); all or none are queued."""
        prepared = [self.check(request) for request in requests]
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if self._waiting + len(self._held) + len(prepared) > self.max_running + self.max_queue:
                raise QueueFull(f"{self.max_running} requests are running and {self.max_queue} waiting")
            tracked = [Tracked(next(self._numbers), one, listener)
                       for one, listener in zip(prepared, listeners, strict=True)]
            self._inbox.extend(tracked)
            self._waiting += len(tracked)
            self._lock.notify()
        return [Handle(self, one) for one in tracked]

    def check(self, request: EngineRequest) -> PreparedRequest:
        """Every check `submit` runs, without queueing: ValueError saying what is wrong."""
        prepared = prepare(self.model, dataclasses.replace(
            request, generation_config=request.generation_config or self.defaults), self.max_context)
        for name in TOKEN_ID_FIELDS:
            if getattr(prepared.config, name) != getattr(self.defaults, name):
                raise FieldError(name, f"{name} is the engine's ({getattr(self.defaults, name)!r}) for every request, "
                                 f"got {getattr(prepared.config, name)!r}", code=UNSUPPORTED)
        return prepared

    def precompile(self, modes: Sequence[str] | None = None, block_sizes: Sequence[int] | None = None, *,
                   sample: bool = True) -> "precompiling.Precompiled":
        """Compile, before serving, the programs of `modes` (default: every mode) at `block_sizes`
        (default: the engine's block size) for every lane size and cache bucket
        (`decoding.engine.precompile`); call it on an idle engine. Afterwards every program compiled
        for a request is logged with its shape. sample: also the sampled variants of the steps."""
        from decoding.modes import MODES

        self.precompiled = precompiling.precompile(self, modes=modes or MODES,
                                                   block_sizes=block_sizes or [self.defaults.block_size],
                                                   sample=sample)
        return self.precompiled

    def queued(self) -> int:
        with self._lock:
            return self._waiting

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._cancels.add(handle.number)
            self._lock.notify()

    def run(self, requests: Sequence[EngineRequest], timeout: float | None = None) -> list[Result]:
        """Submit every request at once and wait for all of them; results in order."""
        done = threading.Event()
        results: list[Result | None] = [None] * len(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        remaining = [len(requests)]
        guard = threading.Lock()

        def listener_for(index: int) -> Callable[[EngineEvent], None]:
            def listen(event: EngineEvent) -> None:
                tokens[index].extend(event.tokens)
                if event.finish is not None:
                    results[index] = Result(tokens[index], event.finish, event.stats, event.error)
                    with guard:
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            done.set()
            return listen

        if not requests:
            return []
        self.submit_all(requests, [listener_for(index) for index in range(len(requests))])
        if not done.wait(timeout):
            raise TimeoutError(f"{remaining[0]} of {len(requests)} requests unfinished after {timeout} s")
        return results

    def running(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        """Stop the loop; requests still queued or held finish with "shutdown"."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # ------------------------------------------------------------------ the engine's thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                # `_queue` too: when every held request finishes in one step, the queued ones are admitted
                # next (without it the loop slept with requests waiting, until a new one arrived).
                while not (self._closed or self._inbox or self._cancels or self._held or self._queue):
                    self._lock.wait()
                if self._closed:
                    break
                arrived, self._inbox = list(self._inbox), collections.deque()
                cancels, self._cancels = self._cancels, set()
            self._queue.extend(arrived)
            try:
                self._cancel(cancels)
                self._admit()
                self._prefill()
                self._step_lanes()
            except Exception:  # a bug in the loop itself: fail what it holds and keep serving
                logger.exception("the engine's loop failed; failing the requests it held")
                for tracked in list(self._held.values()):
                    self._fail(tracked, "internal error in the serving engine")
                self._prefills.clear()
                self._lanes.clear()
        for tracked in list(self._queue) + list(self._inbox) + list(self._held.values()):
            self._deliver(tracked, EngineEvent([], "shutdown", self._stats(tracked)))

    def _cancel(self, numbers: set[int]) -> None:
        if not numbers:
            return
        for tracked in [t for t in self._queue if t.number in numbers]:
            self._queue.remove(tracked)
            with self._lock:
                self._waiting -= 1
            self._finish(tracked, "cancelled")
        for number in numbers:
            tracked = self._held.get(number)
            if tracked is not None:
                self._finish(tracked, "cancelled")

    def _admit(self) -> None:
        while self._queue and len(self._held) < self.max_running:
            tracked = self._queue.popleft()
            prepared = tracked.prepared
            prefix = prepared.prompt[:prefix_length(prepared.lane, len(prepared.prompt))]
            if self.prefix_cache is not None:
                tracked.boundary = Boundary()
            if self.prefix_cache is not None and prefix:
                padding, sizes = 0, None  # no left padding: chunks are planned around the cached prefix
            else:
                unit = prepared.lane.block_size if strategy(prepared.mode).whole_blocks else UNIT
                padding, sizes = chunk_plan(len(prefix), unit, max(unit, self.model.chunk_size // unit * unit))
            ids = np.zeros((1, padding + len(prefix)), np.int32)
            ids[0, padding:] = prefix
            tracked.rows = padding + rows_needed(len(prepared.prompt), prepared.config, prepared.mode)
            self._held[tracked.number] = tracked
            with self._lock:
                self._waiting -= 1
            self._prefills.append(_Prefill(tracked, prepared.lane, ids, sizes))

    def _lane(self, key: LaneKey) -> Lane:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = LANES[key.mode](self.context, key, self._capacity(key))
        return lane

    def _capacity(self, key: LaneKey) -> int:
        return self.max_context + (0 if strategy(key.mode).whole_blocks else UNIT)

    def _prefill(self) -> None:
        budget = self.prefill_budget
        ready: dict[LaneKey, list[_Prefill]] = {}
        while self._prefills and budget > 0:
            job = self._prefills[0]
            if job.tracked.done:
                self._prefills.popleft()
                continue
            try:
                if job.staging is None:
                    padding = job.ids.shape[1] - prefix_length(job.lane, len(job.tracked.prepared.prompt))
                    rows = self._lane(job.lane).rows_for(job.tracked.rows)
                    if job.sizes is None:
                        job.staging, job.done_rows, job.store_at, job.sizes = cached_staging(
                            self.prefix_cache, self.context, job.tracked.prepared, job.ids, rows, self.model.chunk_size)
                        job.tracked.cached = job.done_rows
                    else:
                        job.staging = self._fresh_staging(rows, padding, shared=not job.sizes)
                if job.sizes:
                    size = job.sizes.pop(0)
                    chunk = job.ids[:, job.done_rows:job.done_rows + size]
                    with precompiling.on_demand(self, f"prefill chunk of {size} tokens on a staging state of "
                                                      f"{job.staging.capacity} rows ({job.lane})"):
                        job.last_logits, job.staging = prefill_chunk(self.context.passes, self.context.params, chunk,
                                                                     job.staging)
                    job.done_rows += size
                    budget -= size
                    if job.done_rows == job.store_at:
                        store_prefix(self.prefix_cache, job.tracked.prepared.prompt, job.store_at, job.staging)
                if not job.sizes:
                    self._prefills.popleft()
                    ready.setdefault(job.lane, []).append(job)
            except Exception as error:  # this request alone fails
                logger.exception("prefill of request %d failed", job.tracked.number)
                self._prefills.popleft()
                self._fail(job.tracked, f"prefill failed: {type(error).__name__}: {error}")
        for key, jobs in ready.items():
            self._join(key, jobs)

    def _join(self, key: LaneKey, jobs: list[_Prefill]) -> None:
        """Join prefilled requests into their lane in one write; if that fails, each alone (so
        only a request whose own join fails is failed)."""
        try:
            lane = self._lane(key)
            with precompiling.on_demand(self, f"{len(jobs)} request(s) joining {key} of {lane.live} live", lane):
                lane.add([(job.tracked, job.staging, job.last_logits) for job in jobs])
        except Exception as error:
            if len(jobs) > 1:
                for job in jobs:
                    self._join(key, [job])
                return
            logger.exception("request %d could not join its lane", jobs[0].tracked.number)
            self._fail(jobs[0].tracked, f"joining its decoding lane failed: {type(error).__name__}: {error}")
            return
        for job in jobs:
            job.tracked.lane = key

    def _fresh_staging(self, rows: int, padding: int, shared: bool):
        """An empty staging state; `shared`: one that no prefill will write (a prompt with no
        prefix), kept and handed to every such request (joining reads it, never changes it)."""
        if not shared:
            return new_staging(self.context, rows, padding)
        key = (rows, padding)
        if key not in self._empty_states:
            self._empty_states[key] = new_staging(self.context, rows, padding)
        return self._empty_states[key]

    def _step_lanes(self) -> None:
        for key, lane in list(self._lanes.items()):
            if not lane.live:
                continue
            try:
                with precompiling.on_demand(self, f"step of {key}", lane):
                    lane.fit()
                    committing = [tracked for tracked in lane.requests() if tracked.commits]
                    outcomes = lane.step()
            except Exception as error:
                logger.exception("a step of lane %s failed; failing its %d requests", key, lane.live)
                held = lane.requests()
                lane.drop()
                for tracked in held:
                    self._fail(tracked, f"decoding step failed: {type(error).__name__}: {error}")
                continue
            self.steps += 1
            if self.prefix_cache is not None:
                follow_step(self.prefix_cache, lane, committing, outcomes)
            for outcome in outcomes:
                self._report(outcome)

    def _report(self, outcome: Outcome) -> None:
        tracked = outcome.tracked
        tracked.emitted += len(outcome.tokens)
        if outcome.finish is not None:
            self._finish(tracked, outcome.finish, outcome.tokens, logprobs=outcome.logprobs)
        elif outcome.tokens:
            self._deliver(tracked, EngineEvent(outcome.tokens, logprobs=outcome.logprobs))

    def _finish(self, tracked: Tracked, finish: str, tokens: list[int] | None = None, error: str | None = None,
                logprobs: list | None = None) -> None:
        """Free the request's slot (or prefill) and send its last event."""
        self._release(tracked)
        if not tracked.done:
            self.finished[finish] += 1
        self._deliver(tracked, EngineEvent(tokens or [], finish, self._stats(tracked), error, logprobs))

    def _fail(self, tracked: Tracked, message: str) -> None:
        self._finish(tracked, "error", error=message)

    def _release(self, tracked: Tracked) -> None:
        self._held.pop(tracked.number, None)
        lane = self._lanes.get(tracked.lane) if tracked.lane is not None else None
        if lane is not None and tracked in lane.occupants:
            lane.remove(tracked)
            if not lane.live:
                del self._lanes[tracked.lane]

    def _deliver(self, tracked: Tracked, event: EngineEvent) -> None:
        """Hand an event to the request's listener; a listener that raises ends its request alone
        (no further event reaches it)."""
        if tracked.done:
            return
        tracked.done = event.finish is not None
        try:
            tracked.listener(event)
        except Exception:
            logger.exception("the listener of request %d raised; its request ends here", tracked.number)
            tracked.done = True
            self._release(tracked)

    def _stats(self, tracked: Tracked) -> RequestStats:
        return RequestStats(len(tracked.prepared.prompt), tracked.emitted, tracked.nfe, list(tracked.steps_per_block),
                            cached_tokens=tracked.cached)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
