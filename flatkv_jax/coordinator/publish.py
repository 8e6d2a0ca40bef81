"""Publishing: the prefix index side of the operations. Admission matches, pins and takes hit
pages; a commit publishes the blocks it completed (first publisher wins) and shares the page
that holds a block's key when another page was first."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flatkv_jax.block_pool import decref, incref
from flatkv_jax.coordinator.layout import state_layout
from flatkv_jax.coordinator.rows import replace, set_rows
from flatkv_jax.coordinator.state import CacheState, pool_layout, table_size
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import keys as keys_lib
from flatkv_jax.prefix import lru as lru_lib
from flatkv_jax.prefix._batch import first_index, first_occurrence
from flatkv_jax.prefix.match import MatchLayout

_I32 = jnp.int32


@functools.cache
def match_layout(plan: CachePlan, max_len: int) -> MatchLayout:
    return MatchLayout.for_plan(plan, max_len)


def hit_listing(plan: CachePlan, m, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every matched page of ``rows`` across groups: ``(group int32[N], page int32[N])``,
    pages < 1 where nothing is listed (grouped by pool, as :func:`decref` wants)."""
    groups, pages = [], []
    # The compact listing: O(hit pages) entries per row, not every table slot.
    for g, p in enumerate(m.listed):
        groups.append(jnp.full((p.size,), g, _I32))
        pages.append(jnp.where(rows[:, None] & (p > 0), p, -1).reshape(-1))
    del plan
    return jnp.concatenate(groups), jnp.concatenate(pages)


def pin(plan: CachePlan, state: CacheState, m, rows: jax.Array, on: bool):
    """Sets (``on``) the pin mask of every page ``rows`` matched; returns the state, the
    distinct cached-only pinned pages per pool (``int32[G]``) and the listing."""
    group, pages = hit_listing(plan, m, rows)
    listed = pages > 0
    pinned, cached = [], []
    distinct = first_occurrence((group, pages), listed)
    for g in range(len(plan.groups)):
        mine = (group == g) & listed
        p = jnp.where(mine, pages, state.pinned[g].shape[0])
        pinned.append(state.pinned[g].at[p].set(on, mode="drop"))
        in_lru = state.lrus[g].cached[jnp.clip(pages, 0, state.pinned[g].shape[0] - 1)]
        cached.append(jnp.sum(distinct & mine & in_lru, dtype=_I32))
    return replace(state, pinned=tuple(pinned)), jnp.stack(cached), (group, pages)


def take_hits(plan: CachePlan, state: CacheState, m, s: jax.Array, served, listing) -> CacheState:
    """Served rows take their hit pages (+1 reference, out of the LRU) into their tables;
    the pin mask is cleared again."""
    lay = state_layout(plan)
    group, pages = listing
    listed = pages > 0
    pinned, lrus = [], []
    for g in range(len(plan.groups)):
        mine = (group == g) & listed
        p = jnp.where(mine, pages, state.pinned[g].shape[0])
        # Always False (a count is never negative), but it depends on what the eviction cond
        # computed: that orders the cond's reads of the mask before this in-place write
        # (otherwise XLA copies the whole mask).
        clear = jnp.broadcast_to(state.lrus[g].count < 0, p.shape)
        pinned.append(state.pinned[g].at[p].set(clear, mode="drop"))
    take_rows = jnp.concatenate(
        [jnp.broadcast_to(served[:, None], p.shape).reshape(-1) for p in m.listed]
    )
    took = listed & take_rows
    for g in range(len(plan.groups)):
        lr, _ = lru_lib.take(state.lrus[g], jnp.where(took & (group == g), pages, 0))
        lrus.append(lr)
    pools = incref(state.allocator, pool_layout(plan), group, jnp.where(took, pages, -1))
    tables = state.table_buffer
    for g, p in enumerate(m.pages):
        w = lay.table_width[g]
        cols = min(p.shape[1], w)
        j = jnp.arange(cols, dtype=_I32)[None, :]
        idx = lay.table_offset[g] + s[:, None] * w + j
        val = p[:, :cols]
        ok = served[:, None] & (val >= 0)
        tables = tables.at[jnp.where(ok, idx, table_size(plan))].set(val, mode="drop")
    return replace(
        state, pinned=tuple(pinned), lrus=tuple(lrus), allocator=pools, table_buffer=tables
    )


