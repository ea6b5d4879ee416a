"""Lanes on the host: which request holds which slot, the step of each lane, and its size.

A lane serves one kind of request (`LaneKey`: mode, block size, step cap) in a fixed-shape batch
of slots. Its size is a power of two up to the engine's `max_running`: it doubles when a request
joins a full lane and halves when no more than a quarter of its slots are live (the live slots
are moved to the front), so a lane steps about as many rows as it has requests, and the compiled
step programs are one per size: log2(max_running) + 1 of them, never more. An empty lane is
dropped (its memory freed) and made again at size 1 when a request comes.

Each lane turns its step's report into per-request events: response tokens and the finish.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.state import ModelState
from decoding.controls import TokenIds
from decoding.engine import autoregressive_lane, diffusion_lane, speculative_lane
from decoding.engine.requests import LaneKey, PreparedRequest
from decoding.engine.slots import at_rows, capacity_bucket, empty_staging, put_slots, stack_entries, take_slots
from decoding.modes import Mode, strategy
from decoding.streaming import response_slice

logger = logging.getLogger(__name__)

# A lane of fewer slots keeps its size until it is empty: halving it would save little and cost a
# program per size visited as requests finish one by one.
SHRINK_FROM = 8


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """What every lane reads of the model (the engine builds it once)."""

    passes: Any
    params: Any
    vocab: int
    ids: TokenIds
    eos: frozenset
    coreset: bool
    coreset_top_p: np.float32
    max_slots: int
    lone_commits: bool = False          # diffusion: a slot committing alone runs apart (`diffusion_lane._commit_pass`)


@dataclasses.dataclass
class Tracked:
    """A request the engine holds, on the host."""

    number: int
    prepared: PreparedRequest
    listener: Any
    emitted: int = 0                    # response tokens reported
    blocks: int = 0                     # diffusion: decoded blocks closed
    steps_per_block: list = dataclasses.field(default_factory=list)
    nfe: int = 0
    commits: bool = False               # diffusion: its block closed; the lane's next step commits it
    rows: int = 0                       # cache rows it needs: padding + prompt + response (+ a draft)
    lane: LaneKey | None = None         # set when it joins a lane
    done: bool = False                  # its last event was delivered
    cached: int = 0                     # prompt tokens restored from the prefix cache
    boundary: Any = None                # with a prefix cache: `prefix_cache.Boundary`


@dataclasses.dataclass
class Outcome:
    """What one step did for one request: tokens to report, and the finish reason if it ended."""

    tracked: Tracked
    tokens: list[int]
    finish: str | None
    logprobs: list | None = None  # diffusion, when the request asked: one (logprob, top ids, top logprobs) per token


class Lane:
    """Slot bookkeeping shared by the three kinds; subclasses make entries and read reports.

    The lane's shape is (slots, cache rows per slot), both powers of two: slots follow the live
    requests (doubling when full; from SHRINK_FROM slots up, halving when no more than a quarter
    are live), rows follow the largest need among them (growing when a longer request joins,
    shrinking when the longest left needs a quarter or less), so a step costs about what its
    requests need, and a steady load keeps one shape."""

    def __init__(self, context: ModelContext, key: LaneKey, max_context: int):
        self.context, self.key, self.max_context = context, key, max_context
        self.slots: Any = None              # the device state
        self.occupants: list[Tracked | None] = []
        self.capacity = 0                   # cache rows per slot

    # ------------------------------------------------------------------ shape
    @property
    def size(self) -> int:
        return len(self.occupants)

    @property
    def live(self) -> int:
        return sum(occupant is not None for occupant in self.occupants)

    def alive(self) -> np.ndarray:
        return np.array([occupant is not None for occupant in self.occupants])

    def rows_for(self, rows: int) -> int:
        return capacity_bucket(rows, self.max_context)

    def _reshape(self, size: int, capacity: int) -> None:
        """Move the live slots to the front of a lane of `size` slots of `capacity` rows."""
        live = [slot for slot, occupant in enumerate(self.occupants) if occupant is not None]
        indices = np.array(live + [0] * (size - len(live)), np.int32)
        self.slots, self.capacity = take_slots(self.slots, indices, capacity), capacity
        self.occupants = [self.occupants[slot] for slot in live] + [None] * (size - len(live))

    def add(self, joins: list[tuple[Tracked, ModelState, jax.Array]]) -> None:
        """Join requests whose prefixes their staging states hold into free slots, in one write
        (a full lane grows once for all of them). joins: (request, staging state, last prompt
        logits) each; there are never more than the lane's free slots once it has grown to
        `max_slots` (the engine admits no more)."""
        if self.live + len(joins) > self.context.max_slots:
            raise RuntimeError(f"lane {self.key} is full ({self.size} slots)")  # the engine admits no more
        capacity = max([self.capacity] + [self.rows_for(tracked.rows) for tracked, _, _ in joins])
        # every entry at the lane's rows: the join's program then depends on the lane's shape and count alone
        entries = [at_rows(self._entry(tracked.prepared, staging, last_logits), capacity)
                   for tracked, staging, last_logits in joins]
        if self.slots is None:
            size = min(power_of_two(len(joins)), self.context.max_slots)  # a lane size `max_slots` allows
            self.slots, self.capacity = take_slots(entries[0], np.zeros(size, np.int32), capacity), capacity
            self.occupants = [None] * size
        size = self.size
        if self.live + len(joins) > size:
            size = min(power_of_two(self.live + len(joins)), self.context.max_slots)
        if capacity != self.capacity:
            self._reshape(self.size, capacity)
        while self.size < size:
            # One doubling at a time, each a resize the precompiled set holds (`Engine.precompile`
            # grows lanes by joining requests one by one): a jump, e.g. 1 -> 8 slots as seven requests
            # join a lane of one, would be a program of its own, compiled while the requests wait.
            self._reshape(min(2 * self.size, size), capacity)
        free = [slot for slot, occupant in enumerate(self.occupants) if occupant is None][:len(joins)]
        # padded to a power of two with the last join repeated (the same entry into the same slot); one
        # request joining a lane of several slots joins as two (`padded_joins`), so that a lone join
        # shares the program of two joining, which the precompile's bursts and busy joins compile anyway
        padded = padded_joins(self.size, len(joins))
        indices = np.array(free + [free[-1]] * (padded - len(joins)), np.int32)
        treedef, leaves, on_host = stack_entries(entries + [entries[-1]] * (padded - len(joins)))
        self.slots = put_slots(self.slots, indices, treedef, leaves, on_host)
        for slot, (tracked, _, _) in zip(free, joins, strict=True):
            self.occupants[slot] = tracked
            tracked.nfe = self._first_nfe(tracked.prepared)

    def _first_nfe(self, prepared: PreparedRequest) -> int:
        """The forward passes a request has run when it joins (its prefill's)."""
        raise NotImplementedError  # each kind of lane defines it

    def remove(self, tracked: Tracked) -> None:
        """Free the request's slot; the lane is resized at its next step (`fit`), once for every
        request that left since."""
        self.occupants[self.occupants.index(tracked)] = None
        if not self.live:
            self.drop()  # the memory goes back; a new request makes the lane again

    def fit(self) -> None:
        """Shrink the lane to its live requests (see the class docstring); run before a step."""
        live = self.requests()
        if not live:
            return
        size = shrunk(self.size) if self.size >= SHRINK_FROM and len(live) <= self.size // 4 else self.size
        needed = self.rows_for(max(t.rows for t in live))
        capacity = needed if needed <= self.capacity // 4 else self.capacity
        if (size, capacity) != (self.size, self.capacity):
            self._reshape(size, capacity)

    def requests(self) -> list[Tracked]:
        return [occupant for occupant in self.occupants if occupant is not None]

    def drop(self) -> None:
        self.slots, self.occupants, self.capacity = None, [], 0

    # ------------------------------------------------------------------ kind-specific
    def _entry(self, prepared: PreparedRequest, staging: ModelState, last_logits: jax.Array) -> Any:
        raise NotImplementedError  # each kind of lane defines it

    def step(self) -> list[Outcome]:
        raise NotImplementedError  # each kind of lane defines it

    def _finish(self, tracked: Tracked, tokens: list[int]) -> str:
        """"eos" when the response ended on an EOS, else "length"."""
        return "eos" if tokens and tokens[-1] in self.context.eos else "length"


class DiffusionLane(Lane):
    def __init__(self, context: ModelContext, key: LaneKey, max_context: int):
        super().__init__(context, key, max_context)
        self.layout = diffusion_lane.DiffusionLayout(key.block_size, key.steps_cap, context.coreset)

    def _entry(self, prepared, staging, last_logits):
        size = self.key.block_size
        tail = prepared.prompt[len(prepared.prompt) - len(prepared.prompt) % size:]
        config = prepared.config
        return diffusion_lane.entry(
            staging, tail, size, len(prepared.prompt), config.max_new_tokens, prepared.thinking, prepared.key,
            controls=prepared.controls, schedule=prepared.schedule, sample=config.do_sample,
            has_prefix=len(prepared.prompt) >= size, ids=self.context.ids, vocab=self.context.vocab,
            threshold=config.threshold)

    def _first_nfe(self, prepared):
        return int(len(prepared.prompt) >= self.key.block_size)

    def step(self) -> list[Outcome]:
        requests = self.requests()
        commit = any(tracked.commits for tracked in requests)
        sample = any(tracked.prepared.config.do_sample for tracked in requests)
        # the log-probability program runs only while a request in the lane asks for them
        scores = any(tracked.prepared.logprobs is not None for tracked in requests)
        self.slots, report = diffusion_lane.diffusion_step(
            self.context.passes, self.context.params, self.layout, self.slots, self.alive(),
            self.context.coreset_top_p, self.context.ids, commit=commit, sample=sample, scores=scores,
            lone_commits=self.context.lone_commits)
        closing, finished, blocks, steps, nfe, logprob, top_ids, top_values = jax.device_get(report)
        outcomes = []
        for slot, tracked in enumerate(self.occupants):
            if tracked is None:
                continue
            tracked.nfe = int(nfe[slot])
            tracked.commits = bool(closing[slot] and not finished[slot])  # the next step commits the block
            tokens, finish, logprobs = [], None, None
            if closing[slot]:
                size = self.key.block_size
                first_row = len(tracked.prepared.prompt) % size if tracked.blocks == 0 else 0
                tokens, _ = response_slice(blocks[slot], first_row, tracked.prepared.max_new_tokens - tracked.emitted,
                                           self.context.eos)
                tracked.blocks += 1
                tracked.steps_per_block.append(int(steps[slot]))
                top = tracked.prepared.logprobs
                if top is not None:
                    rows = range(first_row, first_row + len(tokens))
                    logprobs = [(float(logprob[slot, r]), top_ids[slot, r, :top].tolist(),
                                 top_values[slot, r, :top].tolist()) for r in rows]
            if finished[slot]:
                finish = self._finish(tracked, tokens)
            if tokens or finish:
                outcomes.append(Outcome(tracked, tokens, finish, logprobs))
        return outcomes


class AutoregressiveLane(Lane):
    def _entry(self, prepared, staging, last_logits):
        config = prepared.config
        return autoregressive_lane.entry(model_state=staging, last_logits=last_logits,
                                         max_new_tokens=config.max_new_tokens, thinking=prepared.thinking,
                                         key=prepared.key, controls=prepared.controls, sample=config.do_sample,
                                         vocab=self.context.vocab)

    def _first_nfe(self, prepared):
        return 1

    def step(self) -> list[Outcome]:
        alive = self.alive()
        sample = any(o is not None and o.prepared.config.do_sample for o in self.occupants)
        self.slots, report = autoregressive_lane.autoregressive_step(
            self.context.passes, self.context.params, self.slots, alive, self.context.ids, sample=sample)
        token, finished, nfe = jax.device_get(report)
        outcomes = []
        for slot, tracked in enumerate(self.occupants):
            if tracked is not None:
                tracked.nfe = int(nfe[slot])
                tracked.steps_per_block.append(1)
                tokens = [int(token[slot])]
                outcomes.append(Outcome(tracked, tokens, self._finish(tracked, tokens) if finished[slot] else None))
        return outcomes


class SpeculativeLane(Lane):
    def _entry(self, prepared, staging, last_logits):
        return speculative_lane.entry(staging, prepared.prompt[-1], prepared.config.max_new_tokens, prepared.thinking,
                                      prepared.controls, len(prepared.prompt) > 1, self.context.vocab)

    def _first_nfe(self, prepared):
        return int(len(prepared.prompt) > 1)

    def step(self) -> list[Outcome]:
        alive = self.alive()
        self.slots, report = speculative_lane.speculative_step(
            passes=self.context.passes, params=self.context.params, block_size=self.key.block_size,
            coreset=self.context.coreset, slots=self.slots, alive=alive, coreset_top_p=self.context.coreset_top_p,
            ids=self.context.ids)
        choices, emitted, finished, nfe = jax.device_get(report)
        outcomes = []
        for slot, tracked in enumerate(self.occupants):
            if tracked is not None:
                tracked.nfe = int(nfe[slot])
                tracked.steps_per_block.append(1)
                tokens = [int(t) for t in choices[slot, :int(emitted[slot])]]
                outcomes.append(Outcome(tracked, tokens, self._finish(tracked, tokens) if finished[slot] else None))
        return outcomes


LANES = {Mode.DIFFUSION: DiffusionLane, Mode.AUTOREGRESSIVE: AutoregressiveLane,
         Mode.SELF_SPECULATIVE: SpeculativeLane}


def prefix_length(key: LaneKey, prompt_length: int) -> int:
    """Prompt tokens a request prefills before it joins its lane (`ModeStrategy.prefix_length`)."""
    return strategy(key.mode).prefix_length(prompt_length, key.block_size)


def power_of_two(count: int) -> int:
    """The lane size `count` requests grow a lane to (before the cap at `max_slots`)."""
    return 1 << max(count - 1, 0).bit_length()


def padded_joins(size: int, joining: int) -> int:
    """The entries `Lane.add` writes for `joining` requests into a lane of `size` slots (after any
    growth): their count padded to a power of two, and at least two in a lane of several slots."""
    return power_of_two(joining) if size == 1 else max(2, power_of_two(joining))


def shrunk(size: int) -> int:
    """The size a lane of `size` slots halves to (`Lane.fit`): a power of two, so that a lane of a
    `max_slots` that is none (e.g. 12 -> 8) shrinks to a lane size the precompiled set steps."""
    return power_of_two(size // 2)


def new_staging(context: ModelContext, capacity: int, padding: int) -> ModelState:
    state = empty_staging(context.passes, capacity, jnp.full((1,), padding, jnp.int32))
    # committed to its devices, as a prefilled state is (it comes from the parameters): an uncommitted
    # one made the lanes' join, resize and step compile a second program for prompts with no prefix
    return jax.tree_util.tree_map(lambda leaf: jax.device_put(leaf, leaf.sharding), state)
