"""The serving engine: one thread owns the model and runs every request in one ragged pass per step.

    engine = Engine(model, max_running=16)
    handle = engine.submit(EngineRequest(prompt_ids, overrides={"max_new_tokens": 64}), listener)
    results = engine.run([EngineRequest(...), ...])     # or wait for a list of requests

The device state has one shape for the engine's life (docs/serving.md, "The engine's shapes"):
`max_running` slots of GDN states, one pool of K/V pages with a page table per slot
(`clover_jax.core.ragged`), and one structure per decoding mode with a slot axis
(`decoding.engine.slot_states`). Each iteration of the engine's loop, at a step boundary:

1. takes new requests and cancellations (`submit`, `cancel` are thread-safe);
2. admits queued requests while a slot is free and the page pool can promise their pages (a
   bounded queue waits beyond; `submit` raises `QueueFull` past `max_queue`); with a prefix cache
   (`decoding.engine.prefix_cache`) a request starts from the longest prefix the cache keeps
   within its causal prefix: shared pages and the GDN states kept there;
3. plans one pass: every decoding request's work (a denoising step of its block, with its closed
   block's commit; its latest token; a self-speculative round's draft or verification), then
   prefill chunks of the admitted prompts up to `prefill_budget` tokens — a long prompt's chunks
   ride in the same passes as the running requests' steps (`decoding.engine.work`);
4. runs it: one ragged forward padded to one of a few token counts, then the decisions of each
   mode (`decoding.engine.decisions`), and hands each request its new tokens; a finished or
   cancelled request frees its slot and pages (with a prefix cache, a finished one's prompt and
   response are kept first, to their last grid boundary).

Requests never wait for each other: a request admitted starts at the next pass, and one that
finishes frees its slot for the next in the queue. Each request decodes exactly what `generate`
decodes for it alone (the same steps, through the same step functions); the ragged forward
computes its rows to float rounding of the one-sequence forward.

Failures are confined: a request whose listener raises ends alone; a request the engine cannot
admit fails alone; a pass that raises fails the requests it held (their state is gone: the device
state is made again, the prefix cache emptied). The engine keeps serving.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from clover_jax.core.errors import UNSUPPORTED, FieldError
from clover_jax.core.ragged import TRASH_PAGE, layout, page_bytes, slot_state_bytes
from decoding.engine import decisions, grammars, precompile as precompiling
from decoding.engine.pages import PagePool, PoolExhausted
from decoding.engine.prefix_cache import Boundary, PrefixCache, clear_slots_gdn, put_slot_gdn, slot_gdn
from decoding.engine.requests import EngineEvent, EngineRequest, Listener, PreparedRequest, RequestStats, prepare
from decoding.engine.shapes import EngineShapes
from decoding.engine.slot_states import (
    SlotStates,
    autoregressive_entry,
    diffusion_entry,
    empty_slot_states,
    put_slots,
    speculative_entry,
    stacked_rows,
)
from decoding.engine.work import (
    Outcome,
    Tracked,
    autoregressive_outcome,
    diffusion_outcome,
    plan,
    unplan,
    verified_outcome,
)
from decoding.generation_config import TOKEN_ID_FIELDS
from decoding.layouts import token_ids_of
from decoding.modes import Mode, strategy
from decoding.serving_defaults import DEFAULT_GRID
from decoding.validation import model_defaults

logger = logging.getLogger(__name__)


# Prompt tokens a pass takes beside running requests at least, when prefill is balanced against them.
BALANCED_PREFILL_FLOOR = 64


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
    def decoding(self) -> bool:
        """Whether the request is decoding (its prompt prefilled); its next step runs before any
        request submitted from now on decodes."""
        return self._tracked.decoding

    def cancel(self) -> None:
        self._engine.cancel(self)


class PassRecord(NamedTuple):
    """One pass of the engine, as `Engine.passes` logs it."""

    start: float           # monotonic seconds when it began
    seconds: float         # its wall time, decisions included
    rows: int              # token rows it ran (before padding)
    prompt_rows: int       # of them, prefill rows
    pages_in_use: int      # K/V pages of the pool in use after it (by requests and the prefix cache)
    request_pages: int     # pages the running requests hold (a page shared through the prefix cache once per holder)
    positions_held: int    # positions the running requests' states hold after it
    waited: float          # of `seconds`, the host's wait for the device's results (the rest is host work)


class Admission(NamedTuple):
    """A request taken into a slot at this step boundary, its device writes still to come."""

    tracked: Tracked
    field: str             # the slot structure it uses
    entry: Any             # its entry ([1]-slot NumPy leaves)
    gdn: Any               # the GDN states a prefix-cache hit restores (None: zeros)


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """What every pass reads of the model (the engine builds it once)."""

    passes: Any
    params: Any
    vocab: int
    ids: Any
    eos: frozenset
    coreset: bool
    coreset_top_p: np.float32


class Engine:
    """Continuous batching of block diffusion, autoregressive and self-speculative requests.

    model: a `CloverModel` (or anything with its `passes`, `run_params`, `config`, `path`,
    `chunk_size`); generation_config: the defaults of every request (None: the checkpoint's
    `generation_config.json`); max_running: requests held at once (the slots); max_queue:
    requests waiting beyond them; max_context: positions per request (default: the model's
    `max_position_embeddings`); prefill_budget: prompt tokens prefilled per pass (default: the
    model's prefill chunk); prefix_cache_bytes: the prefix cache's budget (0: no cache;
    `decoding.engine.prefix_cache`); prefix_cache_grid: its grid, in tokens; block_sizes: the
    block sizes requests may decode with (default: the checkpoint's; every slot's block is held
    as wide as the widest, so a pass's block work follows it: `clover-jax serve` adds 16, 32 and 64);
    kv_cache_bytes: the K/V page pool's size (default `shapes.EngineShapes.pool_pages`'s rule);
    page_size: positions per page (default 16, or what divides the prefix cache's grid);
    balance_prefill: while requests decode, a pass takes at most the prompt tokens that fill the
    token padding of twice their rows (at least `BALANCED_PREFILL_FLOOR`), rather than the whole
    `prefill_budget`. Default: on a CPU, where a pass's time follows its rows; not on a TPU or
    GPU, where a pass of a few hundred rows is bound by reading the weights and prompt rows ride
    nearly free.
    """

    def __init__(self, model, generation_config=None, max_running: int = 8, max_queue: int = 64,
                 max_context: int | None = None, prefill_budget: int | None = None, prefix_cache_bytes: int = 0,
                 prefix_cache_grid: int = DEFAULT_GRID, *, block_sizes: Sequence[int] | None = None,
                 kv_cache_bytes: int | None = None, page_size: int | None = None,
                 balance_prefill: bool | None = None):
        for name, value, low in (("max_running", max_running, 1), ("max_queue", max_queue, 0),
                                 ("prefix_cache_bytes", prefix_cache_bytes, 0),
                                 ("prefix_cache_grid", prefix_cache_grid, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        limit = model.config.max_position_embeddings
        max_context = limit if max_context is None else max_context
        if isinstance(max_context, bool) or not isinstance(max_context, int) or not 1 <= max_context <= limit:
            raise ValueError(f"max_context must be an integer in [1, {limit}] (max_position_embeddings), "
                             f"got {max_context!r}")
        mesh_sharding = getattr(model, "mesh_sharding", None)
        if mesh_sharding is not None and mesh_sharding.axis_size(mesh_sharding.rules.batch) > 1:
            raise ValueError(f"the engine runs on a mesh whose data axis is 1 (a pass is one row of tokens, which a "
                             f"data axis cannot split), got {dict(mesh_sharding.mesh.shape)}; put the devices on "
                             f"expert and tensor")
        self.model, self.max_running, self.max_queue, self.max_context = model, max_running, max_queue, max_context
        # every request's defaults, with the special token ids the checkpoint gives them
        self.defaults = model_defaults(model) if generation_config is None else \
            generation_config.with_token_ids(model.config, getattr(model, "path", None))
        # every block size is a row of the slots' block windows: a size not served costs the widest's rows
        sizes = sorted(set(block_sizes) if block_sizes is not None else {self.defaults.block_size})
        if not sizes or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
            raise ValueError(f"block_sizes must be positive integers, got {list(sizes)}")
        grid = prefix_cache_grid if prefix_cache_bytes else None
        budget = model.chunk_size if prefill_budget is None else prefill_budget
        self.shapes = EngineShapes.make(model, max_running=max_running, max_context=max_context,
                                        block_sizes=tuple(sizes), prefill_budget=budget,
                                        kv_cache_bytes=kv_cache_bytes, page_size=page_size, grid=grid,
                                        prefix_cache_bytes=prefix_cache_bytes)
        self.block_sizes = self.shapes.block_sizes
        self.prefill_budget = self.shapes.prefill_budget
        if kv_cache_bytes is None and hasattr(model, "check_memory"):
            # the default pool holds every slot at the full context: refused before anything compiles
            # when that and the activations do not fit (a smaller --kv-cache-gb is the user's choice)
            model.check_memory(max_running, max_context, self.shapes.max_block)
        self.balance_prefill = jax.default_backend() == "cpu" if balance_prefill is None else bool(balance_prefill)
        self.pool = PagePool(self.shapes.num_pages)
        self.page_bytes = page_bytes(model.config, self.shapes.page_size, model.dtype)
        self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_grid, pool=self.pool,
                                        page_size=self.shapes.page_size, page_bytes=self.page_bytes) \
            if prefix_cache_bytes else None
        ids = token_ids_of(self.defaults)
        self.context = ModelContext(passes=model.passes, params=model.run_params, vocab=model.config.vocab_size,
                                    ids=ids, eos=frozenset(self.defaults.eos_token_id),
                                    coreset=model.config.moe_block_coreset_enabled,
                                    coreset_top_p=np.float32(model.config.moe_block_coreset_top_p))
        logger.info("engine: %d slots, %d K/V pages of %d positions (%.2f GiB; %.2f GiB of GDN states), passes of "
                    "%s tokens", max_running, self.shapes.num_pages, self.shapes.page_size,
                    self.shapes.num_pages * self.page_bytes / 2**30,
                    max_running * slot_state_bytes(model.config, model.dtype) / 2**30, list(self.shapes.paddings))
        self._new_device_state()
        self._lock = threading.Condition()
        self._device = threading.RLock()  # the device state: the loop's iterations, `precompile`
        self._inbox: collections.deque = collections.deque()     # (Tracked) submitted, not yet seen by the loop
        self._cancels: set[int] = set()
        self._queue: collections.deque = collections.deque()     # admitted to wait, in order
        self._held: dict[int, Tracked] = {}                        # holding a slot, in admission order
        self._free_slots = list(range(max_running - 1, -1, -1))
        self._first_slot = 0                                       # where decoding requests' turns start
        self._waiting = 0                                          # inbox + queue
        self._numbers = itertools.count()
        self._closed = False
        self.steps = 0                                             # passes run
        self._waited = 0.0                                         # the current pass's wait for the device
        # the latest passes, as `PassRecord`s
        self.passes: collections.deque = collections.deque(maxlen=4096)
        self.precompiled: precompiling.Precompiled | None = None   # what `precompile` did
        self.compiled_on_demand = 0                                 # programs compiled after it (logged)
        self.finished: collections.Counter = collections.Counter()  # requests ended, by finish reason
        self._thread = threading.Thread(target=self._loop, name="clover-jax-engine", daemon=True)
        self._thread.start()

    def _new_device_state(self) -> None:
        """The device state of an empty engine: no page held, every slot empty."""
        shapes, context = self.shapes, self.context
        self.page_table = np.full((shapes.slots, shapes.pages_per_slot), TRASH_PAGE, np.int32)
        # committed to their devices, as every program's outputs are: an uncommitted argument is another
        # program (the first pass after `precompile` compiled its forward again)
        commit = lambda tree: jax.tree_util.tree_map(lambda leaf: jax.device_put(leaf, leaf.sharding), tree)
        self.state = commit(jax.jit(context.passes.new_paged_state, static_argnums=(0, 1, 2))(
            shapes.slots, shapes.num_pages, shapes.page_size))
        self.slots = self._empty_slot_states()

    def _empty_slot_states(self) -> SlotStates:
        """Every mode's slot structure with no request, on the devices (committed, as the programs'
        outputs are: an uncommitted argument would be another program)."""
        shapes, context = self.shapes, self.context
        mesh_sharding = getattr(self.model, "mesh_sharding", None)
        slots = jax.device_put(empty_slot_states(slots=shapes.slots, max_block=shapes.max_block, vocab=context.vocab,
                                                 ids=context.ids, template=self.template(Mode.DIFFUSION)),
                               None if mesh_sharding is None else mesh_sharding.replicated())
        return jax.tree_util.tree_map(lambda leaf: jax.device_put(leaf, leaf.sharding), slots)

    def template(self, mode: Mode, **overrides: Any) -> PreparedRequest:
        """A request of `mode` as admission prepares one (the shapes of every slot structure's
        entry), with `overrides` of the engine's generation defaults."""
        return prepare(self.model, EngineRequest([0], mode, generation_config=self.defaults,
                                                 overrides={"max_new_tokens": 1, **overrides}), self.max_context)

    def entry_for(self, prepared: PreparedRequest) -> tuple[str, Any]:
        """(the slot structure a request uses, its entry: NumPy leaves, the key as raw key data)."""
        context, max_block = self.context, self.shapes.max_block
        if prepared.mode == Mode.DIFFUSION:
            return "diffusion", diffusion_entry(prepared, max_block=max_block, ids=context.ids, vocab=context.vocab)
        if prepared.mode == Mode.AUTOREGRESSIVE:
            return "autoregressive", autoregressive_entry(prepared, vocab=context.vocab)
        return "speculative", speculative_entry(prepared, max_block=max_block, vocab=context.vocab)

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
        if strategy(prepared.mode).decodes_blocks and prepared.config.block_size not in self.block_sizes:
            raise FieldError("block_size", f"block_size must be one of {list(self.block_sizes)} on this engine "
                             f"(its block_sizes), got {prepared.config.block_size}", code=UNSUPPORTED)
        return prepared

    def precompile(self, modes: Sequence[str] | None = None, block_sizes: Sequence[int] | None = None, *,
                   sample: bool = True) -> "precompiling.Precompiled":
        """Compile, before serving, every program requests of `modes` (default: every mode) at
        `block_sizes` (default: the engine's) can meet (`decoding.engine.precompile`); call it on an
        idle engine. Afterwards every program compiled for a request is logged with its shape.
        sample: also the sampled variants of the decisions."""
        from decoding.modes import MODES

        with self._lock:
            busy = self._waiting + len(self._held)
        if busy:  # its programs run on slot 0's entry and states, which a held request may own
            raise RuntimeError(f"precompile needs an idle engine; {busy} requests are queued or running")
        sizes = list(block_sizes or self.block_sizes)
        unknown = sorted(set(sizes) - set(self.block_sizes))
        if unknown:
            raise ValueError(f"block sizes {unknown} are not among the engine's ({list(self.block_sizes)})")
        with self._device:
            self.precompiled = precompiling.precompile(self, modes=modes or MODES, block_sizes=sizes, sample=sample)
        return self.precompiled

    def queued(self) -> int:
        with self._lock:
            return self._waiting

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._cancels.add(handle.number)
            self._lock.notify()

    def run(self, requests: Sequence[EngineRequest], timeout: float | None = None) -> list[Result]:
        """Submit every request at once and wait for all of them; results in order. TimeoutError
        after `timeout` seconds, the unfinished requests cancelled."""
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
        handles = self.submit_all(requests, [listener_for(index) for index in range(len(requests))])
        if not done.wait(timeout):
            for handle in handles:  # nobody waits for them any more: their slots and pages go back
                handle.cancel()
            raise TimeoutError(f"{remaining[0]} of {len(requests)} requests unfinished after {timeout} s "
                               "(cancelled)")
        return results

    def running(self) -> int:
        with self._lock:
            return len(self._held)

    def kv_pages_in_use(self) -> int:
        """K/V pages held by requests or the prefix cache (the pool's pages less the free ones)."""
        return self.pool.in_use

    def kv_bytes_in_use(self) -> int:
        """Bytes of the K/V pages in use, over every attention layer (`kv_pages_in_use` pages)."""
        return self.pool.in_use * self.page_bytes

    def kv_bytes_capacity(self) -> int:
        """Bytes of the pages the pool can hand out."""
        return self.pool.capacity * self.page_bytes

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
                while not (self._closed or self._inbox or self._cancels or self._held or self._queue):
                    self._lock.wait()
                if self._closed:
                    break
                arrived, self._inbox = list(self._inbox), collections.deque()
                cancels, self._cancels = self._cancels, set()
            with self._device:
                self._queue.extend(arrived)
                try:
                    self._cancel(cancels)
                    works: list = []  # this iteration's pass, filled once planned (the on-demand log reads it)
                    with precompiling.on_demand(self, functools.partial(precompiling.pass_shape, self, works)):
                        self._admit()
                        works.extend(self._plan())
                        if works:
                            self._run(works)
                except Exception:  # a bug in the loop itself: fail what it holds and keep serving
                    logger.exception("the engine's loop failed; failing the requests it held")
                    try:
                        self._fail_all("internal error in the serving engine")
                    except Exception:  # no fresh state to serve from: stop, and say so to every request
                        logger.exception("the engine could not start again from a fresh state; it stops")
                        self._stop("error", "the serving engine failed and stopped")
                        return
        self._stop("shutdown", None)

    def _stop(self, finish: str, error: str | None) -> None:
        """End every request queued or held with `finish` and refuse new ones (the loop's last act)."""
        with self._lock:
            self._closed = True
            left = list(self._queue) + list(self._inbox) + list(self._held.values())
            self._inbox = collections.deque()
        for tracked in left:
            self._deliver(tracked, EngineEvent([], finish, self._stats(tracked), error))

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
        """Take queued requests into free slots (host work, each request alone), then write every
        one taken at this step boundary to the device together (`_write_admitted`)."""
        admitted = []
        while self._queue and self._free_slots:
            tracked = self._queue[0]
            prepared = tracked.prepared
            need = math.ceil(strategy(prepared.mode).rows_needed(
                len(prepared.prompt), prepared.config.max_new_tokens, prepared.config.block_size)[0]
                / self.shapes.page_size)
            if not self.pool.can_reserve(need):
                break  # the oldest waits for pages; the pool is shared in order
            self._queue.popleft()
            try:
                admitted.append(self._take_slot(tracked, need))
            except Exception as error:  # this request alone fails
                logger.exception("admitting request %d failed", tracked.number)
                self._fail(tracked, f"admission failed: {type(error).__name__}: {error}")
        if admitted:
            self._write_admitted(admitted)

    def _take_slot(self, tracked: Tracked, need: int) -> Admission:
        """A request's slot, pages and host bookkeeping; its device entry is returned, not written."""
        prepared, context = tracked.prepared, self.context
        self.pool.reserve(need)
        tracked.reserved, tracked.slot = need, self._free_slots.pop()
        with self._lock:  # one step, so that `submit_all` counts it once: waiting, or held
            self._waiting -= 1
            self._held[tracked.number] = tracked
        field, entry = self.entry_for(prepared)
        hit = None
        if self.prefix_cache is not None:
            tracked.boundary = Boundary()
            hit = self.prefix_cache.lookup(prepared.prompt, reuse_limit(tracked))
        if hit is not None:
            tracked.pages, tracked.filled, tracked.cached = list(hit.pages), hit.length, hit.length
            self.page_table[tracked.slot, :len(hit.pages)] = hit.pages
        prefix = len(tracked.prefix)
        if self.prefix_cache is not None:
            boundary = prefix // self.prefix_cache.grid * self.prefix_cache.grid
            tracked.store_at = boundary if boundary > tracked.filled else 0
        if prepared.mode == Mode.DIFFUSION:
            size = prepared.config.block_size
            tail = prepared.prompt[prefix:]
            tracked.block = list(tail) + [int(context.ids.mask)] * (size - len(tail))
        elif prepared.mode == Mode.SELF_SPECULATIVE:
            tracked.pending = [prepared.prompt[-1]]
        return Admission(tracked, field, entry, None if hit is None else hit.gdn)

    def _write_admitted(self, admitted: list[Admission]) -> None:
        """The device writes of the requests admitted at one step boundary: their GDN states (zeros,
        or a prefix's kept states) and each mode's slot entries, one program per structure. A
        failure fails these requests (the loop starts from a fresh state if it took the old one)."""
        slots = self.shapes.slots
        try:
            fresh = [one.tracked.slot for one in admitted if one.gdn is None]
            if fresh:
                self.state = clear_slots_gdn(self.state, np.asarray(fresh + [slots] * (slots - len(fresh)), np.int32))
            for one in admitted:
                if one.gdn is not None:
                    self.state = put_slot_gdn(self.state, np.int32(one.tracked.slot), one.gdn)
            for field in dict.fromkeys(one.field for one in admitted):
                mine = [one for one in admitted if one.field == field]
                indices, rows = stacked_rows([one.entry for one in mine], [one.tracked.slot for one in mine],
                                             slots=slots)
                self.slots = self.slots._replace(**{field: put_slots(getattr(self.slots, field), indices, rows)})
        except Exception as error:
            logger.exception("writing %d admitted requests failed", len(admitted))
            for one in admitted:
                self._fail(one.tracked, f"admission failed: {type(error).__name__}: {error}")

    def _plan(self) -> list:
        """Every decoding request's work, then prefill chunks within the budgets. Decoding requests
        take turns at the front (by slot, from where the last pass left off), so that when their
        work exceeds a pass the ones left out run first in the next."""
        mask, budget = int(self.context.ids.mask), self.shapes.max_tokens
        works = []
        held = list(self._held.values())
        decoding = sorted((t for t in held if t.decoding and not t.done),
                          key=lambda t: (t.slot - self._first_slot) % self.shapes.slots)
        for tracked in decoding:
            work = plan(tracked, budget=budget, prefill_budget=0, mask=mask)
            if work is None:
                self._first_slot = tracked.slot  # left out: first in the next pass
                break
            works.append(work)
            budget -= len(work.causal) + len(work.block)
        decoding_rows = self.shapes.max_tokens - budget
        prefill = self.prefill_budget
        if decoding_rows and self.balance_prefill:
            prefill = min(prefill, self.shapes.balanced_prefill(decoding_rows, floor=BALANCED_PREFILL_FLOOR))
        for tracked in held:
            # a request with no prompt rows left (a short diffusion prompt, a whole prefix from the
            # cache) starts decoding beside a long prefill that has taken the prefill budget
            needs_prompt = tracked.filled < len(tracked.prefix)
            if tracked.decoding or tracked.done or budget <= 0 or (needs_prompt and prefill <= 0):
                continue
            work = plan(tracked, budget=budget, prefill_budget=min(prefill, budget), mask=mask)
            if work is not None:
                works.append(work)
                budget -= len(work.causal) + len(work.block)
                prefill -= tracked.ran_prefill
        return works

    def _by_slot(self, slot: int) -> Tracked:
        for tracked in self._held.values():
            if tracked.slot == slot:
                return tracked
        raise KeyError(slot)

    def _pages_for(self, tracked: Tracked, last_position: int) -> None:
        """Hand the request the pages up to `last_position`, evicting cached prefixes when no page is free."""
        if last_position >= self.page_table.shape[1] * self.shapes.page_size:
            raise RuntimeError(f"position {last_position} is past the slot's page table "
                               f"({self.page_table.shape[1]} pages of {self.shapes.page_size})")
        while len(tracked.pages) * self.shapes.page_size <= last_position:
            while not self.pool.free:
                if self.prefix_cache is None or not self.prefix_cache.evict_oldest():
                    raise PoolExhausted("the K/V page pool is exhausted (its reservations should prevent this)")
            page = self.pool.take()
            self.page_table[tracked.slot, len(tracked.pages)] = page
            tracked.pages.append(page)

    def _run(self, works: list) -> None:
        shapes, context = self.shapes, self.context
        started = time.monotonic()
        ran = [self._by_slot(work.slot) for work in works]
        try:
            for tracked, work in zip(ran, works, strict=True):
                self._pages_for(tracked, work.start + len(work.causal) + len(work.block) - 1)
            rows = sum(len(work.causal) + len(work.block) for work in works)
            ids, batch = layout(works, num_tokens=shapes.padding_for(rows), page_table=self.page_table,
                                max_block=shapes.max_block, logit_width=shapes.logit_width, chunk=shapes.chunk)
            hidden, self.state = decisions.forward(context.passes, context.params, self.state, ids, batch,
                                                   context.coreset_top_p, coreset=context.coreset)
            reports = self._decide(hidden, ran)
        except Exception as error:
            for tracked in ran:
                unplan(tracked)
            logger.exception("a pass of %d requests failed; failing every request the engine holds", len(ran))
            self._fail_all(f"decoding step failed: {type(error).__name__}: {error}")
            return
        self.steps += 1
        self._apply(ran, reports)
        held = self._held.values()
        self.passes.append(PassRecord(started, time.monotonic() - started, rows, sum(t.ran_prefill for t in ran),
                                      self.pool.in_use, sum(len(t.pages) for t in held), sum(t.filled for t in held),
                                      self._waited))

    def _decide(self, hidden, ran: list[Tracked]) -> dict:
        """Every decision the pass's requests need, run on the device; their reports on the host. A
        decision that fails fails the requests of its mode alone (that mode's slot structure is made
        again); the other modes decide on."""
        context, slots = self.context, self.shapes.slots
        self._waited = 0.0

        def mask_of(chosen: list[Tracked]) -> np.ndarray:
            """bool [S]: the slots of `chosen`."""
            mask = np.zeros(slots, bool)
            mask[[t.slot for t in chosen]] = True
            return mask

        deciding = [t for t in ran if t.ran_decode]
        # (report key, slot structure, program, its arguments after the structure (a function: a grammar's
        # masks are read inside the mode's try), static arguments)
        jobs = []
        for size in sorted({t.block_size for t in deciding if t.mode == Mode.DIFFUSION}):
            chosen = [t for t in deciding if t.mode == Mode.DIFFUSION and t.block_size == size]
            program = decisions.decide_diffusion
            if any(t.prepared.grammar is not None for t in chosen):
                program = functools.partial(grammars.diffusion_step, chosen, mask_id=int(context.ids.mask),
                                            vocab=context.vocab)
            jobs.append((f"diffusion/{size}", "diffusion", program,
                         lambda chosen=chosen: (hidden, mask_of(chosen), mask_of([t for t in chosen if t.commits]),
                                                context.ids),
                         dict(block_size=size, sample=any(t.prepared.config.do_sample for t in chosen),
                              scores=any(t.prepared.logprobs is not None for t in chosen))))
        chosen = [t for t in deciding if t.mode == Mode.AUTOREGRESSIVE]
        if chosen:
            jobs.append(("autoregressive", "autoregressive", decisions.decide_autoregressive,
                         lambda chosen=chosen: (hidden, mask_of(chosen), context.ids,
                                                *grammars.next_token_masks(chosen, slots, context.vocab)),
                         dict(sample=any(t.prepared.config.do_sample for t in chosen))))
        for verifying in (False, True):
            for size in sorted({t.block_size for t in deciding if t.mode == Mode.SELF_SPECULATIVE}):
                chosen = [t for t in deciding if t.mode == Mode.SELF_SPECULATIVE and t.block_size == size
                          and t.verifying == verifying]
                if chosen and verifying:
                    jobs.append((f"verified/{size}", "speculative", decisions.decide_verified,
                                 lambda chosen=chosen, size=size: (
                                     hidden, mask_of(chosen), context.ids,
                                     *grammars.verification_masks(chosen, slots, context.vocab, size)),
                                 dict(block_size=size)))
                elif chosen:
                    jobs.append((f"drafts/{size}", "speculative", decisions.decide_drafts,
                                 lambda chosen=chosen: (hidden, mask_of(chosen), context.ids),
                                 dict(block_size=size)))
        reports, failed = {}, {}
        for key, field, program, args, static in jobs:
            if field in failed:
                continue
            try:
                structure, report = program(context.passes, context.params, getattr(self.slots, field), *args(),
                                            **static)
                self.slots = self.slots._replace(**{field: structure})
                waiting = time.monotonic()
                reports[key] = jax.device_get(report)
                self._waited += time.monotonic() - waiting
            except Exception as error:
                logger.exception("the %s decision failed; failing the requests of its mode", key)
                failed[field] = f"decoding step failed: {type(error).__name__}: {error}"
        if failed:
            self._fail_modes(failed)
        return reports

    def _fail_modes(self, failed: dict[str, str]) -> None:
        """Fail every request whose mode's slot structure a failed decision may have consumed, and
        make those structures again."""
        field_of = {Mode.DIFFUSION: "diffusion", Mode.AUTOREGRESSIVE: "autoregressive",
                    Mode.SELF_SPECULATIVE: "speculative"}
        for tracked in list(self._held.values()):
            if field_of[tracked.mode] in failed:
                unplan(tracked)
                self._fail(tracked, failed[field_of[tracked.mode]])
        empty = self._empty_slot_states()
        self.slots = self.slots._replace(**{field: getattr(empty, field) for field in failed})

    def _apply(self, ran: list[Tracked], reports: dict) -> None:
        """The pass's effects on each request it ran, then their events."""
        eos = self.context.eos
        outcomes = []
        for tracked in ran:
            if tracked.done:  # failed with its mode's decision
                continue
            if tracked.ran_prefill:
                tracked.filled += tracked.ran_prefill
                if self.prefix_cache is not None and tracked.store_at and tracked.filled == tracked.store_at:
                    self._store(tracked.prepared.prompt, tracked)
            if not tracked.ran_decode:
                continue
            if tracked.starts:
                tracked.nfe = tracked.first_nfe()
            slot = tracked.slot
            outcome = None
            if tracked.mode == Mode.DIFFUSION:
                if tracked.commits:
                    tracked.filled += tracked.block_size
                    tracked.commits = False
                report = reports[f"diffusion/{tracked.block_size}"]
                scores = None if report.logprob is None else (report.logprob[slot], report.top_ids[slot],
                                                              report.top_values[slot])
                outcome = diffusion_outcome(tracked, closing=bool(report.closing[slot]),
                                            finished=bool(report.finished[slot]), block=report.block[slot],
                                            steps=int(report.steps[slot]), scores=scores, eos=eos)
            elif tracked.mode == Mode.AUTOREGRESSIVE:
                tracked.filled += len(tracked.pending)  # the latest token's row (none right after the prefill)
                report = reports["autoregressive"]
                outcome = autoregressive_outcome(tracked, token=int(report.token[slot]),
                                                 finished=bool(report.finished[slot]), eos=eos)
            elif tracked.verifying:
                report = reports[f"verified/{tracked.block_size}"]
                outcome = verified_outcome(tracked, choices=report.choices[slot], emitted=int(report.emitted[slot]),
                                           finished=bool(report.finished[slot]), eos=eos)
            else:
                tracked.filled += len(tracked.pending)
                tracked.pending, tracked.verifying = [], True
                tracked.drafts = [int(token) for token in reports[f"drafts/{tracked.block_size}"][slot]]
                tracked.nfe += 1
            if outcome is not None and tracked.mode != Mode.DIFFUSION and tracked.prepared.grammar is not None:
                try:
                    tracked.prepared.grammar.consume(outcome.tokens)
                except RuntimeError as error:  # a mask that let a refused token through: a bug, this request's alone
                    logger.exception("request %d's grammar refused its own tokens", tracked.number)
                    self._fail(tracked, f"decoding step failed: {error}")
                    continue
            if outcome is not None:
                outcomes.append(outcome)
        if self.prefix_cache is not None:  # before the reports: a request finishing now keeps this pass's boundary
            self._follow(ran)
        for outcome in outcomes:
            self._report(outcome)

    # ------------------------------------------------------------------ the prefix cache
    def _store(self, tokens: Sequence[int], tracked: Tracked) -> None:
        """Keep the request's state at `tracked.filled` positions (a grid boundary). A failure is
        logged: the cache only saves work."""
        try:
            self.prefix_cache.store(tokens, tracked.filled, tracked.pages,
                                    gdn=lambda: slot_gdn(self.state, np.int32(tracked.slot)))
        except Exception:
            logger.exception("storing a prefix of %d tokens in the prefix cache failed", tracked.filled)

    def _follow(self, ran: list[Tracked]) -> None:
        """After a pass: take the GDN states of a decoding request whose state now stands on a grid
        boundary (kept when it finishes, `_finish`)."""
        grid = self.prefix_cache.grid
        for tracked in ran:
            boundary = tracked.boundary
            if tracked.done or boundary is None or not tracked.decoding:
                continue
            if tracked.filled % grid == 0 and tracked.filled > boundary.length:
                boundary.length, boundary.gdn = tracked.filled, slot_gdn(self.state, np.int32(tracked.slot))

    def _keep_finished(self, tracked: Tracked) -> None:
        boundary = tracked.boundary
        if boundary is None or boundary.gdn is None:
            return
        tokens = list(tracked.prepared.prompt) + tracked.response
        try:
            self.prefix_cache.store(tokens, boundary.length, tracked.pages, gdn=lambda: boundary.gdn)
        except Exception:
            logger.exception("keeping a finished request's prefix in the prefix cache failed")

    # ------------------------------------------------------------------ ending requests
    def _report(self, outcome: Outcome) -> None:
        tracked = outcome.tracked
        tracked.emitted += len(outcome.tokens)
        tracked.response.extend(outcome.tokens)
        if outcome.finish is not None:
            self._finish(tracked, outcome.finish, outcome.tokens, logprobs=outcome.logprobs)
        elif outcome.tokens:
            self._deliver(tracked, EngineEvent(outcome.tokens, logprobs=outcome.logprobs))

    def _finish(self, tracked: Tracked, finish: str, tokens: list[int] | None = None, error: str | None = None,
                logprobs: list | None = None) -> None:
        """Free the request's slot and pages and send its last event."""
        if finish in ("eos", "length") and self.prefix_cache is not None:
            self._keep_finished(tracked)
        self._release(tracked)
        if not tracked.done:
            self.finished[finish] += 1
        self._deliver(tracked, EngineEvent(tokens or [], finish, self._stats(tracked), error, logprobs))

    def _fail(self, tracked: Tracked, message: str) -> None:
        self._finish(tracked, "error", error=message)

    def _fail_all(self, message: str) -> None:
        """Fail every request held and start again from an empty device state (a failed pass may
        have consumed the state it was given)."""
        for tracked in list(self._held.values()):
            self._fail(tracked, message)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.pool = PagePool(self.shapes.num_pages)
        if self.prefix_cache is not None:
            self.prefix_cache.pool = self.pool
        self._new_device_state()

    def _release(self, tracked: Tracked) -> None:
        if self._held.pop(tracked.number, None) is None:
            return
        self.pool.release(tracked.pages)
        self.pool.unreserve(tracked.reserved)
        self.page_table[tracked.slot] = TRASH_PAGE
        self._free_slots.append(tracked.slot)
        tracked.pages, tracked.reserved = [], 0

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


def reuse_limit(tracked: Tracked) -> int:
    """The most cached tokens a request may start from: its causal prefix (diffusion: the whole
    prompt blocks, floor(P/B)·B; self-speculative: all but the pending last token), less one for
    autoregressive decoding, whose first token is chosen from the last prompt row's logits."""
    return len(tracked.prefix) - int(tracked.mode == Mode.AUTOREGRESSIVE)
