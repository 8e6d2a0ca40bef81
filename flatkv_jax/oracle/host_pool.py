"""One host pool of the oracle: refcounts, a free list, an explicit LRU list and the contents.

Page states (docs/semantics.md): **free** (refcount 0, on the free list), **in use** (some
table references it), **cached-only** (only the prefix index references it; it sits on the
LRU list in the order it became cached-only). The pool does not know the index: the oracle
tells it which pages the index holds (:meth:`set_indexed`).
"""

from __future__ import annotations

import collections

import numpy as np

from flatkv_jax.plan import CachePlan


class HostPool:
    """Allocator and contents of one group's pool.

    Attributes:
      refcount: ``int64[num_pages]``, table references + index references.
      indexed: ``bool[num_pages]``, the prefix index holds the page.
      free: free page ids (a stack; which free page is handed out is not part of the contract).
      lru: cached-only pages, least recently released first.
      contents: per field, per layer, ``[num_pages, rows_per_page, *row]`` in the field dtype.
    """

    def __init__(self, plan: CachePlan, group: int):
        g = plan.groups[group]
        n = plan.pages(g)
        self.usable = plan.usable_pages(g)
        self.refcount = np.zeros(n, np.int64)
        self.indexed = np.zeros(n, bool)
        self.free: list[int] = list(range(n - 2, 0, -1))
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.contents = [
            [np.zeros(plan.pool_shape(g, f.name), f.format.np_dtype) for _ in g.layers]
            for f in g.fields
        ]

    def supply(self, pinned: set[int]) -> int:
        """Pages an allocation may take: free + cached-only that are not pinned."""
        return len(self.free) + sum(1 for p in self.lru if p not in pinned)

    def oldest_unpinned(self, pinned: set[int]) -> int:
        """The least recently released cached-only page that is not pinned."""
        return next(p for p in self.lru if p not in pinned)

    def take_free(self) -> int:
        """Pops a free page, zeroes it and gives it one (table) reference."""
        page = self.free.pop()
        self._zero(page)
        self.refcount[page] = 1
        return page

    def take_evicted(self, page: int) -> None:
        """Reuses cached-only ``page`` whose index entry the caller removed: zero it, one ref."""
        del self.lru[page]
        self.indexed[page] = False
        self._zero(page)
        self.refcount[page] = 1

    def evict_to_free(self, page: int) -> None:
        """Cached-only ``page``, whose index entry the caller removed, loses the index's
        reference and goes to the free list (an eviction ahead of demand)."""
        del self.lru[page]
        self.indexed[page] = False
        self.refcount[page] = 0
        self.free.append(page)

    def incref(self, page: int) -> None:
        """A table takes a reference (a prefix hit); a cached-only page is in use again."""
        self.refcount[page] += 1
        self.lru.pop(page, None)

    def decref(self, page: int) -> None:
        """A table drops a reference; the page becomes free or cached-only when none is left."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self.free.append(page)
        elif self.refcount[page] == 1 and self.indexed[page]:
            self.lru[page] = None

    def set_indexed(self, page: int) -> None:
        """The index takes a reference (publish)."""
        self.indexed[page] = True
        self.refcount[page] += 1

    def drop_index_ref(self, page: int) -> None:
        """The index lets go of ``page`` (index cleared)."""
        self.indexed[page] = False
        self.lru.pop(page, None)
        self.decref(page)

    def counts(self) -> tuple[int, int, int]:
        """``(free, in_use, cached_only)``."""
        free, cached = len(self.free), len(self.lru)
        return free, self.usable - free - cached, cached

    def _zero(self, page: int) -> None:
        for per_field in self.contents:
            for arr in per_field:
                arr[page] = 0
