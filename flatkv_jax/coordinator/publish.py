"""Publishing: the prefix index side of the operations. Admission matches, pins and takes hit
pages; a commit publishes the blocks it completed (first publisher wins) and shares the page
that holds a block's key when another page was first."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flatkv_jax.block_pool import decref, flat_ids, incref
from flatkv_jax.coordinator.layout import (
    admit_lanes_width,
    div_groups,
    hit_run_start,
    per_group,
    publish_strides,
    publish_unit,
    state_layout,
)
from flatkv_jax.coordinator.rows import ceil_div, replace, set_rows
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
    addr = _pin_address(plan, group, pages)
    pinned = state.pinned.at[addr].set(on, mode="drop")
    distinct = first_occurrence((group, pages), listed)
    # The LRU set's per-page arrays use the pools' page offsets, as the pin mask does.
    in_lru = state.lru.cached[jnp.clip(addr, 0, state.lru.cached.shape[0] - 1)]
    n_g = len(plan.groups)
    cached = (
        jnp.zeros((n_g,), _I32)
        .at[jnp.clip(group, 0, n_g - 1)]
        .add((distinct & listed & in_lru).astype(_I32))
    )
    return replace(state, pinned=pinned), cached, (group, pages)


def _pin_address(plan: CachePlan, group: jax.Array, pages: jax.Array):
    """Entries of the flat pin mask (laid out as the allocator's refcounts): out of range
    (dropped) where nothing is listed (pages < 1)."""
    layout = pool_layout(plan)
    flat = flat_ids(layout, group, pages)
    return jnp.where(flat >= 0, flat, layout.total_pages)


def take_hits(plan: CachePlan, state: CacheState, m, s: jax.Array, served, listing) -> CacheState:
    """Served rows take their hit pages (+1 reference, out of the LRU) into their tables;
    the pin mask is cleared again."""
    lay = state_layout(plan)
    group, pages = listing
    listed = pages > 0
    # Always False (a count is never negative), but it depends on what the eviction cond
    # computed: that orders the cond's reads of the mask before this in-place write
    # (otherwise XLA copies the whole mask).
    clear = jnp.broadcast_to(state.lru.count.min() < 0, pages.shape)
    pinned = state.pinned.at[_pin_address(plan, group, pages)].set(clear, mode="drop")
    take_rows = jnp.concatenate(
        [jnp.broadcast_to(served[:, None], p.shape).reshape(-1) for p in m.listed]
    )
    took = listed & take_rows
    # Every pool's hit pages leave its LRU in one batched take (one dedupe for the listing).
    lru = lru_lib.take_in(state.lru, group, pages, took)
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
    return replace(state, pinned=pinned, lru=lru, allocator=pools, table_buffer=tables)


def publish_blocks(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    pub: jax.Array,
    c_old: jax.Array,
    accepted: jax.Array,
    head: jax.Array,
    width: int,
    fresh: jax.Array | None = None,
) -> CacheState:
    """Publishes the blocks completed in ``(c_old, c_old + accepted]`` of rows ``pub`` (their
    step's tokens, continued from the request's chain state ``S(c_old)``), and advances the
    chain to ``S(c_old + accepted)``. First publisher wins, rows in batch order, per row and
    group older blocks first. ``width`` (static) bounds ``accepted``: only that many of the
    step's token columns are hashed.

    ``fresh`` (bool[B], optional): rows retiring their admission's step whole, whose lanes
    and final chain state the admission kept (``CacheState.admit_hashed``). When every
    publishing row is fresh, those are taken instead of hashing the step's tokens again (the
    same words: the admission hashed the same tokens from position 0).

    A completed block whose key another page already holds (published earlier, or by an
    earlier row of this call) is **shared**: the row's table entry takes the holder page (+1
    reference; out of the LRU if it was cached-only) and the row's own copy, which only this
    table referenced, is freed. Both pages hold the same tokens' KV, so nothing the request
    reads changes; the request keeps the indexed page alive, so every committed block stays
    in the index while the request holds it and a release has nothing left to publish
    (docs/semantics.md, "Prefix reuse"). A block whose insert overflows its bucket pair is
    not cached (a later miss, never a wrong hit).

    Few rows of a decode step reach a block end (B = 256, one token each, ends every 64
    tokens: ~4 rows): only those are hashed and offered, compacted in batch order,
    :func:`publish_rows` at a time (the others add their tokens' terms to the chain's partial
    sum).
    """
    b = s.shape[0]
    k = publish_rows(plan, b, width)

    def write(st: CacheState) -> CacheState:
        if k >= b:
            return _publish(plan, st, s, pub, c_old, accepted, head, width, fresh)
        a = jnp.where(pub, accepted, 0)
        u = math.gcd(publish_unit(plan), keys_lib.CHAIN_TOKENS)
        # A row needs lanes or a chain step only if its tokens reach a multiple of `u` (the
        # unit ends and the chain-block ends are such multiples); the others add their terms.
        reach = pub & ((c_old + a) // u != c_old // u)
        toks = st.fifo_tokens[s, head, :width]
        chain = keys_lib.add_terms(st.chain[s], toks, c_old, a, st.subkeys[s, 0])
        st = replace(st, chain=set_rows(st.chain, s, pub & ~reach, chain))
        # The reaching rows, in batch order, `k` at a time (one pass unless more than `k`
        # reach): each pass sees what earlier ones published, so the index ends with the
        # keys -> pages of one pass over every row (a key may sit in the other bucket of its
        # pair: an insert picks the less loaded one as loaded before its call). A loop, not
        # a cond between a compacted and a full pass: XLA copied the index and the tables,
        # ~13 MB at B = 256, for a conditional with two writing branches.
        order = jnp.nonzero(reach, size=b, fill_value=b)[0].astype(_I32)
        order = jnp.pad(order, (0, -b % k), constant_values=b)

        def one_pass(i, st):
            rows = jax.lax.dynamic_slice(order, (i * k,), (k,))
            j = jnp.clip(rows, 0, b - 1)
            fr = None if fresh is None else fresh[j]
            return _publish(
                plan, st, s[j], reach[j] & (rows < b), c_old[j], a[j], head[j], width, fr
            )

        return jax.lax.fori_loop(0, ceil_div(jnp.sum(reach, dtype=_I32), k), one_pass, st)

    return jax.lax.cond(jnp.any(pub), write, lambda st: st, state)


def publish_rows(plan: CachePlan, b: int, width: int) -> int:
    """Rows one publish hashes and offers when few of ``b`` rows of ``width`` accepted tokens
    reach a block end (static; ``b``: no compaction). About four times the rows expected to
    reach one when positions are spread (``b * width / unit``), at least 8, and only when
    that is at most half the batch: a decode step at B = 256 compacts to 16 rows."""
    unit = math.gcd(publish_unit(plan), keys_lib.CHAIN_TOKENS)
    expect = b * min(width, unit) / unit
    k = max(8, 1 << max(0, math.ceil(math.log2(max(4 * expect, 1)))))
    return k if 2 * k <= b else b


def _publish(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    pub: jax.Array,
    c_old: jax.Array,
    accepted: jax.Array,
    head: jax.Array,
    width: int,
    fresh: jax.Array | None = None,
) -> CacheState:
    """:func:`publish_blocks` for every row of the batch."""
    a = jnp.where(pub, accepted, 0)
    ns = state.namespace[s]
    # Only the `width` accepted-token columns are hashed (lanes [B, width, LANES]).
    # Lanes only at the ends a block can be published at (multiples of `unit`), not at every
    # token: a prefill's finishing mixes follow its blocks, not its tokens.
    unit = publish_unit(plan)

    def hash_tokens(_):
        return keys_lib.extend_chain(
            state.chain[s],
            state.fifo_tokens[s, head, :width],
            c_old,
            a,
            ns,
            seed=state.key_seed,
            unit=unit,
            sub=keys_lib.Subkeys.from_words(state.subkeys[s]),
        )

    n_lanes = width // unit + 1
    if fresh is not None and width > 1 and 0 < n_lanes <= admit_lanes_width(plan):
        # A prefill's retire: the admission hashed these tokens already (with the whole
        # prompt, to match it) and kept the lanes at the same ends and the chain state at
        # the step's end; a cond skips the hashing when every publishing row has them.
        kept = (state.admit_lanes[s, :n_lanes], state.admit_chain[s])
        lanes, chain = jax.lax.cond(jnp.all(fresh | ~pub), lambda _: kept, hash_tokens, None)
    else:
        lanes, chain = hash_tokens(None)
    state = replace(state, chain=set_rows(state.chain, s, pub, chain))
    runs = _runs_of_equal_blocks(plan, width)
    if not runs:  # no group ever publishes a block (only the chain advances)
        return state
    offered = _flatten(
        [
            _completed_blocks(plan, state, run, s, pub, c_old, c_old + a, lanes, unit, width, ns)
            for run in runs
        ]
    )
    # Few of the B x groups candidate rows complete a block (a decode step at B = 256: ~50 of
    # 1,536): the offered rows are compacted, in order, and published in chunks of `k` rows,
    # so keys, lookups and the batch rules' sorts cost the blocks offered, not the candidates.
    # Chunks run in row order and each sees the blocks earlier chunks indexed, so the outcome
    # is the one of a single pass (first publisher wins in row order), up to which bucket of
    # its pair a key sits in.
    n = offered.valid.shape[0]
    k = publish_chunk(n)
    total = jnp.sum(offered.valid, dtype=_I32)
    order = jnp.nonzero(offered.valid, size=n, fill_value=n)[0].astype(_I32)
    order = jnp.pad(order, (0, -n % k), constant_values=n)
    marks = (state.lru.cached, state.lru.count)
    lru_layout = state.lru  # its static layout only (no array of it enters the cond)

    def body(i, carry):
        pools, index, marks, tables = carry
        sel = jax.lax.dynamic_slice(order, (i * k,), (k,))
        c = jax.tree.map(lambda x: x[jnp.clip(sel, 0, n - 1)], offered)
        c = c._replace(valid=c.valid & (sel < n))
        keys = keys_lib.keys_from_lanes(c.sums[:, None, :], c.ends[:, None], c.namespace)[:, 0]
        # One row's blocks are distinct (each key covers another length, each table entry
        # holds another page): no duplicate rules. Several rows may repeat each other's.
        index, taken, _, present = index_lib.insert_in(
            index, c.group, keys, c.page, c.valid, distinct=s.shape[0] == 1
        )
        pools = incref(pools, pool_layout(plan), c.group, jnp.where(taken, c.page, -1))
        # Not taken and not already this page's key: another page holds it (from before this
        # chunk, or an earlier row of this chunk took it), or its bucket pair is full.
        others = c.valid & ~taken & (present != c.page)
        # Sharing happens only when a request recomputed blocks another page holds (a prefix
        # evicted in some group but not in all, or two requests computing one prompt at
        # once): skip its sort and scatters otherwise. The cond carries only the arrays it
        # writes (an LRU's ring passed through a cond is copied by XLA).
        pools, marks, tables = jax.lax.cond(
            jnp.any(others),
            lambda pl, mk, tb: _share_blocks(
                plan, lru_layout, pl, mk, tb, c, taken, present, keys, others
            ),
            lambda pl, mk, tb: (pl, mk, tb),
            pools,
            marks,
            tables,
        )
        return pools, index, marks, tables

    carry = (state.allocator, state.index, marks, state.table_buffer)
    # One chunk holds every candidate (a decode step's 80, a one-row prefill's ~200): the
    # chunk straight, no loop (ab_compiled: decode x0.975, one-row admissions x0.95).
    if k >= n:
        pools, index, marks, tables = body(0, carry)
    else:
        pools, index, marks, tables = jax.lax.fori_loop(0, ceil_div(total, k), body, carry)
    lru = dataclasses.replace(state.lru, cached=marks[0], count=marks[1])
    return replace(state, allocator=pools, index=index, lru=lru, table_buffer=tables)


def publish_chunk(n: int) -> int:
    """Rows of one publish chunk for ``n`` candidate rows (static). Up to 256 candidates, one
    chunk of all of them: a one-row prefill of 4,096 tokens offers ~190 of its 197 candidates
    on V4-Flash (publish strides), which chunks of 64 walked in three iterations (measured
    x0.92 for that admission with one). Above, about a sixteenth of them, at least 64 (a
    decode step at B = 256 offers ~50 blocks out of 1,280 candidates: one chunk of 128)."""
    if n <= 256:
        return n
    return min(n, max(64, 1 << max(0, (n // 16 - 1).bit_length())))


def _flatten(blocks: list[_Blocks]) -> _Blocks:
    """Every group's candidate blocks as one flat batch (groups in order, then rows, older
    blocks first): each field ``[groups, B, N, ...]`` becomes ``[sum of groups * B * N, ...]``."""
    return jax.tree.map(
        lambda *xs: jnp.concatenate([x.reshape(-1, *x.shape[3:]) for x in xs]), *blocks
    )


def _share_blocks(
    plan: CachePlan, lru_layout, pools, marks, tables, o: _Blocks, taken, present, keys, others
):
    """Rows whose key another page holds switch their table entry to that page; ``marks``
    are the LRUs' ``(cached, count)`` (taking a page touches nothing else)."""
    layout = pool_layout(plan)
    # A key absent before the chunk and not taken by this row: the first row of the chunk
    # with the same key took it (its page holds it now), or its bucket pair was full
    # (nothing holds it).
    cols = (o.group, *(keys[:, w] for w in range(keys_lib.KEY_WORDS)))
    first = first_index(cols, o.valid & (present == 0))
    f = jnp.clip(first, 0, o.page.shape[0] - 1)
    in_call = jnp.where((first >= 0) & taken[f], o.page[f], 0)
    holder = jnp.where(present > 0, present, in_call)
    share = others & (holder > 0)
    # The holder gains this table's reference first, then the own copy (one reference: this
    # table's; never indexed) drops to 0 and is freed. Listings stay grouped by pool.
    pools = incref(pools, layout, o.group, jnp.where(share, holder, -1))
    pools, _ = decref(pools, layout, o.group, jnp.where(share, o.page, -1))
    marks = lru_lib.take_marks_in(lru_layout, marks, o.group, holder, share)
    idx = jnp.where(share, o.table_index, table_size(plan))
    return pools, marks, tables.at[idx].set(holder, mode="drop")


