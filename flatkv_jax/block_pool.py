"""BlockPoolSet: the page allocator of every pool of a plan at once (free stacks + refcounts).

All pools live in three flat arrays with static per-pool offsets (:class:`PoolLayout`), so one
call allocates or returns pages in every pool with a handful of vectorised XLA ops instead of
a handful per pool — on CPU each op costs about a microsecond whatever its size, so ops across
G pools must not multiply by G.

Every function costs O(pages touched) — the pages taken or returned by the call, bounded by
the static shapes of its arguments — and never scans a pool: a pool of 1M pages costs the same
per call as one of 16k pages (the arrays are donated, so XLA updates them in place).

Page states (docs/semantics.md): **free** (refcount 0, on its pool's free stack), **in use**
(referenced by at least one table entry) and **cached-only** (held only by the prefix index). ``refcount(page) == #table references + #index references``. Page 0 (null) and the
last page (scratch) of every pool are never on a stack and never handed out.

Allocation order: pages are popped from the top of the pool's free stack. A pool that is
short of free pages evicts cached-only pages (LRU, :mod:`flatkv_jax.prefix.lru`): the
coordinator decides the served rows against :func:`evictable_pages` with :func:`fit`, evicts
the shortfall, drops the evicted pages' index reference with :func:`decref` (which pushes them
onto the stack) and then pops with :func:`allocate`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.plan import RESERVED_PAGES

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Static placement of every pool in the flat allocator arrays (hashable).

    Pool ``g``'s refcounts are ``refcount[page_offset[g] : page_offset[g] + num_pages[g]]``
    (indexed by the pool's own page ids) and its free stack is
    ``free_ids[stack_offset[g] : stack_offset[g] + top[g]]`` (the pool's own page ids).

    Attributes:
      num_pages: per pool, pages of its pool array including the null and scratch pages.
    """

    num_pages: tuple[int, ...]

    @property
    def num_pools(self) -> int:
        return len(self.num_pages)

    @property
    def usable(self) -> tuple[int, ...]:
        return tuple(n - RESERVED_PAGES for n in self.num_pages)

    @functools.cached_property
    def page_offset(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0, *self.num_pages[:-1])))

    @functools.cached_property
    def stack_offset(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0, *self.usable[:-1])))

    @property
    def total_pages(self) -> int:
        return sum(self.num_pages)

    @property
    def total_usable(self) -> int:
        return sum(self.usable)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockPoolSet:
    """Allocator state of every pool (a pytree of three arrays; see :class:`PoolLayout`).

    Attributes:
      free_ids: ``int32[sum of usable pages]``, the free stacks of all pools, each in its
        segment; the next page pool ``g`` hands out is ``free_ids[stack_offset[g] + top[g] - 1]``.
      top: ``int32[G]``, free pages per pool.
      refcount: ``int32[sum of num_pages]``, references per page (table + index entries).
    """

    free_ids: jax.Array
    top: jax.Array
    refcount: jax.Array

    def pool(self, layout: PoolLayout, g: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Pool ``g``'s view: ``(free stack int32[top], top int32[], refcount int32[num_pages])``
        (host-side inspection; the slices copy)."""
        so, po = layout.stack_offset[g], layout.page_offset[g]
        top = self.top[g]
        return self.free_ids[so : so + int(top)], top, self.refcount[po : po + layout.num_pages[g]]


def create_block_pool_set(layout: PoolLayout) -> BlockPoolSet:
    """Every usable page of every pool free; each pool hands out its page 1 first."""
    ids = np.concatenate([np.arange(u, 0, -1, dtype=np.int32) for u in layout.usable])
    return BlockPoolSet(
        free_ids=jnp.asarray(ids),
        top=jnp.asarray(layout.usable, _I32),
        refcount=jnp.zeros((layout.total_pages,), _I32),
    )


def evictable_pages(top: jax.Array, cached: jax.Array, pinned_cached: jax.Array) -> jax.Array:
    """Per pool, the supply of the in-order allocation rule: free + unpinned cached-only pages.

    Args:
      top: ``int32[G]``, free pages per pool.
      cached: ``int32[G]``, cached-only pages per pool (``CachedLRU.count``).
      pinned_cached: ``int32[G]``, cached-only pages matched by a row of the current admit
        (pinned: not evictable during the call).
    """
    return top + cached - pinned_cached


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Allocation:
    """What :func:`allocate` decided for a batch.

    Attributes:
      served: ``bool[B]``, rows that got every page they asked for in every pool.
      short_group: ``int32[B]``, for the first row that could not be served, the first pool
        (plan order) that was short; -1 elsewhere.
      short_pages: ``int32[B]``, pages missing in that pool for that row; 0 elsewhere.
      pages: ``int32[B, G, K]``: row ``r``'s new pages of pool ``g`` (the pool's own ids) in
        columns ``[0, needs[r, g])``, -1 elsewhere (and for rows not served).
    """

    served: jax.Array
    short_group: jax.Array
    short_pages: jax.Array
    pages: jax.Array


def fit(
    needs: jax.Array, want: jax.Array, avail: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Which rows of a batch an in-order allocation serves (reads nothing, changes nothing).

    Args:
      needs: ``int32[B, G]``, pages each row needs in each pool.
      want: ``bool[B]``, rows that ask for pages.
      avail: ``int32[G]``, the supply per pool (free, plus evictable cached-only pages).

    Returns:
      ``(served bool[B], short_group int32[B], short_pages int32[B], total int32[G])``:
      see :class:`Allocation`; ``total`` is the pages the served rows take per pool.
    """
    served, short_group, short_pages, total, _ = fit_sums(needs.T, want, avail)
    return served, short_group, short_pages, total


