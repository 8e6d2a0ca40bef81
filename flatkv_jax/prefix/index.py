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
import math

import jax
import jax.numpy as jnp

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
    bk = _buckets(index, k)
    cand_keys = index.keys[bk]  # [N, 2, WAYS, KEY_WORDS]
    cand_pages = index.pages[bk]  # [N, 2, WAYS]
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
    pages = jnp.asarray(pages, jnp.int32)
    ok = (pages >= 0) & (pages < index.num_pages)
    return ok & (index.slot_of_page[jnp.clip(pages, 0, index.num_pages - 1)] >= 0)


def _place(
    index: PrefixIndex,
    k: jax.Array,
    pages: jax.Array,
    bucket: jax.Array,
    want: jax.Array,
    rank: jax.Array | None = None,
) -> tuple[PrefixIndex, jax.Array]:
    """Writes the wanted rows into free ways of ``bucket``; rows that do not fit are not placed.

    ``rank``: each wanted row's rank among the wanted rows of its bucket (batch order);
    computed here unless the caller ranked several indexes' rows in one sort."""
    if rank is None:
        rank = rank_within(bucket, want)
    free = index.pages[bucket] == 0  # [N, WAYS]
    nth = jnp.cumsum(free.astype(jnp.int32), axis=1)
    placed = want & (rank < nth[:, -1])
    way = jnp.argmax(free & (nth == rank[:, None] + 1), axis=1).astype(jnp.int32)
    slot = bucket * WAYS + way
    cap = index.capacity
    target = jnp.where(placed, slot, cap)  # cap is out of range: dropped
    new = PrefixIndex(
        keys=index.keys.reshape(cap, KEY_WORDS)
        .at[target]
        .set(k, mode="drop")
        .reshape(index.keys.shape),
        pages=index.pages.reshape(cap)
        .at[target]
        .set(pages, mode="drop")
        .reshape(index.pages.shape),
        slot_of_page=index.slot_of_page.at[jnp.where(placed, pages, index.num_pages)].set(
            slot, mode="drop"
        ),
        count=index.count + jnp.sum(placed, dtype=jnp.int32),
    )
    return new, placed


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
    present, _ = _find(index, k)
    held = holds(index, pages)
    eligible = v & usable & (present == 0) & ~held
    # Both duplicate rules are relative to the same eligible set, so the outcome does not
    # depend on which rule is applied first.
    want = eligible & first_occurrence(tuple(k[:, w] for w in range(KEY_WORDS)), eligible)
    want = want & first_occurrence((pages,), eligible)
    first, second = _pick_buckets(index, k)
    index, placed1 = _place(index, k, pages, first, want)
    index, placed2 = _place(index, k, pages, second, want & ~placed1)
    return index, placed1 | placed2, held


def _pick_buckets(index: PrefixIndex, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, second) bucket of each key: the less loaded one first (loads before the call)."""
    bk = _buckets(index, k)
    load = jnp.sum(index.pages[bk] > 0, axis=2)  # [N, 2]
    pick = (load[:, 1] < load[:, 0]).astype(jnp.int32)
    first = jnp.take_along_axis(bk, pick[:, None], axis=1)[:, 0]
    second = jnp.take_along_axis(bk, 1 - pick[:, None], axis=1)[:, 0]
    return first, second


def insert_groups(
    indexes: tuple[PrefixIndex, ...],
    sizes: tuple[int, ...],
    keys: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
) -> tuple[tuple[PrefixIndex, ...], jax.Array, jax.Array]:
    """:func:`insert_held` into several indexes at once: the same result as one call per index.

    The rows are the concatenation of each index's rows (``sizes[i]`` rows for
    ``indexes[i]``, a static split). Lookups and writes stay per index (they touch only its
    entries), but the batch-wide steps — the two first-publisher-wins rules and the ranks
    within a bucket — are one sort each over all rows with the index number as the leading
    column, instead of one sort per index: publishing into every group's index runs 4 sorts,
    not 4 per group. (The coordinator compacts its sparse rows and uses
    :func:`insert_mixed`, which takes rows of any index in any order.)

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
    v = _valid(valid, (n,))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    cut = [slice(a, a + m) for a, m in zip(starts, sizes, strict=True)]
    eligible, held, first, second, b_off = [], [], [], [], 0
    boff = []
    for ix, sl in zip(indexes, cut, strict=True):
        kg, pg = k[sl], pages[sl]
        usable = (pg >= 1) & (pg <= ix.num_pages - 2)
        present, _ = _find(ix, kg)
        h = holds(ix, pg)
        held.append(h)
        eligible.append(v[sl] & usable & (present == 0) & ~h)
        f, s2 = _pick_buckets(ix, kg)
        first.append(f)
        second.append(s2)
        boff.append(b_off)
        b_off += ix.num_buckets
    eligible = jnp.concatenate(eligible)
    held = jnp.concatenate(held)
    gid = jnp.concatenate([jnp.full((m,), i, jnp.int32) for i, m in enumerate(sizes)])
    want = eligible & first_occurrence((gid, *(k[:, w] for w in range(KEY_WORDS))), eligible)
    want = want & first_occurrence((gid, pages), eligible)
    # Buckets numbered across indexes, so one sort ranks every index's rows.
    first_all = jnp.concatenate([f + o for f, o in zip(first, boff, strict=True)])
    second_all = jnp.concatenate([f + o for f, o in zip(second, boff, strict=True)])
    rank1 = rank_within(first_all, want)
    out, placed1 = [], []
    for i, (ix, sl) in enumerate(zip(indexes, cut, strict=True)):
        ix, p1 = _place(ix, k[sl], pages[sl], first[i], want[sl], rank1[sl])
        out.append(ix)
        placed1.append(p1)
    placed1 = jnp.concatenate(placed1)
    want2 = want & ~placed1
    rank2 = rank_within(second_all, want2)
    placed2 = []
    for i, sl in enumerate(cut):
        out[i], p2 = _place(out[i], k[sl], pages[sl], second[i], want2[sl], rank2[sl])
        placed2.append(p2)
    return tuple(out), placed1 | jnp.concatenate(placed2), held


