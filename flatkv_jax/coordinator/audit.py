"""Host-side audit of a cache state: page counts and the invariants of docs/semantics.md.

These read the whole state back to NumPy (O(pool + table size)); they are for tests,
differential comparison with the radix oracle, and debugging — never for the serving loop.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flatkv_jax.coordinator.state import CacheState, table
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import lru as lru_lib


class StateInvariantError(AssertionError):
    """A cache state broke an invariant of docs/semantics.md (a library bug, not bad input)."""


@dataclasses.dataclass(frozen=True)
class PoolCounts:
    """Per-pool page accounting: ``free + in_use + cached_only == total`` (usable pages)."""

    free: int
    in_use: int
    cached_only: int
    total: int


def table_references(plan: CachePlan, state: CacheState) -> list[np.ndarray]:
    """Per group, ``int64[num_pages]``: live table entries pointing at each page."""
    out = []
    for gi, g in enumerate(plan.groups):
        t = np.asarray(table(plan, state, gi))
        out.append(np.bincount(t[t > 0].ravel(), minlength=plan.pages(g)))
    return out


def pool_arrays(plan: CachePlan, state: CacheState, g: int) -> tuple[np.ndarray, int, np.ndarray]:
    """Pool ``g``'s free stack (``int32[top]``), ``top`` and refcounts, as NumPy."""
    view = state.pools[g]
    top = int(view.top)
    return np.asarray(view.free_ids)[:top], top, np.asarray(view.refcount)


def page_counts(plan: CachePlan, state: CacheState) -> dict[str, PoolCounts]:
    """Free / in-use / cached-only pages of every pool, keyed by group name."""
    refs = table_references(plan, state)
    out = {}
    for gi, (g, ref) in enumerate(zip(plan.groups, refs, strict=True)):
        _, top, rc = pool_arrays(plan, state, gi)
        in_use = int(np.count_nonzero(ref))
        cached = int(np.count_nonzero((rc > 0) & (ref == 0)))
        out[g.name] = PoolCounts(top, in_use, cached, plan.usable_pages(g))
    return out


def request_pages(plan: CachePlan, state: CacheState, slot: int) -> dict[str, list[int]]:
    """The pages request ``slot`` holds per group (table entries >= 1, in slot order)."""
    return {
        g.name: [int(x) for x in np.asarray(table(plan, state, gi)[slot]) if x > 0]
        for gi, g in enumerate(plan.groups)
    }


