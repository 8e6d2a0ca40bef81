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
``STALE``, ``BAD_ARG``, then the op's own checks, and ``OUT_OF_PAGES`` last.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flatkv_jax.block_pool import Acquired, BlockPoolSet, acquire, decref
from flatkv_jax.coordinator.batches import (
    AdmitBatch,
    ExtendBatch,
    HandleBatch,
    ReleaseBatch,
    ReleaseMode,
    RetireBatch,
    RewindBatch,
)
from flatkv_jax.coordinator.results import ReclaimResult, RetireResult, StatusResult, StepResult
from flatkv_jax.coordinator.segments import segment_rows
from flatkv_jax.coordinator.state import CacheState, pool_layout, table_offset, table_size
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan
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
) -> tuple[CacheState, jax.Array, Acquired]:
    """Allocates every block ``[hi, ceil(new_end / B))`` of every group, atomically, in order.

    Returns the state with tables and ``hi`` updated for the served rows, the served mask and
    the allocator's :class:`~flatkv_jax.block_pool.Acquired` (pages, shortage).
    """
    geo = geometry(plan)
    hi = state.hi[:, s].T  # [B, G]
    needs = jnp.maximum(0, _ceil_div(new_end[:, None], geo.a("block_tokens")[None, :]) - hi)
    pools, got = acquire(state.allocator, pool_layout(plan), needs, want, k)
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


def _zero_lists(got: Acquired) -> jax.Array:
    """``[G, B * K]``: every page handed out, per pool, padded with -1."""
    b, g, k = got.pages.shape
    return jnp.transpose(got.pages, (1, 0, 2)).reshape(g, b * k)


def _sweep(
    plan: CachePlan,
    pools: BlockPoolSet,
    tables: jax.Array,
    s: jax.Array,
    mask: jax.Array,
    start: jax.Array,
    end: jax.Array,
    fill: int,
    chunk: int,
) -> tuple[BlockPoolSet, jax.Array]:
    """For every group ``g`` and row ``i`` of ``mask``: sets table entries
    ``[start[g, i], end[g, i])`` of request ``s[i]`` to ``fill`` and decrefs the pages they
    held. Cost O(entries changed), in chunks of ``chunk`` entries across all groups."""
    geo = geometry(plan)
    n_g, b = start.shape
    length = jnp.where(mask[None, :], jnp.maximum(end - start, 0), 0).reshape(-1)  # [G * B]
    incl = jnp.cumsum(length, dtype=_I32)
    excl = incl - length
    total = incl[-1]
    group = jnp.broadcast_to(jnp.arange(n_g, dtype=_I32)[:, None], (n_g, b)).reshape(-1)
    row_base = (geo.a("table_offset")[:, None] + geo.a("width")[:, None] * s[None, :]).reshape(-1)
    first = (row_base + start.reshape(-1)) - excl  # table index of flat entry e is first[q] + e
    size = table_size(plan)

    def body(i, carry):
        pools, tables = carry
        e = i * chunk + jnp.arange(chunk, dtype=_I32)
        on = e < total
        q = segment_rows(excl, length, i * chunk, chunk)
        idx = first[q] + e
        old = tables[jnp.where(on, idx, 0)]
        # The written value depends on `old` (it never equals INT32_MIN), which pins the gather
        # before the scatter; a gather used only after it makes XLA copy the whole buffer.
        value = jnp.where(old == jnp.iinfo(_I32).min, old, fill)
        tables = tables.at[jnp.where(on, idx, size)].set(value, mode="drop")
        pools, _ = decref(pools, pool_layout(plan), group[q], jnp.where(on, old, -1))
        return pools, tables

    return jax.lax.fori_loop(0, _ceil_div(total, chunk), body, (pools, tables))


def _free(
    plan: CachePlan, state: CacheState, s: jax.Array, mask: jax.Array, mode: jax.Array
) -> CacheState:
    """Frees requests now: publish (FINISH/RETRACT, issue 5), drop every table reference, reset
    the slot and bump its generation."""
    publish = mask & (mode != ReleaseMode.ABORT)
    del publish  # Issue 5: publish the complete committed blocks of these rows before freeing.
    b = s.shape[0]
    hi = state.hi[:, s]
    pools, tables = _sweep(
        plan,
        state.allocator,
        state.table_buffer,
        s,
        mask,
        jnp.zeros_like(hi),
        hi,
        -1,
        _release_chunk(b),
    )
    zeros = jnp.zeros_like(hi)
    return _replace(
        state,
        allocator=pools,
        table_buffer=tables,
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


def _release_chunk(b: int) -> int:
    # One chunk covers a few short requests; long requests loop (cost follows their length).
    return max(256, 8 * b)


def _replace(state: CacheState, **kw) -> CacheState:
    return dataclasses.replace(state, **kw)


# --- operations ------------------------------------------------------------------------------
def admit_fn(
    plan: CachePlan, state: CacheState, batch: AdmitBatch, *, max_count: int | None = None
) -> tuple[CacheState, StepResult]:
    """Admits new requests: claims the lowest free slots, allocates their first chunk.

    Per row, in priority order: ``IDLE`` (masked), ``BAD_ARG`` (``prompt_len < 1``,
    ``first_chunk`` outside ``[0, min(prompt_len, max_count)]``), ``TOO_LONG``
    (``prompt_len > max_context``), ``NO_SLOT``, ``OUT_OF_PAGES`` (FIFO rule: the first row
    that does not fit and every later row), else ``OK``. Served rows claim the lowest free
    slots in batch order and get ``extent = h + first_chunk``, ``committed = h`` and, if
    ``first_chunk > 0``, one in-flight step ``(h, first_chunk)``. With the prefix index (issue
    5) ``h`` is the hit; now ``h = 0``.

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`admit`).
      batch: the new requests.
      max_count: static bound on ``first_chunk`` (default ``max(chunk_tokens, 1 + verify)``).

    Returns:
      The new state and a :class:`StepResult` (its ``zero`` lists the pages to zero).
    """
    mc = resolve_max_count(plan, max_count)
    r = state.max_requests
    b = batch.valid.shape[0]
    valid, pl, fc = batch.valid, batch.prompt_len, batch.first_chunk
    bad = valid & ((pl < 1) | (fc < 0) | (fc > pl) | (fc > mc))
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
    # Issue 5: match the prefix index here; shared pages get refcount + 1 and fill table slots
    # [lo(h), ceil(h / B)) of window groups and [0, h / B) of history groups; lo = lo(h).
    hit = jnp.zeros((b,), _I32)
    count = jnp.minimum(fc, pl - hit)
    state, served, part = _grow(plan, state, s, want, hit + count, pages_per_row(plan, mc))
    oop = want & ~served
    status = _pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (bad, Status.BAD_ARG),
        (too_long, Status.TOO_LONG),
        (no_slot, Status.NO_SLOT),
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
    )
    return state, result


