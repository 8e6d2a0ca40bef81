"""LRU order of a pool's cached-only pages (held only by the prefix index), on device.

Design: a FIFO ring of page ids in the order pages became cached-only, plus per page the
sequence number of its one **live** ring entry. A page becomes cached-only when its last table
reference drops while the index still holds it (:func:`cache`: push at the tail); it leaves
the LRU when a prefix hit takes it back (:func:`take`) or when it is evicted (:func:`evict`).
Acquiring does not search the ring: it only clears the page's ``cached`` flag, so its ring
entry goes **stale**; eviction pops from the head and skips stale entries (an entry at sequence
``q`` is live iff ``cached[page] and seq_of_page[page] == q``). Order of becoming unreferenced
is the LRU order of last use, because a page in use cannot be evicted and re-enters at the
tail when it is released again.

Sequence numbers are uint32 and wrap; the ring size ``R`` is a power of two, so ``q % R`` stays
consistent across the wrap, and equality tests are sound because every entry between head and
tail is within ``R`` of the tail.

Overflow: stale entries accumulate between evictions (a hot page released and re-hit leaves
one per cycle). When a push would overflow the ring, the ring is **compacted** first (one
O(R) pass keeping live entries in order, renumbered from the head). With ``R >= 4 x usable
pages`` (the default) at most ``usable`` entries are live, so a compaction frees at least
``2 x usable`` entries for later pushes after room for the push itself; its cost is O(1)
amortised per push. A single push of more than ``R - usable`` pages cannot happen, because a
pool never has more than ``usable`` cached-only pages.

Eviction pops the first ``n`` live entries (a ``lax.while_loop`` over chunks of the ring from
the head): O(entries popped), each stale entry popped once in its life, so O(1) amortised.
:attr:`CachedLRU.count` is the number of cached-only pages; read it (no mutation) to decide
whether an allocation can succeed before evicting anything.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail
from flatkv_jax.plan import RESERVED_PAGES, CachePlan, check_plan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix._batch import first_occurrence, last_occurrence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CachedLRU:
    """One pool's LRU of cached-only pages (a pytree of arrays).

    Attributes:
      ring: int32[R], page ids by push sequence (entry for sequence ``q`` at ``q % R``).
      seq_of_page: uint32[num_pages], sequence number of the page's live entry (meaningful
        only while ``cached``).
      cached: bool[num_pages], the page is cached-only (in the LRU).
      head: uint32[], sequence of the oldest entry not yet popped.
      tail: uint32[], sequence the next push gets.
      count: int32[], cached-only pages (live entries) == pages :func:`evict` can return.
    """

    ring: jax.Array
    seq_of_page: jax.Array
    cached: jax.Array
    head: jax.Array
    tail: jax.Array
    count: jax.Array

    @property
    def ring_size(self) -> int:
        return self.ring.shape[0]

    @property
    def num_pages(self) -> int:
        return self.cached.shape[0]


def default_ring_size(usable_pages: int) -> int:
    """The power of two >= 4 x ``usable_pages`` (at least 8); see the module docstring."""
    check_positive_int("usable_pages", usable_pages)
    return 1 << (max(8, 4 * usable_pages) - 1).bit_length()


def create_lru(num_pages: int, *, ring_size: int | None = None) -> CachedLRU:
    """An empty LRU for a pool of ``num_pages`` pages (null and scratch pages included).

    Args:
      num_pages: pages of the group's pool array.
      ring_size: a power of two >= 2 x usable pages; defaults to :func:`default_ring_size`.
    """
    check_positive_int("num_pages", num_pages)
    if num_pages <= RESERVED_PAGES:
        fail(
            "num_pages",
            num_pages,
            f"a pool needs more than the {RESERVED_PAGES} reserved pages",
            "give the pool usable pages",
        )
    usable = num_pages - RESERVED_PAGES
    if ring_size is None:
        ring_size = default_ring_size(usable)
    check_positive_int("ring_size", ring_size)
    if ring_size & (ring_size - 1) or ring_size < 2 * usable:
        fail(
            "ring_size",
            ring_size,
            f"the ring is a power of two >= 2 x usable pages ({2 * usable}) so that a compaction always makes room",
            f"pass {default_ring_size(usable)} (the default)",
        )
    return CachedLRU(
        ring=jnp.zeros((ring_size,), jnp.int32),
        seq_of_page=jnp.zeros((num_pages,), jnp.uint32),
        cached=jnp.zeros((num_pages,), bool),
        head=jnp.zeros((), jnp.uint32),
        tail=jnp.zeros((), jnp.uint32),
        count=jnp.zeros((), jnp.int32),
    )


def create_lrus(plan: CachePlan) -> tuple[CachedLRU, ...]:
    """One empty LRU per group of ``plan``, in group order."""
    check_plan(plan)
    return tuple(create_lru(plan.pages(g)) for g in plan.groups)


def _pages_arg(lru: CachedLRU, pages, valid) -> tuple[jax.Array, jax.Array]:
    pages = jnp.asarray(pages)
    if pages.ndim != 1 or pages.dtype != jnp.int32:
        fail(
            "pages",
            f"{pages.dtype}{list(pages.shape)}",
            "pages are int32[N]",
            "pass a flat int32 array",
        )
    if valid is None:
        valid = jnp.ones(pages.shape, bool)
    valid = jnp.asarray(valid)
    if valid.shape != pages.shape or valid.dtype != jnp.bool_:
        fail(
            "valid",
            f"{valid.dtype}{list(valid.shape)}",
            f"a bool mask shaped like pages {pages.shape}",
            "pass bool[N]",
        )
    return pages, valid & _usable(pages, lru.num_pages)


def _usable(pages: jax.Array, num_pages: int) -> jax.Array:
    # Reserved pages never enter the LRU (defensive: a caller bug must not make them evictable).
    return (pages >= 1) & (pages <= num_pages - 2)


def _group_arg(group, pages) -> tuple[jax.Array, jax.Array]:
    """Checks a batched call's ``group`` (one int32 LRU number per page)."""
    pages = jnp.asarray(pages)
    group = jnp.asarray(group)
    if group.shape != pages.shape or group.dtype != jnp.int32:
        fail(
            "group",
            f"{group.dtype}{list(group.shape)}",
            f"one int32 LRU number per page, shape {pages.shape}",
            "pass int32[N]",
        )
    return group, pages