class _Blocks(NamedTuple):
    """Candidate blocks: a run of groups' ``[groups, B, N]``, or every group's flattened
    (:func:`_flatten`) to ``[N]``."""

    group: jax.Array  # int32: the group
    ends: jax.Array  # int32: the block's end position (its key covers tokens [0, end))
    sums: jax.Array  # uint32[..., LANES]: the chain lanes at ``end``
    table_index: jax.Array  # int32: the block's entry in ``table_buffer``
    page: jax.Array  # int32: the page the table holds there (the row's own page)
    valid: jax.Array  # bool: offered (a complete committed block whose page is not a hole)
    namespace: jax.Array  # the row's namespace, one per block


def _runs_of_equal_blocks(plan: CachePlan, width: int) -> list[tuple[int, ...]]:
    """The groups that publish, in order, cut into runs of consecutive groups that can
    complete equally many publishable blocks per row in ``width`` tokens (``width // stride
    + 1``): each run's candidates are computed as one ``[groups, B, N]`` batch (a decode
    step: one run of every group, not one copy of the code per group)."""
    strides = publish_strides(plan)
    runs: list[list[int]] = []
    for g, st in enumerate(strides):
        if not st:
            continue
        if runs and width // strides[runs[-1][0]] == width // st:
            runs[-1].append(g)
        else:
            runs.append([g])
    return [tuple(r) for r in runs]