def publish_blocks(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    pub: jax.Array,
    c_old: jax.Array,
    accepted: jax.Array,
    head: jax.Array,
    width: int,
) -> CacheState:
    """Publishes the blocks completed in ``(c_old, c_old + accepted]`` of rows ``pub`` (their
    step's tokens, continued from the request's chain state ``S(c_old)``), and advances the
    chain to ``S(c_old + accepted)``. First publisher wins, rows in batch order, per row and
    group older blocks first. ``width`` (static) bounds ``accepted``: only that many of the
    step's token columns are hashed.

    A completed block whose key another page already holds (published earlier, or by an
    earlier row of this call) is **shared**: the row's table entry takes the holder page (+1
    reference; out of the LRU if it was cached-only) and the row's own copy, which only this
    table referenced, is freed. Both pages hold the same tokens' KV, so nothing the request
    reads changes; the request keeps the indexed page alive, so every committed block stays
    in the index while the request holds it and a release has nothing left to publish
    (docs/semantics.md, "Prefix reuse"). A block whose insert overflows its bucket pair is
    not cached (a later miss, never a wrong hit).
    """
    layout = pool_layout(plan)
    a = jnp.where(pub, accepted, 0)
    ns = state.namespace[s]
    toks = state.fifo_tokens[s, head, :width]
    # Only the `width` accepted-token columns are hashed (lanes [B, width, LANES]).
    lanes, chain = keys_lib.extend_chain(state.chain[s], toks, c_old, a, ns, seed=state.key_seed)
    offered = [
        _completed_blocks(plan, state, g, s, pub, c_old, c_old + a, lanes, width)
        for g in range(len(plan.groups))
    ]
    indexes, taken, present, keys = _insert_blocks(state.indexes, offered, ns)
    groups = jnp.concatenate([b.group.reshape(-1) for b in offered])
    pages = jnp.concatenate([b.page.reshape(-1) for b in offered])
    tidx = jnp.concatenate([b.table_index.reshape(-1) for b in offered])
    valid = jnp.concatenate([b.valid.reshape(-1) for b in offered])
    pools = incref(state.allocator, layout, groups, jnp.where(taken, pages, -1))
    # Not taken and not already this page's key: another page holds it (from before the call,
    # or an earlier row of this call took it), or its bucket pair is full.
    others = valid & ~taken & (present != pages)
    state = replace(
        state,
        allocator=pools,
        indexes=tuple(indexes),
        chain=set_rows(state.chain, s, pub, chain),
    )
    # Sharing happens only when a request recomputed blocks another page holds (a prefix
    # evicted in some group but not in all, or two requests computing one prompt at once):
    # skip its sort and scatters on every other step. The cond carries only the arrays it
    # writes (an LRU's ring passed through a cond is copied by XLA, every step).
    marks = tuple((lr.cached, lr.count) for lr in state.lrus)
    pools, marks, tables = jax.lax.cond(
        jnp.any(others),
        lambda pl, mk, tb: _share_blocks(
            plan, pl, mk, tb, _Offered(groups, pages, tidx, valid, taken, present, keys, others)
        ),
        lambda pl, mk, tb: (pl, mk, tb),
        state.allocator,
        marks,
        state.table_buffer,
    )
    lrus = tuple(
        dataclasses.replace(lr, cached=c, count=n)
        for lr, (c, n) in zip(state.lrus, marks, strict=True)
    )
    return replace(state, allocator=pools, lrus=lrus, table_buffer=tables)


class _Offered(NamedTuple):
    """Every offered block of one publish, flattened (groups in order)."""

    group: jax.Array  # int32[N]
    page: jax.Array  # int32[N]: the row's own page
    table_index: jax.Array  # int32[N]: its entry in ``table_buffer``
    valid: jax.Array  # bool[N]
    taken: jax.Array  # bool[N]: the index took this page
    present: jax.Array  # int32[N]: the page holding the key before the call (0: none)
    keys: jax.Array  # uint32[N, KEY_WORDS]
    others: jax.Array  # bool[N]: not taken, key not held by this page


def _share_blocks(plan: CachePlan, pools, marks, tables, o: _Offered):
    """Rows whose key another page holds switch their table entry to that page; ``marks``
    are the LRUs' ``(cached, count)`` (taking a page touches nothing else)."""
    layout = pool_layout(plan)
    # A key absent before the call and not taken by this row: the first row of the call with
    # the same key took it (its page holds it now), or its bucket pair was full (nothing).
    cols = (o.group, *(o.keys[:, w] for w in range(keys_lib.KEY_WORDS)))
    first = first_index(cols, o.valid & (o.present == 0))
    f = jnp.clip(first, 0, o.page.shape[0] - 1)
    in_call = jnp.where((first >= 0) & o.taken[f], o.page[f], 0)
    holder = jnp.where(o.present > 0, o.present, in_call)
    share = o.others & (holder > 0)
    # The holder gains this table's reference first, then the own copy (one reference: this
    # table's; never indexed) drops to 0 and is freed. Listings stay grouped by pool.
    pools = incref(pools, layout, o.group, jnp.where(share, holder, -1))
    pools, _ = decref(pools, layout, o.group, jnp.where(share, o.page, -1))
    marks = lru_lib.take_marks(marks, o.group, holder, share)
    idx = jnp.where(share, o.table_index, table_size(plan))
    return pools, marks, tables.at[idx].set(holder, mode="drop")


