"""Allocation: growing requests' tables (with LRU eviction of cached-only pages when a free
stack runs dry), sweeping table ranges back (decref, free or cache) and freeing requests."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.block_pool import (
    Evicted,
    decref,
    decref_left,
    evictable_pages,
    fit_sums,
    pop_fitted,
)
from flatkv_jax.coordinator.layout import ceil_div_groups, per_group, state_layout
from flatkv_jax.coordinator.rows import ceil_div, replace, set_cols, set_rows
from flatkv_jax.coordinator.segments import segment_rows
from flatkv_jax.coordinator.state import CacheState, pool_layout, table_size
from flatkv_jax.errors import check_positive_int
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import lru as lru_lib

_I32 = jnp.int32


class Grown(NamedTuple):
    """What :func:`grow` did, per row: ``served`` ``bool[B]``; ``short_group`` and
    ``short_pages`` ``int32[B]`` (:class:`~flatkv_jax.block_pool.Allocation`); ``zero``
    ``int32[G, B * K]``, per pool row ``r``'s new pages in entries ``[r * K, (r + 1) * K)``,
    -1 elsewhere (:attr:`~flatkv_jax.coordinator.results.StepResult.zero`)."""

    served: jax.Array
    short_group: jax.Array
    short_pages: jax.Array
    zero: jax.Array


def grow(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    want: jax.Array,
    new_end: jax.Array,
    k: int,
    hi: jax.Array | None = None,
    pinned_cached: jax.Array | None = None,
    top_up: bool = False,
) -> tuple[CacheState, Grown]:
    """Allocates every block ``[hi, ceil(new_end / B))`` of every group, atomically, in order.

    Supply per pool is free + unpinned cached-only pages; the served rows take the free stack
    first and only then evict LRU cached-only pages (pages matched by the current admission
    are pinned in ``state.pinned``). Returns the state with tables and ``hi`` updated for the
    served rows and a :class:`Grown`. Everything is group-major (``[G, B]``, ``[G, B, K]``),
    as ``state.hi`` and the zero lists are: no transposes. With ``plan.evict_ahead_tokens``
    and ``top_up`` (``admit`` passes True, ``extend`` leaves it False), a call that evicted
    then tops up every pool's free stack (:func:`evict_ahead`).

    Args:
      hi: ``int32[G, B]`` first slot to allocate (default: the slot's ``hi``; admit passes
        the hit's ``h / B``).
      pinned_cached: ``int32[G]`` cached-only pages pinned by this call (default 0).
    """
    lay = state_layout(plan)
    layout = pool_layout(plan)
    n_g = len(plan.groups)
    hi = state.hi[:, s] if hi is None else hi  # [G, B]
    needs = jnp.maximum(0, ceil_div_groups(new_end[None, :], lay.block_tokens, 0) - hi)
    needs = jnp.where(want[None, :], needs, 0)
    top = state.allocator.top
    if state.prefix:
        cached = state.lru.count
        pc = jnp.zeros((n_g,), _I32) if pinned_cached is None else pinned_cached
        supply = evictable_pages(top, cached, pc)
        served, short_group, short_pages, total, incl = fit_sums(needs, want, supply)
        short = jnp.maximum(total - top, 0)
        bounds = evict_bounds(plan, s.shape[0], k)
        none = (jnp.full((sum(bounds),), -1, _I32), jnp.zeros((n_g,), _I32))
        # Eviction only when a free stack runs dry (skip its loops otherwise). The evicted
        # pages go to the served rows with the index's reference: no decref, no push.
        state, (ev_pages, ev_count) = jax.lax.cond(
            jnp.any(short > 0),
            lambda st: evict_pages(plan, st, short, bounds),
            lambda st: (st, none),
            state,
        )
        evicted = Evicted(ev_pages, ev_count, tuple(int(x) for x in np.cumsum((0, *bounds[:-1]))))
    else:
        served, short_group, short_pages, total, incl = fit_sums(needs, want, top)
        evicted = None
    # Fitted once: the served rows' pages are the free stacks' and the evicted ones.
    pools, pages = pop_fitted(state.allocator, layout, needs, served, incl, total, k, evicted)
    take = pages >= 0  # [G, B, K]
    j = jnp.arange(k, dtype=_I32)[None, None, :]
    row_base = (
        per_group(lay.table_offset)[:, None] + s[None, :] * per_group(lay.table_width)[:, None]
    )
    idx = (row_base + hi)[:, :, None] + j
    tables = state.table_buffer.at[jnp.where(take, idx, table_size(plan))].set(pages, mode="drop")
    hi_arr = set_cols(state.hi, s, served, hi + jnp.sum(take, axis=2, dtype=_I32))
    state = replace(state, allocator=pools, table_buffer=tables, hi=hi_arr)
    if state.prefix and plan.evict_ahead_tokens and top_up:
        state = evict_ahead(plan, state, short)
    return state, Grown(served, short_group, short_pages, pages.reshape(n_g, -1))


def evict_ahead(plan: CachePlan, state: CacheState, short: jax.Array) -> CacheState:
    """After an allocation that had to evict (``short[g] > 0`` for some pool): tops up every
    pool's free stack to :meth:`~flatkv_jax.plan.CachePlan.evict_ahead_pages` pages by
    evicting its LRU cached-only (unpinned) pages (fewer if fewer are left), so the next
    steps find free pages. Every pool at once: pools run dry at different steps, and one
    eviction per pool would evict about as often as none ahead. A call that evicted
    nowhere runs none of it (a cond). Only admissions top up (measured on the vs_vllm
    trace, B = 256, T = 16: decode x0.95 with admissions topping up, x0.96 with admissions
    and decode steps, x1.04 with decode steps alone, the second eviction loop costing an
    evicting decode step more than the evictions it saved)."""
    ahead = tuple(plan.evict_ahead_pages(g) for g in plan.groups)
    room = jnp.maximum(jnp.asarray(ahead, _I32) - state.allocator.top, 0)
    n = jnp.where(jnp.any(short > 0), room, 0)
    return jax.lax.cond(jnp.any(n > 0), lambda st: evict(plan, st, n, ahead), lambda st: st, state)


def evict_bounds(plan: CachePlan, b: int, k: int) -> tuple[int, ...]:
    """Per pool (static): the most pages ``b`` rows of a grow with ``k`` pages per row can
    take from it, ``b * min(k, ceil(k * B_min / B_g))``: a step of at most ``k * B_min`` tokens
    opens at most that many blocks of span ``B_g``. Eviction never needs more (V4-Flash
    admission of 4,096 tokens: 2,688 pages over the six pools instead of 6 x 1,024)."""
    spans = state_layout(plan).block_tokens
    return tuple(b * min(k, -(-k * min(spans) // bt)) for bt in spans)


def evict_pages(
    plan: CachePlan, state: CacheState, n: jax.Array, max_pages: tuple[int, ...]
) -> tuple[CacheState, tuple[jax.Array, jax.Array]]:
    """Evicts ``n[g]`` LRU cached-only (unpinned) pages of every pool from the LRU and the
    index, **keeping** the index's reference on each: the caller hands them out (their one
    reference becomes a table's; :class:`~flatkv_jax.block_pool.Evicted`) or drops it.

    Returns:
      The state and ``(pages int32[sum(max_pages)], count int32[G])``: pool ``g``'s evicted
      pages in LRU order in its ``max_pages[g]`` entries (pools in order), padded with -1.
    """
    # Every pool in one loop (seven per-pool loops cost ~70 thunks per evicting step).
    lru, pages, count = lru_lib.evict_all(state.lru, n, max_pages=max_pages, pinned=state.pinned)
    group = jnp.asarray(np.repeat(np.arange(len(plan.groups), dtype=np.int32), max_pages))
    # Every pool's evicted pages leave the index in one removal (each popped once: distinct).
    index, _ = index_lib.remove_in(state.index, group, pages, pages >= 0, distinct=True)
    return replace(state, lru=lru, index=index), (pages, count)


def evict(
    plan: CachePlan, state: CacheState, n: jax.Array, max_pages: int | tuple[int, ...]
) -> CacheState:
    """Evicts ``n[g]`` LRU cached-only (unpinned) pages of every pool: they leave the index,
    lose its reference and go onto the free stack. ``max_pages`` (static) bounds ``n[g]``:
    one int for every pool, or one per pool; the removal and the decref walk their sum.
    (An allocation uses :func:`evict_pages` and takes the pages over instead.)"""
    n_g = len(plan.groups)
    bounds = (max_pages,) * n_g if isinstance(max_pages, int) else tuple(max_pages)
    state, (pages, _) = evict_pages(plan, state, n, bounds)
    group = jnp.asarray(np.repeat(np.arange(n_g, dtype=np.int32), bounds))
    pools, _ = decref(state.allocator, pool_layout(plan), group, pages, distinct=True)
    return replace(state, allocator=pools)


def sweep(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    mask: jax.Array,
    start: jax.Array,
    end: jax.Array,
    fill: int | jax.Array,
    chunk: int,
    *,
    one_request: bool | None = None,
) -> CacheState:
    """For every group ``g`` and row ``i`` of ``mask``: sets table entries
    ``[start[g, i], end[g, i])`` of request ``s[i]`` to ``fill`` (an int, or ``int32[B]``: one
    value per row) and decrefs the pages they held: a page falling to 0 is freed, a page left
    with only the index's reference becomes cached-only (pushed onto its pool's LRU). Entries
    are visited per group, rows in batch order, each row from its highest slot down, so a
    row's pages become cached-only tail first (the oracle's tie order). Cost O(entries
    changed), in chunks of ``chunk`` entries across all groups. ``one_request`` (static):
    every segment belongs to one request, so no page is listed twice (default: ``s`` has one
    row)."""
    lay = state_layout(plan)
    layout = pool_layout(plan)
    n_g, b = start.shape
    length = jnp.where(mask[None, :], jnp.maximum(end - start, 0), 0).reshape(-1)  # [G * B]
    incl = jnp.cumsum(length, dtype=_I32)
    excl = incl - length
    total = incl[-1]
    group = jnp.broadcast_to(jnp.arange(n_g, dtype=_I32)[:, None], (n_g, b)).reshape(-1)
    row_base = (
        per_group(lay.table_offset)[:, None] + per_group(lay.table_width)[:, None] * s[None, :]
    ).reshape(-1)
    # Table index of flat entry e is last[q] - e: each segment is walked from its end down.
    last = (row_base + start.reshape(-1) + length - 1) + excl
    size = table_size(plan)
    one = b == 1 if one_request is None else one_request
    # One fill per flat segment when rows differ (a release's -1 beside a reclaim's holes).
    fills = None if isinstance(fill, int) else jnp.broadcast_to(fill, (n_g, b)).reshape(-1)

    def body(i, carry):
        # The index is only read, but rides in the carry: a loop-invariant operand that is
        # also live after the loop makes XLA copy it (its slot_of_page, every call).
        pools, tables, lru, index = carry
        e = i * chunk + jnp.arange(chunk, dtype=_I32)
        on = e < total
        q = segment_rows(excl, length, i * chunk, chunk)
        idx = last[q] - e
        old = tables[jnp.where(on, idx, 0)]
        # The written value depends on `old` (it never equals INT32_MIN), which pins the gather
        # before the scatter; a gather used only after it makes XLA copy the whole buffer.
        value = jnp.where(old == jnp.iinfo(_I32).min, old, fill if fills is None else fills[q])
        tables = tables.at[jnp.where(on, idx, size)].set(value, mode="drop")
        pages = jnp.where(on, old, -1)
        gq = group[q]
        held = jnp.zeros((chunk,), jnp.bool_)
        if index is not None:  # none without a prefix index
            held = index_lib.holds_in(index, gq, pages)
        # With `held`, decref sorts only when some page is listed twice (two requests of
        # the batch share it), not whenever a dropped page is also indexed (every step of a
        # decode batch drops published window pages).
        # One row's entries hold distinct pages (a page holds one block): no repeat check.
        pools, _, left, repeated = decref_left(pools, layout, gq, pages, held, distinct=one)
        # Left with only the index's reference: cached-only now.
        now_cached = held & (pages > 0) & (left == 1)
        # Every pool's pushes in one batched release; most chunks push nothing at all: skip
        # it then. No page listed twice: no dedupe (sort) either.
        if lru is not None:  # none without a prefix index
            lru = jax.lax.cond(
                jnp.any(now_cached),
                lambda lr: lru_lib.cache_in(
                    lr, gq, pages, now_cached, repeats=repeated, grouped=True
                ),
                lambda lr: lr,
                lru,
            )
        return pools, tables, lru, index

    pools, tables, lru, index = jax.lax.fori_loop(
        0,
        ceil_div(total, chunk),
        body,
        (state.allocator, state.table_buffer, state.lru, state.index),
    )
    return replace(state, allocator=pools, table_buffer=tables, lru=lru, index=index)


def free_now(
    plan: CachePlan, state: CacheState, s: jax.Array, mask: jax.Array, chunk: int | None = None
) -> CacheState:
    """Frees requests now: drop every table reference, reset the slot and bump its generation.

    Nothing is published here: every committed block was offered to the index by the
    ``retire`` that committed it (and is indexed, or shares the page that holds its key).
    ``chunk`` (static): the sweep's entries per iteration (default :func:`release_chunk`);
    the result is the same for any value.
    """
    b = s.shape[0]
    hi = state.hi[:, s]
    chunk = release_chunk(b) if chunk is None else chunk
    state = sweep(plan, state, s, mask, jnp.zeros_like(hi), hi, -1, chunk)
    return forget_rows(state, s, mask)


def forget_rows(state: CacheState, s: jax.Array, mask: jax.Array) -> CacheState:
    """The row half of :func:`free_now`: resets the slots of ``s[mask]`` and bumps their
    generation, leaving tables and pages as they are (the caller sweeps ``[0, hi)`` of each
    row with fill -1, before or after: the two touch disjoint parts of the state)."""
    zeros = jnp.zeros_like(state.hi[:, s])
    return replace(
        state,
        keyed=set_rows(state.keyed, s, mask, False),
        admit_hashed=set_rows(state.admit_hashed, s, mask, False),
        lo=set_cols(state.lo, s, mask, zeros),
        hi=set_cols(state.hi, s, mask, zeros),
        live=set_rows(state.live, s, mask, False),
        generation=set_rows(state.generation, s, mask, state.generation[s] + 1),
        pending=set_rows(state.pending, s, mask, 0),
        extent=set_rows(state.extent, s, mask, 0),
        committed=set_rows(state.committed, s, mask, 0),
        fifo_head=set_rows(state.fifo_head, s, mask, 0),
        fifo_len=set_rows(state.fifo_len, s, mask, 0),
    )


def release_chunk(b: int) -> int:
    # One chunk covers a few short requests; long requests loop (cost follows their length).
    return max(256, 8 * b)


def reclaim_chunk(plan: CachePlan, b: int, max_count: int | None = None) -> int:
    """Entries per sweep iteration of a reclaim of ``b`` rows.

    A decode step drops at most a block per window group and request, and usually only in
    the small-block groups: a chunk of one entry per request is one or two iterations. After
    ``max_count`` committed tokens a row drops up to ``max_count / B + 1`` columns per window
    group: the chunk covers that (a power of two, at most 2,048: each iteration sorts its
    chunk twice), instead of looping 64 entries at a time.
    """
    if max_count is None:
        return max(64, b)
    check_positive_int("max_count", max_count)
    lay = state_layout(plan)
    per_row = sum(
        max_count // bt + 1 for bt, win in zip(lay.block_tokens, lay.is_window, strict=True) if win
    )
    want = max(64, b, b * per_row)
    return min(1 << (want - 1).bit_length(), max(2048, b))