def _completed_blocks(
    plan: CachePlan,
    state: CacheState,
    run: tuple[int, ...],
    s: jax.Array,
    pub: jax.Array,
    c_old: jax.Array,
    c_new: jax.Array,
    lanes: jax.Array,
    unit: int,
    width: int,
    ns: jax.Array,
) -> _Blocks:
    """The publishable blocks completed in ``(c_old, c_new]`` by the groups of ``run``
    (static, groups with equal ``width // stride + 1``, the most a row can complete), each
    field ``[groups, B, N]``; ``lanes``: :func:`~flatkv_jax.prefix.keys.extend_chain`'s at
    multiples of ``unit``; ``ns``: each row's namespace."""
    lay = state_layout(plan)
    strides = publish_strides(plan)

    def const(values):
        return per_group(tuple(values[g] for g in run))[:, None, None]

    bt, w, st = const(lay.block_tokens), const(lay.table_width), const(strides)
    n_ends = width // strides[run[0]] + 1
    k = jnp.arange(n_ends, dtype=_I32)[None, None, :]
    ends = (div_groups(c_old[None, :, None], tuple(strides[g] for g in run), 0) + 1 + k) * st
    ok = pub[None, :, None] & (ends <= c_new[None, :, None])
    at = jnp.clip(ends // unit - c_old[None, :, None] // unit - 1, 0, lanes.shape[1] - 1)
    g_n, b = len(run), s.shape[0]
    new_sums = lanes[jnp.arange(b, dtype=_I32)[None, :, None], at]  # [groups, B, N, LANES]
    blk = div_groups(ends, tuple(lay.block_tokens[g] for g in run), 0)
    slot = jnp.clip(blk - 1, 0, w - 1)
    if any(lay.is_window[g] for g in run):
        start = hit_run_start(bt, const(lay.hit_reach), plan.prefix_granularity, ends)
        ok = ok & (~const(lay.is_window) | (blk - 1 >= start))
    tidx = const(lay.table_offset) + s[None, :, None] * w + slot
    entry = state.table_buffer[tidx]
    group = jnp.broadcast_to(per_group(run)[:, None, None], ok.shape)
    row_ns = jnp.broadcast_to(ns[None, :, None], (g_n, b, n_ends, *ns.shape[1:]))
    return _Blocks(group, ends, new_sums, tidx, entry, ok & (entry >= 1), row_ns)
