"""The request lifecycle as pure functions ``(plan, state, batch) -> (state, result)``.

Each operation exists twice: ``<op>_fn`` is the plain pure function (compose it inside your own
jitted step), and ``<op>`` is the same function under ``jax.jit`` with the plan (and
``max_count``) static and the state donated — one compilation per (plan, batch size,
``max_count``). Semantics: docs/semantics.md; decisions taken where it is silent:
docs/coordinator.md.

Cost model (no operation scans a pool or a whole table):

- admit/extend: ``O(B * G * K)`` with ``K = ceil(max_count / smallest block_tokens)``, the
  most pages one row can take in a pool, plus ``O(max_requests)`` for admit's slot search.
- reclaim/release/deferred release: ``O(entries changed)`` through a ``lax.while_loop`` over
  fixed-size chunks of the flattened (row, table slot) segments that change; a release touches
  ``[0, hi)`` of each of the request's rows (its pages, and its holes which become -1).
- retire/rewind: ``O(B * fifo_depth)``.

Checks run in a fixed priority per row (the first failing check is the status): ``IDLE``, then
``STALE``, ``BAD_ARG``, then the op's own checks, then ``STEP_FULL`` and ``OUT_OF_PAGES`` last.

Before any of that, at trace time, every operation checks that the state was created for the
plan and that every batch field has its dtype and shape (:mod:`.checks`): misuse that would
otherwise compute a wrong step raises ``ValueError``/``TypeError`` instead.

The step budget: ``admit`` and ``extend`` schedule the tokens of one step, whose flat token
axis holds ``plan.limits.step_tokens`` tokens. A call's rows and the OK rows of the calls
passed as ``same_step`` (the earlier calls of the same step) never schedule more: a row that
would is ``STEP_FULL`` and changes nothing, so no token is ever scheduled (and later
committed) that the step cannot write. ``step_metadata`` takes the step's results only in
that call order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flatkv_jax.block_pool import (
    Acquired,
    acquire,
    decref,
    decref_left,
    evictable_pages,
    fit,
    incref,
)
from flatkv_jax.coordinator.batches import (
    AdmitBatch,
    ExtendBatch,
    HandleBatch,
    ReleaseBatch,
    ReleaseMode,
    RetireBatch,
    RewindBatch,
)
from flatkv_jax.coordinator.checks import check_batch, check_same_step, check_state_for_plan
from flatkv_jax.coordinator.results import ReclaimResult, RetireResult, StatusResult, StepResult
from flatkv_jax.coordinator.segments import segment_rows
from flatkv_jax.coordinator.state import (
    CacheState,
    pool_layout,
    step_token_width,
    table_offset,
    table_size,
)
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import keys as keys_lib
from flatkv_jax.prefix import lru as lru_lib
from flatkv_jax.prefix._batch import first_occurrence
from flatkv_jax.prefix.match import MatchLayout, match_prompts
from flatkv_jax.status import Status

_I32 = jnp.int32


# --- static helpers -------------------------------------------------------------------------
def resolve_max_count(plan: CachePlan, max_count: int | None) -> int:
    """The static per-row token bound of admit/extend (default ``max(chunk, 1 + verify)``).

    A smaller bound (``plan.limits.decode_tokens`` for a decode-only batch) shrinks the zero
    lists and the per-row table scatter.
    """
    lim = plan.limits
    default = max(lim.chunk_tokens, lim.decode_tokens)
    if max_count is None:
        return default
    check_positive_int("max_count", max_count)
    if max_count > default:
        fail(
            "max_count",
            max_count,
            f"a step writes at most max(chunk_tokens, 1 + verify_width) = {default} tokens per request",
            f"pass max_count <= {default} or None",
        )
    return max_count


def pages_per_row(plan: CachePlan, max_count: int) -> int:
    """The most pages one row of admit/extend can take in any pool: ``ceil(max_count / B)``
    for the smallest block span ``B`` (a step of ``n <= max_count`` tokens opens at most
    ``ceil(n / B)`` new blocks, since blocks ``< hi`` are already allocated)."""
    return -(-max_count // min(g.block_tokens for g in plan.groups))


def _pick_status(default: int, *checks: tuple[jax.Array, int]) -> jax.Array:
    """The code of the first true check per row (checks in priority order), else ``default``."""
    out = jnp.full(checks[0][0].shape, default, _I32)
    for cond, code in reversed(checks):
        out = jnp.where(cond, jnp.asarray(code, _I32), out)
    return out


def _lookup(
    state: CacheState, slot: jax.Array, generation: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Clipped slots and whether each handle names a live request of that generation."""
    r = state.max_requests
    in_range = (slot >= 0) & (slot < r)
    s = jnp.clip(slot, 0, r - 1)
    return s, in_range & state.live[s] & (state.generation[s] == generation)


def _later_duplicates(s: jax.Array, mask: jax.Array, num_slots: int) -> jax.Array:
    """Rows of ``mask`` naming a slot an earlier row of ``mask`` already names."""
    b = s.shape[0]
    rows = jnp.arange(b, dtype=_I32)
    first = jnp.full((num_slots,), b, _I32).at[jnp.where(mask, s, num_slots)].min(rows, mode="drop")
    return mask & (first[s] != rows)


def _set_rows(x: jax.Array, s: jax.Array, mask: jax.Array, value) -> jax.Array:
    """``x[s[i]] = value[i]`` for rows of ``mask`` (other rows dropped)."""
    return x.at[jnp.where(mask, s, x.shape[0])].set(value, mode="drop")


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + (b - 1)) // b


