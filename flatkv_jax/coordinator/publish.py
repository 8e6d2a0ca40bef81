"""Publishing: the prefix index side of the operations. Admission matches, pins and takes hit
pages; a commit publishes the blocks it completed (first publisher wins) and remembers the
ones another page's key holds, to offer them again later."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flatkv_jax.block_pool import incref
from flatkv_jax.coordinator.batches import ReleaseMode
from flatkv_jax.coordinator.layout import state_layout
from flatkv_jax.coordinator.rows import replace, set_rows
from flatkv_jax.coordinator.state import CacheState, pool_layout, table_size
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import keys as keys_lib
from flatkv_jax.prefix import lru as lru_lib
from flatkv_jax.prefix._batch import first_occurrence
from flatkv_jax.prefix.match import MatchLayout

_I32 = jnp.int32


@functools.cache
def match_layout(plan: CachePlan, max_len: int) -> MatchLayout:
    return MatchLayout.for_plan(plan, max_len)


def hit_listing(plan: CachePlan, m, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every matched page of ``rows`` across groups: ``(group int32[N], page int32[N])``,
    pages < 1 where nothing is listed (grouped by pool, as :func:`decref` wants)."""
    groups, pages = [], []
    for g, p in enumerate(m.pages):
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
        [jnp.broadcast_to(served[:, None], p.shape).reshape(-1) for p in m.pages]
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
    retry: bool,
    width: int,
) -> CacheState:
    """Publishes the blocks completed in ``(c_old, c_old + accepted]`` of rows ``pub`` (their
    step's tokens, continued from the request's chain state ``S(c_old)``), and advances the
    chain to ``S(c_old + accepted)``. First publisher wins, rows in batch order, per row and
    group older blocks first. ``width`` (static) bounds ``accepted``: only that many of the
    step's token columns are hashed.

    A committed block whose key another page holds is remembered (``defer_*``: its chain
    state and table slot) and offered again at the request's next publish (``retry``): once
    the other page is evicted this request's copy is published, as docs/semantics.md asks
    ("every complete committed block ... not yet in the index"). Blocks that became holes
    are dropped from the list; a full list drops the newest (documented limit).
    """
    a = jnp.where(pub, accepted, 0)
    ns = state.namespace[s]
    toks = state.fifo_tokens[s, head, :width]
    # Only the `width` accepted-token columns are hashed (lanes [B, width, LANES]).
    lanes, chain = keys_lib.extend_chain(state.chain[s], toks, c_old, a, ns, seed=state.key_seed)
    offered = [
        _completed_blocks(plan, state, g, s, pub, c_old, c_old + a, lanes, width, retry)
        for g in range(len(plan.groups))
    ]
    indexes, taken, held = _insert_blocks(state.indexes, offered, ns)
    groups = jnp.concatenate([b.group.reshape(-1) for b in offered])
    pages = jnp.concatenate([b.page.reshape(-1) for b in offered])
    pools = incref(state.allocator, pool_layout(plan), groups, jnp.where(taken, pages, -1))
    waiting, at = [], 0
    for blocks in offered:
        n = blocks.valid.size
        # Offered but neither taken nor already held by this page: another page holds the key.
        done = (taken[at : at + n] | held[at : at + n]).reshape(blocks.valid.shape)
        waiting.append(blocks._replace(valid=blocks.valid & ~done))
        at += n
    # A row's list after this publish has at most as many entries as were offered: only
    # that many columns are written (entries past ``defer_len`` are never read), so a decode
    # step writes a few columns per row, not the whole ``[B, K]`` list.
    kd = min(state.defer_group.shape[1], sum(w.valid.shape[1] for w in waiting))
    dg, dslot, dsums, dlen = _compact_deferred(waiting, kd)
    rows = jnp.where(pub, s, state.max_requests)
    return replace(
        state,
        allocator=pools,
        indexes=tuple(indexes),
        chain=set_rows(state.chain, s, pub, chain),
        defer_group=state.defer_group.at[rows, :kd].set(dg, mode="drop"),
        defer_slot=state.defer_slot.at[rows, :kd].set(dslot, mode="drop"),
        defer_sums=state.defer_sums.at[rows, :kd].set(dsums, mode="drop"),
        defer_len=set_rows(state.defer_len, s, pub, dlen),
    )


