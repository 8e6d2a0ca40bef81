"""A fixed-capacity, per-group hash table from prefix key to page, on device.

Layout: ``num_buckets`` buckets (a power of two) of ``WAYS = 8`` entries. A key may live in
one of two buckets, picked by its hash lanes 0 and 1 (two-choice hashing): a lookup compares
the 2 x 8 entries of those buckets — O(1) per key, no probing chains, no tombstones — and
an insert goes to the less loaded of the two (by the loads before the call; rows of one batch
that overflow their first bucket try the other). The default capacity is at least four times
the group's usable pages; every page is in the index at most once, so the load stays <= 1/4
and a full bucket pair is very rare (it costs 32 bytes per page, nothing next to a page of
KV). If it happens the insert is reported as not taken: the block is simply not cached (a miss
later, never a wrong hit).

A reverse map ``slot_of_page`` (one int32 per pool page) makes removal by page O(1) and tells
the allocator whether the index holds a page (its "index reference").

Every operation is a pure function, batched, and costs O(entries touched) plus an
O(N log N) sort of the N-row batch (for first-publisher-wins among duplicates); only
:func:`create_index` / :func:`clear` touch the whole table.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import RESERVED_PAGES, CachePlan, check_plan
from flatkv_jax.prefix._batch import first_occurrence, rank_within
from flatkv_jax.prefix.keys import KEY_WORDS

#: Entries per bucket.
WAYS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixIndex:
    """One group's prefix index (a pytree of arrays; sizes are static through the shapes).

    Attributes:
      keys: uint32[num_buckets, WAYS, KEY_WORDS], the key of each entry (zeros when empty).
      pages: int32[num_buckets, WAYS], the entry's page; 0 marks an empty entry.
      slot_of_page: int32[num_pages], the flat entry ``bucket * WAYS + way`` holding each page,
        or -1 when the index does not hold the page.
      count: int32[], entries in use (== pages the index holds).
    """

    keys: jax.Array
    pages: jax.Array
    slot_of_page: jax.Array
    count: jax.Array

    @property
    def num_buckets(self) -> int:
        return self.pages.shape[0]

    @property
    def capacity(self) -> int:
        return self.pages.shape[0] * WAYS

    @property
    def num_pages(self) -> int:
        return self.slot_of_page.shape[0]


def default_buckets(usable_pages: int) -> int:
    """Buckets for a pool of ``usable_pages``: the power of two giving capacity >= 4x pages."""
    check_positive_int("usable_pages", usable_pages)
    need = max(2, -(-4 * usable_pages // WAYS))
    return 1 << (need - 1).bit_length()


def create_index(num_pages: int, *, num_buckets: int | None = None) -> PrefixIndex:
    """An empty index for a pool of ``num_pages`` pages (null and scratch pages included).

    Args:
      num_pages: pages of the group's pool array.
      num_buckets: a power of two >= 2; defaults to :func:`default_buckets`.

    Raises:
      ValueError/TypeError: a bad page or bucket count.
    """
    check_positive_int("num_pages", num_pages)
    if num_pages <= RESERVED_PAGES:
        fail(
            "num_pages",
            num_pages,
            f"a pool needs more than the {RESERVED_PAGES} reserved pages",
            "give the pool usable pages",
        )
    if num_buckets is None:
        num_buckets = default_buckets(num_pages - RESERVED_PAGES)
    check_positive_int("num_buckets", num_buckets)
    if num_buckets < 2 or num_buckets & (num_buckets - 1):
        fail(
            "num_buckets",
            num_buckets,
            "bucket counts are powers of two >= 2",
            "round up to a power of two",
        )
    return PrefixIndex(
        keys=jnp.zeros((num_buckets, WAYS, KEY_WORDS), jnp.uint32),
        pages=jnp.zeros((num_buckets, WAYS), jnp.int32),
        slot_of_page=jnp.full((num_pages,), -1, jnp.int32),
        count=jnp.zeros((), jnp.int32),
    )


def create_indexes(plan: CachePlan) -> tuple[PrefixIndex, ...]:
    """One empty index per group of ``plan``, in group order."""
    check_plan(plan)
    return tuple(create_index(plan.pages(g)) for g in plan.groups)


def clear(index: PrefixIndex) -> PrefixIndex:
    """An empty index of the same shape (O(capacity + pages): for wake/repair, not per step)."""
    return create_index(index.num_pages, num_buckets=index.num_buckets)


def _flat_keys(index: PrefixIndex, keys: jax.Array) -> jax.Array:
    keys = jnp.asarray(keys)
    if keys.dtype != jnp.uint32 or keys.ndim < 1 or keys.shape[-1] != KEY_WORDS:
        fail(
            "keys",
            f"{keys.dtype}{list(keys.shape)}",
            f"keys are uint32[..., {KEY_WORDS}]",
            "build them with flatkv_jax.prefix.keys",
        )
    return keys.reshape(-1, KEY_WORDS)


def _per_key(what: str, x, n: int, meaning: str) -> jax.Array:
    """``x`` as int32[N], one value per key; a wrong shape or dtype fails naming ``what``."""
    x = jnp.asarray(x)
    if x.shape != (n,) or x.dtype != jnp.int32:
        fail(
            what,
            f"{x.dtype}{list(x.shape)}",
            f"one int32 {meaning} per key, shape ({n},)",
            "pass int32[N]",
        )
    return x


def _valid(valid, shape: tuple[int, ...]) -> jax.Array:
    if valid is None:
        return jnp.ones((math.prod(shape),), bool)
    valid = jnp.asarray(valid)
    if valid.dtype != jnp.bool_ or valid.shape != shape:
        fail(
            "valid",
            f"{valid.dtype}{list(valid.shape)}",
            f"a bool mask of shape {shape}",
            "pass a bool array shaped like the batch",
        )
    return valid.reshape(-1)


def _buckets(index: PrefixIndex, k: jax.Array) -> jax.Array:
    """int32[N, 2]: the two candidate buckets of each key (hash lanes 0 and 1)."""
    mask = jnp.uint32(index.num_buckets - 1)
    return jnp.stack([k[:, 0] & mask, k[:, 1] & mask], axis=1).astype(jnp.int32)


def _find(index: PrefixIndex, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page int32[N], flat slot int32[N]) of each key; 0 / -1 when absent."""
    return _find_at(index.keys, index.pages, _buckets(index, k), k)


