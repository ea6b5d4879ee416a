"""The engine's prefix cache: prompt prefixes whose model state a later request starts from.

Agent harnesses resend the whole growing transcript every turn; without a cache, turn k prefills
all of it again. The cache keeps what a prefill leaves, keyed by the tokens that produced it:

- a trie of *grid chunks*: node d holds the K/V rows of tokens [(d-1)·G, d·G) of every
  attention layer (G = `grid` tokens), so K/V is kept once for every cached token, and prompts
  that share a beginning share its nodes;
- GDN conv and recurrent states only where a prefill ended a prompt's last grid boundary
  (a recurrent state sums every row before it, so it cannot be cut out of a longer one).

A request restores the deepest node on its tokens' path that holds GDN states and lies within
its `limit` (its own causal prefix), then prefills only the rest. Every byte held is counted;
past `budget` bytes the least recently stored or restored GDN states go first, and with them the
K/V chunks that no kept state needs any more.

Arrays are copies made on the device by the functions at the bottom; nothing here reads them on
the host. The engine calls from its own thread; a lock guards the counters read from others.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.state import GDNState, KVCache, ModelState
from decoding.engine.slots import empty_staging
from decoding.modes import Mode, strategy
from decoding.serving_defaults import DEFAULT_GRID, DEFAULT_PREFIX_CACHE_BYTES

__all__ = ["DEFAULT_GRID", "DEFAULT_PREFIX_CACHE_BYTES", "Hit", "PrefixCache", "cached_staging", "store_prefix"]

logger = logging.getLogger(__name__)



def _nbytes(tree: Any) -> int:
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


class _Node:
    """One grid chunk of a cached prefix (the root holds nothing); `used`: when its GDN states were
    last stored or restored."""

    __slots__ = ("parent", "chunk", "children", "kv", "gdn", "kv_bytes", "gdn_bytes", "used")

    def __init__(self, parent: "_Node | None", chunk: tuple[int, ...], kv: Any):
        self.parent, self.chunk, self.kv = parent, chunk, kv
        self.children: dict[tuple[int, ...], _Node] = {}
        self.gdn: Any = None
        self.kv_bytes, self.gdn_bytes = _nbytes(kv), 0
        self.used = 0


@dataclasses.dataclass(frozen=True)
class Hit:
    """A lookup's answer: `length` cached tokens (a multiple of the grid); `kv` the K/V chunks of
    every node on the way, in order ({layer: KVCache [groups, grid, heads, dim]} each); `gdn` the
    GDN states at `length` ({layer: GDNState without a batch axis})."""

    length: int
    kv: tuple
    gdn: Any


class PrefixCache:
    """budget: bytes of device memory the cache may hold (>= 1); grid: tokens per chunk (>= 1).

    Eviction is least recently used over the kept GDN states (each a point a request can restore):
    the oldest goes first, and then every K/V chunk that no kept state below it needs."""

    def __init__(self, budget: int, grid: int = DEFAULT_GRID):
        for name, value in (("budget", budget), ("grid", grid)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prefix cache {name} must be an integer >= 1, got {value!r}")
        self.budget, self.grid = budget, grid
        self._root = _Node(None, (), {})
        self._states: set[_Node] = set()   # the nodes that hold GDN states
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self.nbytes = 0          # bytes held
        self.nodes = 0           # grid chunks held
        self.hits = 0            # lookups that restored something
        self.hit_tokens = 0      # tokens restored, all lookups together
        self.evicted = 0         # kept states evicted

    @property
    def states(self) -> int:
        return len(self._states)

    # ------------------------------------------------------------------ lookups
    def lookup(self, tokens: Sequence[int], limit: int) -> Hit | None:
        """The longest kept prefix of `tokens` of at most `limit` tokens, or None."""
        with self._lock:
            node, path, best = self._root, [], 0
            for depth in range(1, min(limit, len(tokens)) // self.grid + 1):
                node = node.children.get(tuple(tokens[(depth - 1) * self.grid:depth * self.grid]))
                if node is None:
                    break
                path.append(node)
                if node.gdn is not None:
                    best = depth
            if best == 0:
                return None
            found = path[best - 1]
            found.used = next(self._clock)
            self.hits += 1
            self.hit_tokens += best * self.grid
            return Hit(best * self.grid, tuple(n.kv for n in path[:best]), found.gdn)

    # ------------------------------------------------------------------ stores
    def store(self, tokens: Sequence[int], length: int, kv_rows: Callable[[int], Any], gdn: Callable[[], Any]) -> None:
        """Keep the prefix `tokens[:length]` (`length` a multiple of the grid): `kv_rows(row)` gives
        the K/V of rows [row, row + grid) of a node not yet held, `gdn()` the GDN states at `length`
        (called only when that node holds none). Then evicts down to the budget."""
        if length <= 0 or length % self.grid or length > len(tokens):
            raise ValueError(f"a stored prefix is a positive multiple of the grid ({self.grid}) within the "
                             f"tokens ({len(tokens)}), got {length}")
        with self._lock:
            node = self._root
            try:
                for depth in range(1, length // self.grid + 1):
                    chunk = tuple(tokens[(depth - 1) * self.grid:depth * self.grid])
                    child = node.children.get(chunk)
                    if child is None:
                        child = node.children[chunk] = _Node(node, chunk, kv_rows((depth - 1) * self.grid))
                        self.nbytes += child.kv_bytes
                        self.nodes += 1
                    node = child
                if node.gdn is None:
                    states = gdn()
                    node.gdn, node.gdn_bytes = states, _nbytes(states)
                    self.nbytes += node.gdn_bytes
                    self._states.add(node)
            except BaseException:
                self._prune(node)  # the chunks this store added, now needed by no kept state
                raise
            node.used = next(self._clock)
            while self.nbytes > self.budget and self._states:
                self._evict(min(self._states, key=lambda held: held.used))

    def _evict(self, node: _Node) -> None:
        """Drop a node's GDN states, then every chunk above it that no kept state needs any more."""
        node.gdn, self.nbytes, node.gdn_bytes = None, self.nbytes - node.gdn_bytes, 0
        self._states.discard(node)
        self.evicted += 1
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Drop `node` and the chunks above it while no kept state needs them."""
        while node is not self._root and not node.children and node.gdn is None:
            del node.parent.children[node.chunk]
            self.nbytes -= node.kv_bytes
            self.nodes -= 1
            node = node.parent

    def clear(self) -> None:
        with self._lock:
            self._root.children.clear()
            self._states.clear()
            self.nbytes = self.nodes = 0

    def held_bytes(self) -> int:
        """Bytes of every array the trie holds, counted afresh (the accounting's check)."""
        return self.census()["bytes"]

    def census(self) -> dict[str, int]:
        """The trie counted afresh, to check the running counts against (`nbytes`, `nodes`,
        `states`): bytes of every array it holds, its chunks, the chunks holding GDN states, and
        the chunks that no kept state needs (a leaf without states: eviction should have dropped it)."""
        with self._lock:
            counts = {"bytes": 0, "nodes": 0, "states": 0, "unneeded": 0}
            stack = list(self._root.children.values())
            while stack:
                node = stack.pop()
                counts["bytes"] += _nbytes(node.kv) + (_nbytes(node.gdn) if node.gdn is not None else 0)
                counts["nodes"] += 1
                counts["states"] += node.gdn is not None
                counts["unneeded"] += node.gdn is None and not node.children
                stack.extend(node.children.values())
            return counts


# ---------------------------------------------------------------------- device copies
@functools.partial(jax.jit, static_argnames=("rows",))
def kv_rows(state: ModelState, row: jax.Array, rows: int) -> dict[str, KVCache]:
    """Rows [row, row + rows) of a one-sequence state's K/V caches: {layer: KVCache [groups, rows, heads, dim]}."""
    def cut(a):
        return jax.lax.dynamic_slice_in_dim(a[:, 0], row, rows, axis=1)
    return {name: KVCache(cut(layer.key), cut(layer.value))
            for name, layer in state.layers.items() if isinstance(layer, KVCache)}


@jax.jit
def gdn_states(state: ModelState) -> dict[str, GDNState]:
    """A one-sequence state's GDN states without the batch axis (copies)."""
    return {name: GDNState(layer.conv[:, 0], layer.recurrent[:, 0])
            for name, layer in state.layers.items() if isinstance(layer, GDNState)}


@functools.partial(jax.jit, donate_argnames=("state",))
def put_kv_rows(state: ModelState, kv: dict[str, KVCache], row: jax.Array) -> ModelState:
    """`state` (one sequence) with K/V rows [row, row + chunk rows) replaced by `kv`."""
    layers = dict(state.layers)
    for name, chunk in kv.items():
        layer = layers[name]
        put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part[:, None].astype(full.dtype), row,
                                                                     axis=2)
        layers[name] = KVCache(put(layer.key, chunk.key), put(layer.value, chunk.value))
    return state._replace(layers=layers)