def fit_sums(
    needs: jax.Array, want: jax.Array, avail: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`fit` for group-major ``needs`` (``int32[G, B]``), also returning its running
    sums ``int32[G, B]`` (each wanting row's needs plus those of the wanting rows before it),
    which :func:`pop_fitted` takes: one cumulative sum per allocation, not one per use (each
    costs ~10 us on XLA:CPU at ``[6, 256]``). Group-major, as the coordinator's ``hi`` and
    zero lists are: a row-major ``[B, G]`` pass made XLA transpose the sums in each of the
    five fusions that read them."""
    b = needs.shape[1]
    needs = jnp.where(want[None, :], needs, 0)
    incl = jnp.cumsum(needs, axis=1, dtype=_I32)  # [G, B]
    fits_g = incl <= avail[:, None]
    # incl is monotone in the row index, so "fits" is too: the rows served are a prefix of the
    # wanting rows (the FIFO rule of docs/semantics.md) without any sequential scan.
    served = want & jnp.all(fits_g, axis=0)
    failed = want & ~served
    first = jnp.argmax(failed)
    g_short = jnp.argmax(~fits_g[:, first]).astype(_I32)
    is_first = jnp.any(failed) & (jnp.arange(b, dtype=_I32) == first)
    short_group = jnp.where(is_first, g_short, -1)
    short_pages = jnp.where(is_first, incl[g_short, first] - avail[g_short], 0)
    total = jnp.sum(jnp.where(served[None, :], needs, 0), axis=1, dtype=_I32)
    return served, short_group, short_pages, total, incl


def allocate(
    allocator: BlockPoolSet,
    layout: PoolLayout,
    needs: jax.Array,
    want: jax.Array,
    k: int,
    avail: jax.Array | None = None,
) -> tuple[BlockPoolSet, Allocation]:
    """Atomic multi-pool allocation for a batch of requests, served in batch order.

    Rows are served in order; the first row whose needs do not all fit (given the rows served
    before it) and every later row are not served, and no pool changes for them. Pages taken
    get refcount 1 and are popped from the free stacks.

    With the prefix index the caller decides the served rows against the supply
    (:func:`evictable_pages`) with :func:`fit`, evicts what the free stacks lack and pushes the
    evicted pages onto the stacks (:func:`decref` of their index reference), then calls this
    with ``want = served``: every served row then fits the stacks alone.

    Args:
      allocator: the allocator (donated by the caller's jit).
      layout: its static layout.
      needs: ``int32[B, G]``, pages each row needs in each pool (``0 <= needs <= k``).
      want: ``bool[B]``, rows that ask for pages (others are ignored and not served).
      k: static bound on ``needs`` (the last axis of ``pages``).
      avail: ``int32[G]``, supply for the FIFO rule (default: the free stacks).

    Returns:
      The new allocator and an :class:`Allocation`. Cost: O(B * G * k), independent of pool size.
    """
    served, short_group, short_pages, total, incl = fit_sums(
        needs.T, want, allocator.top if avail is None else avail
    )
    allocator, pages = pop_fitted(allocator, layout, needs.T, served, incl, total, k)
    return allocator, Allocation(served, short_group, short_pages, jnp.transpose(pages, (1, 0, 2)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Evicted:
    """Pages evicted from the prefix index for an allocation (:func:`pop_fitted`), each still
    holding the index's one reference.

    Attributes:
      pages: ``int32[E]``, pool ``g``'s evicted pages in the ``E_g`` entries from
        ``offset[g]``, in eviction (LRU) order, padded with -1.
      count: ``int32[G]``, pages evicted per pool (a prefix of each pool's entries).
      offset: static, per pool, where its entries start in ``pages``.
    """

    pages: jax.Array
    count: jax.Array
    offset: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def pop_fitted(
    allocator: BlockPoolSet,
    layout: PoolLayout,
    needs: jax.Array,
    served: jax.Array,
    incl: jax.Array,
    total: jax.Array,
    k: int,
    evicted: Evicted | None = None,
) -> tuple[BlockPoolSet, jax.Array]:
    """Pops the pages of the rows a :func:`fit_sums` served, whose supply the free stacks now
    hold (:func:`allocate` without its fit: a caller that fitted against a larger supply and
    evicted the difference does not fit again).

    With ``evicted`` (pages just evicted from the prefix index, each still holding the one
    reference the index had) the supply is the stacks plus those pages, handed out first and
    in the order a push of them onto the stacks followed by the pops would give (the result
    equals :func:`decref` of the evicted pages and then this without ``evicted``, up to the
    stale stack slots above the new top): the allocation takes the index's reference over,
    so no refcount drops to 0 and nothing is pushed. Every evicted page must be taken
    (``evicted.count <= total``, as when the stacks' shortfall is what was evicted): one left
    over would keep a reference nothing holds.

    Args:
      allocator: the allocator (donated by the caller's jit); its stacks hold ``total``.
      layout: its static layout.
      needs: ``int32[G, B]``, as passed to :func:`fit_sums` (group-major).
      served, incl, total: :func:`fit_sums`'s served rows, running sums and totals.
      k: static bound on ``needs``.
      evicted: optional :class:`Evicted` pages, taken before the stacks.

    Returns:
      The new allocator and ``int32[G, B, K]`` pages: pool ``g``'s pages of row ``r`` in
        ``[g, r, :needs[g, r]]``, -1 elsewhere (:attr:`Allocation.pages` transposed: that one
        is row-major, as :func:`allocate` returns it).
    """
    need = jnp.where(served[None, :], needs, 0)  # [G, B]
    # The served rows are a prefix of the wanting rows: their running sums are the served
    # rows' own, so each row's first page sits `incl - need` below the top.
    excl = incl - need
    j = jnp.arange(k, dtype=_I32)[None, None, :]
    take = j < need[:, :, None]  # [G, B, K]
    depth = excl[:, :, None] + j  # pages popped before this one, per pool
    stack_off = jnp.asarray(layout.stack_offset, _I32)[:, None, None]
    top = allocator.top[:, None, None]
    if evicted is None:
        pages = allocator.free_ids[
            jnp.clip(stack_off + top - 1 - depth, 0, layout.total_usable - 1)
        ]
        new_top = allocator.top - total
    else:
        # As if pushed (in listing order) and popped: the last evicted page comes off first.
        n_ev = evicted.count[:, None, None]
        ev_off = jnp.asarray(evicted.offset, _I32)[:, None, None]
        from_ev = depth < n_ev
        n_pages = evicted.pages.shape[0]
        ev_page = evicted.pages[jnp.clip(ev_off + n_ev - 1 - depth, 0, max(n_pages - 1, 0))]
        pos = stack_off + top - 1 - (depth - n_ev)
        st_page = allocator.free_ids[jnp.clip(pos, 0, layout.total_usable - 1)]
        pages = jnp.where(from_ev, ev_page, st_page)
        new_top = allocator.top + evicted.count - total
    pages = jnp.where(take, pages, -1)
    page_off = jnp.asarray(layout.page_offset, _I32)[:, None, None]
    flat = jnp.where(take, page_off + pages, layout.total_pages)
    # An evicted page already holds one reference (the index's, taken over): 1 either way.
    refcount = allocator.refcount.at[flat].set(1, mode="drop")
    return BlockPoolSet(allocator.free_ids, new_top, refcount), pages


def incref(
    allocator: BlockPoolSet, layout: PoolLayout, group: jax.Array, pages: jax.Array
) -> BlockPoolSet:
    """Adds one reference to page ``pages[i]`` of pool ``group[i]`` (pages < 1 skip; a page
    listed twice gains two). For pages that gain a reference while held (prefix hits, issue 5).
    """
    flat = flat_ids(layout, group, pages)
    rc = allocator.refcount.at[jnp.where(flat >= 0, flat, layout.total_pages)].add(1, mode="drop")
    return BlockPoolSet(allocator.free_ids, allocator.top, rc)


def decref(
    allocator: BlockPoolSet,
    layout: PoolLayout,
    group: jax.Array,
    pages: jax.Array,
    *,
    distinct: bool = False,
) -> tuple[BlockPoolSet, jax.Array]:
    """Drops one reference per listed page and pushes pages that reach 0 onto their free stack.

    Listings must be grouped by pool (``group`` non-decreasing within each pool's run, as the
    coordinator's sweeps produce them). When every listed page holds a single reference (no
    prefix sharing) each page is listed once and the call is a gather, a scatter and two prefix
    scans, O(T). A page with several references may be listed several times (shared by several
    requests of the batch): it loses one reference per listing and is pushed once; when a
    pairwise check of the shared pages' listings finds one listed twice (or there are more than
    :data:`SUSPECTS`), that path sorts the listing (O(T log T), no pool-sized scratch). Either way the refcounts are read
    once, then written once with values that depend on the read — a write -> read -> write ->
    read chain, or a read used only after the write, would make XLA copy the whole array.

    Args:
      allocator: the allocator (donated by the caller's jit).
      layout: its static layout.
      group: ``int32[T]``, the pool of each listing.
      pages: ``int32[T]``, page ids within that pool; ids < 1 skip.
      distinct: static; the caller promises no page is listed twice (an eviction's pages):
        no check for repeats, no sort path.

    Returns:
      The new allocator and ``int32[G]``, pages freed per pool.
    """
    allocator, freed, _, _ = decref_left(allocator, layout, group, pages, distinct=distinct)
    return allocator, freed


def decref_left(
    allocator: BlockPoolSet,
    layout: PoolLayout,
    group: jax.Array,
    pages: jax.Array,
    held: jax.Array | None = None,
    *,
    distinct: bool = False,
) -> tuple[BlockPoolSet, jax.Array, jax.Array, jax.Array]:
    """:func:`decref`, also returning ``int32[T]``: each listed page's references left after
    the call (-1 for skipped listings) — a page left with only the prefix index's reference
    became cached-only. Returned rather than read back, which would copy the refcounts.

    Args:
      held: optional ``bool[T]``, whether the prefix index holds each listed page (one of its
        references is the index's). A page listed ``d`` times has at least ``d`` references
        besides the index's, so only listings whose page has more references than one
        listing plus the index's can repeat (suspects: a sweep dropping pages the index also
        holds has none; a prefill whose hit pages other requests hold, a few dozen). Up to
        :data:`SUSPECTS` suspects are compared pairwise, and the listing is sorted only when
        two of them name one page or there are more (without ``held``, every page with two
        references is a suspect).
      distinct: static; the caller promises no page is listed twice: the check and the
        sorted path are left out (``repeated`` is False).

    Returns:
      ``(allocator, freed, left, repeated)``: ``repeated`` is a ``bool[]``, False when no page
      was listed twice (callers may skip their own dedupes then); True when one was, or when
      more than :data:`SUSPECTS` listings were suspects.
    """
    flat = flat_ids(layout, group, pages).reshape(-1)
    group = group.reshape(-1)
    old = allocator.refcount[jnp.clip(flat, 0, layout.total_pages - 1)]
    if distinct:
        # An eviction's pages (each popped once from its LRU): no repeat check, no cond (~10
        # thunks fewer per evicting step).
        shared = jnp.zeros((), jnp.bool_)
        planned = _plan_unique(layout, flat, group, old)
    else:
        others = 1 if held is None else 1 + held.reshape(-1).astype(_I32)
        shared = _listed_twice(flat, (flat >= 0) & (old > others))
        # The cond only plans (listing-sized outputs); the refcounts and the stacks are
        # written once, after it: a cond whose two branches both write a buffer makes XLA
        # copy the buffer (every refcount and stack of every pool, on every call).
        planned = jax.lax.cond(
            shared,
            lambda: _plan_sorted(allocator, layout, flat, group),
            lambda: _plan_unique(layout, flat, group, old),
        )
    target, new, push_flat, push_group, win, left = planned
    rc = allocator.refcount.at[target].set(new, mode="drop")
    allocator, freed = _push(allocator, layout, rc, push_flat, push_group, win)
    return allocator, freed, left, shared


#: Suspects (listings whose page has more references than the listing explains) compared
#: pairwise by :func:`_listed_twice`; more than this many fall back to the sort.
SUSPECTS = 64


def _listed_twice(flat: jax.Array, suspect: jax.Array) -> jax.Array:
    """Whether some page is listed twice (``bool[]``), from ``suspect``: the listings whose
    page has more references than one listing (plus the index's) explains. A page listed
    ``d >= 2`` times has at least ``d`` references besides the index's, so every listing of
    it is a suspect, and a page shared with another request but listed once is a suspect
    that matches no other one. Up to :data:`SUSPECTS` suspects are compared pairwise (a
    prefill whose hit pages other requests hold lists a few dozen); more answer True, the
    sorted path, which is right in every case."""
    t = flat.shape[0]
    k = min(t, SUSPECTS)
    at = jnp.nonzero(suspect, size=k, fill_value=t)[0]
    # Unused slots get distinct negative ids: they match nothing.
    ids = jnp.where(at < t, flat[jnp.clip(at, 0, t - 1)], -1 - jnp.arange(k, dtype=_I32))
    same = (ids[:, None] == ids[None, :]) & ~jnp.eye(k, dtype=jnp.bool_)
    return (jnp.sum(suspect, dtype=_I32) > k) | jnp.any(same)


def _plan_unique(layout: PoolLayout, flat, group, old):
    """Every listed page listed once: each loses one reference."""
    valid = flat >= 0
    new = old - 1
    target = jnp.where(valid, flat, layout.total_pages)
    return target, new, flat, group, valid & (new == 0), jnp.where(valid, new, -1)


def _plan_sorted(allocator: BlockPoolSet, layout: PoolLayout, flat, group):
    """Pages may be listed several times: sort the listing so each page is written once."""
    t = flat.shape[0]
    big = jnp.iinfo(_I32).max
    idx = jnp.arange(t, dtype=_I32)
    # Sorting by flat id keeps the listings grouped by pool (pool offsets ascend).
    ps, gs, orig = jax.lax.sort((jnp.where(flat >= 0, flat, big), group, idx), num_keys=1)
    valid = ps != big
    first = jnp.concatenate([jnp.ones((1,), jnp.bool_), ps[1:] != ps[:-1]])
    # Listings of each page: from its first listing to the next page's first listing.
    next_first = jax.lax.cummin(jnp.where(first, idx, t), axis=0, reverse=True)
    next_first = jnp.concatenate([next_first[1:], jnp.full((1,), t, _I32)])
    new = allocator.refcount[jnp.clip(ps, 0, layout.total_pages - 1)] - (next_first - idx)
    lead = valid & first
    run_lead = jax.lax.cummax(jnp.where(first, idx, 0), axis=0)
    left = jnp.where(valid, new[run_lead], -1)
    target = jnp.where(lead, ps, layout.total_pages)
    return target, new, ps, gs, lead & (new == 0), jnp.zeros((t,), _I32).at[orig].set(left)


def _push(allocator: BlockPoolSet, layout: PoolLayout, rc, flat, group, win):
    """Pushes the pages of ``win`` (flat ids, listings grouped by pool) onto their stacks."""
    win_i = win.astype(_I32)
    excl = jnp.cumsum(win_i, dtype=_I32) - win_i
    # Rank among this call's frees of the same pool: wins since the pool's first listing.
    g_start = jnp.concatenate([jnp.ones((1,), jnp.bool_), group[1:] != group[:-1]])
    rank = excl - jax.lax.cummax(jnp.where(g_start, excl, 0), axis=0)
    g_safe = jnp.clip(group, 0, layout.num_pools - 1)
    stack_off = jnp.asarray(layout.stack_offset, _I32)
    page_off = jnp.asarray(layout.page_offset, _I32)
    freed = (
        jnp.zeros((layout.num_pools,), _I32)
        .at[jnp.where(win, g_safe, layout.num_pools)]
        .add(1, mode="drop")
    )
    slot = jnp.where(win, stack_off[g_safe] + allocator.top[g_safe] + rank, layout.total_usable)
    free_ids = allocator.free_ids.at[slot].set(flat - page_off[g_safe], mode="drop")
    return BlockPoolSet(free_ids, allocator.top + freed, rc), freed


def flat_ids(layout: PoolLayout, group: jax.Array, pages: jax.Array) -> jax.Array:
    """Flat refcount index of (pool, page), or -1 for pages < 1 (never the null page). Any
    per-page array laid out as the refcounts (the coordinator's pin mask) uses it too."""
    page_off = jnp.asarray(layout.page_offset, _I32)
    return jnp.where(pages > 0, page_off[jnp.clip(group, 0, layout.num_pools - 1)] + pages, -1)
