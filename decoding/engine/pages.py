"""The K/V page pool on the host: which pages are free, and who holds the others.

The device holds one pool of `num_pages` pages per attention layer (`clover_jax.core.ragged`);
this class hands their indices out. A page is held by reference count: by the slot whose request
writes it, and by the prefix cache once it keeps the tokens the page holds (a cached page is
shared, read-only, by every request that starts from it). Page 0 is never handed out: rows of a
pass that belong to no request write there.

Requests *reserve* the pages they may need at admission (their prompt and every response token
they may decode) and take them one by one as their positions grow, so the pages in use follow the
tokens held, while a request admitted can never run out: reservations never exceed the pool, and
pages that only the prefix cache holds are given back (its states evicted) when the free ones run
short.
"""

from __future__ import annotations

import threading

from clover_jax.core.ragged import TRASH_PAGE


class PoolExhausted(RuntimeError):
    """No free page and nothing the prefix cache can give back (an accounting error: reservations
    should have prevented it)."""


class PagePool:
    """num_pages: pages of the device pool (page 0 included, never handed out)."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"the page pool needs at least 2 pages (one is never handed out), got {num_pages!r}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, TRASH_PAGE, -1))  # popped from the end: lowest index first
        self._references = [0] * num_pages
        self.reserved = 0           # pages promised to admitted requests (taken or not)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (all but the trash page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def can_reserve(self, pages: int) -> bool:
        return self.reserved + pages <= self.capacity

    def reserve(self, pages: int) -> None:
        with self._lock:
            if not self.can_reserve(pages):
                raise PoolExhausted(f"{pages} pages cannot be reserved: {self.reserved} of {self.capacity} already are")
            self.reserved += pages

    def unreserve(self, pages: int) -> None:
        with self._lock:
            if pages > self.reserved:
                raise RuntimeError(f"{pages} pages unreserved, but only {self.reserved} are reserved")
            self.reserved -= pages

    def take(self) -> int:
        """A free page, held once; PoolExhausted when none is free."""
        with self._lock:
            if not self._free:
                raise PoolExhausted("no free page in the K/V pool")
            page = self._free.pop()
            self._references[page] = 1
            return page

    def retain(self, pages) -> None:
        """One more holder for each of `pages`."""
        with self._lock:
            idle = [page for page in pages if self._references[page] <= 0]
            if idle:  # checked first, so that a refusal retains nothing
                raise RuntimeError(f"pages {idle} are not held: they cannot be retained")
            for page in pages:
                self._references[page] += 1

    def release(self, pages) -> None:
        """One holder fewer for each of `pages`; a page nobody holds is free again."""
        with self._lock:
            for page in pages:
                if self._references[page] <= 0:
                    raise RuntimeError(f"page {page} is released more often than it was held")
                self._references[page] -= 1
                if self._references[page] == 0:
                    self._free.append(page)

    def references(self, page: int) -> int:
        return self._references[page]