def _find_at(keys: jax.Array, pages: jax.Array, bk: jax.Array, k: jax.Array):
    """:func:`_find` in the tables ``keys``/``pages`` with explicit bucket pairs ``bk``."""
    cand_keys = keys[bk]  # [N, 2, WAYS, KEY_WORDS]
    cand_pages = pages[bk]  # [N, 2, WAYS]
    hit = jnp.all(cand_keys == k[:, None, None, :], axis=-1) & (cand_pages > 0)
    page = jnp.max(jnp.where(hit, cand_pages, 0), axis=(1, 2))
    slots = bk[:, :, None] * WAYS + jnp.arange(WAYS, dtype=jnp.int32)[None, None, :]
    slot = jnp.max(jnp.where(hit, slots, -1), axis=(1, 2))
    return page, slot


def lookup(index: PrefixIndex, keys: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Pages of ``keys`` (read-only: touches no state, no LRU order).

    Args:
      index: the group's index.
      keys: uint32[..., KEY_WORDS].
      valid: optional bool[...]; invalid keys miss.

    Returns:
      int32[...]: the page holding each key's block, 0 on a miss.
    """
    shape = keys.shape[:-1]
    k = _flat_keys(index, keys)
    v = _valid(valid, shape)
    page, _ = _find(index, k)
    return jnp.where(v, page, 0).reshape(shape)


def holds(index: PrefixIndex, pages: jax.Array) -> jax.Array:
    """bool[...]: whether the index holds each page (its index reference). Out-of-range -> False."""
    return _held_at(index.slot_of_page, jnp.asarray(pages, jnp.int32))


class _Tables(NamedTuple):
    """The arrays an insert or a removal writes: an index's, or a set's (every group's)."""

    keys: jax.Array
    pages: jax.Array
    slot_of_page: jax.Array


def _place(
    t: _Tables,
    k: jax.Array,
    pages: jax.Array,
    addr: jax.Array,
    bucket: jax.Array,
    want: jax.Array,
    rank: jax.Array,
) -> tuple[_Tables, jax.Array]:
    """Writes the wanted rows into free ways of ``bucket``; rows that do not fit are not placed.

    ``addr``: each row's entry in ``slot_of_page`` (its page, offset by its group's pages in a
    set); ``rank``: each wanted row's rank among the wanted rows of its bucket (batch order)."""
    free = t.pages[bucket] == 0  # [N, WAYS]
    nth = jnp.cumsum(free.astype(jnp.int32), axis=1)
    placed = want & (rank < nth[:, -1])
    way = jnp.argmax(free & (nth == rank[:, None] + 1), axis=1).astype(jnp.int32)
    slot = bucket * WAYS + way
    # (bucket, way) indices, not flat ones: a reshape around the scatter made XLA copy the
    # keys (9 MB at V4-Flash B = 256) when the caller's second pass sits in a cond.
    target = jnp.where(placed, bucket, t.pages.shape[0])  # out of range: dropped
    new = _Tables(
        keys=t.keys.at[target, way].set(k, mode="drop"),
        pages=t.pages.at[target, way].set(pages, mode="drop"),
        slot_of_page=t.slot_of_page.at[jnp.where(placed, addr, t.slot_of_page.shape[0])].set(
            slot, mode="drop"
        ),
    )
    return new, placed


def _held_at(slot_of_page: jax.Array, addr: jax.Array) -> jax.Array:
    """bool[...]: ``slot_of_page`` holds an entry at each address (out of range: False)."""
    n = slot_of_page.shape[0]
    ok = (addr >= 0) & (addr < n)
    return ok & (slot_of_page[jnp.clip(addr, 0, n - 1)] >= 0)


def _insert(
    t: _Tables,
    k: jax.Array,
    pages: jax.Array,
    addr: jax.Array,
    bk: jax.Array,
    eligible_rows: jax.Array,
    group: jax.Array | None,
    distinct: bool = False,
) -> tuple[_Tables, jax.Array, jax.Array, jax.Array]:
    """The insert rules over explicit addresses: ``bk`` int32[N, 2] each row's bucket pair,
    ``addr`` its page's entry in ``slot_of_page``, ``eligible_rows`` the valid rows with a
    usable page, ``group`` (or None: one index) keeps equal keys of different groups apart;
    ``distinct`` (static): no two valid rows share a key or an address (no duplicate rules).

    Returns ``(tables, taken, held, present)`` (:func:`insert_held`, :func:`insert_mixed`)."""
    present, _ = _find_at(t.keys, t.pages, bk, k)
    held = _held_at(t.slot_of_page, addr)
    eligible = eligible_rows & (present == 0) & ~held
    want = eligible
    if not distinct:
        # Both duplicate rules are relative to the same eligible set, so the outcome does
        # not depend on which rule is applied first. Addresses are distinct across groups.
        tag = () if group is None else (group,)
        want = want & first_occurrence((*tag, *(k[:, w] for w in range(KEY_WORDS))), eligible)
        want = want & first_occurrence((addr,), eligible)
    # The less loaded bucket first (loads before the call); rows that overflow it try the
    # other one.
    load = jnp.sum(t.pages[bk] > 0, axis=2)  # [N, 2]
    pick = (load[:, 1] < load[:, 0]).astype(jnp.int32)
    first = jnp.take_along_axis(bk, pick[:, None], axis=1)[:, 0]
    second = jnp.take_along_axis(bk, 1 - pick[:, None], axis=1)[:, 0]
    t, placed1 = _place(t, k, pages, addr, first, want, rank_within(first, want))
    w2 = want & ~placed1
    # A row overflows its less loaded bucket only when that bucket is (nearly) full: rare
    # below full load, so the second pass (a rank, a gather, three scatters) is skipped when
    # no row overflowed. One branch writes, the other passes the tables through: no copy.
    t, placed2 = jax.lax.cond(
        jnp.any(w2),
        lambda tb: _place(tb, k, pages, addr, second, w2, rank_within(second, w2)),
        lambda tb: (tb, jnp.zeros_like(w2)),
        t,
    )
    return t, placed1 | placed2, held, present


def insert(
    index: PrefixIndex, keys: jax.Array, pages: jax.Array, valid: jax.Array | None = None
) -> tuple[PrefixIndex, jax.Array]:
    """Publishes blocks: ``key -> page``, first publisher wins.

    Same as :func:`insert_held` without its third result.
    """
    index, taken, _ = insert_held(index, keys, pages, valid)
    return index, taken


def insert_held(
    index: PrefixIndex, keys: jax.Array, pages: jax.Array, valid: jax.Array | None = None
) -> tuple[PrefixIndex, jax.Array, jax.Array]:
    """Publishes blocks: ``key -> page``, first publisher wins.

    A row takes effect iff it is valid, its page is a usable page (``1 .. num_pages - 2``) not
    already held by the index and its key is not already present (the row is *eligible*), no
    earlier eligible row of the batch has the same key or the same page, and its bucket pair
    has a free entry. The caller adds
    one index reference to the page of every row that took effect (and only those).

    Args:
      index: the group's index.
      keys: uint32[N, KEY_WORDS].
      pages: int32[N].
      valid: optional bool[N].

    Returns:
      ``(index, taken, held)``: the new index, bool[N] (the row took effect) and bool[N]
      (the index held the row's page before the call: :func:`holds` on the old index, read
      in the same pass — reading the old index after the in-place update would make XLA copy
      its ``slot_of_page``).
    """
    k = _flat_keys(index, keys)
    n = k.shape[0]
    pages = _per_key("pages", pages, n, "page")
    v = _valid(valid, (n,))
    usable = (pages >= 1) & (pages <= index.num_pages - 2)
    t = _Tables(index.keys, index.pages, index.slot_of_page)
    t, taken, held, _ = _insert(t, k, pages, pages, _buckets(index, k), v & usable, None)
    count = index.count + jnp.sum(taken, dtype=jnp.int32)
    return PrefixIndex(*t, count=count), taken, held


def insert_groups(
    indexes: tuple[PrefixIndex, ...],
    sizes: tuple[int, ...],
    keys: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
) -> tuple[tuple[PrefixIndex, ...], jax.Array, jax.Array]:
    """:func:`insert_held` into several indexes at once: the same result as one call per index.

    The rows are the concatenation of each index's rows (``sizes[i]`` rows for
    ``indexes[i]``, a static split): :func:`insert_mixed` with those group numbers.

    Args:
      indexes: the indexes, in order.
      sizes: static, rows per index (``sum(sizes) == N``).
      keys: uint32[N, KEY_WORDS].
      pages: int32[N], pages of each row's own index's pool.
      valid: bool[N].

    Returns:
      ``(indexes, taken, held)`` as :func:`insert_held`, per row.
    """
    if len(sizes) != len(indexes) or any(not isinstance(n, int) or n < 0 for n in sizes):
        fail(
            "sizes",
            sizes,
            f"one non-negative int per index ({len(indexes)})",
            "pass the static row count of each index",
        )
    k = _flat_keys(indexes[0], keys) if indexes else keys
    n = sum(sizes)
    pages = jnp.asarray(pages)
    if pages.shape != (n,) or pages.dtype != jnp.int32 or k.shape[0] != n:
        fail(
            "pages",
            f"{pages.dtype}{list(pages.shape)}",
            f"one int32 page per key, shape ({n},) = sum(sizes)",
            "pass int32[N] and keys of N rows",
        )
    gid = jnp.concatenate([jnp.full((m,), i, jnp.int32) for i, m in enumerate(sizes)])
    out, taken, held, _ = insert_mixed(indexes, gid, k, pages, valid)
    return out, taken, held


def insert_mixed(
    indexes: tuple[PrefixIndex, ...],
    group: jax.Array,
    keys: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
) -> tuple[tuple[PrefixIndex, ...], jax.Array, jax.Array, jax.Array]:
    """:func:`insert_held` into several indexes, row ``i`` into ``indexes[group[i]]``.

    The same result as one :func:`insert_held` per index on its rows (first publisher wins
    per index, in row order), for rows of every index mixed in any order. The indexes are
    packed into one :class:`PrefixIndexSet` for the call (a copy of every table: for tests
    and tools; the coordinator keeps its indexes in a set and calls :func:`insert_in`).

    Args:
      indexes: the indexes.
      group: int32[N], each row's index (rows with another value are ignored).
      keys: uint32[N, KEY_WORDS].
      pages: int32[N], pages of each row's own index's pool.
      valid: bool[N].

    Returns:
      ``(indexes, taken, held, present)``: as :func:`insert_held` per row, plus int32[N], the
      page holding each valid row's key before the call (0: none).
    """
    k = _flat_keys(indexes[0], keys) if indexes else keys
    n = k.shape[0]
    _per_key("pages", pages, n, "page")
    _per_key("group", group, n, "index number")
    ixs, taken, held, present = insert_in(pack(indexes), group, k, pages, valid)
    return unpack(ixs), taken, held, present


def remove(
    index: PrefixIndex,
    pages: jax.Array,
    valid: jax.Array | None = None,
    *,
    distinct: bool = False,
) -> tuple[PrefixIndex, jax.Array]:
    """Drops the entries holding ``pages`` (eviction, or invalidating a page's content).

    Args:
      index: the group's index.
      pages: int32[N] (duplicates and pages the index does not hold are fine).
      valid: optional bool[N].
      distinct: static; True promises that no page is listed twice among the valid rows
        (an LRU eviction's pages, each popped once), which skips the sort that counts
        distinct pages. A wrong promise miscounts ``count``.

    Returns:
      ``(index, removed)``: bool[N], whether the index held the page before the call (true
      for every duplicate of such a page). The caller drops one index reference per distinct
      removed page.
    """
    pages = _pages_1d(pages)
    v = _valid(valid, pages.shape)
    t, removed, once = _remove(
        _Tables(index.keys, index.pages, index.slot_of_page), pages, v, distinct
    )
    return PrefixIndex(*t, count=index.count - jnp.sum(once, dtype=jnp.int32)), removed


def _pages_1d(pages) -> jax.Array:
    pages = jnp.asarray(pages)
    if pages.ndim != 1 or pages.dtype != jnp.int32:
        fail(
            "pages",
            f"{pages.dtype}{list(pages.shape)}",
            "pages are int32[N]",
            "pass a flat int32 array",
        )
    return pages


def _remove(
    t: _Tables, addr: jax.Array, v: jax.Array, distinct: bool
) -> tuple[_Tables, jax.Array, jax.Array]:
    """Drops the entries at ``addr`` (entries of ``slot_of_page``); returns the tables, which
    rows were held and which of them are the first of their address (each counted once)."""
    removed = v & _held_at(t.slot_of_page, addr)
    n = t.slot_of_page.shape[0]
    slot = t.slot_of_page[jnp.clip(addr, 0, n - 1)]
    cap = t.pages.size
    target = jnp.where(removed, slot, cap)
    once = removed if distinct else first_occurrence((addr,), removed)
    new = _Tables(
        keys=t.keys.reshape(cap, KEY_WORDS)
        .at[target]
        .set(jnp.uint32(0), mode="drop")
        .reshape(t.keys.shape),
        pages=t.pages.reshape(cap).at[target].set(0, mode="drop").reshape(t.pages.shape),
        slot_of_page=t.slot_of_page.at[jnp.where(removed, addr, n)].set(-1, mode="drop"),
    )
    return new, removed, once


def remove_keys(
    index: PrefixIndex, keys: jax.Array, valid: jax.Array | None = None
) -> tuple[PrefixIndex, jax.Array]:
    """Drops the entries of ``keys``; returns ``(index, pages)`` with the page each key held (0 if absent)."""
    shape = keys.shape[:-1]
    k = _flat_keys(index, keys)
    v = _valid(valid, shape)
    page, _ = _find(index, k)
    page = jnp.where(v, page, 0)
    index, _ = remove(index, page, page > 0)
    return index, page.reshape(shape)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["keys", "pages", "slot_of_page", "count"],
    meta_fields=["num_buckets", "num_pages"],
)
@dataclasses.dataclass(frozen=True)
class PrefixIndexSet:
    """Every group's index in one set of flat arrays (the coordinator's state holds one).

    Group ``g``'s buckets are rows ``[bucket_offset[g], bucket_offset[g] + num_buckets[g])``
    of ``keys``/``pages``, its pages entries ``[page_offset[g], page_offset[g] +
    num_pages[g])`` of ``slot_of_page``; slots are flat entries of the whole table. Each
    group behaves exactly as its own :class:`PrefixIndex` (:func:`view`), but one batched
    operation serves rows of every group at once: one lookup, one insert, one removal, as
    many ops as for one group (per-group copies of every op were most of the coordinator's
    publish and sweep programs) and four state leaves instead of four per group.

    Attributes:
      keys: uint32[sum(num_buckets), WAYS, KEY_WORDS].
      pages: int32[sum(num_buckets), WAYS]; an entry's page (of its group's pool), 0 empty.
      slot_of_page: int32[sum(num_pages)], the flat entry holding each page, or -1.
      count: int32[G], entries in use per group.
      num_buckets: static, buckets per group (powers of two).
      num_pages: static, pages per group's pool.
    """

    keys: jax.Array
    pages: jax.Array
    slot_of_page: jax.Array
    count: jax.Array
    num_buckets: tuple[int, ...]
    num_pages: tuple[int, ...]

    @property
    def groups(self) -> int:
        return len(self.num_buckets)

    @property
    def bucket_offset(self) -> tuple[int, ...]:
        return _offsets(self.num_buckets)

    @property
    def page_offset(self) -> tuple[int, ...]:
        return _offsets(self.num_pages)


def _offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Where each block of ``sizes`` starts when they are laid end to end."""
    return tuple(itertools.accumulate((0, *sizes[:-1])))


def create_index_set(plan: CachePlan) -> PrefixIndexSet:
    """An empty set of every group of ``plan``, each sized as :func:`create_indexes` sizes it."""
    return pack(create_indexes(plan))


def clear_set(ixs: PrefixIndexSet) -> PrefixIndexSet:
    """An empty set of the same shape (O(capacity + pages): for wake/repair, not per step)."""
    return pack(tuple(clear(view(ixs, g)) for g in range(ixs.groups)))


def pack(indexes: tuple[PrefixIndex, ...]) -> PrefixIndexSet:
    """The indexes as one set (copies every table; slots renumbered to the set's entries)."""
    boff = _offsets(tuple(ix.num_buckets for ix in indexes))
    sop = [
        jnp.where(ix.slot_of_page >= 0, ix.slot_of_page + o * WAYS, -1)
        for ix, o in zip(indexes, boff, strict=True)
    ]
    return PrefixIndexSet(
        keys=jnp.concatenate([ix.keys for ix in indexes]),
        pages=jnp.concatenate([ix.pages for ix in indexes]),
        slot_of_page=jnp.concatenate(sop),
        count=jnp.stack([ix.count for ix in indexes]),
        num_buckets=tuple(ix.num_buckets for ix in indexes),
        num_pages=tuple(ix.num_pages for ix in indexes),
    )


def view(ixs: PrefixIndexSet, g: int) -> PrefixIndex:
    """Group ``g`` (static) of the set as a :class:`PrefixIndex` (slices; read-only use)."""
    b0, nb = ixs.bucket_offset[g], ixs.num_buckets[g]
    p0, npg = ixs.page_offset[g], ixs.num_pages[g]
    sop = ixs.slot_of_page[p0 : p0 + npg]
    # NumPy arrays stay NumPy (an audit slices a host copy without device ops).
    where = np.where if isinstance(sop, np.ndarray) else jnp.where
    return PrefixIndex(
        keys=ixs.keys[b0 : b0 + nb],
        pages=ixs.pages[b0 : b0 + nb],
        slot_of_page=where(sop >= 0, sop - b0 * WAYS, -1),
        count=ixs.count[g],
    )


def unpack(ixs: PrefixIndexSet) -> tuple[PrefixIndex, ...]:
    """Every group of the set as its own :class:`PrefixIndex` (:func:`view` of each)."""
    return tuple(view(ixs, g) for g in range(ixs.groups))


def _address(ixs: PrefixIndexSet, group: jax.Array, k: jax.Array | None, pages: jax.Array):
    """Per row of ``group``: whether the group exists, the bucket pair of its key in the set
    (``None`` without keys), the page's entry in ``slot_of_page`` (out of range for a page
    outside its pool) and whether the page is usable (``1 .. num_pages - 2``)."""
    known, gi, addr, usable = page_address(ixs.num_pages, group, pages)
    bk = None
    if k is not None:
        mask = (jnp.asarray(ixs.num_buckets, jnp.int32)[gi] - 1).astype(jnp.uint32)
        b0 = jnp.asarray(ixs.bucket_offset, jnp.int32)[gi]
        bk = jnp.stack([k[:, 0] & mask, k[:, 1] & mask], axis=1).astype(jnp.int32)
        bk = bk + b0[:, None]
    return known, bk, addr, usable


def page_address(num_pages: tuple[int, ...], group: jax.Array, pages: jax.Array):
    """Pools of ``num_pages`` pages laid end to end (a set's per-page arrays): per row,
    ``(known, gi, addr, usable)``: the pool exists, its number clipped, the page's entry
    (out of range, ``sum(num_pages)``, for a page outside its pool) and whether the page is
    usable (``1 .. num_pages - 2``). Shared by the index set and the LRU set."""
    g_n = len(num_pages)
    known = (group >= 0) & (group < g_n)
    gi = jnp.clip(group, 0, g_n - 1)
    npg = jnp.asarray(num_pages, jnp.int32)[gi]
    in_pool = known & (pages >= 0) & (pages < npg)
    offset = jnp.asarray(_offsets(num_pages), jnp.int32)[gi]
    addr = jnp.where(in_pool, offset + pages, sum(num_pages))
    return known, gi, addr, known & (pages >= 1) & (pages <= npg - 2)


def _as_group(group, n: int) -> jax.Array:
    if isinstance(group, int) and not isinstance(group, bool):
        return jnp.full((n,), group, jnp.int32)
    return _per_key("group", group, n, "group number")


def lookup_in(ixs: PrefixIndexSet, group, keys: jax.Array, valid=None) -> jax.Array:
    """:func:`lookup` in the set: each key in its row's group (``group``: an int for every
    row, or int32[N] per flattened key). Returns int32[...], the page, 0 on a miss."""
    shape = keys.shape[:-1]
    k = _flat_keys(ixs, keys)
    n = k.shape[0]
    known, bk, _, _ = _address(ixs, _as_group(group, n), k, jnp.zeros((n,), jnp.int32))
    page, _ = _find_at(ixs.keys, ixs.pages, bk, k)
    return jnp.where(_valid(valid, shape) & known, page, 0).reshape(shape)


def holds_in(ixs: PrefixIndexSet, group, pages: jax.Array) -> jax.Array:
    """:func:`holds` in the set: bool[N], whether each page's group index holds it."""
    pages = _pages_1d(jnp.asarray(pages, jnp.int32))
    _, _, addr, _ = _address(ixs, _as_group(group, pages.shape[0]), None, pages)
    return _held_at(ixs.slot_of_page, addr)


def insert_in(
    ixs: PrefixIndexSet,
    group,
    keys: jax.Array,
    pages: jax.Array,
    valid: jax.Array | None = None,
    *,
    distinct: bool = False,
) -> tuple[PrefixIndexSet, jax.Array, jax.Array, jax.Array]:
    """:func:`insert_held` in the set, row ``i`` into group ``group[i]`` (rows of an unknown
    group are ignored): the result of one :func:`insert_held` per group on its rows, in row
    order, for rows of every group mixed in any order.

    Args:
      ixs: the set.
      group: int32[N] (or an int for every row).
      keys: uint32[N, KEY_WORDS].
      pages: int32[N], pages of each row's own group's pool.
      valid: optional bool[N].
      distinct: static; True promises that no two valid rows share a group and a key, nor a
        group and a page (one request's blocks: each key covers another length, each
        table entry holds another page), which skips the two duplicate rules (pairwise
        compares: ~85 us for a one-row prefill's ~200 blocks on the 2-vCPU machine). A
        wrong promise lets two rows write one bucket entry or one page's slot.

    Returns:
      ``(ixs, taken, held, present)``: as :func:`insert_held` per row, plus int32[N], the
      page holding each valid row's key in its group before the call (0: none).
    """
    k = _flat_keys(ixs, keys)
    n = k.shape[0]
    pages = _per_key("pages", pages, n, "page")
    group = _as_group(group, n)
    v = _valid(valid, (n,))
    known, bk, addr, usable = _address(ixs, group, k, pages)
    v = v & known
    t = _Tables(ixs.keys, ixs.pages, ixs.slot_of_page)
    t, taken, held, present = _insert(t, k, pages, addr, bk, v & usable, group, distinct)
    count = ixs.count.at[jnp.where(taken, group, ixs.groups)].add(1, mode="drop")
    new = PrefixIndexSet(*t, count=count, num_buckets=ixs.num_buckets, num_pages=ixs.num_pages)
    return new, taken, held & known, jnp.where(v, present, 0)


def remove_in(
    ixs: PrefixIndexSet,
    group,
    pages: jax.Array,
    valid: jax.Array | None = None,
    *,
    distinct: bool = False,
) -> tuple[PrefixIndexSet, jax.Array]:
    """:func:`remove` in the set: drops the entries holding each row's page in its group.

    Returns ``(ixs, removed)`` as :func:`remove` (``distinct`` likewise)."""
    pages = _pages_1d(pages)
    n = pages.shape[0]
    group = _as_group(group, n)
    known, _, addr, _ = _address(ixs, group, None, pages)
    v = _valid(valid, (n,)) & known
    t, removed, once = _remove(_Tables(ixs.keys, ixs.pages, ixs.slot_of_page), addr, v, distinct)
    count = ixs.count.at[jnp.where(once, group, ixs.groups)].add(-1, mode="drop")
    new = PrefixIndexSet(*t, count=count, num_buckets=ixs.num_buckets, num_pages=ixs.num_pages)
    return new, removed