class _Blocks(NamedTuple):
    """Blocks of one group offered to the index, ``[B, N]`` per row."""

    group: jax.Array  # int32: the group
    ends: jax.Array  # int32: the block's end position (its key covers tokens [0, end))
    sums: jax.Array  # uint32[B, N, LANES]: the chain state at ``end``
    table_index: jax.Array  # int32: the block's entry in ``table_buffer``
    page: jax.Array  # int32: the page the table holds there
    valid: jax.Array  # bool: offered (a complete committed block whose page is not a hole)


def hit_run_start(block_tokens: int, window: int, granularity: int, ends):
    """For a window group's block ending at ``ends``: the first block of the trailing run of
    the nearest hit boundary at or after it (``h``, the next multiple of ``granularity``).

    A match at ``h`` needs the blocks ``[max(0, (h - W + 1) // B), h / B)``; later
    boundaries start their runs later still, so a block below this start is in no run and
    no admission can ever read it from the index: it is not published (its page is freed,
    not cached, when the request lets it go).
    """
    h = (ends + granularity - 1) // granularity * granularity
    run = (h - window + 1) // block_tokens
    return jnp.maximum(run, 0)


def _completed_blocks(
    plan: CachePlan,
    state: CacheState,
    g: int,
    s: jax.Array,
    pub: jax.Array,
    c_old: jax.Array,
    c_new: jax.Array,
    lanes: jax.Array,
    width: int,
) -> _Blocks:
    """Group ``g``'s blocks completed in ``(c_old, c_new]`` (at most ``width // B + 1`` per
    row)."""
    lay = state_layout(plan)
    bt, w = lay.block_tokens[g], lay.table_width[g]
    n_ends = width // bt + 1
    ends = (c_old[:, None] // bt + 1 + jnp.arange(n_ends, dtype=_I32)[None, :]) * bt
    ok = pub[:, None] & (ends <= c_new[:, None])
    at = jnp.clip(ends - c_old[:, None] - 1, 0, width - 1)
    new_sums = jnp.take_along_axis(lanes, at[:, :, None], axis=1)
    slot = jnp.clip(ends // bt - 1, 0, w - 1)
    if lay.is_window[g]:
        ok = ok & (
            ends // bt - 1 >= hit_run_start(bt, lay.window[g], plan.prefix_granularity, ends)
        )
    tidx = lay.table_offset[g] + s[:, None] * w + slot
    entry = state.table_buffer[tidx]
    group = jnp.full(ok.shape, g, _I32)
    return _Blocks(group, ends, new_sums, tidx, entry, ok & (entry >= 1))


def _insert_blocks(indexes, offered: list[_Blocks], ns: jax.Array):
    """Inserts every group's offered blocks into its index (first publisher wins), all groups
    in one :func:`~flatkv_jax.prefix.index.insert_groups` (4 sorts per step, not 4 per
    group); returns the indexes and, per flattened block (groups in order), whether its page
    was taken, the page that held its key before the call (0: none) and its key."""
    sizes = tuple(b.valid.size for b in offered)
    valid = jnp.concatenate([b.valid.reshape(-1) for b in offered])

    def insert(ixs):
        keys = [
            keys_lib.keys_from_lanes(b.sums, b.ends, ns).reshape(-1, keys_lib.KEY_WORDS)
            for b in offered
        ]
        # Read before the insert writes (a read of the written index would copy it).
        present = jnp.concatenate(
            [
                index_lib.lookup(ix, k, b.valid.reshape(-1))
                for ix, k, b in zip(ixs, keys, offered, strict=True)
            ]
        )
        keys = jnp.concatenate(keys)
        pages = jnp.concatenate([b.page.reshape(-1) for b in offered])
        ixs, taken, _ = index_lib.insert_groups(ixs, sizes, keys, pages, valid)
        return ixs, taken, present, keys

    def skip(ixs):
        n = valid.shape[0]
        return (
            ixs,
            jnp.zeros((n,), jnp.bool_),
            jnp.zeros((n,), _I32),
            jnp.zeros((n, keys_lib.KEY_WORDS), jnp.uint32),
        )

    # A step that completes no block (or only holes) skips the insert's sorts and scatters.
    return jax.lax.cond(jnp.any(valid), insert, skip, tuple(indexes))
