"""The shapes of the serving engine, fixed for its life: they are what its programs are compiled for.

| shape          | what it is                                                          | default                      |
|----------------|---------------------------------------------------------------------|------------------------------|
| slots          | requests held at once, each with a GDN state slot                   | `max_running`                |
| page_size      | positions per K/V page                                              | 16 (what divides the grid)   |
| pages_per_slot | the page table's width: `max_context` positions                     |                              |
| num_pages      | the K/V pool                                                        | `pool_pages`                 |
| max_block      | the widest block a request may decode with                          | the largest of `block_sizes` |
| max_tokens     | the most tokens of one pass: a prefill chunk (or one slot's work)   | the prefill budget           |
| paddings       | the token counts a pass is padded to: one forward program each      | `token_paddings`             |

A pass's token count is padded to the smallest padding that holds it: powers of two from 16 and
the halfway points between them (16, 24, 32, 48, ...), so a pass computes at most a third more
rows than it holds, and the programs holding a forward pass are `len(paddings)` — the same for
one mode or three, one block size or three, a context of 4K or 128K.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from clover_jax.core.ragged import page_bytes
from pallas_kernels.gdn_chunk_size import CHUNK_SIZE

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16
SMALLEST_PADDING = 16
# Of the device memory left free after the weights, the most the default pool takes (the rest: the
# pass's activations and logits, the GDN states, the prefix cache's states).
POOL_SHARE_OF_FREE = 0.6


def token_paddings(max_tokens: int, smallest: int = SMALLEST_PADDING) -> tuple[int, ...]:
    """Powers of two from `smallest` and 1.5 times each, up to the first that holds `max_tokens`."""
    paddings, size = [], smallest
    while True:
        for candidate in (size, size + size // 2):
            paddings.append(candidate)
            if candidate >= max_tokens:
                return tuple(paddings)
        size *= 2


def max_pass_tokens(*, max_block: int, prefill_budget: int) -> int:
    """The most tokens one pass holds: a prefill chunk of the budget, and at least one slot's widest
    decoding work (a commit and a block of the widest size, or a self-speculative round's pending
    tokens and draft: 2·Bmax + 1). When the running requests' work exceeds it (many slots, wide
    blocks), the slots left out run first in the next pass; the largest padding, and with it the
    programs, depends on the prefill budget alone."""
    return max(2 * max_block + 1, prefill_budget)


def free_device_bytes() -> int | None:
    """Bytes free on the first local device (None where the platform does not say: a CPU)."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a platform without memory statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def pool_pages(*, slots: int, pages_per_slot: int, page_size_bytes: int, prefix_cache_bytes: int,
               free_bytes: int | None) -> int:
    """The default pool: a page for every position of every slot at the full context, and the prefix
    cache's budget in pages up to as many again (the cache keeps what finished requests leave in
    pages of the pool, and gives them back when running requests need them), plus the page padding
    rows write to — at most `POOL_SHARE_OF_FREE` of the device memory free after the weights where
    the device says, and never fewer than one request at the full context needs."""
    running = slots * pages_per_slot
    wanted = running + min(prefix_cache_bytes // page_size_bytes, running) + 1
    if free_bytes is None:
        return wanted
    affordable = int(free_bytes * POOL_SHARE_OF_FREE) // page_size_bytes
    if affordable < wanted:
        logger.warning("the K/V pool holds %d pages (%.2f GiB, %.0f%% of the free device memory), not the %d that "
                       "every slot at the full context would take: requests wait for pages beyond it", affordable,
                       affordable * page_size_bytes / 2**30, 100 * POOL_SHARE_OF_FREE, wanted)
    return max(min(wanted, affordable), pages_per_slot + 1)


@dataclasses.dataclass(frozen=True)
class EngineShapes:
    slots: int
    max_context: int
    block_sizes: tuple[int, ...]
    page_size: int
    pages_per_slot: int
    num_pages: int
    prefill_budget: int
    max_tokens: int
    paddings: tuple[int, ...]
    chunk: int = CHUNK_SIZE  # rows of a GDN chunk in a pass (`clover_jax.core.ragged.chunk_shape`)

    @property
    def max_block(self) -> int:
        return max(self.block_sizes)

    @property
    def logit_width(self) -> int:
        """Logit rows per slot: a self-speculative draft's pending row and block."""
        return self.max_block + 1

    def padding_for(self, rows: int) -> int:
        for padding in self.paddings:
            if padding >= rows:
                return padding
        raise ValueError(f"a pass of {rows} tokens exceeds the engine's largest ({self.paddings[-1]})")

    def balanced_prefill(self, decoding_rows: int, *, floor: int) -> int:
        """Prompt rows a pass takes beside `decoding_rows` rows of running requests where a pass
        costs about its padded rows (a CPU): the rest of the padding that twice their rows pad to
        (at least `floor`), so their step costs at most about twice a step without the prompt and
        the padding rows the pass pays for anyway carry prompt."""
        doubled = self.padding_for(min(2 * decoding_rows, self.paddings[-1]))
        return max(floor, doubled - decoding_rows)

    @classmethod
    def make(cls, model, *, max_running: int, max_context: int, block_sizes: tuple[int, ...], prefill_budget: int,
             kv_cache_bytes: int | None, page_size: int | None, grid: int | None,
             prefix_cache_bytes: int) -> "EngineShapes":
        """The shapes for `model` (its config and dtype) and the engine's settings; ValueError for
        settings that cannot work. grid: the prefix cache's (None: no cache)."""
        if page_size is None:
            page_size = math.gcd(DEFAULT_PAGE_SIZE, grid) if grid else DEFAULT_PAGE_SIZE
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if grid and grid % page_size:
            raise ValueError(f"the prefix cache's grid ({grid}) must be a multiple of the page size ({page_size})")
        if isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int) or prefill_budget < 1:
            raise ValueError(f"prefill_budget must be a positive integer, got {prefill_budget!r}")
        pages_per_slot = math.ceil(max_context / page_size)
        one_page = page_bytes(model.config, page_size, model.dtype)
        if kv_cache_bytes is None:
            num_pages = pool_pages(slots=max_running, pages_per_slot=pages_per_slot, page_size_bytes=one_page,
                                   prefix_cache_bytes=prefix_cache_bytes, free_bytes=free_device_bytes())
        else:
            num_pages = int(kv_cache_bytes) // one_page + 1
            if num_pages < pages_per_slot + 1:
                raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds {num_pages - 1} pages of {page_size} "
                                 f"positions ({one_page} bytes each); one request at max_context={max_context} "
                                 f"needs {pages_per_slot} ({pages_per_slot * one_page} bytes)")
        max_block = max(block_sizes)
        max_tokens = max_pass_tokens(max_block=max_block, prefill_budget=prefill_budget)
        return cls(slots=max_running, max_context=max_context, block_sizes=tuple(block_sizes), page_size=page_size,
                   pages_per_slot=pages_per_slot, num_pages=num_pages, prefill_budget=prefill_budget,
                   max_tokens=max_tokens, paddings=token_paddings(max_tokens))
