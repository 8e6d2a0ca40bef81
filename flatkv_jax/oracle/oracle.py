"""The radix oracle: a deliberately simple host implementation of docs/semantics.md.

It shares no allocation or matching code with the device coordinator: Python lists and
dicts, a token trie (:mod:`~flatkv_jax.oracle.radix`), per-pool free lists and an explicit
LRU list (:mod:`~flatkv_jax.oracle.host_pool`), compact per-request tables. Every operation
takes a batch and returns an :class:`~flatkv_jax.oracle.batches.OpResult`; rows are served
strictly in batch order. Contents live in NumPy page arrays the oracle owns and are written
through its own tables (:meth:`RadixOracle.write`), so :meth:`RadixOracle.view` shows what
every live token maps to.

Decisions where docs/semantics.md is silent are listed in docs/oracle.md ("Decisions");
the ones that shape the code are commented where they are made.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.oracle.batches import (
    Counts,
    LogicalView,
    OpResult,
    OracleAdmitBatch,
    OracleExtendBatch,
    OracleHandleBatch,
    ReleaseMode,
    empty_result,
)
from flatkv_jax.oracle.host_pool import HostPool
from flatkv_jax.oracle.radix import Node, RadixIndex
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.status import Status


@dataclasses.dataclass
class _Request:
    namespace: int
    tokens: list[int]  # tokens of positions [0, n) (prompt, then the extends' tokens)
    n: int
    c: int
    tables: list[np.ndarray]  # per group, int64[width]: -1 unallocated, 0 hole, >= 1 page
    fifo: collections.deque  # in-flight steps: [start, count, cap] (cap: tokens still valid)
    pending: ReleaseMode | None = None


class RadixOracle:
    """Host reference coordinator for one plan.

    Args:
      plan: the cache plan (pools, limits, table widths).
      fifo_depth: in-flight steps one request may have.
      max_count: most tokens one ``extend`` row (or admit's first chunk) may schedule; default
        ``max(chunk_tokens, 1 + verify_width)``.
      tail_first: LRU ties: pages one row releases in one call become cached-only from its
        highest table slot down (``True``, so a prefix's tail is evicted before its head) or
        from the lowest up (``False``). The contract is silent; see docs/oracle.md.
      prefix_reuse: ``False`` never matches and never publishes (hit 0): the contract before
        issue 5, for comparing with a coordinator that has no prefix index yet.
    """

    def __init__(
        self,
        plan: CachePlan,
        *,
        fifo_depth: int = 2,
        max_count: int | None = None,
        tail_first: bool = True,
        prefix_reuse: bool = True,
    ):
        check_plan(plan)
        self.plan = plan
        self.fifo_depth = check_positive_int("fifo_depth", fifo_depth)
        lim = plan.limits
        self.max_count = check_positive_int(
            "max_count",
            max_count if max_count is not None else lim.max_count,
        )
        self.max_extent = lim.max_context + lim.verify_width
        if not isinstance(tail_first, bool):
            fail("tail_first", tail_first, "it must be a bool", "pass True or False", exc=TypeError)
        self.tail_first = tail_first
        if not isinstance(prefix_reuse, bool):
            fail(
                "prefix_reuse",
                prefix_reuse,
                "it must be a bool",
                "pass True or False",
                exc=TypeError,
            )
        self.prefix_reuse = prefix_reuse
        self._readable: dict[tuple[int, int], bool] = {}  # (group, block) -> _hit_readable
        self.reset()

    # --- state ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empties everything: all pages free, all slots free, generations 0, index empty."""
        plan = self.plan
        self.pools = [HostPool(plan, gi) for gi in range(len(plan.groups))]
        self._dry = [False] * len(plan.groups)  # pools this call's allocation evicted from
        self.evicted_ahead = 0  # pages evicted ahead of demand so far (a statistic)
        self.index = RadixIndex()
        self.node_of: list[dict[int, Node]] = [{} for _ in plan.groups]  # page -> index node
        self.requests: list[_Request | None] = [None] * plan.limits.max_requests
        self.generation = [0] * plan.limits.max_requests

    def _req(self, slot: int, gen: int, *, allow_pending: bool = False) -> _Request | None:
        """The live request a handle names, or None (stale). A request whose release is
        deferred takes no new operations except ``retire`` (decision: they report STALE)."""
        if not 0 <= slot < len(self.requests):
            return None
        req = self.requests[slot]
        if req is None or self.generation[slot] != gen:
            return None
        if req.pending is not None and not allow_pending:
            return None
        return req

    def _rows(self, batch, *, allow_pending: bool) -> list:
        """``(row, slot, request, status)`` for the valid rows of a handle batch, in order:
        ``status`` is STALE (bad handle), BAD_ARG (a slot an earlier non-stale row of the
        batch already named) or None (go on with the op's own checks).

        Every row is judged against the state before the call (docs/semantics.md), so the
        list is built before the op changes anything: a row that defers or frees a request
        must not turn a later row naming the same slot into STALE (it is BAD_ARG).
        """
        rows, seen = [], set()
        for i in np.flatnonzero(batch.valid):
            slot = int(batch.slot[i])
            req = self._req(slot, int(batch.generation[i]), allow_pending=allow_pending)
            if req is None:
                rows.append((i, slot, None, Status.STALE))
            elif slot in seen:
                rows.append((i, slot, req, Status.BAD_ARG))
            else:
                seen.add(slot)
                rows.append((i, slot, req, None))
        return rows

    # --- allocation -------------------------------------------------------------------------
    def _take(self, gi: int, pinned: set[int]) -> int:
        """One page for a table: a free page first, else evict the LRU cached-only page."""
        pool = self.pools[gi]
        if pool.free:
            return pool.take_free()
        self._dry[gi] = True
        page = pool.oldest_unpinned(pinned)
        self.index.remove(self.node_of[gi].pop(page), gi)
        pool.take_evicted(page)
        return page

    def _evict_ahead(self, pinned: list[set[int]]) -> None:
        """``CachePlan.evict_ahead_tokens``: after an ``admit`` whose allocation evicted from
        any pool, every pool's free list is topped up to ``plan.evict_ahead_pages(g)`` pages
        with its LRU cached-only pages not pinned by the call (fewer if fewer are left)."""
        if any(self._dry):
            for gi, pool in enumerate(self.pools):
                for _ in range(self.plan.evict_ahead_pages(gi) - len(pool.free)):
                    page = next((p for p in pool.lru if p not in pinned[gi]), None)
                    if page is None:
                        break
                    self.index.remove(self.node_of[gi].pop(page), gi)
                    pool.evict_to_free(page)
                    self.evicted_ahead += 1
        self._dry = [False] * len(self.pools)

    def _new_slots(self, req: _Request, start: int, count: int) -> list[list[int]]:
        """Per group, the table slots positions ``[start, start + count)`` touch that hold no
        page yet (history and window groups alike: every touched slot is needed)."""
        out = []
        for gi, g in enumerate(self.plan.groups):
            b = g.block_tokens
            lo, hi = start // b, -(-(start + count) // b)
            out.append([i for i in range(lo, hi) if req.tables[gi][i] == -1])
        return out

    def _allocate(self, req: _Request, slots: list[list[int]], pinned: list[set[int]]) -> None:
        for gi, idx in enumerate(slots):
            for i in idx:
                req.tables[gi][i] = self._take(gi, pinned[gi])

    def _short(self, demand: list[int], supply: list[int]) -> tuple[int, int]:
        """``(first short pool, pages missing there)`` or ``(-1, 0)``."""
        for gi, (d, s) in enumerate(zip(demand, supply, strict=True)):
            if d > s:
                return gi, d - s
        return -1, 0

    def _decref_all(self, req: _Request, gi: int, idx: list[int]) -> None:
        # Decision (LRU ties): within one row, a pool's pages become cached-only from the
        # highest table slot down, so the tail of a prefix is evicted before its head.
        for i in sorted(idx, reverse=self.tail_first):
            page = int(req.tables[gi][i])
            if page >= 1:
                self.pools[gi].decref(page)

    # --- prefix index -----------------------------------------------------------------------
    def _match(
        self, namespace: int, tokens: np.ndarray, prompt_len: int
    ) -> tuple[int, list[list[tuple[int, int]]]]:
        """The prefix hit ``h`` and, per group, the ``(table slot, page)`` pairs it maps."""
        plan, gran = self.plan, self.plan.prefix_granularity
        if not self.prefix_reuse:
            return 0, [[] for _ in plan.groups]
        path = self.index.path(namespace, tokens, prompt_len - 1)

        def page(gi: int, i: int) -> int | None:
            node = path[(i + 1) * plan.groups[gi].block_tokens]
            return None if node is None else node.pages.get(gi)

        for h in range((prompt_len - 1) // gran * gran, 0, -gran):
            hits: list[list[tuple[int, int]]] = []
            for gi, g in enumerate(plan.groups):
                pages = [
                    (i, page(gi, i)) for i in range(self._run_start(g, h), h // g.block_tokens)
                ]
                if any(p is None for _, p in pages):
                    break
                hits.append(pages)
            else:
                return h, hits
        return 0, [[] for _ in plan.groups]

    @staticmethod
    def _run_start(g, h: int) -> int:
        """First block a hit at ``h`` needs: 0 for history, the trailing run for windows.

        The first position the new request computes is ``h``; what it and later positions
        read reaches back to ``h - hit_reach`` (``h - W + 1`` for a sliding window: exactly the
        blocks a request with ``c = h`` keeps after reclaim, docs/semantics.md; a group with a
        period reads less behind its boundaries), so the run starts at the block holding it.
        """
        return max(0, (h - g.hit_reach) // g.block_tokens) if g.is_window else 0

    def _hit_readable(self, gi: int, i: int) -> bool:
        """Whether some admission could read block ``i`` of group ``gi`` from the index: a
        history block always; a window block only if it lies in the trailing run of some hit
        boundary (a multiple of the plan's granularity). Found by trying the boundaries."""
        g = self.plan.groups[gi]
        if not g.is_window:
            return True
        key = (gi, i)
        if key not in self._readable:
            gran, b = self.plan.prefix_granularity, g.block_tokens
            # A boundary h needs (i + 1) * b <= h, and its run starts at or below i only
            # while h - hit_reach <= (i + 1) * b (hit_reach < W); try every multiple of gran
            # up to there.
            top = (i + 1) * b + g.window + gran
            self._readable[key] = any(
                self._run_start(g, h) <= i < h // b for h in range(gran, top, gran)
            )
        return self._readable[key]

    def _publish(self, req: _Request) -> None:
        """Registers every complete committed block not yet in the index (first key wins); a
        block whose key another page holds shares that page and frees its own copy."""
        if not self.prefix_reuse:
            return
        for gi, g in enumerate(self.plan.groups):
            b, pool = g.block_tokens, self.pools[gi]
            for i in range(req.c // b):
                page = int(req.tables[gi][i])
                if page < 1 or pool.indexed[page] or not self._hit_readable(gi, i):
                    continue
                node = self.index.node(req.namespace, req.tokens, (i + 1) * b)
                holder = node.pages.get(gi)
                if holder is not None:
                    # Same key, same tokens: the table takes the indexed page (in use again
                    # if it was cached-only) and its own copy, referenced only here, is freed.
                    pool.incref(holder)
                    req.tables[gi][i] = holder
                    pool.decref(page)
                    continue
                node.pages[gi] = page
                self.node_of[gi][page] = node
                pool.set_indexed(page)

    def clear_index(self) -> None:
        """Drops every index entry: cached-only pages become free (the sleep/wake repair)."""
        for gi, pool in enumerate(self.pools):
            for page in list(self.node_of[gi]):
                pool.drop_index_ref(page)
            self.node_of[gi].clear()
        self.index.clear()

    # --- operations -------------------------------------------------------------------------
    def admit(self, batch: OracleAdmitBatch) -> OpResult:
        """Claims slots, matches prefixes, allocates first chunks (docs/semantics.md, admit).

        Per row: IDLE, BAD_ARG (``prompt_len < 1``, ``first_chunk`` outside ``[0,
        min(prompt_len, max_count)]``), TOO_LONG (``prompt_len > max_context``), NO_SLOT,
        STEP_FULL (the call's first chunks so far pass ``step_tokens``; that row and every
        later one), OUT_OF_PAGES (the first row that does not fit and every later one), else
        OK. Each oracle call is one step of its own.
        """
        plan, res = self.plan, empty_result(batch.valid.shape[0])
        max_ctx = plan.limits.max_context
        rows = []  # (row, h, hits) of rows that pass the argument checks
        for i in np.flatnonzero(batch.valid):
            plen, chunk = int(batch.prompt_len[i]), int(batch.first_chunk[i])
            if plen < 1 or chunk < 0 or chunk > min(plen, self.max_count):
                res.status[i] = Status.BAD_ARG
            elif plen > max_ctx:
                res.status[i] = Status.TOO_LONG
            else:
                h, hits = self._match(int(batch.namespace[i]), batch.tokens[i], plen)
                rows.append((i, h, hits))
        # Every page matched by any row is pinned for the whole call (all rows matched
        # against the index as it was at the start of the call).
        pinned = [{p for _, _, hits in rows for _, p in hits[gi]} for gi in range(len(plan.groups))]
        supply = [pool.supply(pinned[gi]) for gi, pool in enumerate(self.pools)]
        # The k-th row that passed the argument checks gets the k-th lowest free slot (or
        # NO_SLOT), whether or not earlier rows were served: NO_SLOT outranks OUT_OF_PAGES.
        free_slots = [x for x, r in enumerate(self.requests) if r is None]
        stopped = False
        scheduled, step_full = 0, False  # the step budget (tokens of rows with a slot)
        for k, (i, h, hits) in enumerate(rows):
            if k >= len(free_slots):
                res.status[i] = Status.NO_SLOT
                continue
            slot = free_slots[k]
            plen = int(batch.prompt_len[i])
            count = min(int(batch.first_chunk[i]), plen - h)
            scheduled += count
            step_full = step_full or scheduled > plan.limits.step_tokens
            if step_full:
                res.status[i] = Status.STEP_FULL
                continue
            if stopped:
                res.status[i] = Status.OUT_OF_PAGES
                continue
            demand = [-(-(h + count) // g.block_tokens) - h // g.block_tokens for g in plan.groups]
            short_g, short_n = self._short(demand, supply)
            if short_g >= 0:
                res.status[i], res.short_group[i], res.short_pages[i] = (
                    Status.OUT_OF_PAGES,
                    short_g,
                    short_n,
                )
                stopped = True
                continue
            supply = [s - d for s, d in zip(supply, demand, strict=True)]
            tables = []
            for gi, g in enumerate(plan.groups):
                t = np.full(plan.table_width(g), -1, np.int64)
                if g.is_window and h:
                    t[: h // g.block_tokens] = 0  # holes before the trailing run
                for idx, page in hits[gi]:
                    t[idx] = page
                    self.pools[gi].incref(page)
                tables.append(t)
            req = _Request(
                namespace=int(batch.namespace[i]),
                tokens=[int(x) for x in batch.tokens[i, : h + count]],
                n=h,
                c=h,
                tables=tables,
                fifo=collections.deque(),
            )
            self._allocate(req, self._new_slots(req, h, count), pinned)
            if count:
                req.n = h + count
                req.fifo.append([h, count, count])
            self.requests[slot] = req
            res.status[i], res.slot[i], res.generation[i] = Status.OK, slot, self.generation[slot]
            res.hit[i], res.count[i] = h, count
        self._evict_ahead(pinned)
        return res

    def extend(self, batch: OracleExtendBatch) -> OpResult:
        """Grows tables for the next step's tokens; the first short row stops the rest.

        Per row: IDLE, STALE (incl. a pending release), BAD_ARG (repeated slot, count outside
        ``[1, max_count]`` or above the width of ``batch.tokens``), FIFO_FULL, TOO_LONG,
        STEP_FULL (the call's counts so far pass ``step_tokens``; that row and every later
        one), OUT_OF_PAGES, else OK.
        """
        res = empty_result(batch.valid.shape[0])
        supply = [pool.supply(set()) for pool in self.pools]
        stopped = False
        scheduled, step_full = 0, False
        for i, _, req, status in self._rows(batch, allow_pending=False):
            count = int(batch.count[i])
            if status is None and not 1 <= count <= min(self.max_count, batch.tokens.shape[1]):
                status = Status.BAD_ARG
            if status is not None:
                res.status[i] = status
            elif len(req.fifo) >= self.fifo_depth:
                res.status[i] = Status.FIFO_FULL
            elif req.n + count > self.max_extent:
                res.status[i] = Status.TOO_LONG
            elif step_full or scheduled + count > self.plan.limits.step_tokens:
                res.status[i], step_full = Status.STEP_FULL, True
            elif stopped:
                res.status[i] = Status.OUT_OF_PAGES
                scheduled += count  # its tokens still count (as the device's)
            else:
                slots = self._new_slots(req, req.n, count)
                demand = [len(x) for x in slots]
                short_g, short_n = self._short(demand, supply)
                scheduled += count
                if short_g >= 0:
                    res.status[i], res.short_group[i], res.short_pages[i] = (
                        Status.OUT_OF_PAGES,
                        short_g,
                        short_n,
                    )
                    stopped = True
                    continue
                supply = [x - d for x, d in zip(supply, demand, strict=True)]
                self._allocate(req, slots, [set() for _ in self.pools])
                del req.tokens[req.n :]
                req.tokens.extend(int(x) for x in batch.tokens[i, :count])
                req.fifo.append([req.n, count, count])
                req.n += count
                res.status[i], res.count[i] = Status.OK, count
        self._dry = [False] * len(self.pools)  # extends do not evict ahead
        return res

    def retire(self, batch: OracleHandleBatch) -> OpResult:
        """Commits the oldest in-flight step (``arg`` = accepted), publishes, rewinds.

        Per row: IDLE, STALE (a pending release is fine here), BAD_ARG (repeated slot),
        NO_STEP, BAD_ARG (accepted outside ``[0, count]``), DISCARDED (the step starts past
        ``c``, or a rewind cut all of it), else OK.
        """
        res = empty_result(batch.valid.shape[0])
        for i, slot, req, status in self._rows(batch, allow_pending=True):
            accepted = int(batch.arg[i])
            if status is None and not req.fifo:
                status = Status.NO_STEP
            if status is None and not 0 <= accepted <= req.fifo[0][1]:
                status = Status.BAD_ARG
            if status is not None:
                res.status[i] = status
                continue
            start, _count, cap = req.fifo.popleft()
            if start != req.c or cap == 0:
                res.status[i] = Status.DISCARDED
            else:
                res.status[i] = Status.OK
                # A rewind may have cut the step (cap < count): commit only what is left.
                req.c = start + min(accepted, cap)
                if accepted < cap:
                    req.n = req.c
                    del req.tokens[req.n :]
                if req.pending is not ReleaseMode.ABORT:
                    self._publish(req)
            if req.pending is not None and not req.fifo:
                self._free(slot, req.pending)
        return res

    def retire_reclaim(self, batch: OracleHandleBatch) -> OpResult:
        """:meth:`retire`, then :meth:`reclaim` of the rows it committed (``OK``) whose
        request it did not free (a deferred release it completed): the coordinator's
        ``retire_reclaim``. Returns the retire's result (every reclaim it runs is ``OK``)."""
        res = self.retire(batch)
        keep = np.array(
            [
                res.status[i] == Status.OK
                and self._req(int(batch.slot[i]), int(batch.generation[i]), allow_pending=True)
                is not None
                for i in range(batch.valid.shape[0])
            ],
            bool,
        )
        rec = self.reclaim(dataclasses.replace(batch, valid=keep))
        if not np.all(rec.status[keep] == Status.OK):
            raise AssertionError(f"reclaim of committed rows failed: {rec.status[keep]}")
        return res

    def rewind(self, batch: OracleHandleBatch) -> OpResult:
        """Lowers extents (``arg`` = new extent); pages are kept, in-flight steps are cut.

        Per row: IDLE, STALE (incl. a pending release), BAD_ARG (repeated slot, new extent
        outside ``[c, n]``), else OK.
        """
        res = empty_result(batch.valid.shape[0])
        for i, _, req, status in self._rows(batch, allow_pending=False):
            new = int(batch.arg[i])
            if status is None and not req.c <= new <= req.n:
                status = Status.BAD_ARG
            if status is not None:
                res.status[i] = status
                continue
            req.n = new
            del req.tokens[new:]
            for step in req.fifo:  # in-flight steps keep only their tokens below the extent
                step[2] = max(0, min(step[2], new - step[0]))
            res.status[i] = Status.OK
        return res

    def reclaim(self, batch: OracleHandleBatch) -> OpResult:
        """Window groups: slots wholly before ``GroupSpec.first_read(c)`` become holes (the
        window of position ``c``; for a group with a period, also what lies before its last
        period boundary less its carry).

        Per row: IDLE, STALE (a pending release may still reclaim), BAD_ARG (repeated slot),
        else OK.
        """
        res = empty_result(batch.valid.shape[0])
        for i, _, req, status in self._rows(batch, allow_pending=True):
            if status is not None:
                res.status[i] = status
                continue
            for gi, g in enumerate(self.plan.groups):
                if not g.is_window:
                    continue
                lo = max(0, g.first_read(req.c)) // g.block_tokens
                idx = [j for j in range(lo) if req.tables[gi][j] >= 1]
                self._decref_all(req, gi, idx)
                req.tables[gi][idx] = 0
            res.status[i] = Status.OK
        return res

    def release(self, batch: OracleHandleBatch) -> OpResult:
        """Ends requests (``arg`` = :class:`ReleaseMode`); deferred while steps are in flight.

        Per row: IDLE, STALE (incl. a release already pending), BAD_ARG (repeated slot,
        unknown mode), DEFERRED (steps in flight), else OK (published unless ABORT, freed).
        """
        res = empty_result(batch.valid.shape[0])
        for i, slot, req, status in self._rows(batch, allow_pending=False):
            mode = int(batch.arg[i])
            if status is None and mode not in tuple(ReleaseMode):
                status = Status.BAD_ARG
            if status is not None:
                res.status[i] = status
            elif req.fifo:
                req.pending = ReleaseMode(mode)
                res.status[i] = Status.DEFERRED
            else:
                self._free(slot, ReleaseMode(mode))
                res.status[i] = Status.OK
        return res

    def _free(self, slot: int, mode: ReleaseMode) -> None:
        req = self.requests[slot]
        if mode is not ReleaseMode.ABORT:
            self._publish(req)
        for gi in range(len(self.plan.groups)):
            self._decref_all(req, gi, list(range(len(req.tables[gi]))))
        self.requests[slot] = None
        self.generation[slot] += 1

    # --- contents and observation -----------------------------------------------------------
    def write(self, group: int, slots: np.ndarray, rows: np.ndarray, values) -> None:
        """Writes rows through the tables (what a model step's ``write_rows`` does).

        Args:
          group: the group index.
          slots, rows: ``int[K]``, request slot and absolute row index (``position //
            tokens_per_row``) of each row written.
          values: per field, per layer, ``[K, *row_shape]`` in the field dtype.
        """
        g = self.plan.groups[group]
        rpp = g.rows_per_page
        pages = np.array(
            [
                self.requests[int(s)].tables[group][int(j) // rpp]
                for s, j in zip(slots, rows, strict=True)
            ],
            np.int64,
        )
        if pages.size and pages.min() < 1:
            raise RuntimeError(
                f"oracle: a row of group {g.name!r} is written through a hole or an unallocated slot"
            )
        for fi, per_layer in enumerate(values):
            for li, v in enumerate(per_layer):
                self.pools[group].contents[fi][li][pages, np.asarray(rows) % rpp] = v

    def counts(self) -> Counts:
        """Pool and request counters."""
        pc = np.array([p.counts() for p in self.pools], np.int64).reshape(-1, 3)
        reqs = self.requests

        def per_req(f) -> np.ndarray:
            return np.array([0 if r is None else f(r) for r in reqs], np.int64)

        return Counts(
            free=pc[:, 0],
            in_use=pc[:, 1],
            cached_only=pc[:, 2],
            live=np.array([r is not None for r in reqs]),
            generation=np.array(self.generation, np.int64),
            extent=per_req(lambda r: r.n),
            committed=per_req(lambda r: r.c),
            in_flight=per_req(lambda r: len(r.fifo)),
            pending=per_req(lambda r: 0 if r.pending is None else 1 + int(r.pending)),
        )

    def view(self) -> LogicalView:
        """Tables and the rows every slot maps to (see :class:`LogicalView`)."""
        tables, rows = [], []
        for gi, g in enumerate(self.plan.groups):
            t = np.full(self.plan.table_shape(g), -1, np.int32)
            for s, r in enumerate(self.requests):
                if r is not None:
                    t[s] = r.tables[gi]
            tables.append(t)
            pages = np.maximum(t, 0)
            rows.append(
                tuple(
                    tuple(a[pages].reshape(t.shape[0], -1, *a.shape[2:]) for a in per_layer)
                    for per_layer in self.pools[gi].contents
                )
            )
        return LogicalView(tuple(tables), tuple(rows))

    def tokens(self, slot: int) -> list[int]:
        """Tokens of positions ``[0, n)`` of the request in ``slot`` (the keys it publishes)."""
        return list(self.requests[slot].tokens)

    def violations(self) -> list[str]:
        """Broken invariants (empty when all hold): conservation, refcounts, sharing, LRU."""
        out = []
        for gi, (g, pool) in enumerate(zip(self.plan.groups, self.pools, strict=True)):
            refs = np.zeros_like(pool.refcount)
            holders: dict[int, int] = collections.Counter()
            for r in self.requests:
                if r is None:
                    continue
                for p in r.tables[gi][r.tables[gi] >= 1]:
                    refs[p] += 1
                    holders[int(p)] += 1
            for p in self.node_of[gi]:
                refs[p] += 1
            if not np.array_equal(refs, pool.refcount):
                bad = np.flatnonzero(refs != pool.refcount)[:5].tolist()
                out.append(f"{g.name}: refcount != table + index references at pages {bad}")
            free, in_use, cached = pool.counts()
            if free + in_use + cached != self.plan.usable_pages(g) or in_use < 0:
                out.append(f"{g.name}: free {free} + in use {in_use} + cached {cached} != usable")
            if any(pool.refcount[p] for p in pool.free):
                out.append(f"{g.name}: a free page has references")
            if any(not pool.indexed[p] or holders.get(p) for p in pool.lru):
                out.append(f"{g.name}: an LRU page is not cached-only")
            if sum(1 for p, k in holders.items() if k > 1 and not pool.indexed[p]):
                out.append(
                    f"{g.name}: a page is in two tables without being shared through the index"
                )
            if set(self.node_of[gi]) != {int(p) for p in np.flatnonzero(pool.indexed)}:
                out.append(f"{g.name}: index entries and indexed pages disagree")
        entries = sorted((gi, p) for _, gi, p in self.index.entries())
        if entries != sorted((gi, p) for gi in range(len(self.pools)) for p in self.node_of[gi]):
            out.append("the trie's entries and the page -> node maps disagree")
        return out
