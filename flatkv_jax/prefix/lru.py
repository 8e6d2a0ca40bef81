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

:class:`CachedLRUSet` holds every pool's LRU in one set of flat arrays (the coordinator's
state): one push or take serves rows of every pool. The single-LRU functions are the set's
with one pool (the same arrays, reshaped), so both share one implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

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
    return _one(_compact_pool(_as_set(lru), 0, chunk))


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
    return _one(cache_in(_as_set(lru), jnp.zeros(pages.shape, jnp.int32), pages, valid))


def cache_groups(
    lrus: tuple[CachedLRU, ...],
    group: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
    *,
    repeats: jax.Array | bool = True,
) -> tuple[CachedLRU, ...]:
    """:func:`cache` into several LRUs at once: the same result as one call per LRU
    (``lrus[g]`` gets the rows with ``group == g``, in batch order). The LRUs are packed into
    one :class:`CachedLRUSet` for the call (a copy: for tests and tools; the coordinator keeps
    a set and calls :func:`cache_in`).

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
    return unpack(cache_in(pack(lrus), group, pages, valid, repeats=repeats))


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
    one = _as_set(lru)
    zeros = jnp.zeros(pages.shape, jnp.int32)
    cached, count, was = _take(one, (one.cached, one.count), zeros, pages, valid)
    return _one(dataclasses.replace(one, cached=cached, count=count)), was


def take_groups(
    lrus: tuple[CachedLRU, ...], group: jax.Array, pages: jax.Array, valid: jax.Array
) -> tuple[CachedLRU, ...]:
    """:func:`take` from several LRUs at once: the same LRUs as one call per LRU
    (``lrus[g]`` loses the rows with ``group == g``); packed into a :class:`CachedLRUSet`
    for the call, as :func:`cache_groups`.

    Args:
      lrus: the pools' LRUs.
      group: int32[N], the LRU of each row.
      pages: int32[N], pages of that LRU's pool (duplicates and pages not in the LRU are fine).
      valid: bool[N].
    """
    group, pages = _group_arg(group, pages)
    return unpack(take_in(pack(lrus), group, pages, valid))


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
    got_set, out, got = evict_in(
        _as_set(lru), 0, n, max_pages=max_pages, pinned=pinned, pin_offset=pin_offset
    )
    if index is not None:
        # Each cached-only page has one live ring entry: the evicted pages are distinct.
        index, _ = index_lib.remove(index, out, out >= 0, distinct=True)
    return _one(got_set), index, out, got


def _as_set(lru: CachedLRU) -> CachedLRUSet:
    """``lru`` as a one-pool set: the same arrays, the scalars as ``[1]`` (reshapes only, so
    a donated LRU is still updated in place)."""
    return CachedLRUSet(
        ring=lru.ring,
        seq_of_page=lru.seq_of_page,
        cached=lru.cached,
        head=lru.head.reshape(1),
        tail=lru.tail.reshape(1),
        count=lru.count.reshape(1),
        ring_sizes=(lru.ring_size,),
        num_pages=(lru.num_pages,),
    )


def _one(lrus: CachedLRUSet) -> CachedLRU:
    """The only pool of a one-pool set (:func:`_as_set`'s inverse)."""
    return CachedLRU(
        ring=lrus.ring,
        seq_of_page=lrus.seq_of_page,
        cached=lrus.cached,
        head=lrus.head.reshape(()),
        tail=lrus.tail.reshape(()),
        count=lrus.count.reshape(()),
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ring", "seq_of_page", "cached", "head", "tail", "count"],
    meta_fields=["ring_sizes", "num_pages"],
)
@dataclasses.dataclass(frozen=True)
class CachedLRUSet:
    """Every pool's LRU in one set of flat arrays (the coordinator's state holds one).

    Pool ``g``'s ring is ``ring[ring_offset[g] : ring_offset[g] + ring_sizes[g]]``, its
    per-page arrays ``seq_of_page``/``cached`` at ``page_offset[g]`` (as the allocator's
    refcounts); ``head``, ``tail`` and ``count`` are per pool. Each pool behaves exactly as its
    own :class:`CachedLRU` (:func:`view`), but a push or a take of rows of every pool is one
    batched update (six state leaves, not six per pool).

    Attributes:
      ring: int32[sum(ring_sizes)].
      seq_of_page: uint32[sum(num_pages)].
      cached: bool[sum(num_pages)].
      head, tail: uint32[G].
      count: int32[G].
      ring_sizes, num_pages: static, per pool.
    """

    ring: jax.Array
    seq_of_page: jax.Array
    cached: jax.Array
    head: jax.Array
    tail: jax.Array
    count: jax.Array
    ring_sizes: tuple[int, ...]
    num_pages: tuple[int, ...]

    @property
    def groups(self) -> int:
        return len(self.ring_sizes)

    @property
    def ring_offset(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((0, *self.ring_sizes[:-1])))

    @property
    def page_offset(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((0, *self.num_pages[:-1])))


def create_lru_set(plan: CachePlan) -> CachedLRUSet:
    """An empty set of every pool of ``plan``, each sized as :func:`create_lrus` sizes it."""
    return pack(create_lrus(plan))


def pack(lrus: tuple[CachedLRU, ...]) -> CachedLRUSet:
    """The LRUs as one set (copies every array)."""
    return CachedLRUSet(
        ring=jnp.concatenate([lr.ring for lr in lrus]),
        seq_of_page=jnp.concatenate([lr.seq_of_page for lr in lrus]),
        cached=jnp.concatenate([lr.cached for lr in lrus]),
        head=jnp.stack([lr.head for lr in lrus]),
        tail=jnp.stack([lr.tail for lr in lrus]),
        count=jnp.stack([lr.count for lr in lrus]),
        ring_sizes=tuple(lr.ring_size for lr in lrus),
        num_pages=tuple(lr.num_pages for lr in lrus),
    )


def view(lrus: CachedLRUSet, g: int) -> CachedLRU:
    """Pool ``g`` (static) of the set as a :class:`CachedLRU` (slices; read-only use)."""
    r0, p0 = lrus.ring_offset[g], lrus.page_offset[g]
    r, n = lrus.ring_sizes[g], lrus.num_pages[g]
    return CachedLRU(
        ring=lrus.ring[r0 : r0 + r],
        seq_of_page=lrus.seq_of_page[p0 : p0 + n],
        cached=lrus.cached[p0 : p0 + n],
        head=lrus.head[g],
        tail=lrus.tail[g],
        count=lrus.count[g],
    )


def unpack(lrus: CachedLRUSet) -> tuple[CachedLRU, ...]:
    """Every pool of the set as its own :class:`CachedLRU` (:func:`view` of each)."""
    return tuple(view(lrus, g) for g in range(lrus.groups))


def _set_address(lrus: CachedLRUSet, group: jax.Array, pages: jax.Array):
    """Per row: the pool number clipped, whether the page is a usable page of a known pool,
    and its entry in the per-page arrays (out of range where it is not)."""
    _, gi, addr, usable = index_lib.page_address(lrus.num_pages, group, pages)
    return gi, usable, jnp.where(usable, addr, sum(lrus.num_pages))


def _per_pool_sum(x: jax.Array, group: jax.Array, g_n: int, dtype) -> jax.Array:
    return jnp.zeros((g_n,), dtype).at[group].add(x.astype(dtype), mode="drop")


def cache_in(
    lrus: CachedLRUSet,
    group: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
    *,
    repeats: jax.Array | bool = True,
    grouped: bool = False,
) -> CachedLRUSet:
    """:func:`cache_groups` on the set: pool ``group[i]`` gets row ``i`` (rows of an unknown
    pool and reserved pages are ignored), in batch order; the result of one :func:`cache` per
    pool. ``repeats`` as for :func:`cache_groups`. ``grouped`` (static): the caller promises
    that the rows pushed list their pools in non-decreasing order (a sweep's listing), so a
    row's rank within its pool is one running count less the pushes of earlier pools, not a
    running count per pool (``[n, G]``)."""
    group, pages = _group_arg(group, pages)
    gi, usable, addr = _set_address(lrus, group, pages)
    usable = usable & valid
    if repeats is True:
        push = last_occurrence((group, pages), usable)
    else:
        push = jax.lax.cond(
            jnp.asarray(repeats), lambda u: last_occurrence((group, pages), u), lambda u: u, usable
        )
    g_n = lrus.groups
    n_push = _per_pool_sum(push, gi, g_n, jnp.uint32)
    sizes = jnp.asarray(lrus.ring_sizes, jnp.uint32)
    lrus = jax.lax.cond(
        jnp.any(lrus.tail - lrus.head + n_push > sizes),
        lambda x: _compact_overflowing(x, n_push),
        lambda x: x,
        lrus,
    )
    was = lrus.cached[jnp.clip(addr, 0, lrus.cached.shape[0] - 1)]
    new_pages = _per_pool_sum(push & ~was, gi, g_n, jnp.int32)
    # Each row's sequence: its pool's tail + its rank among the pool's pushed rows.
    if grouped:
        before = jnp.cumsum(n_push, dtype=jnp.uint32) - n_push  # pushes of earlier pools
        rank = jnp.cumsum(push.astype(jnp.uint32), dtype=jnp.uint32) - before[gi]
    else:
        mine = (gi[:, None] == jnp.arange(g_n, dtype=jnp.int32)[None, :]) & push[:, None]
        rank = jnp.take_along_axis(jnp.cumsum(mine.astype(jnp.uint32), axis=0), gi[:, None], 1)
        rank = rank[:, 0]
    seq = lrus.tail[gi] + rank - jnp.uint32(1)
    r_total = lrus.ring.shape[0]
    in_ring = (seq & (sizes[gi] - jnp.uint32(1))).astype(jnp.int32)
    slot = jnp.where(push, jnp.asarray(lrus.ring_offset, jnp.int32)[gi] + in_ring, r_total)
    target = jnp.where(push, addr, lrus.cached.shape[0])
    return dataclasses.replace(
        lrus,
        ring=lrus.ring.at[slot].set(pages, mode="drop"),
        seq_of_page=lrus.seq_of_page.at[target].set(seq, mode="drop"),
        # The value (True wherever written) depends on the read of `cached` and on the
        # compaction's result (`seq`), which orders both reads before the in-place write;
        # otherwise XLA copies the whole array.
        cached=lrus.cached.at[target].set(push | was | (seq == 0), mode="drop"),
        tail=lrus.tail + n_push,
        count=lrus.count + new_pages,
    )


def _compact_overflowing(lrus: CachedLRUSet, n_push: jax.Array) -> CachedLRUSet:
    """:func:`compact` of every pool whose push of ``n_push[g]`` would overflow its ring.

    One loop over the pools, not one copy of the compaction per pool: XLA:CPU charges every
    call of a program for the code it holds, taken or not (measured: ~300 fusions of six
    unrolled compactions cost a B = 256 decode step ~40 us, docs/benchmarks.md), and this
    path runs only when a ring fills up."""
    sizes = jnp.asarray(lrus.ring_sizes, jnp.uint32)
    over = lrus.tail - lrus.head + n_push > sizes
    return jax.lax.fori_loop(0, lrus.groups, lambda g, x: _compact_pool(x, g, active=over[g]), lrus)


def _compact_pool(
    lrus: CachedLRUSet, g, chunk: int = COMPACT_CHUNK, active: jax.Array | bool = True
) -> CachedLRUSet:
    """:func:`compact` of pool ``g`` (an int, or a traced one) of the set, in place, if
    ``active`` (else nothing changes: no entry is read or moved)."""
    r = jnp.asarray(lrus.ring_sizes, jnp.uint32)[g]
    r0 = jnp.asarray(lrus.ring_offset, jnp.int32)[g]
    p0 = jnp.asarray(lrus.page_offset, jnp.int32)[g]
    # Static chunk: the largest ring's (a smaller ring's pass reads past its live entries,
    # masked by `pos < n`).
    chunk = min(max(lrus.ring_sizes), chunk)
    j = jnp.arange(chunk, dtype=jnp.uint32)
    head = lrus.head[g]
    n = jnp.where(active, lrus.tail[g] - head, jnp.uint32(0))
    n_pages = lrus.cached.shape[0]
    mask = r - jnp.uint32(1)

    def body(carry):
        i, kept, ring, seq_of_page = carry
        pos = i + j
        seq_at = head + pos
        page = ring[r0 + (seq_at & mask).astype(jnp.int32)]
        live = (pos < n) & lrus.cached[p0 + page] & (seq_of_page[p0 + page] == seq_at)
        seq = head + kept + jnp.cumsum(live.astype(jnp.uint32), dtype=jnp.uint32) - 1
        slot = jnp.where(live, r0 + (seq & mask).astype(jnp.int32), ring.shape[0])
        return (
            i + jnp.uint32(chunk),
            kept + jnp.sum(live, dtype=jnp.uint32),
            ring.at[slot].set(page, mode="drop"),
            seq_of_page.at[jnp.where(live, p0 + page, n_pages)].set(seq, mode="drop"),
        )

    _, kept, ring, seq_of_page = jax.lax.while_loop(
        lambda c: c[0] < n,
        body,
        (jnp.zeros((), jnp.uint32), jnp.zeros((), jnp.uint32), lrus.ring, lrus.seq_of_page),
    )
    tail = lrus.tail.at[g].set(jnp.where(active, head + kept, lrus.tail[g]))
    return dataclasses.replace(lrus, ring=ring, seq_of_page=seq_of_page, tail=tail)


def take_in(
    lrus: CachedLRUSet, group: jax.Array, pages: jax.Array, valid: jax.Array
) -> CachedLRUSet:
    """:func:`take_groups` on the set (one pass for every pool)."""
    cached, count = take_marks_in(lrus, (lrus.cached, lrus.count), group, pages, valid)
    return dataclasses.replace(lrus, cached=cached, count=count)


def take_marks_in(
    lrus: CachedLRUSet,
    marks: tuple[jax.Array, jax.Array],
    group: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """:func:`take_in` on the only fields a take writes, ``(cached, count)`` (a caller inside
    a ``lax.cond`` passes just these: the ring passed through a cond is copied by XLA);
    ``lrus`` gives the layout only."""
    group, pages = _group_arg(group, pages)
    cached, count, _ = _take(lrus, marks, group, pages, valid)
    return cached, count


def _take(lrus: CachedLRUSet, marks, group, pages, valid):
    """The take of :func:`take_marks_in`, plus ``was`` (bool[N], the row's page was cached)."""
    cached, count = marks
    gi, usable, addr = _set_address(lrus, group, pages)
    was = valid & usable & cached[jnp.clip(addr, 0, cached.shape[0] - 1)]
    gone = _per_pool_sum(first_occurrence((group, pages), was), gi, lrus.groups, jnp.int32)
    cached = cached.at[jnp.where(was, addr, cached.shape[0])].set(False, mode="drop")
    return cached, count - gone, was


def evict_all(
    lrus: CachedLRUSet,
    n: jax.Array,
    *,
    max_pages: tuple[int, ...],
    pinned: jax.Array | None = None,
) -> tuple[CachedLRUSet, jax.Array, jax.Array]:
    """:func:`evict_in` from every pool at once: the result of one :func:`evict_in` per pool
    (pool ``g``: ``n[g]`` pages, ``max_pages[g]`` its static bound, its pin flags at its page
    offset in the flat mask ``pinned``), walked in one loop over a flat window of every
    pool's ring entries (pool ``g``: as many as :func:`evict_in` walks per iteration) instead
    of one loop per pool (on XLA:CPU each loop costs its thunks whatever its size: a grow
    that evicts walked seven). The caller removes the pages from the index.

    Args:
      lrus: the set.
      n: int32[G], pages wanted per pool (clipped as :func:`evict` clips).
      max_pages: static, one bound per pool.
      pinned: optional bool[sum(num_pages)], every pool's pin flags at its page offset.

    Returns:
      ``(lrus, pages, evicted)``: ``pages`` int32[sum(max_pages)], pool ``g``'s evicted pages
      in LRU order in its ``max_pages[g]`` entries (pools in order), padded with -1;
      ``evicted`` int32[G].
    """
    g_n = lrus.groups
    bounds = tuple(max_pages)
    if len(bounds) != g_n:
        fail(
            "max_pages",
            bounds,
            f"one bound per pool of the set ({g_n})",
            "pass a tuple of ints, one per pool",
        )
    for b in bounds:
        check_nonnegative_int("max_pages", b)
    widths = [min(max(b, 64), r) if b else 0 for b, r in zip(bounds, lrus.ring_sizes, strict=True)]
    if max(bounds) == 0:
        return lrus, jnp.zeros((0,), jnp.int32), jnp.zeros((g_n,), jnp.int32)
    # One flat window of every pool's lanes (pool g: `widths[g]` consecutive lanes), not a
    # [G, max width] grid: an admission's bounds range from 32 to 1,024 entries per pool.
    u32, i32 = jnp.uint32, jnp.int32
    lane_g_np = np.repeat(np.arange(g_n), widths)
    seg_start = np.concatenate([[0], np.cumsum(widths)[:-1]])
    lane_g = jnp.asarray(lane_g_np, i32)
    j = jnp.asarray(np.arange(len(lane_g_np)) - seg_start[lane_g_np], u32)
    n_lanes = len(lane_g_np)
    ring_mask = jnp.asarray(np.asarray(lrus.ring_sizes)[lane_g_np] - 1, u32)
    r0 = jnp.asarray(np.asarray(lrus.ring_offset)[lane_g_np], i32)
    p0 = jnp.asarray(np.asarray(lrus.page_offset)[lane_g_np], i32)
    out_off_np = np.concatenate([[0], np.cumsum(bounds)[:-1]])
    out_off = jnp.asarray(out_off_np[lane_g_np], i32)
    n_out = sum(bounds)
    width = jnp.asarray(widths, u32)
    # Per pool, the running count at the lane before its window (static positions).
    before = jnp.asarray(seg_start, i32)
    last_lane = jnp.asarray(seg_start + np.asarray(widths), i32)
    n = jnp.clip(jnp.asarray(n, i32), 0, jnp.minimum(lrus.count, jnp.asarray(bounds)))
    tail = lrus.tail

    def active(cursor, got):
        return (got < n) & (cursor != tail)

    def first_lane(flag):
        """int32[G]: each pool's first flagged lane (relative to its window), ``n_lanes``
        if none."""
        at = jnp.where(flag, j.astype(i32), n_lanes)
        return jnp.full((g_n,), n_lanes, i32).at[lane_g].min(at)

    def body(carry):
        cursor, head, stopped, out, got = carry
        on = active(cursor, got)
        seq_at = cursor[lane_g] + j
        page = lrus.ring[r0 + (seq_at & ring_mask).astype(i32)]
        live = (
            on[lane_g]
            & (j < (tail - cursor)[lane_g])
            & lrus.cached[p0 + page]
            & (lrus.seq_of_page[p0 + page] == seq_at)
        )
        keep = live & pinned[p0 + page] if pinned is not None else jnp.zeros_like(live)
        live = live & ~keep
        cs = jnp.cumsum(live.astype(i32))
        cs0 = jnp.concatenate([jnp.zeros((1,), i32), cs])
        nth = cs - cs0[before][lane_g]  # the lane's rank among its pool's live lanes
        total = cs0[last_lane] - cs0[before]  # [G]
        left = n - got
        take = live & (nth <= left[lane_g])
        slot = jnp.where(take, out_off + got[lane_g] + nth - 1, n_out)
        out = out.at[slot].set(page, mode="drop")
        done = total >= left
        last = first_lane(take & (nth == left[lane_g])).astype(u32)
        step = jnp.where(done, last + u32(1), jnp.minimum(width, tail - cursor))
        step = jnp.where(on, step, u32(0))
        kept = first_lane(keep & (j < step[lane_g]))
        any_kept = kept < n_lanes
        head = jnp.where(
            stopped | ~on, head, jnp.where(any_kept, cursor + kept.astype(u32), cursor + step)
        )
        got = got + jnp.where(on, jnp.minimum(total, left), 0)
        return cursor + step, head, stopped | any_kept, out, got

    init = (
        lrus.head,
        lrus.head,
        jnp.zeros((g_n,), bool),
        jnp.full((n_out,), -1, i32),
        jnp.zeros((g_n,), i32),
    )
    _, head, _, pages, got = jax.lax.while_loop(
        lambda carry: jnp.any(active(carry[0], carry[4])), body, init
    )
    taken = pages >= 0
    page_base = jnp.asarray(np.repeat(np.asarray(lrus.page_offset), bounds), i32)
    lrus = dataclasses.replace(
        lrus,
        cached=lrus.cached.at[jnp.where(taken, page_base + pages, lrus.cached.shape[0])].set(
            False, mode="drop"
        ),
        head=head,
        count=lrus.count - got,
    )
    return lrus, pages, got


def evict_in(
    lrus: CachedLRUSet,
    g: int,
    n: jax.Array,
    *,
    max_pages: int,
    pinned: jax.Array | None = None,
    pin_offset: int = 0,
) -> tuple[CachedLRUSet, jax.Array, jax.Array]:
    """:func:`evict` from pool ``g`` (static) of the set; the caller removes the pages from
    the index. Returns ``(lrus, pages, evicted)``."""
    check_nonnegative_int("max_pages", max_pages)
    r, r0, p0 = lrus.ring_sizes[g], lrus.ring_offset[g], lrus.page_offset[g]
    n = jnp.clip(jnp.asarray(n, jnp.int32), 0, jnp.minimum(lrus.count[g], max_pages))
    if max_pages == 0:
        return lrus, jnp.zeros((0,), jnp.int32), jnp.zeros((), jnp.int32)
    chunk = min(max(max_pages, 64), r)
    j = jnp.arange(chunk, dtype=jnp.uint32)
    tail = lrus.tail[g]

    def cond(carry):
        cursor, _, _, _, got = carry
        return (got < n) & (cursor != tail)

    def body(carry):
        cursor, head, stopped, out, got = carry
        seq_at = cursor + j
        page = lrus.ring[r0 + (seq_at & jnp.uint32(r - 1)).astype(jnp.int32)]
        live = (
            (j < tail - cursor) & lrus.cached[p0 + page] & (lrus.seq_of_page[p0 + page] == seq_at)
        )
        keep = live & pinned[pin_offset + page] if pinned is not None else jnp.zeros_like(live)
        live = live & ~keep
        nth = jnp.cumsum(live.astype(jnp.int32))
        take = live & (nth <= n - got)
        out = out.at[jnp.where(take, got + nth - 1, max_pages)].set(page, mode="drop")
        done = nth[-1] >= n - got
        last = jnp.argmax(take & (nth == n - got)).astype(jnp.uint32)
        step = jnp.where(done, last + jnp.uint32(1), jnp.minimum(jnp.uint32(chunk), tail - cursor))
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

    h0 = lrus.head[g]
    init = (
        h0,
        h0,
        jnp.zeros((), bool),
        jnp.full((max_pages,), -1, jnp.int32),
        jnp.zeros((), jnp.int32),
    )
    _, head, _, out, got = jax.lax.while_loop(cond, body, init)
    taken = out >= 0
    lrus = dataclasses.replace(
        lrus,
        cached=lrus.cached.at[jnp.where(taken, p0 + out, lrus.cached.shape[0])].set(
            False, mode="drop"
        ),
        head=lrus.head.at[g].set(head),
        count=lrus.count.at[g].add(-got),
    )
    return lrus, out, got