def check_state(plan: CachePlan, state: CacheState, *, shared_ok: bool = False) -> None:
    """Raises :class:`StateInvariantError` if ``state`` breaks an invariant.

    Checks, per pool: the free stack holds distinct usable pages; free + in use + cached-only
    == usable; refcount == table references + index references; the index holds
    ``index.count`` distinct pages, each at the slot ``slot_of_page`` says; the LRU's cached
    pages are exactly the indexed pages without table references, and ``lru.count`` counts
    them; no pin is left set; no
    table entry points at a free page, the null page or the scratch page; no page is in two
    requests' tables unless ``shared_ok``. Per request slot: a free slot's rows are all -1
    and its counters are 0; a live slot has ``c <= n``, a FIFO no deeper than ``fifo_depth``
    and rows shaped ``0 * lo, pages * (hi - lo), -1 * rest`` with ``hi`` covering ``n``; a
    slot marked ``admit_hashed`` is live, keyed, and its admission's step is the FIFO's
    unretired head (``fifo_head == 0``, ``fifo_start[s, 0] == c``).
    """

    def bad(msg: str):
        raise StateInvariantError(msg)

    refs = table_references(plan, state)
    live = np.asarray(state.live)
    n, c = np.asarray(state.extent), np.asarray(state.committed)
    flen, pend = np.asarray(state.fifo_len), np.asarray(state.pending)
    lo_all, hi_all = np.asarray(state.lo), np.asarray(state.hi)
    # The prefix sets on the host once; each group's view is then a few NumPy slices.
    index_host = jax.tree.map(np.asarray, state.index) if state.prefix else None
    lru_host = jax.tree.map(np.asarray, state.lru) if state.prefix else None
    for gi, (g, ref) in enumerate(zip(plan.groups, refs, strict=True)):
        usable = plan.usable_pages(g)
        top = int(state.allocator.top[gi])
        if not 0 <= top <= usable:
            bad(f"{g.name}: top={top} outside [0, {usable}]")
        free, top, rc = pool_arrays(plan, state, gi)
        if len(np.unique(free)) != top or (top and (free.min() < 1 or free.max() > usable)):
            bad(f"{g.name}: free stack holds duplicates or reserved pages")
        if rc[0] or rc[-1]:
            bad(f"{g.name}: the null or scratch page has a refcount")
        indexed = np.zeros(plan.pages(g), np.int64)
        if state.prefix:
            ix = index_lib.view(index_host, gi)
            ipages = np.asarray(ix.pages).reshape(-1)
            sop = np.asarray(ix.slot_of_page)
            np.add.at(indexed, ipages[ipages > 0], 1)
            if indexed.max(initial=0) > 1 or int(ix.count) != int(np.count_nonzero(indexed)):
                bad(f"{g.name}: the index holds a page twice or its count is wrong")
            if np.any((sop >= 0) != (indexed > 0)) or np.any(
                ipages[sop[indexed > 0]] != np.flatnonzero(indexed > 0)
            ):
                bad(f"{g.name}: slot_of_page disagrees with the index entries")
            if indexed[0] or indexed[-1]:
                bad(f"{g.name}: the index holds the null or scratch page")
        if not np.array_equal(rc, ref + indexed):
            p = int(np.argmax(rc != ref + indexed))
            bad(
                f"{g.name}: page {p} refcount {rc[p]} != table references {ref[p]}"
                f" + index references {indexed[p]}"
            )
        if state.prefix:
            lr = lru_lib.view(lru_host, gi)
            cached = np.asarray(lr.cached)
            if not np.array_equal(cached, (indexed > 0) & (ref == 0)):
                bad(f"{g.name}: the LRU's cached pages are not the indexed pages without tables")
            if int(lr.count) != int(np.count_nonzero(cached)):
                bad(f"{g.name}: lru.count {int(lr.count)} != cached pages")
            if np.asarray(state.pinned).any():
                bad(f"{g.name}: a pin was left set after the call")
        if np.any(rc[free] != 0):
            bad(f"{g.name}: a free page has a refcount (a live table points at a free page)")
        held = int(np.count_nonzero(rc[1:-1]))
        if top + held != usable:
            bad(f"{g.name}: free {top} + held {held} != usable {usable}")
        if not shared_ok and ref.max(initial=0) > 1:
            bad(f"{g.name}: page {int(np.argmax(ref))} is in two requests' tables")
        t = np.asarray(table(plan, state, gi))
        if np.any(t >= plan.pages(g) - 1):
            bad(f"{g.name}: a table entry points at the scratch page or past the pool")
        lo, hi = lo_all[gi], hi_all[gi]
        for s in range(state.max_requests):
            row = t[s]
            if not live[s]:
                if np.any(row != -1) or lo[s] or hi[s]:
                    bad(f"{g.name}: free slot {s} has table entries or lo/hi")
                continue
            if not g.is_window and lo[s]:
                bad(f"{g.name}: history group has lo={lo[s]} for slot {s}")
            if (
                np.any(row[: lo[s]] != 0)
                or np.any(row[lo[s] : hi[s]] < 1)
                or np.any(row[hi[s] :] != -1)
            ):
                bad(f"{g.name}: slot {s} row is not holes/pages/-1 at lo={lo[s]} hi={hi[s]}")
            if hi[s] * g.block_tokens < n[s]:
                bad(f"{g.name}: slot {s} hi={hi[s]} does not cover extent {n[s]}")
            if g.is_window and lo[s] > max(0, g.first_read(int(c[s])) // g.block_tokens):
                bad(
                    f"{g.name}: slot {s} dropped a slot still inside the window (lo={lo[s]}, c={c[s]})"
                )
    for s in range(state.max_requests):
        if not live[s] and (n[s] or c[s] or flen[s] or pend[s]):
            bad(f"free slot {s} has counters n={n[s]} c={c[s]} fifo={flen[s]} pending={pend[s]}")
        if live[s] and not (0 <= c[s] <= n[s] and 0 <= flen[s] <= state.fifo_depth):
            bad(f"slot {s}: c={c[s]} n={n[s]} fifo_len={flen[s]}")
    # The admission's kept hashes (docs/coordinator.md, "The prefill is hashed once") belong
    # to a live request whose first step is still the FIFO's head, unretired.
    marked, keyed = np.asarray(state.admit_hashed), np.asarray(state.keyed)
    head, start = np.asarray(state.fifo_head), np.asarray(state.fifo_start)
    for s in np.flatnonzero(marked):
        if not (live[s] and keyed[s] and head[s] == 0 and flen[s] >= 1 and start[s, 0] == c[s]):
            bad(
                f"slot {s}: admit_hashed is set but the slot's first step is not the FIFO "
                f"head (live={live[s]} head={head[s]} fifo_len={flen[s]} "
                f"start={start[s, 0]} c={c[s]})"
            )