def insert_mixed(
    indexes: tuple[PrefixIndex, ...],
    group: jax.Array,
    keys: jax.Array,
    pages: jax.Array,
    valid: jax.Array,
) -> tuple[tuple[PrefixIndex, ...], jax.Array, jax.Array, jax.Array]:
    """:func:`insert_held` into several indexes, row ``i`` into ``indexes[group[i]]``.

    The same result as :func:`insert_groups` on the rows stably sorted by group (first
    publisher wins per index, in row order), for rows of every index mixed in any order: a
    caller that compacted a sparse batch (the coordinator publishes a few completed blocks out
    of ``B x groups`` candidate rows) passes only those rows. Every index looks up every row
    (``O(N x indexes)`` compares, no sort), so keep ``N`` small; the batch-wide rules are 4
    sorts of ``N`` rows as in :func:`insert_groups`.

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
    pages = _per_key("pages", pages, n, "page")
    group = _per_key("group", group, n, "index number")
    v = _valid(valid, (n,))
    eligible = held = jnp.zeros((n,), bool)
    present = first = second = jnp.zeros((n,), jnp.int32)
    offsets, b_off = [], 0
    for g, ix in enumerate(indexes):
        ours = group == g
        mine = v & ours
        pg = jnp.where(ours, pages, 0)
        usable = (pg >= 1) & (pg <= ix.num_pages - 2)
        found, _ = _find(ix, k)
        h = ours & holds(ix, pg)
        held = held | h
        present = jnp.where(mine, found, present)
        eligible = eligible | (mine & usable & (found == 0) & ~h)
        f, s2 = _pick_buckets(ix, k)
        first = jnp.where(mine, f + b_off, first)
        second = jnp.where(mine, s2 + b_off, second)
        offsets.append(b_off)
        b_off += ix.num_buckets
    want = eligible & first_occurrence((group, *(k[:, w] for w in range(KEY_WORDS))), eligible)
    want = want & first_occurrence((group, pages), eligible)
    out = list(indexes)
    placed = jnp.zeros((n,), bool)
    for buckets in (first, second):
        w = want & ~placed
        rank = rank_within(buckets, w)
        for g, ix in enumerate(out):
            mine = group == g
            local = jnp.where(mine, buckets - offsets[g], 0)
            out[g], p = _place(ix, k, pages, local, w & mine, rank)
            placed = placed | p
    return tuple(out), placed, held, jnp.where(v, present, 0)


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
    pages = jnp.asarray(pages)
    if pages.ndim != 1 or pages.dtype != jnp.int32:
        fail(
            "pages",
            f"{pages.dtype}{list(pages.shape)}",
            "pages are int32[N]",
            "pass a flat int32 array",
        )
    v = _valid(valid, pages.shape)
    removed = v & holds(index, pages)
    slot = index.slot_of_page[jnp.clip(pages, 0, index.num_pages - 1)]
    cap = index.capacity
    target = jnp.where(removed, slot, cap)
    once = removed if distinct else first_occurrence((pages,), removed)
    new = PrefixIndex(
        keys=index.keys.reshape(cap, KEY_WORDS)
        .at[target]
        .set(jnp.uint32(0), mode="drop")
        .reshape(index.keys.shape),
        pages=index.pages.reshape(cap).at[target].set(0, mode="drop").reshape(index.pages.shape),
        slot_of_page=index.slot_of_page.at[jnp.where(removed, pages, index.num_pages)].set(
            -1, mode="drop"
        ),
        count=index.count - jnp.sum(once, dtype=jnp.int32),
    )
    return new, removed


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