def _step_full(
    plan: CachePlan, asking: jax.Array, count: jax.Array, same_step: tuple[StepResult, ...]
) -> jax.Array:
    """Rows of ``asking`` that the step's token budget refuses (``STEP_FULL``).

    The step's flat token axis holds ``plan.limits.step_tokens`` tokens; the calls in
    ``same_step`` already scheduled their OK rows' tokens. Rows of ``asking`` add their
    ``count`` in batch order; the first row that passes the budget and every later asking
    row are refused (the FIFO rule of ``OUT_OF_PAGES``: a long chunk is never starved by
    later short rows of the same call). A row that fits is then still subject to the page
    check, and keeps its tokens counted even if it runs out of pages (every later row does
    then too).
    """
    used = jnp.zeros((), _I32)
    for x in same_step:
        used = used + jnp.sum(jnp.where(x.status == Status.OK, x.count, 0), dtype=_I32)
    total = used + jnp.cumsum(jnp.where(asking, count, 0), dtype=_I32)
    over = asking & (total > plan.limits.step_tokens)
    return asking & (jnp.cumsum(over.astype(_I32)) > 0)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-group constants of a plan, as tuples (turned into small constant arrays in jit)."""

    block_tokens: tuple[int, ...]
    rows_per_page: tuple[int, ...]
    tokens_per_row: tuple[int, ...]
    width: tuple[int, ...]
    table_offset: tuple[int, ...]
    is_window: tuple[bool, ...]
    window: tuple[int, ...]

    def a(self, name: str) -> jax.Array:
        """The named constant as a ``[G]`` array."""
        dtype = jnp.bool_ if name == "is_window" else _I32
        return jnp.asarray(getattr(self, name), dtype)


@functools.cache
def geometry(plan: CachePlan) -> Geometry:
    """The per-group constants the vectorised operations need."""
    return Geometry(
        block_tokens=tuple(g.block_tokens for g in plan.groups),
        rows_per_page=tuple(g.rows_per_page for g in plan.groups),
        tokens_per_row=tuple(g.tokens_per_row for g in plan.groups),
        width=tuple(plan.table_width(g) for g in plan.groups),
        table_offset=table_offset(plan),
        is_window=tuple(g.is_window for g in plan.groups),
        window=tuple(g.window or 0 for g in plan.groups),
    )


def _set_cols(x: jax.Array, s: jax.Array, mask: jax.Array, value) -> jax.Array:
    """``x[:, s[i]] = value[:, i]`` for rows of ``mask`` (``x``: ``[G, R]``)."""
    g, r = x.shape
    gi = jnp.arange(g, dtype=_I32)[:, None]
    return x.at[gi, jnp.where(mask, s, r)[None, :]].set(value, mode="drop")


# --- shared pieces ----------------------------------------------------------------------------
def _grow(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    want: jax.Array,
    new_end: jax.Array,
    k: int,
    hi: jax.Array | None = None,
    pinned_cached: jax.Array | None = None,
) -> tuple[CacheState, jax.Array, Acquired]:
    """Allocates every block ``[hi, ceil(new_end / B))`` of every group, atomically, in order.

    Supply per pool is free + unpinned cached-only pages; the served rows take the free stack
    first and only then evict LRU cached-only pages (pages matched by the current admission
    are pinned in ``state.pinned``). Returns the state with tables and ``hi`` updated for the
    served rows, the served mask and the :class:`~flatkv_jax.block_pool.Acquired` (pages,
    shortage).

    Args:
      hi: ``int32[B, G]`` first slot to allocate (default: the slot's ``hi``; admit passes
        the hit's ``h / B``).
      pinned_cached: ``int32[G]`` cached-only pages pinned by this call (default 0).
    """
    geo = geometry(plan)
    layout = pool_layout(plan)
    n_g = len(plan.groups)
    hi = state.hi[:, s].T if hi is None else hi  # [B, G]
    needs = jnp.maximum(0, _ceil_div(new_end[:, None], geo.a("block_tokens")[None, :]) - hi)
    needs = jnp.where(want[:, None], needs, 0)
    top = state.allocator.top
    if state.prefix:
        cached = jnp.stack([lr.count for lr in state.lrus])
        pc = jnp.zeros((n_g,), _I32) if pinned_cached is None else pinned_cached
        served, short_group, short_pages, total = fit(needs, want, evictable_pages(top, cached, pc))
        short = jnp.maximum(total - top, 0)
        # Eviction is rare (only when a free stack runs dry): skip its loops otherwise.
        state = jax.lax.cond(
            jnp.any(short > 0),
            lambda st: _evict(plan, st, short, needs.shape[0] * k),
            lambda st: st,
            state,
        )
    else:
        served, short_group, short_pages, _ = fit(needs, want, top)
    pools, got = acquire(state.allocator, layout, needs, served, k)
    got = Acquired(served, short_group, short_pages, got.pages)
    take = got.pages >= 0  # [B, G, K]
    j = jnp.arange(k, dtype=_I32)[None, None, :]
    row_base = geo.a("table_offset")[None, :] + s[:, None] * geo.a("width")[None, :]
    idx = (row_base + hi)[:, :, None] + j
    tables = state.table_buffer.at[jnp.where(take, idx, table_size(plan))].set(
        got.pages, mode="drop"
    )
    new_hi = hi + jnp.sum(take, axis=2, dtype=_I32)
    hi_arr = _set_cols(state.hi, s, got.served, new_hi.T)
    return _replace(state, allocator=pools, table_buffer=tables, hi=hi_arr), got.served, got


def _evict(plan: CachePlan, state: CacheState, n: jax.Array, max_pages: int) -> CacheState:
    """Evicts ``n[g]`` LRU cached-only (unpinned) pages of every pool: they leave the index,
    lose its reference and go onto the free stack (the caller pops them right away)."""
    lrus, indexes, out = [], [], []
    for g in range(len(plan.groups)):
        lr, ix, pages, _ = lru_lib.evict(
            state.lrus[g], state.indexes[g], n[g], max_pages=max_pages, pinned=state.pinned[g]
        )
        lrus.append(lr)
        indexes.append(ix)
        out.append(pages)
    group = jnp.repeat(jnp.arange(len(plan.groups), dtype=_I32), max_pages)
    pools, _ = decref(state.allocator, pool_layout(plan), group, jnp.concatenate(out))
    return _replace(state, allocator=pools, lrus=tuple(lrus), indexes=tuple(indexes))


def _zero_lists(got: Acquired) -> jax.Array:
    """``[G, B * K]``: every page handed out, per pool, padded with -1."""
    b, g, k = got.pages.shape
    return jnp.transpose(got.pages, (1, 0, 2)).reshape(g, b * k)


def _sweep(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    mask: jax.Array,
    start: jax.Array,
    end: jax.Array,
    fill: int,
    chunk: int,
) -> CacheState:
    """For every group ``g`` and row ``i`` of ``mask``: sets table entries
    ``[start[g, i], end[g, i])`` of request ``s[i]`` to ``fill`` and decrefs the pages they
    held: a page falling to 0 is freed, a page left with only the index's reference becomes
    cached-only (pushed onto its pool's LRU). Entries are visited per group, rows in batch
    order, each row from its highest slot down, so a row's pages become cached-only tail first
    (the oracle's tie order). Cost O(entries changed), in chunks of ``chunk`` entries across
    all groups."""
    geo = geometry(plan)
    layout = pool_layout(plan)
    n_g, b = start.shape
    length = jnp.where(mask[None, :], jnp.maximum(end - start, 0), 0).reshape(-1)  # [G * B]
    incl = jnp.cumsum(length, dtype=_I32)
    excl = incl - length
    total = incl[-1]
    group = jnp.broadcast_to(jnp.arange(n_g, dtype=_I32)[:, None], (n_g, b)).reshape(-1)
    row_base = (geo.a("table_offset")[:, None] + geo.a("width")[:, None] * s[None, :]).reshape(-1)
    # Table index of flat entry e is last[q] - e: each segment is walked from its end down.
    last = (row_base + start.reshape(-1) + length - 1) + excl
    size = table_size(plan)

    def body(i, carry):
        # The indexes are only read, but ride in the carry: a loop-invariant operand that is
        # also live after the loop makes XLA copy it (every slot_of_page, every call).
        pools, tables, lrus, indexes = carry
        e = i * chunk + jnp.arange(chunk, dtype=_I32)
        on = e < total
        q = segment_rows(excl, length, i * chunk, chunk)
        idx = last[q] - e
        old = tables[jnp.where(on, idx, 0)]
        # The written value depends on `old` (it never equals INT32_MIN), which pins the gather
        # before the scatter; a gather used only after it makes XLA copy the whole buffer.
        value = jnp.where(old == jnp.iinfo(_I32).min, old, fill)
        tables = tables.at[jnp.where(on, idx, size)].set(value, mode="drop")
        pages = jnp.where(on, old, -1)
        gq = group[q]
        held = jnp.zeros((chunk,), jnp.bool_)
        for g, ix in enumerate(indexes):  # none without a prefix index
            held = held | ((gq == g) & index_lib.holds(ix, jnp.where(gq == g, pages, 0)))
        pools, _, left = decref_left(pools, layout, gq, pages)
        # Left with only the index's reference: cached-only now.
        now_cached = held & (pages > 0) & (left == 1)
        # Most chunks push nothing in most pools: skip those pools' pushes (and their sorts).
        lrus = tuple(
            jax.lax.cond(
                jnp.any(now_cached & (gq == g)),
                lambda lr, m: lru_lib.release(lr, pages, m),
                lambda lr, m: lr,
                lr,
                now_cached & (gq == g),
            )
            for g, lr in enumerate(lrus)
        )
        return pools, tables, lrus, indexes

    pools, tables, lrus, indexes = jax.lax.fori_loop(
        0,
        _ceil_div(total, chunk),
        body,
        (state.allocator, state.table_buffer, state.lrus, state.indexes),
    )
    return _replace(state, allocator=pools, table_buffer=tables, lrus=lrus, indexes=indexes)


def _final_publish(state: CacheState, s: jax.Array, mask: jax.Array, mode: jax.Array) -> jax.Array:
    """Rows of ``mask`` whose release publishes: FINISH/RETRACT of a keyed request with
    deferred blocks. Only those wait: every other committed block was offered to the index
    by the ``retire`` that committed it (``c`` changes nowhere else)."""
    return mask & (mode != ReleaseMode.ABORT) & state.keyed[s] & (state.defer_len[s] > 0)


def _free(
    plan: CachePlan,
    state: CacheState,
    s: jax.Array,
    mask: jax.Array,
    mode: jax.Array,
    publish: bool = True,
) -> CacheState:
    """Frees requests now: drop every table reference, reset the slot and bump its generation.

    With ``publish``, FINISH/RETRACT first publish the request's deferred blocks
    (:func:`_final_publish`); ``retire`` passes False because its own publish already
    covered those rows.
    """
    b = s.shape[0]
    if publish and state.prefix:
        pub = _final_publish(state, s, mask, mode)
        c = state.committed[s]
        state = jax.lax.cond(
            jnp.any(pub),
            lambda st: _publish(plan, st, s, pub, c, jnp.zeros_like(c), st.fifo_head[s], True, 1),
            lambda st: st,
            state,
        )
    hi = state.hi[:, s]
    state = _sweep(plan, state, s, mask, jnp.zeros_like(hi), hi, -1, _release_chunk(b))
    zeros = jnp.zeros_like(hi)
    return _replace(
        state,
        keyed=_set_rows(state.keyed, s, mask, False),
        defer_len=_set_rows(state.defer_len, s, mask, 0),
        lo=_set_cols(state.lo, s, mask, zeros),
        hi=_set_cols(state.hi, s, mask, zeros),
        live=_set_rows(state.live, s, mask, False),
        generation=_set_rows(state.generation, s, mask, state.generation[s] + 1),
        pending=_set_rows(state.pending, s, mask, 0),
        extent=_set_rows(state.extent, s, mask, 0),
        committed=_set_rows(state.committed, s, mask, 0),
        fifo_head=_set_rows(state.fifo_head, s, mask, 0),
        fifo_len=_set_rows(state.fifo_len, s, mask, 0),
    )


def _require_prefix(state: CacheState, what: str) -> None:
    """Tokens mean prefix reuse: the state must keep a prefix index (checked at trace time)."""
    if not state.prefix:
        fail(
            what,
            "an int32 token array",
            "tokens turn prefix reuse on, but this state was created without a prefix index",
            "build the state with create_state(plan, prefix=True) or pass tokens=None",
        )


def _release_chunk(b: int) -> int:
    # One chunk covers a few short requests; long requests loop (cost follows their length).
    return max(256, 8 * b)


def _replace(state: CacheState, **kw) -> CacheState:
    return dataclasses.replace(state, **kw)


# --- prefix pieces ----------------------------------------------------------------------------
@functools.cache
def _match_layout(plan: CachePlan, max_len: int) -> MatchLayout:
    return MatchLayout.for_plan(plan, max_len)


def _hit_listing(plan: CachePlan, m, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every matched page of ``rows`` across groups: ``(group int32[N], page int32[N])``,
    pages < 1 where nothing is listed (grouped by pool, as :func:`decref` wants)."""
    groups, pages = [], []
    for g, p in enumerate(m.pages):
        groups.append(jnp.full((p.size,), g, _I32))
        pages.append(jnp.where(rows[:, None] & (p > 0), p, -1).reshape(-1))
    del plan
    return jnp.concatenate(groups), jnp.concatenate(pages)


def _pin(plan: CachePlan, state: CacheState, m, rows: jax.Array, on: bool):
    """Sets (``on``) the pin mask of every page ``rows`` matched; returns the state, the
    distinct cached-only pinned pages per pool (``int32[G]``) and the listing."""
    group, pages = _hit_listing(plan, m, rows)
    listed = pages > 0
    pinned, cached = [], []
    distinct = first_occurrence((group, pages), listed)
    for g in range(len(plan.groups)):
        mine = (group == g) & listed
        p = jnp.where(mine, pages, state.pinned[g].shape[0])
        pinned.append(state.pinned[g].at[p].set(on, mode="drop"))
        in_lru = state.lrus[g].cached[jnp.clip(pages, 0, state.pinned[g].shape[0] - 1)]
        cached.append(jnp.sum(distinct & mine & in_lru, dtype=_I32))
    return _replace(state, pinned=tuple(pinned)), jnp.stack(cached), (group, pages)


def _take_hits(plan: CachePlan, state: CacheState, m, s: jax.Array, served, listing) -> CacheState:
    """Served rows take their hit pages (+1 reference, out of the LRU) into their tables;
    the pin mask is cleared again."""
    geo = geometry(plan)
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
        lr, _ = lru_lib.acquire(state.lrus[g], jnp.where(took & (group == g), pages, 0))
        lrus.append(lr)
    pools = incref(state.allocator, pool_layout(plan), group, jnp.where(took, pages, -1))
    tables = state.table_buffer
    for g, p in enumerate(m.pages):
        w = geo.width[g]
        cols = min(p.shape[1], w)
        j = jnp.arange(cols, dtype=_I32)[None, :]
        idx = geo.table_offset[g] + s[:, None] * w + j
        val = p[:, :cols]
        ok = served[:, None] & (val >= 0)
        tables = tables.at[jnp.where(ok, idx, table_size(plan))].set(val, mode="drop")
    return _replace(
        state, pinned=tuple(pinned), lrus=tuple(lrus), allocator=pools, table_buffer=tables
    )


def _publish(
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
    geo = geometry(plan)
    a = jnp.where(pub, accepted, 0)
    ns = state.namespace[s]
    toks = state.fifo_tokens[s, head, :width]
    # Only the `width` accepted-token columns are hashed (lanes [B, width, LANES]).
    lanes, chain = keys_lib.extend_chain(state.chain[s], toks, c_old, a, ns, seed=state.key_seed)
    c_new = c_old + a
    b = s.shape[0]
    kd = state.defer_group.shape[1]
    d_on = pub[:, None] & (jnp.arange(kd, dtype=_I32)[None, :] < state.defer_len[s][:, None])
    d_group, d_slot, d_sums = state.defer_group[s], state.defer_slot[s], state.defer_sums[s]
    indexes, groups, taken_pages = [], [], []
    keep_g, keep_slot, keep_sums, keep_on = [], [], [], []
    for g in range(len(plan.groups)):
        bt, w = geo.block_tokens[g], geo.width[g]
        n_ends = width // bt + 1
        ends = (c_old[:, None] // bt + 1 + jnp.arange(n_ends, dtype=_I32)[None, :]) * bt
        ok = pub[:, None] & (ends <= c_new[:, None])
        at = jnp.clip(ends - c_old[:, None] - 1, 0, width - 1)
        new_sums = jnp.take_along_axis(lanes, at[:, :, None], axis=1)
        slot = jnp.clip(ends // bt - 1, 0, w - 1)
        if retry:
            mine = d_on & (d_group == g)
            ends = jnp.concatenate([(d_slot + 1) * bt, ends], axis=1)
            ok = jnp.concatenate([mine, ok], axis=1)
            new_sums = jnp.concatenate([d_sums, new_sums], axis=1)
            slot = jnp.concatenate([jnp.clip(d_slot, 0, w - 1), slot], axis=1)
        entry = state.table_buffer[geo.table_offset[g] + s[:, None] * w + slot]
        valid = ok & (entry >= 1)

        def insert(ix, valid=valid, new_sums=new_sums, ends=ends, entry=entry):
            keys = keys_lib.keys_from_lanes(new_sums, ends, ns)
            ix, taken, held = index_lib.insert_held(
                ix, keys.reshape(-1, keys_lib.KEY_WORDS), entry.reshape(-1), valid.reshape(-1)
            )
            return ix, taken, held

        def skip(ix, n=valid.size):
            return ix, jnp.zeros((n,), jnp.bool_), jnp.zeros((n,), jnp.bool_)

        # A decode step completes a block in few groups: skip the others' inserts.
        ix, taken, held = jax.lax.cond(jnp.any(valid), insert, skip, state.indexes[g])
        indexes.append(ix)
        groups.append(jnp.full((entry.size,), g, _I32))
        taken_pages.append(jnp.where(taken, entry.reshape(-1), -1))
        keep_on.append(valid & ~(taken | held).reshape(valid.shape))
        keep_g.append(jnp.full(valid.shape, g, _I32))
        keep_slot.append(slot)
        keep_sums.append(new_sums)
    pools = incref(
        state.allocator, pool_layout(plan), jnp.concatenate(groups), jnp.concatenate(taken_pages)
    )
    # The blocks still waiting, compacted in order (per row: group, then block).
    on = jnp.concatenate(keep_on, axis=1)
    pos = jnp.cumsum(on.astype(_I32), axis=1) - 1
    dst = jnp.where(on & (pos < kd), pos, kd)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=_I32)[:, None], dst.shape)
    dg = jnp.zeros((b, kd), _I32).at[rows, dst].set(jnp.concatenate(keep_g, axis=1), mode="drop")
    dslot = (
        jnp.zeros((b, kd), _I32).at[rows, dst].set(jnp.concatenate(keep_slot, axis=1), mode="drop")
    )
    dsums = (
        jnp.zeros((b, kd, keys_lib.LANES), jnp.uint32)
        .at[rows, dst]
        .set(jnp.concatenate(keep_sums, axis=1), mode="drop")
    )
    dlen = jnp.minimum(jnp.sum(on, axis=1, dtype=_I32), kd)
    return _replace(
        state,
        allocator=pools,
        indexes=tuple(indexes),
        chain=_set_rows(state.chain, s, pub, chain),
        defer_group=_set_rows(state.defer_group, s, pub, dg),
        defer_slot=_set_rows(state.defer_slot, s, pub, dslot),
        defer_sums=_set_rows(state.defer_sums, s, pub, dsums),
        defer_len=_set_rows(state.defer_len, s, pub, dlen),
    )


# --- operations ------------------------------------------------------------------------------
def admit_fn(
    plan: CachePlan,
    state: CacheState,
    batch: AdmitBatch,
    *,
    max_count: int | None = None,
    same_step: tuple[StepResult, ...] = (),
) -> tuple[CacheState, StepResult]:
    """Admits new requests: claims the lowest free slots, allocates their first chunk.

    Per row, in priority order: ``IDLE`` (masked), ``BAD_ARG`` (``prompt_len < 1``,
    ``first_chunk`` outside ``[0, min(prompt_len, max_count)]``, ``prompt_len`` above the
    width of ``batch.tokens``), ``TOO_LONG``
    (``prompt_len > max_context``), ``NO_SLOT``, ``STEP_FULL`` (the first chunk would pass
    the step's ``step_tokens``; FIFO rule), ``OUT_OF_PAGES`` (FIFO rule: the first row that
    does not fit and every later row), else ``OK``. Served rows claim the lowest free
    slots in batch order and get ``extent = h + first_chunk``, ``committed = h`` and, if
    ``first_chunk > 0``, one in-flight step ``(h, first_chunk)``. With the prefix index (issue
    With ``batch.tokens`` the prompt is matched against the prefix index first: ``h`` is the
    hit (docs/semantics.md, "Prefix reuse"), its pages are shared (+1 reference, out of the
    LRU), window slots before the trailing run are holes, and the supply of the in-order rule
    is free + unpinned cached-only pages (matched pages are pinned for the call). Without
    tokens ``h = 0``.

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`admit`).
      batch: the new requests.
      max_count: static bound on ``first_chunk`` (default ``max(chunk_tokens, 1 + verify)``).
      same_step: the results of the ``admit``/``extend`` calls made earlier for the same step,
        in call order (their OK tokens count against ``step_tokens``); ``()``: this call opens
        the step. Pass the same tuple plus this result to ``step_metadata``.

    Returns:
      The new state and a :class:`StepResult` (its ``zero`` lists the pages to zero).

    Raises:
      ValueError/TypeError: at trace time, a state of another plan, a batch field of the wrong
        dtype or shape, or ``same_step`` out of order.
    """
    check_state_for_plan(plan, state, "admit")
    check_batch(batch, AdmitBatch, "admit")
    check_same_step(plan, same_step, "admit")
    mc = resolve_max_count(plan, max_count)
    r = state.max_requests
    b = batch.valid.shape[0]
    valid, pl, fc = batch.valid, batch.prompt_len, batch.first_chunk
    bad = valid & ((pl < 1) | (fc < 0) | (fc > pl) | (fc > mc))
    if batch.tokens is not None:
        # The prompt must lie within the tokens' width (hashing and the first chunk read it).
        bad = bad | (valid & (pl > batch.tokens.shape[1]) & (pl <= plan.limits.max_context))
    too_long = valid & ~bad & (pl > plan.limits.max_context)
    asks = valid & ~bad & ~too_long
    ask_i = asks.astype(_I32)
    rank = jnp.cumsum(ask_i, dtype=_I32) - ask_i
    # O(max_requests): the lowest free slots, in order (the k-th asking row takes the k-th).
    free_slots = jnp.nonzero(~state.live, size=b, fill_value=r)[0].astype(_I32)
    slot = free_slots[jnp.clip(rank, 0, b - 1)]
    no_slot = asks & (slot >= r)
    want = asks & ~no_slot
    s = jnp.clip(slot, 0, r - 1)
    geo = geometry(plan)
    bt = geo.a("block_tokens")[None, :]
    prefix = batch.tokens is not None
    if prefix:
        _require_prefix(state, "AdmitBatch.tokens")
    if prefix:
        tokens = batch.tokens
        ns = jnp.zeros((b,), _I32) if batch.namespace is None else batch.namespace
        # Read-only: the index as at the start of the call. Rows past the argument checks
        # (NO_SLOT included) pin what they match, as the oracle does.
        # Hashing and lookups cover the tokens' width only (the host builder buckets it to
        # the longest prompt): cost follows the prompts, not max_context.
        m = match_prompts(
            _match_layout(plan, tokens.shape[1]),
            state.indexes,
            tokens,
            pl,
            ns,
            asks,
            seed=state.key_seed,
        )
        hit = m.hit
        state, pinned_cached, listing = _pin(plan, state, m, asks, True)
    else:
        hit = jnp.zeros((b,), _I32)
        pinned_cached = None
    count = jnp.minimum(fc, pl - hit)
    step_full = _step_full(plan, want, count, same_step)
    want = want & ~step_full
    state, served, part = _grow(
        plan,
        state,
        s,
        want,
        hit + count,
        pages_per_row(plan, mc),
        hi=hit[:, None] // bt,
        pinned_cached=pinned_cached,
    )
    if prefix:
        state = _take_hits(plan, state, m, s, served, listing)
        need = jnp.asarray([gm.need for gm in _match_layout(plan, tokens.shape[1]).groups], _I32)
        lo = jnp.where(
            geo.a("is_window")[None, :], jnp.maximum(0, hit[:, None] // bt - need[None, :]), 0
        )
        t_w = step_token_width(plan)
        pos = jnp.clip(hit[:, None] + jnp.arange(t_w, dtype=_I32)[None, :], 0, tokens.shape[1] - 1)
        first_tokens = jnp.take_along_axis(tokens, pos, axis=1)
        state = _replace(
            state,
            lo=_set_cols(state.lo, s, served, lo.T),
            chain=_set_rows(state.chain, s, served, m.state),
            namespace=_set_rows(state.namespace, s, served, ns),
            keyed=_set_rows(state.keyed, s, served, True),
            defer_len=_set_rows(state.defer_len, s, served, 0),
            fifo_tokens=state.fifo_tokens.at[jnp.where(served, s, r), 0].set(
                first_tokens, mode="drop"
            ),
        )
    else:
        state = _replace(state, keyed=_set_rows(state.keyed, s, served, False))
    oop = want & ~served
    status = _pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (bad, Status.BAD_ARG),
        (too_long, Status.TOO_LONG),
        (no_slot, Status.NO_SLOT),
        (step_full, Status.STEP_FULL),
        (oop, Status.OUT_OF_PAGES),
    )
    has_step = served & (count > 0)
    state = _replace(
        state,
        live=_set_rows(state.live, s, served, True),
        pending=_set_rows(state.pending, s, served, 0),
        extent=_set_rows(state.extent, s, served, hit + count),
        committed=_set_rows(state.committed, s, served, hit),
        fifo_head=_set_rows(state.fifo_head, s, served, 0),
        fifo_len=_set_rows(state.fifo_len, s, served, has_step.astype(_I32)),
        fifo_start=state.fifo_start.at[jnp.where(has_step, s, r), 0].set(hit, mode="drop"),
        fifo_count=state.fifo_count.at[jnp.where(has_step, s, r), 0].set(count, mode="drop"),
        fifo_cap=state.fifo_cap.at[jnp.where(has_step, s, r), 0].set(count, mode="drop"),
    )
    result = StepResult(
        status=status,
        slot=jnp.where(served, s, -1),
        generation=jnp.where(served, state.generation[s], -1),
        start=jnp.where(served, hit, -1),
        count=jnp.where(served, count, 0),
        hit=jnp.where(served, hit, 0),
        short_group=part.short_group,
        short_pages=part.short_pages,
        zero=_zero_lists(part),
        step_index=len(same_step),
    )
    return state, result


def extend_fn(
    plan: CachePlan,
    state: CacheState,
    batch: ExtendBatch,
    *,
    max_count: int | None = None,
    same_step: tuple[StepResult, ...] = (),
) -> tuple[CacheState, StepResult]:
    """Allocates the next step's tokens of running requests and records the step in flight.

    Per row: ``IDLE``, ``STALE`` (bad handle, or a release is pending), ``BAD_ARG`` (repeated
    slot, ``count`` outside ``[1, max_count]``), ``FIFO_FULL``, ``TOO_LONG`` (``n + count >
    max_context + verify_width``), ``STEP_FULL`` (the tokens would pass the step's
    ``step_tokens``; FIFO rule), ``OUT_OF_PAGES`` (FIFO rule), else ``OK``: every group gets
    the blocks ``[hi, ceil((n + count) / B))`` (history: every new slot; window: every slot the
    new positions touch), ``n += count`` and the step ``(n_old, count)`` joins the FIFO.

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`extend`).
      batch: handles and token counts.
      max_count: static bound on ``count`` (default ``max(chunk_tokens, 1 + verify)``); pass
        ``plan.limits.decode_tokens`` for a decode-only batch.
      same_step: the results of the ``admit``/``extend`` calls made earlier for the same step,
        in call order (see :func:`admit_fn`).

    Returns:
      The new state and a :class:`StepResult`.

    Raises:
      ValueError/TypeError: at trace time, as :func:`admit_fn`.
    """
    check_state_for_plan(plan, state, "extend")
    check_batch(batch, ExtendBatch, "extend")
    check_same_step(plan, same_step, "extend")
    mc = resolve_max_count(plan, max_count)
    r, d = state.max_requests, state.fifo_depth
    lim = plan.limits
    valid = batch.valid
    s, ok = _lookup(state, batch.slot, batch.generation)
    stale = valid & (~ok | (state.pending[s] != 0))
    dup = _later_duplicates(s, valid & ~stale, r)
    cnt = batch.count
    bad = valid & ~stale & (dup | (cnt < 1) | (cnt > mc))
    n_old = state.extent[s]
    flen = state.fifo_len[s]
    fifo_full = valid & ~stale & ~bad & (flen >= d)
    too_long = (
        valid & ~stale & ~bad & ~fifo_full & (n_old + cnt > lim.max_context + lim.verify_width)
    )
    want = valid & ~stale & ~bad & ~fifo_full & ~too_long
    step_full = _step_full(plan, want, cnt, same_step)
    want = want & ~step_full
    state, served, part = _grow(plan, state, s, want, n_old + cnt, pages_per_row(plan, mc))
    status = _pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (stale, Status.STALE),
        (bad, Status.BAD_ARG),
        (fifo_full, Status.FIFO_FULL),
        (too_long, Status.TOO_LONG),
        (step_full, Status.STEP_FULL),
        (want & ~served, Status.OUT_OF_PAGES),
    )
    pos = (state.fifo_head[s] + flen) % d
    srow = jnp.where(served, s, r)
    state = _replace(
        state,
        extent=_set_rows(state.extent, s, served, n_old + cnt),
        fifo_len=_set_rows(state.fifo_len, s, served, flen + 1),
        fifo_start=state.fifo_start.at[srow, pos].set(n_old, mode="drop"),
        fifo_count=state.fifo_count.at[srow, pos].set(cnt, mode="drop"),
        fifo_cap=state.fifo_cap.at[srow, pos].set(cnt, mode="drop"),
    )
    if batch.tokens is not None:
        _require_prefix(state, "ExtendBatch.tokens")
    if batch.tokens is None:
        # The step's tokens are unknown: the request's committed chain would be too.
        state = _replace(state, keyed=_set_rows(state.keyed, s, served, False))
    else:
        t_w = step_token_width(plan)
        toks = batch.tokens[:, :t_w]
        toks = jnp.pad(toks, ((0, 0), (0, t_w - toks.shape[1])))
        state = _replace(state, fifo_tokens=state.fifo_tokens.at[srow, pos].set(toks, mode="drop"))
    result = StepResult(
        status=status,
        slot=jnp.where(served, s, -1),
        generation=jnp.where(served, batch.generation, -1),
        start=jnp.where(served, n_old, -1),
        count=jnp.where(served, cnt, 0),
        hit=jnp.zeros_like(cnt),
        short_group=part.short_group,
        short_pages=part.short_pages,
        zero=_zero_lists(part),
        step_index=len(same_step),
    )
    return state, result


def retire_fn(
    plan: CachePlan, state: CacheState, batch: RetireBatch, *, max_count: int | None = None
) -> tuple[CacheState, RetireResult]:
    """Retires the oldest in-flight step of each row with the number of accepted tokens.

    Per row: ``IDLE``, ``STALE`` (a late result of a freed request), ``BAD_ARG`` (repeated
    slot), ``NO_STEP`` (FIFO empty), ``BAD_ARG`` (``accepted`` outside ``[0, count]`` or
    above ``max_count``); else the head ``(start, count)`` is popped and: ``DISCARDED`` if
    ``start != committed`` or a rewind cut every token of the step; otherwise ``OK`` with
    ``committed = start + min(accepted, cap)`` (``cap``: the step's tokens a rewind left
    valid) and, if some valid token was rejected, ``extent = committed`` (rewind: pages kept).
    The blocks the commit completed are published (requests admitted with tokens, unless an
    ABORT is pending). A request whose release was deferred is freed by the retire that
    empties its FIFO.

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`retire`).
      batch: handles and accepted counts.
      max_count: static bound on ``accepted`` (default ``max(chunk_tokens, 1 + verify)``):
        publishing hashes that many token columns per row, so a decode-only batch should
        pass ``plan.limits.decode_tokens`` (as it does to :func:`extend_fn`).

    Returns:
      The new state and a :class:`RetireResult`.
    """
    check_state_for_plan(plan, state, "retire")
    check_batch(batch, RetireBatch, "retire")
    mc = resolve_max_count(plan, max_count)
    r, d = state.max_requests, state.fifo_depth
    valid = batch.valid
    s, ok = _lookup(state, batch.slot, batch.generation)
    stale = valid & ~ok
    dup = valid & _later_duplicates(s, valid & ~stale, r)
    flen = state.fifo_len[s]
    no_step = valid & ~stale & ~dup & (flen == 0)
    head = state.fifo_head[s]
    st = state.fifo_start[s, head]
    cnt = state.fifo_count[s, head]
    cap = state.fifo_cap[s, head]
    acc = batch.accepted
    bad_acc = valid & ~stale & ~dup & ~no_step & ((acc < 0) | (acc > cnt) | (acc > mc))
    go = valid & ~stale & ~dup & ~no_step & ~bad_acc
    c_old, n_old = state.committed[s], state.extent[s]
    discarded = go & ((st != c_old) | (cap == 0))
    commit = go & ~discarded
    a = jnp.minimum(acc, cap)
    c_new = jnp.where(commit, st + a, c_old)
    n_new = jnp.where(commit & (a < cap), c_new, n_old)
    len_new = flen - 1
    status = _pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (stale, Status.STALE),
        (dup, Status.BAD_ARG),
        (no_step, Status.NO_STEP),
        (bad_acc, Status.BAD_ARG),
        (discarded, Status.DISCARDED),
    )
    pending = state.pending[s]
    release = go & (pending != 0) & (len_new == 0)
    if state.prefix:
        # Publish the blocks this step completed (not for a request being aborted), and the
        # deferred blocks of requests this call frees (FINISH/RETRACT): one publish for both.
        pub = commit & state.keyed[s] & (pending != 1 + ReleaseMode.ABORT)
        new_blocks = pub & (a > 0)
        pub = pub | _final_publish(state, s, release, pending - 1)
        a = jnp.where(commit, a, 0)
        # Two conds in sequence, at most one taken: XLA updates a cond's buffers in place
        # only when the other branch is the identity (two writing branches, or a cond nested
        # in the untaken branch, copy every buffer they write: the whole index, every step).
        any_retry = jnp.any(pub & (state.defer_len[s] > 0))
        state = jax.lax.cond(
            any_retry,
            lambda st: _publish(plan, st, s, pub, c_old, a, head, True, mc),
            lambda st: st,
            state,
        )
        state = jax.lax.cond(
            ~any_retry & jnp.any(new_blocks),
            lambda st: _publish(plan, st, s, new_blocks, c_old, a, head, False, mc),
            lambda st: st,
            state,
        )
    state = _replace(
        state,
        committed=_set_rows(state.committed, s, go, c_new),
        extent=_set_rows(state.extent, s, go, n_new),
        fifo_head=_set_rows(state.fifo_head, s, go, (head + 1) % d),
        fifo_len=_set_rows(state.fifo_len, s, go, len_new),
    )
    # Deferred releases are rare: skip the sweeps (and their loops) on steps without one.
    state = jax.lax.cond(
        jnp.any(release),
        lambda st: _free(plan, st, s, release, pending - 1, publish=False),
        lambda st: st,
        state,
    )
    result = RetireResult(
        status=status,
        committed=jnp.where(go, c_new, -1),
        extent=jnp.where(go, n_new, -1),
        released=release,
    )
    return state, result


def rewind_fn(
    plan: CachePlan, state: CacheState, batch: RewindBatch
) -> tuple[CacheState, StatusResult]:
    """Drops uncommitted tokens: ``extent = new_extent`` with ``committed <= new_extent <= extent``.

    Pages are kept (tables are position-addressed; the next step overwrites the same rows).
    In-flight steps are cut at ``new_extent``: their tokens at or past it will not be committed
    by ``retire`` (a step cut entirely retires as ``DISCARDED``).

    Per row: ``IDLE``, ``STALE`` (incl. a pending release), ``BAD_ARG`` (repeated slot,
    ``new_extent`` out of range), else ``OK``.
    """
    check_state_for_plan(plan, state, "rewind")
    check_batch(batch, RewindBatch, "rewind")
    r, d = state.max_requests, state.fifo_depth
    valid = batch.valid
    s, ok = _lookup(state, batch.slot, batch.generation)
    stale = valid & (~ok | (state.pending[s] != 0))
    e = batch.extent
    bad = (
        valid
        & ~stale
        & (
            _later_duplicates(s, valid & ~stale, r)
            | (e < state.committed[s])
            | (e > state.extent[s])
        )
    )
    go = valid & ~stale & ~bad
    status = _pick_status(
        Status.OK, (~valid, Status.IDLE), (stale, Status.STALE), (bad, Status.BAD_ARG)
    )
    j = jnp.arange(d, dtype=_I32)[None, :]
    in_flight = ((j - state.fifo_head[s][:, None]) % d) < state.fifo_len[s][:, None]
    starts = state.fifo_start[s]
    caps = state.fifo_cap[s]
    new_caps = jnp.where(in_flight, jnp.clip(e[:, None] - starts, 0, caps), caps)
    state = _replace(
        state,
        extent=_set_rows(state.extent, s, go, e),
        fifo_cap=_set_rows(state.fifo_cap, s, go, new_caps),
    )
    return state, StatusResult(status)


def reclaim_fn(
    plan: CachePlan, state: CacheState, batch: HandleBatch
) -> tuple[CacheState, ReclaimResult]:
    """Window groups: slots wholly behind the window of ``committed`` become holes (0).

    Slot ``i`` of a window group with window ``W`` and span ``B`` is dropped iff
    ``i < lo = max(0, (committed - W + 1) // B)``; its page is decref'd (freed unless the
    prefix index holds it). Cost O(slots dropped).

    Per row: ``IDLE``, ``STALE``, ``BAD_ARG`` (repeated slot), else ``OK`` (a request whose
    release is pending may still reclaim).
    """
    check_state_for_plan(plan, state, "reclaim")
    check_batch(batch, HandleBatch, "reclaim")
    r = state.max_requests
    b = batch.valid.shape[0]
    valid = batch.valid
    s, ok = _lookup(state, batch.slot, batch.generation)
    stale = valid & ~ok
    bad = valid & _later_duplicates(s, valid & ~stale, r)
    go = valid & ~stale & ~bad
    status = _pick_status(
        Status.OK, (~valid, Status.IDLE), (stale, Status.STALE), (bad, Status.BAD_ARG)
    )
    geo = geometry(plan)
    c = state.committed[s]
    lo, hi = state.lo[:, s], state.hi[:, s]  # [G, B]
    bt, win = geo.a("block_tokens")[:, None], geo.a("window")[:, None]
    behind = jnp.maximum(0, (c[None, :] - win + 1) // bt)
    new_lo = jnp.where(geo.a("is_window")[:, None], jnp.clip(behind, lo, hi), lo)
    state = _sweep(plan, state, s, go, lo, new_lo, 0, _reclaim_chunk(plan, b))
    state = _replace(state, lo=_set_cols(state.lo, s, go, new_lo))
    return state, ReclaimResult(status, jnp.where(go[:, None], (new_lo - lo).T, 0))


def _reclaim_chunk(plan: CachePlan, b: int) -> int:
    # A decode step drops at most a block per window group and request, and usually only in
    # the small-block groups: a chunk of one entry per request is one or two iterations.
    del plan
    return max(64, b)


def release_fn(
    plan: CachePlan, state: CacheState, batch: ReleaseBatch
) -> tuple[CacheState, StatusResult]:
    """Finishes, aborts or retracts requests (``batch.mode``, a :class:`ReleaseMode`).

    Per row: ``IDLE``, ``STALE`` (incl. a release already pending), ``BAD_ARG`` (repeated slot,
    unknown mode); ``DEFERRED`` if steps are in flight (the request takes no new steps and the
    ``retire`` that empties its FIFO frees it); else ``OK``: FINISH/RETRACT publish (issue 5),
    every table reference is dropped, the rows become -1, the slot is free and its generation
    is incremented.
    """
    check_state_for_plan(plan, state, "release")
    check_batch(batch, ReleaseBatch, "release")
    r = state.max_requests
    valid = batch.valid
    s, ok = _lookup(state, batch.slot, batch.generation)
    stale = valid & (~ok | (state.pending[s] != 0))
    mode = batch.mode
    bad = (
        valid
        & ~stale
        & (_later_duplicates(s, valid & ~stale, r) | (mode < 0) | (mode > max(ReleaseMode)))
    )
    go = valid & ~stale & ~bad
    deferred = go & (state.fifo_len[s] > 0)
    now = go & ~deferred
    status = _pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (stale, Status.STALE),
        (bad, Status.BAD_ARG),
        (deferred, Status.DEFERRED),
    )
    state = _replace(state, pending=_set_rows(state.pending, s, deferred, mode + 1))
    state = _free(plan, state, s, now, mode)
    return state, StatusResult(status)


#: ``admit_fn`` jitted (plan and ``max_count`` static, state donated).
admit = jax.jit(admit_fn, static_argnames=("plan", "max_count"), donate_argnames=("state",))
#: ``extend_fn`` jitted (plan and ``max_count`` static, state donated).
extend = jax.jit(extend_fn, static_argnames=("plan", "max_count"), donate_argnames=("state",))
#: ``retire_fn`` jitted (plan and ``max_count`` static, state donated).
retire = jax.jit(retire_fn, static_argnames=("plan", "max_count"), donate_argnames=("state",))
#: ``rewind_fn`` jitted (plan static, state donated).
rewind = jax.jit(rewind_fn, static_argnames=("plan",), donate_argnames=("state",))
#: ``reclaim_fn`` jitted (plan static, state donated).
reclaim = jax.jit(reclaim_fn, static_argnames=("plan",), donate_argnames=("state",))
#: ``release_fn`` jitted (plan static, state donated).
release = jax.jit(release_fn, static_argnames=("plan",), donate_argnames=("state",))
