"""The engine's prefix cache: prompt prefixes whose state a later request starts from.

Agent harnesses resend the whole growing transcript every turn; without a cache, turn k prefills
all of it again. The cache keeps what a prefill (or a finished request) leaves, keyed by the
tokens that produced it:

- a trie of *grid chunks*: node d holds the K/V pages of tokens [(d-1)·G, d·G) (G = `grid`
  tokens, a whole number of pages), shared by reference with the requests that wrote or read
  them (`decoding.engine.pages`): K/V is kept once for every cached token, never copied, and
  prompts that share a beginning share its nodes;
- GDN conv and recurrent states only where a prefill ended a prompt's last grid boundary, or a
  request's state stood on one (a recurrent state sums every row before it, so it cannot be cut
  out of a longer one).

A request restores the deepest node on its tokens' path that holds GDN states and lies within
its `limit` (its own causal prefix): its page table starts with that path's pages and its slot's
GDN states are the node's; it then prefills only the rest. Every byte held is counted (pages at
their size in the pool, GDN states at theirs); past `budget` bytes the least recently stored or
restored GDN states go first, and with them the chunks that no kept state needs any more (their
pages go back to the pool when no request holds them either). The engine also evicts when the
pool has no free page for a running request.

The engine calls from its own thread; a lock guards the counters read from others.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
from typing import Any, Callable, Sequence

import jax

from clover_jax.core.ragged import PagedState
from clover_jax.core.state import GDNState
from decoding.serving_defaults import DEFAULT_GRID, DEFAULT_PREFIX_CACHE_BYTES

__all__ = ["DEFAULT_GRID", "DEFAULT_PREFIX_CACHE_BYTES", "Boundary", "Hit", "PrefixCache"]

logger = logging.getLogger(__name__)


def _nbytes(tree: Any) -> int:
    return sum(int(leaf.size) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


class _Node:
    """One grid chunk of a cached prefix (the root holds nothing); `used`: when its GDN states were
    last stored or restored."""

    __slots__ = ("parent", "chunk", "children", "pages", "gdn", "gdn_bytes", "used")

    def __init__(self, parent: "_Node | None", chunk: tuple[int, ...], pages: tuple[int, ...]):
        self.parent, self.chunk, self.pages = parent, chunk, pages
        self.children: dict[tuple[int, ...], _Node] = {}
        self.gdn: Any = None
        self.gdn_bytes = 0
        self.used = 0


@dataclasses.dataclass(frozen=True)
class Hit:
    """A lookup's answer: `length` cached tokens (a multiple of the grid); `pages` the K/V pages of
    every node on the way, in position order (each retained once for the request); `gdn` the GDN
    states at `length` ({layer: GDNState without a slot axis})."""

    length: int
    pages: tuple[int, ...]
    gdn: Any


class PrefixCache:
    """budget: bytes the cache may hold (>= 1); grid: tokens per chunk (>= 1, a multiple of the
    pool's page size); pool: the engine's `PagePool`; page_bytes: the bytes of one page.

    Eviction is least recently used over the kept GDN states (each a point a request can restore):
    the oldest goes first, and then every chunk that no kept state below it needs."""

    def __init__(self, budget: int, grid: int = DEFAULT_GRID, *, pool, page_size: int, page_bytes: int):
        for name, value in (("budget", budget), ("grid", grid)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prefix cache {name} must be an integer >= 1, got {value!r}")
        if grid % page_size:
            raise ValueError(f"the prefix cache's grid ({grid}) must be a multiple of the page size ({page_size})")
        self.budget, self.grid, self.pool = budget, grid, pool
        self.page_size, self.page_bytes = page_size, page_bytes
        self._root = _Node(None, (), ())
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

    @property
    def pages_per_chunk(self) -> int:
        return self.grid // self.page_size

    # ------------------------------------------------------------------ lookups
    def lookup(self, tokens: Sequence[int], limit: int) -> Hit | None:
        """The longest kept prefix of `tokens` of at most `limit` tokens, or None; its pages are
        retained for the caller (who releases them with its own)."""
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
            pages = tuple(page for held in path[:best] for page in held.pages)
            self.pool.retain(pages)
            return Hit(best * self.grid, pages, found.gdn)

    # ------------------------------------------------------------------ stores
    def store(self, tokens: Sequence[int], length: int, pages: Sequence[int], gdn: Callable[[], Any]) -> None:
        """Keep the prefix `tokens[:length]` (`length` a multiple of the grid) whose K/V `pages`
        hold (in position order, at least `length` positions' worth): a chunk not yet held keeps
        its pages (retained), `gdn()` gives the GDN states at `length` (called only when that
        node holds none). Then evicts down to the budget."""
        if length <= 0 or length % self.grid or length > len(tokens):
            raise ValueError(f"a stored prefix is a positive multiple of the grid ({self.grid}) within the "
                             f"tokens ({len(tokens)}), got {length}")
        if len(pages) * self.page_size < length:
            raise ValueError(f"{len(pages)} pages of {self.page_size} positions cannot hold a prefix of {length}")
        per_chunk = self.pages_per_chunk
        with self._lock:
            node = self._root
            try:
                for depth in range(1, length // self.grid + 1):
                    chunk = tuple(tokens[(depth - 1) * self.grid:depth * self.grid])
                    child = node.children.get(chunk)
                    if child is None:
                        held = tuple(pages[(depth - 1) * per_chunk:depth * per_chunk])
                        self.pool.retain(held)
                        child = node.children[chunk] = _Node(node, chunk, held)
                        self.nbytes += len(held) * self.page_bytes
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
                self._evict(min(self._states, key=lambda kept: kept.used))

    def evict_oldest(self) -> bool:
        """Drop the least recently used kept state (and the chunks only it needed); False when the
        cache keeps none."""
        with self._lock:
            if not self._states:
                return False
            self._evict(min(self._states, key=lambda kept: kept.used))
            return True

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
            self.pool.release(node.pages)
            self.nbytes -= len(node.pages) * self.page_bytes
            self.nodes -= 1
            node = node.parent

    def clear(self) -> None:
        with self._lock:
            for node in list(self._states):
                self._evict(node)

    def held_bytes(self) -> int:
        """Bytes of every page and state the trie holds, counted afresh (the accounting's check)."""
        return self.census()["bytes"]

    def census(self) -> dict[str, int]:
        """The trie counted afresh, to check the running counts against (`nbytes`, `nodes`,
        `states`): bytes of every page and array it holds, its chunks, the chunks holding GDN
        states, and the chunks that no kept state needs (a leaf without states: eviction should
        have dropped it)."""
        with self._lock:
            counts = {"bytes": 0, "nodes": 0, "states": 0, "unneeded": 0, "pages": 0}
            stack = list(self._root.children.values())
            while stack:
                node = stack.pop()
                counts["bytes"] += len(node.pages) * self.page_bytes + (_nbytes(node.gdn) if node.gdn else 0)
                counts["pages"] += len(node.pages)
                counts["nodes"] += 1
                counts["states"] += node.gdn is not None
                counts["unneeded"] += node.gdn is None and not node.children
                stack.extend(node.children.values())
            return counts


@dataclasses.dataclass
class Boundary:
    """What the engine follows of a decoding request for the cache: the GDN states of its slot at
    `length` positions, the last grid boundary its state stood on after a pass (None: none yet)."""

    length: int = 0
    gdn: Any = None


# ---------------------------------------------------------------------- device copies
@jax.jit
def slot_gdn(state: PagedState, slot: jax.Array) -> dict[str, GDNState]:
    """One slot's GDN states, without the slot axis (copies)."""
    return {name: GDNState(layer.conv[:, slot], layer.recurrent[:, slot])
            for name, layer in state.layers.items() if isinstance(layer, GDNState)}


@functools.partial(jax.jit, donate_argnames=("state",))
def put_slot_gdn(state: PagedState, slot: jax.Array, gdn: dict[str, GDNState]) -> PagedState:
    """`state` with slot `slot`'s GDN states replaced by `gdn` (a prefix's kept states)."""
    layers = dict(state.layers)
    for name, layer in state.layers.items():
        if isinstance(layer, GDNState):
            new = gdn[name]
            layers[name] = GDNState(layer.conv.at[:, slot].set(new.conv.astype(layer.conv.dtype)),
                                    layer.recurrent.at[:, slot].set(new.recurrent))
    return PagedState(layers)


@functools.partial(jax.jit, donate_argnames=("state",))
def clear_slots_gdn(state: PagedState, indices: jax.Array) -> PagedState:
    """`state` with the GDN states of slots `indices` (int32 [S]; S, past the last slot, marks an
    unused entry) zeroed: the empty prefix of the requests admitted at one step boundary."""
    layers = dict(state.layers)
    for name, layer in state.layers.items():
        if isinstance(layer, GDNState):
            layers[name] = GDNState(layer.conv.at[:, indices].set(0, mode="drop"),
                                    layer.recurrent.at[:, indices].set(0, mode="drop"))
    return PagedState(layers)