@functools.partial(jax.jit, donate_argnames=("state",))
def put_gdn(state: ModelState, gdn: dict[str, GDNState], length: jax.Array) -> ModelState:
    """`state` (one sequence) holding `gdn` and filled to `length` rows."""
    layers = dict(state.layers)
    for name, layer in gdn.items():
        layers[name] = GDNState(layer.conv[:, None].astype(layers[name].conv.dtype), layer.recurrent[:, None])
    return state._replace(layers=layers, length=jnp.asarray(length, state.length.dtype).reshape(state.length.shape))


def restore(state: ModelState, hit: Hit, grid: int) -> ModelState:
    """An empty one-sequence state (no left padding) holding `hit`'s prefix."""
    for index, kv in enumerate(hit.kv):
        state = put_kv_rows(state, kv, jnp.int32(index * grid))
    return put_gdn(state, hit.gdn, jnp.int32(hit.length))


def binary_plan(count: int, chunk: int) -> list[int]:
    """Prefill chunk lengths covering `count` tokens: whole `chunk`s, then the binary digits of the
    rest, largest first (so the lengths ever compiled are powers of two up to `chunk`, when it is one)."""
    sizes = [chunk] * (count // chunk)
    rest = count % chunk
    return sizes + [1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


# ---------------------------------------------------------------------- the engine's use
def reuse_limit(prepared) -> int:
    """The most cached tokens a request may start from: its causal prefix (diffusion: the whole
    prompt blocks, floor(P/B)·B; self-speculative: all but the pending last token), less one for
    autoregressive decoding, whose first token is chosen from the last prompt row's logits."""
    prefix = strategy(prepared.mode).prefix_length(len(prepared.prompt), prepared.lane.block_size)
    return prefix - int(prepared.mode == Mode.AUTOREGRESSIVE)


def cached_staging(cache: PrefixCache, context, prepared, ids: np.ndarray, rows: int,
                   chunk: int) -> tuple[ModelState, int, int, list[int]]:
    """A request's staging state of `rows` rows, holding the longest cached prefix of its prompt
    that `reuse_limit` allows; ids: int32 [1, prefix] (no left padding). Returns (the state, rows
    it holds, the row after which the prefill's state is stored (0: none), the prefill's chunk
    lengths: up to that grid boundary, then the rest)."""
    state = empty_staging(context.passes, rows, jnp.zeros((1,), jnp.int32))
    hit = cache.lookup(prepared.prompt, reuse_limit(prepared))
    start = 0
    if hit is not None:
        state, start = restore(state, hit, cache.grid), hit.length
    total = ids.shape[1]
    boundary = total // cache.grid * cache.grid
    store_at = boundary if boundary > start else 0
    sizes = binary_plan(max(boundary - start, 0), chunk) + binary_plan(total - max(boundary, start), chunk)
    return state, start, store_at, sizes


def store_prefix(cache: PrefixCache, tokens: Sequence[int], length: int, state: ModelState) -> None:
    """Keep `state`'s first `length` rows (a one-sequence staging state filled to exactly `length`
    rows of `tokens`, no left padding). A failure is logged: the cache only saves work."""
    try:
        cache.store(tokens, length, kv_rows=lambda row: kv_rows(state, jnp.int32(row), cache.grid),
                    gdn=lambda: gdn_states(state))
    except Exception:
        logger.exception("storing a prefix of %d tokens in the prefix cache failed", length)


# ---------------------------------------------------------------------- finished requests
@dataclasses.dataclass
class Boundary:
    """What the engine follows of a decoding request for the cache: its response so far, the blocks
    it committed (diffusion), and its state's GDN states at `length`, the last grid boundary its
    state stood on after a step (None: none yet)."""

    response: list = dataclasses.field(default_factory=list)
    committed: int = 0
    length: int = 0
    gdn: Any = None


def state_rows(prepared, boundary: Boundary) -> int:
    """Rows a decoding request's slot state holds after a step that did not finish it (no left
    padding): the prompt and response so far (autoregressive), all but the pending last token
    (self-speculative), the prompt blocks and committed blocks (diffusion)."""
    prompt = len(prepared.prompt)
    if prepared.mode == Mode.DIFFUSION:
        size = prepared.lane.block_size
        return prompt - prompt % size + boundary.committed * size
    return prompt + len(boundary.response) - int(prepared.mode == Mode.SELF_SPECULATIVE)


def follow_step(cache: PrefixCache, lane, committing: list, outcomes: list) -> None:
    """After a lane's step: note each request's new tokens and commits, take the GDN states of a
    slot whose state now stands on a grid boundary, and keep the prefix of every request that
    finished (eos or length) at its last boundary — before the engine frees its slot."""
    for tracked in committing:
        tracked.boundary.committed += 1
    ended = {}
    for outcome in outcomes:
        outcome.tracked.boundary.response.extend(outcome.tokens)
        if outcome.finish is not None:
            ended[id(outcome.tracked)] = outcome.finish
    for slot, tracked in enumerate(lane.occupants):
        if tracked is None or tracked.boundary is None:
            continue
        boundary = tracked.boundary
        if id(tracked) not in ended:
            rows = state_rows(tracked.prepared, boundary)
            if rows % cache.grid == 0 and rows > boundary.length:
                boundary.length, boundary.gdn = rows, slot_gdn(lane.slots.model, jnp.int32(slot))
        elif ended[id(tracked)] in ("eos", "length") and boundary.gdn is not None:
            model, tokens = lane.slots.model, list(tracked.prepared.prompt) + boundary.response
            rows_of = functools.partial(slot_kv_rows, model, jnp.int32(slot), rows=cache.grid)
            try:
                cache.store(tokens, boundary.length, gdn=lambda boundary=boundary: boundary.gdn,
                            kv_rows=lambda row, rows_of=rows_of: rows_of(jnp.int32(row)))
            except Exception:
                logger.exception("keeping a finished request's prefix in the prefix cache failed")


@jax.jit
def slot_gdn(state: ModelState, slot: jax.Array) -> dict[str, GDNState]:
    """One slot's GDN states of a lane's state, without the slot axis (copies)."""
    return {name: GDNState(layer.conv[:, slot], layer.recurrent[:, slot])
            for name, layer in state.layers.items() if isinstance(layer, GDNState)}


@functools.partial(jax.jit, static_argnames=("rows",))
def slot_kv_rows(state: ModelState, slot: jax.Array, row: jax.Array, rows: int) -> dict[str, KVCache]:
    """Rows [row, row + rows) of one slot's K/V caches: {layer: KVCache [groups, rows, heads, dim]}."""
    def cut(a):
        return jax.lax.dynamic_slice_in_dim(jnp.take(a, slot, axis=1), row, rows, axis=1)
    return {name: KVCache(cut(layer.key), cut(layer.value))
            for name, layer in state.layers.items() if isinstance(layer, KVCache)}