def _live(lru: CachedLRU, seq: jax.Array, in_range: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page, live) of the ring entries at sequences ``seq``."""
    page = lru.ring[(seq & jnp.uint32(lru.ring_size - 1)).astype(jnp.int32)]
    live = in_range & lru.cached[page] & (lru.seq_of_page[page] == seq)
    return page, live


#: Ring entries one iteration of :func:`compact` moves (its temporaries are this size).
COMPACT_CHUNK = 4096


def compact(lru: CachedLRU, chunk: int = COMPACT_CHUNK) -> CachedLRU:
    """Rewrites the ring with only its live entries, in order, from the head (O(R)).

    In place, ``chunk`` entries at a time: a live entry only moves towards the head, onto a
    position already read, so no pool- or ring-sized temporary exists (only chunk-sized ones).
    Entries past the new tail keep stale values; nothing reads outside ``[head, tail)``.

    Args:
      lru: the pool's LRU.
      chunk: static, ring entries per loop iteration (clipped to the ring size).
    """
    check_positive_int("chunk", chunk)
    r = lru.ring_size
    chunk = min(r, chunk)
    j = jnp.arange(chunk, dtype=jnp.uint32)
    n = lru.tail - lru.head

    def body(carry):
        i, kept, ring, seq_of_page = carry
        pos = i + j
        now = dataclasses.replace(lru, ring=ring, seq_of_page=seq_of_page)
        page, live = _live(now, lru.head + pos, pos < n)
        seq = lru.head + kept + jnp.cumsum(live.astype(jnp.uint32), dtype=jnp.uint32) - 1
        slot = jnp.where(live, (seq & jnp.uint32(r - 1)).astype(jnp.int32), r)
        return (
            i + jnp.uint32(chunk),
            kept + jnp.sum(live, dtype=jnp.uint32),
            ring.at[slot].set(page, mode="drop"),
            seq_of_page.at[jnp.where(live, page, lru.num_pages)].set(seq, mode="drop"),
        )

    _, kept, ring, seq_of_page = jax.lax.while_loop(
        lambda c: c[0] < n,
        body,
        (jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.uint32), lru.ring, lru.seq_of_page),
    )
    return dataclasses.replace(lru, ring=ring, seq_of_page=seq_of_page, tail=lru.head + kept)


def cache(lru: CachedLRU, pages: jax.Array, valid: jax.Array | None = None) -> CachedLRU:
    """Pushes pages that just became cached-only, least recent first (batch order).

    A page pushed twice (in one batch, or while already cached) keeps only its latest position.

    Args:
      lru: the pool's LRU.
      pages: int32[N]; the caller pushes exactly the pages whose last table reference dropped
        while the index holds them. Reserved pages (0 and the scratch page) are ignored.
      valid: optional bool[N].

    Returns:
      The new LRU.
    """
    pages, valid = _pages_arg(lru, pages, valid)
    return _push(lru, pages, last_occurrence((pages,), valid))


def cache_groups(
    lrus: tuple[CachedLRU, ...],
    group: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
    *,
    repeats: jax.Array | bool = True,
) -> tuple[CachedLRU, ...]:
    """:func:`cache` into several LRUs at once: the same result as one call per LRU
    (``lrus[g]`` gets the rows with ``group == g``, in batch order), with one sort for the
    whole batch instead of one per LRU.

    Args:
      lrus: the pools' LRUs.
      group: int32[N], the LRU of each row.
      pages: int32[N], pages of that LRU's pool.
      valid: bool[N].
      repeats: a Python bool or a traced ``bool[]``: whether a page may be listed twice
        among the valid rows. False promises it is not (the caller knows, e.g. from
        :func:`~flatkv_jax.block_pool.decref_left`) and skips the dedupe sort; a wrong
        promise corrupts the LRU.
    """
    group, pages = _group_arg(group, pages)
    usable = jnp.zeros(pages.shape, bool)
    for g, lr in enumerate(lrus):
        _, ok = _pages_arg(lr, pages, valid & (group == g))
        usable = usable | ok
    if repeats is True:
        push_all = last_occurrence((group, pages), usable)
    else:
        push_all = jax.lax.cond(
            jnp.asarray(repeats),
            lambda u: last_occurrence((group, pages), u),
            lambda u: u,
            usable,
        )
    return tuple(_push(lr, pages, push_all & (group == g)) for g, lr in enumerate(lrus))


def _push(lru: CachedLRU, pages: jax.Array, push: jax.Array) -> CachedLRU:
    """The writes of :func:`cache` for rows ``push`` (each page's last valid row)."""
    n_push = jnp.sum(push, dtype=jnp.uint32)
    lru = jax.lax.cond(
        lru.tail - lru.head + n_push > jnp.uint32(lru.ring_size), compact, lambda x: x, lru
    )
    was = lru.cached[jnp.clip(pages, 0, lru.num_pages - 1)]
    new_pages = jnp.sum(push & ~was, dtype=jnp.int32)
    seq = lru.tail + jnp.cumsum(push.astype(jnp.uint32), dtype=jnp.uint32) - jnp.uint32(1)
    r = lru.ring_size
    slot = jnp.where(push, (seq & jnp.uint32(r - 1)).astype(jnp.int32), r)
    target = jnp.where(push, pages, lru.num_pages)
    return dataclasses.replace(
        lru,
        ring=lru.ring.at[slot].set(pages, mode="drop"),
        seq_of_page=lru.seq_of_page.at[target].set(seq, mode="drop"),
        # The value (True wherever written) depends on the read of `cached` and on the
        # compaction's result (`seq`), which orders both reads before the in-place write;
        # otherwise XLA copies the whole array.
        cached=lru.cached.at[target].set(push | was | (seq == 0), mode="drop"),
        tail=lru.tail + n_push,
        count=lru.count + new_pages,
    )


def take(
    lru: CachedLRU, pages: jax.Array, valid: jax.Array | None = None
) -> tuple[CachedLRU, jax.Array]:
    """Takes pages out of the LRU because a prefix hit references them again.

    Args:
      lru: the pool's LRU.
      pages: int32[N] hit pages (duplicates and pages not in the LRU are fine).
      valid: optional bool[N].

    Returns:
      ``(lru, was_cached)``: bool[N], the page was cached-only before the call (true for every
      duplicate of it). O(N log N) in the batch.
    """
    pages, valid = _pages_arg(lru, pages, valid)
    was = valid & lru.cached[pages]
    gone = jnp.sum(first_occurrence((pages,), was), dtype=jnp.int32)
    lru = dataclasses.replace(
        lru,
        cached=lru.cached.at[jnp.where(was, pages, lru.num_pages)].set(False, mode="drop"),
        count=lru.count - gone,
    )
    return lru, was


def take_groups(
    lrus: tuple[CachedLRU, ...], group: jax.Array, pages: jax.Array, valid: jax.Array
) -> tuple[CachedLRU, ...]:
    """:func:`take` from several LRUs at once: the same LRUs as one call per LRU
    (``lrus[g]`` loses the rows with ``group == g``), with one sort for the whole batch
    instead of one per LRU.

    Args:
      lrus: the pools' LRUs.
      group: int32[N], the LRU of each row.
      pages: int32[N], pages of that LRU's pool (duplicates and pages not in the LRU are fine).
      valid: bool[N].
    """
    marks = take_marks(tuple((lr.cached, lr.count) for lr in lrus), group, pages, valid)
    return tuple(
        dataclasses.replace(lr, cached=c, count=n) for lr, (c, n) in zip(lrus, marks, strict=True)
    )


def take_marks(
    marks: tuple[tuple[jax.Array, jax.Array], ...],
    group: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """:func:`take_groups` on the only fields a take writes, each LRU's ``(cached, count)``:
    a caller inside a ``lax.cond`` passes just these (the ring passed through a cond is
    copied by XLA). Same arguments as :func:`take_groups`; returns the new marks."""
    group, pages = _group_arg(group, pages)
    was = []
    for g, (cached, _) in enumerate(marks):
        n = cached.shape[0]
        ok = valid & (group == g) & _usable(pages, n)
        was.append(ok & cached[jnp.clip(pages, 0, n - 1)])
    was_any = functools.reduce(jnp.logical_or, was, jnp.zeros(pages.shape, bool))
    first = first_occurrence((group, pages), was_any)
    out = []
    for (cached, count), w in zip(marks, was, strict=True):
        n = cached.shape[0]
        gone = jnp.sum(first & w, dtype=jnp.int32)
        target = jnp.where(w, jnp.clip(pages, 0, n - 1), n)
        out.append((cached.at[target].set(False, mode="drop"), count - gone))
    return tuple(out)


def evictable(lru: CachedLRU) -> jax.Array:
    """int32[]: cached-only pages that :func:`evict` could hand out (reads, mutates nothing)."""
    return lru.count


def evict(
    lru: CachedLRU,
    index: index_lib.PrefixIndex | None,
    n: jax.Array,
    *,
    max_pages: int,
    pinned: jax.Array | None = None,
    pin_offset: int = 0,
) -> tuple[CachedLRU, index_lib.PrefixIndex | None, jax.Array, jax.Array]:
    """Evicts the ``n`` least recently released cached-only pages (LRU first).

    Their index entries are removed; the pages leave the index and the LRU with refcount 0,
    ready for the allocator to hand out (after zeroing).

    Args:
      lru: the pool's LRU.
      index: the same pool's prefix index, or None: the caller removes the pages from its
        index (the coordinator removes every pool's evicted pages from its
        :class:`~flatkv_jax.prefix.index.PrefixIndexSet` in one call).
      n: int32[] pages wanted; clipped to ``[0, min(count, max_pages)]`` (with ``pinned``,
        pages beyond the unpinned ones are simply not found).
      max_pages: static bound on pages per call (the output width).
      pinned: optional bool[num_pages]: pages that must not be evicted (matched by the
        admission in progress). They keep their place in the LRU order: the head stops at the
        first pinned entry and the pages evicted behind it leave stale entries.
      pin_offset: static; page ``p``'s flag is ``pinned[pin_offset + p]`` (``pinned`` may be
        the mask of every pool, as the coordinator's: a slice of it passed into the loop
        would be copied).

    Returns:
      ``(lru, index, pages, evicted)``: ``pages`` int32[max_pages] in LRU order, padded with -1;
      ``evicted`` int32[] how many.
    """
    check_nonnegative_int("max_pages", max_pages)
    n = jnp.clip(jnp.asarray(n, jnp.int32), 0, jnp.minimum(lru.count, max_pages))
    if max_pages == 0:
        return lru, index, jnp.zeros((0,), jnp.int32), jnp.zeros((), jnp.int32)
    chunk = min(max(max_pages, 64), lru.ring_size)
    j = jnp.arange(chunk, dtype=jnp.uint32)

    def cond(carry):
        cursor, _, _, _, got = carry
        return (got < n) & (cursor != lru.tail)

    def body(carry):
        cursor, head, stopped, out, got = carry
        page, live = _live(lru, cursor + j, j < lru.tail - cursor)
        keep = live & pinned[pin_offset + page] if pinned is not None else jnp.zeros_like(live)
        live = live & ~keep
        nth = jnp.cumsum(live.astype(jnp.int32))
        take = live & (nth <= n - got)
        out = out.at[jnp.where(take, got + nth - 1, max_pages)].set(page, mode="drop")
        done = nth[-1] >= n - got
        last = jnp.argmax(take & (nth == n - got)).astype(jnp.uint32)  # entry of the final page
        step = jnp.where(
            done, last + jnp.uint32(1), jnp.minimum(jnp.uint32(chunk), lru.tail - cursor)
        )
        # The head may not pass a pinned live entry (it must stay in the ring).
        kept = keep & (j < step)
        head = jnp.where(
            stopped,
            head,
            jnp.where(jnp.any(kept), cursor + jnp.argmax(kept).astype(jnp.uint32), cursor + step),
        )
        return (
            cursor + step,
            head,
            stopped | jnp.any(kept),
            out,
            got + jnp.sum(take, dtype=jnp.int32),
        )

    init = (
        lru.head,
        lru.head,
        jnp.zeros((), bool),
        jnp.full((max_pages,), -1, jnp.int32),
        jnp.zeros((), jnp.int32),
    )
    _, head, _, out, got = jax.lax.while_loop(cond, body, init)
    taken = out >= 0
    lru = dataclasses.replace(
        lru,
        cached=lru.cached.at[jnp.where(taken, out, lru.num_pages)].set(False, mode="drop"),
        head=head,
        count=lru.count - got,
    )
    if index is not None:
        # Each cached-only page has one live ring entry: the evicted pages are distinct.
        index, _ = index_lib.remove(index, out, taken, distinct=True)
    return lru, index, out, got