class _Blocks(NamedTuple):
    """Blocks of one group offered to the index, ``[B, N]`` per row (deferred ones first)."""

    group: jax.Array  # int32: the group, for the deferred list
    ends: jax.Array  # int32: the block's end position (its key covers tokens [0, end))
    sums: jax.Array  # uint32[B, N, LANES]: the chain state at ``end``
    slot: jax.Array  # int32: the table column of the block
    page: jax.Array  # int32: the page the table holds there
    valid: jax.Array  # bool: offered (a complete committed block whose page is not a hole)


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
    retry: bool,
) -> _Blocks:
    """Group ``g``'s blocks completed in ``(c_old, c_new]`` (at most ``width // B + 1`` per
    row), preceded with ``retry`` by the rows' deferred blocks of that group."""
    lay = state_layout(plan)
    bt, w = lay.block_tokens[g], lay.table_width[g]
    n_ends = width // bt + 1
    ends = (c_old[:, None] // bt + 1 + jnp.arange(n_ends, dtype=_I32)[None, :]) * bt
    ok = pub[:, None] & (ends <= c_new[:, None])
    at = jnp.clip(ends - c_old[:, None] - 1, 0, width - 1)
    new_sums = jnp.take_along_axis(lanes, at[:, :, None], axis=1)
    slot = jnp.clip(ends // bt - 1, 0, w - 1)
    if retry:
        kd = state.defer_group.shape[1]
        d_on = pub[:, None] & (jnp.arange(kd, dtype=_I32)[None, :] < state.defer_len[s][:, None])
        d_group, d_slot, d_sums = state.defer_group[s], state.defer_slot[s], state.defer_sums[s]
        mine = d_on & (d_group == g)
        ends = jnp.concatenate([(d_slot + 1) * bt, ends], axis=1)
        ok = jnp.concatenate([mine, ok], axis=1)
        new_sums = jnp.concatenate([d_sums, new_sums], axis=1)
        slot = jnp.concatenate([jnp.clip(d_slot, 0, w - 1), slot], axis=1)
    entry = state.table_buffer[lay.table_offset[g] + s[:, None] * w + slot]
    group = jnp.full(ok.shape, g, _I32)
    return _Blocks(group, ends, new_sums, slot, entry, ok & (entry >= 1))


def _insert_blocks(indexes, offered: list[_Blocks], ns: jax.Array):
    """Inserts every group's offered blocks into its index (first publisher wins), all groups
    in one :func:`~flatkv_jax.prefix.index.insert_groups` (4 sorts per step, not 4 per
    group); returns the indexes and, per flattened block (groups in order), whether its page
    was taken and whether it already held the key."""
    sizes = tuple(b.valid.size for b in offered)
    valid = jnp.concatenate([b.valid.reshape(-1) for b in offered])

    def insert(ixs):
        keys = jnp.concatenate(
            [
                keys_lib.keys_from_lanes(b.sums, b.ends, ns).reshape(-1, keys_lib.KEY_WORDS)
                for b in offered
            ]
        )
        pages = jnp.concatenate([b.page.reshape(-1) for b in offered])
        return index_lib.insert_groups(ixs, sizes, keys, pages, valid)

    def skip(ixs):
        n = valid.shape[0]
        return ixs, jnp.zeros((n,), jnp.bool_), jnp.zeros((n,), jnp.bool_)

    # A step that completes no block (or only holes) skips the insert's sorts and scatters.
    return jax.lax.cond(jnp.any(valid), insert, skip, tuple(indexes))


def _compact_deferred(waiting: list[_Blocks], kd: int):
    """The blocks still waiting, compacted in order (per row: group, then block) into the
    ``kd``-entry deferred list; a full list drops the newest. Returns ``(group, slot, sums,
    len)``."""
    on = jnp.concatenate([w.valid for w in waiting], axis=1)
    b = on.shape[0]
    pos = jnp.cumsum(on.astype(_I32), axis=1) - 1
    dst = jnp.where(on & (pos < kd), pos, kd)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=_I32)[:, None], dst.shape)

    def packed(field, init):
        vals = jnp.concatenate([getattr(w, field) for w in waiting], axis=1)
        return init.at[rows, dst].set(vals, mode="drop")

    dg = packed("group", jnp.zeros((b, kd), _I32))
    dslot = packed("slot", jnp.zeros((b, kd), _I32))
    dsums = packed("sums", jnp.zeros((b, kd, keys_lib.LANES), jnp.uint32))
    dlen = jnp.minimum(jnp.sum(on, axis=1, dtype=_I32), kd)
    return dg, dslot, dsums, dlen


def final_publish(state: CacheState, s: jax.Array, mask: jax.Array, mode: jax.Array) -> jax.Array:
    """Rows of ``mask`` whose release publishes: FINISH/RETRACT of a keyed request with
    deferred blocks. Only those wait: every other committed block was offered to the index
    by the ``retire`` that committed it (``c`` changes nowhere else)."""
    return mask & (mode != ReleaseMode.ABORT) & state.keyed[s] & (state.defer_len[s] > 0)