def extend_fn(
    plan: CachePlan, state: CacheState, batch: ExtendBatch, *, max_count: int | None = None
) -> tuple[CacheState, StepResult]:
    """Allocates the next step's tokens of running requests and records the step in flight.

    Per row: ``IDLE``, ``STALE`` (bad handle, or a release is pending), ``BAD_ARG`` (repeated
    slot, ``count`` outside ``[1, max_count]``), ``FIFO_FULL``, ``TOO_LONG`` (``n + count >
    max_context + verify_width``), ``OUT_OF_PAGES`` (FIFO rule), else ``OK``: every group gets
    the blocks ``[hi, ceil((n + count) / B))`` (history: every new slot; window: every slot the
    new positions touch), ``n += count`` and the step ``(n_old, count)`` joins the FIFO.

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`extend`).
      batch: handles and token counts.
      max_count: static bound on ``count`` (default ``max(chunk_tokens, 1 + verify)``); pass
        ``plan.limits.decode_tokens`` for a decode-only batch.

    Returns:
      The new state and a :class:`StepResult`.
    """
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
    state, served, part = _grow(plan, state, s, want, n_old + cnt, pages_per_row(plan, mc))
    status = _pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (stale, Status.STALE),
        (bad, Status.BAD_ARG),
        (fifo_full, Status.FIFO_FULL),
        (too_long, Status.TOO_LONG),
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
    )
    return state, result


def retire_fn(
    plan: CachePlan, state: CacheState, batch: RetireBatch
) -> tuple[CacheState, RetireResult]:
    """Retires the oldest in-flight step of each row with the number of accepted tokens.

    Per row: ``IDLE``, ``STALE`` (a late result of a freed request), ``BAD_ARG`` (repeated
    slot), ``NO_STEP`` (FIFO empty), ``BAD_ARG`` (``accepted`` outside ``[0, count]``); else the
    head ``(start, count)`` is popped and: ``DISCARDED`` if ``start != committed`` or a rewind
    cut every token of the step; otherwise ``OK`` with ``committed = start + min(accepted,
    cap)`` (``cap``: the step's tokens a rewind left valid) and, if some valid token was
    rejected, ``extent = committed`` (rewind: pages kept). Publishing (issue 5) would happen
    here. A request whose release was deferred is freed by the retire that empties its FIFO.

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`retire`).
      batch: handles and accepted counts.

    Returns:
      The new state and a :class:`RetireResult`.
    """
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
    bad_acc = valid & ~stale & ~dup & ~no_step & ((acc < 0) | (acc > cnt))
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
    state = _replace(
        state,
        committed=_set_rows(state.committed, s, go, c_new),
        extent=_set_rows(state.extent, s, go, n_new),
        fifo_head=_set_rows(state.fifo_head, s, go, (head + 1) % d),
        fifo_len=_set_rows(state.fifo_len, s, go, len_new),
    )
    release = go & (pending != 0) & (len_new == 0)
    # Deferred releases are rare: skip the sweeps (and their loops) on steps without one.
    state = jax.lax.cond(
        jnp.any(release),
        lambda st: _free(plan, st, s, release, pending - 1),
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
    del plan
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
    pools, tables = _sweep(
        plan, state.allocator, state.table_buffer, s, go, lo, new_lo, 0, _reclaim_chunk(plan, b)
    )
    state = _replace(
        state, allocator=pools, table_buffer=tables, lo=_set_cols(state.lo, s, go, new_lo)
    )
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
#: ``retire_fn`` jitted (plan static, state donated).
retire = jax.jit(retire_fn, static_argnames=("plan",), donate_argnames=("state",))
#: ``rewind_fn`` jitted (plan static, state donated).
rewind = jax.jit(rewind_fn, static_argnames=("plan",), donate_argnames=("state",))
#: ``reclaim_fn`` jitted (plan static, state donated).
reclaim = jax.jit(reclaim_fn, static_argnames=("plan",), donate_argnames=("state",))
#: ``release_fn`` jitted (plan static, state donated).
release = jax.jit(release_fn, static_argnames=("plan",), donate_argnames=("state",))
