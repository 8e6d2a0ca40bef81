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
  fixed-size chunks of the flattened (row, table column) segments that change; a release touches
  ``[0, hi)`` of each of the request's rows (its pages, and its holes which become -1).
- retire/rewind: ``O(B * fifo_depth)``; retire_reclaim: retire's plus reclaim's, one sweep.

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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator.alloc import forget_rows, free_now, grow, reclaim_chunk, sweep
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
from flatkv_jax.coordinator.layout import (
    admit_lanes_width,
    div_groups,
    pages_per_row,
    per_group,
    publish_unit,
    resolve_max_count,
    state_layout,
)
from flatkv_jax.coordinator.publish import (
    match_layout,
    pin,
    publish_blocks,
    take_hits,
)
from flatkv_jax.coordinator.results import (
    ReclaimResult,
    RetireReclaimResult,
    RetireResult,
    StatusResult,
    StepResult,
)
from flatkv_jax.coordinator.rows import (
    later_duplicates,
    lookup,
    over_step_budget,
    pick_status,
    replace,
    require_prefix,
    set_cols,
    set_rows,
)
from flatkv_jax.coordinator.state import CacheState
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix import keys as keys_lib
from flatkv_jax.prefix.match import match_prompts
from flatkv_jax.status import Status

_I32 = jnp.int32

# resolve_max_count and pages_per_row live in .layout; they are re-exported here because the
# model and the serving engine import them from this module.
__all__ = [
    "admit",
    "admit_fn",
    "extend",
    "extend_fn",
    "pages_per_row",
    "reclaim",
    "reclaim_fn",
    "release",
    "release_fn",
    "resolve_max_count",
    "retire",
    "retire_fn",
    "retire_reclaim",
    "retire_reclaim_fn",
    "rewind",
    "rewind_fn",
]


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
    ``first_chunk > 0``, one in-flight step ``(h, first_chunk)``.
    With ``batch.tokens`` the prompt is matched against the prefix index first: ``h`` is the
    hit (docs/semantics.md, "Prefix reuse"), its pages are shared (+1 reference, out of the
    LRU), window columns before the trailing run are holes, and the supply of the in-order rule
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
    rows = _admission_rows(plan, state, batch, mc)
    if batch.tokens is None:
        hit = jnp.zeros_like(batch.prompt_len)
        pinned_cached = match = listing = None
    else:
        require_prefix(state, "AdmitBatch.tokens")
        state, hit, pinned_cached, match, listing = _match_admission(plan, state, batch, rows.asks)
    count = jnp.minimum(batch.first_chunk, batch.prompt_len - hit)
    step_full = over_step_budget(plan, rows.want, count, same_step, mc)
    want = rows.want & ~step_full
    state, part = grow(
        plan,
        state,
        rows.s,
        want,
        hit + count,
        pages_per_row(plan, mc),
        hi=div_groups(hit[None, :], state_layout(plan).block_tokens, 0),
        pinned_cached=pinned_cached,
        top_up=True,  # plan.evict_ahead_tokens: admissions top the free stacks up
    )
    served = part.served
    if batch.tokens is None:
        state = replace(
            state,
            keyed=set_rows(state.keyed, rows.s, served, False),
            admit_hashed=set_rows(state.admit_hashed, rows.s, served, False),
        )
    else:
        state = _record_prefix_admission(
            plan, state, batch, rows.s, served, hit, count, match, listing
        )
    status = pick_status(
        Status.OK,
        (~batch.valid, Status.IDLE),
        (rows.bad, Status.BAD_ARG),
        (rows.too_long, Status.TOO_LONG),
        (rows.no_slot, Status.NO_SLOT),
        (step_full, Status.STEP_FULL),
        (want & ~served, Status.OUT_OF_PAGES),
    )
    state = _start_requests(state, rows.s, served, hit, count)
    s = rows.s
    result = StepResult(
        status=status,
        slot=jnp.where(served, s, -1),
        generation=jnp.where(served, state.generation[s], -1),
        start=jnp.where(served, hit, -1),
        count=jnp.where(served, count, 0),
        hit=jnp.where(served, hit, 0),
        short_group=part.short_group,
        short_pages=part.short_pages,
        zero=part.zero,
        step_index=len(same_step),
        max_count=mc,
    )
    return state, result


class _AdmissionRows(NamedTuple):
    """The argument checks and slot claims of one admit call, per row."""

    bad: jax.Array  # BAD_ARG
    too_long: jax.Array  # TOO_LONG
    asks: jax.Array  # past the argument checks (these rows match and pin their prefix)
    no_slot: jax.Array  # NO_SLOT
    want: jax.Array  # asks and got a slot
    s: jax.Array  # the claimed request slot (clipped; meaningful where ``want``)


def _admission_rows(
    plan: CachePlan, state: CacheState, batch: AdmitBatch, mc: int
) -> _AdmissionRows:
    """Checks admit's arguments and claims the lowest free request slots, in batch order."""
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
    return _AdmissionRows(bad, too_long, asks, no_slot, asks & ~no_slot, jnp.clip(slot, 0, r - 1))


def _match_admission(plan: CachePlan, state: CacheState, batch: AdmitBatch, asks: jax.Array):
    """Matches the prompts of ``asks`` against the prefix index and pins the matched pages.

    Returns ``(state, hit, pinned_cached, match, listing)``: the hit per row, the distinct
    cached-only pages pinned per pool, the match and the pinned pages' listing.
    """
    tokens = batch.tokens
    b = tokens.shape[0]
    ns = jnp.zeros((b,), _I32) if batch.namespace is None else batch.namespace
    # Read-only: the index as at the start of the call. Rows past the argument checks
    # (NO_SLOT included) pin what they match, as the oracle does.
    # Hashing and lookups cover the tokens' width only (the host builder buckets it to
    # the longest prompt): cost follows the prompts, not max_context.
    m = match_prompts(
        match_layout(plan, tokens.shape[1]),
        state.index,
        tokens,
        batch.prompt_len,
        ns,
        asks,
        seed=state.key_seed,
    )
    state, pinned_cached, listing = pin(plan, state, m, asks, True)
    return state, m.hit, pinned_cached, m, listing


def _record_prefix_admission(
    plan: CachePlan,
    state: CacheState,
    batch: AdmitBatch,
    s: jax.Array,
    served: jax.Array,
    hit: jax.Array,
    count: jax.Array,
    m,
    listing,
) -> CacheState:
    """Served rows take their hit pages; window columns before the trailing run become holes;
    the request's chain state, namespace and first step's tokens are recorded, and what the
    publish of that step needs from the match's hashes (:func:`_admission_hashes`)."""
    lay = state_layout(plan)
    tokens = batch.tokens
    b = tokens.shape[0]
    ns = jnp.zeros((b,), _I32) if batch.namespace is None else batch.namespace
    state = take_hits(plan, state, m, s, served, listing)
    need = jnp.asarray([gm.need for gm in match_layout(plan, tokens.shape[1]).groups], _I32)
    lo = jnp.where(
        per_group(lay.is_window)[None, :],
        jnp.maximum(0, div_groups(hit[:, None], lay.block_tokens, 1) - need[None, :]),
        0,
    )
    t_w = plan.limits.max_count
    pos = jnp.clip(hit[:, None] + jnp.arange(t_w, dtype=_I32)[None, :], 0, tokens.shape[1] - 1)
    first_tokens = jnp.take_along_axis(tokens, pos, axis=1)
    hashed, lanes, chain_end = _admission_hashes(plan, m.prompt, batch.prompt_len, hit, count)
    hashed = served & hashed
    if lanes is not None:
        state = replace(
            state,
            admit_lanes=set_rows(state.admit_lanes, s, hashed, lanes),
            admit_chain=set_rows(state.admit_chain, s, hashed, chain_end),
        )
    return replace(
        state,
        admit_hashed=set_rows(state.admit_hashed, s, served, hashed),
        lo=set_cols(state.lo, s, served, lo.T),
        chain=set_rows(state.chain, s, served, m.state),
        namespace=set_rows(state.namespace, s, served, ns),
        subkeys=set_rows(state.subkeys, s, served, keys_lib.subkeys(state.key_seed, ns, b).words()),
        keyed=set_rows(state.keyed, s, served, True),
        fifo_tokens=state.fifo_tokens.at[jnp.where(served, s, state.max_requests), 0].set(
            first_tokens, mode="drop"
        ),
    )


def _admission_hashes(
    plan: CachePlan,
    ph: keys_lib.PromptHash,
    prompt_len: jax.Array,
    hit: jax.Array,
    count: jax.Array,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """What the publish of each row's first step ``(hit, count)`` needs, from the match's
    hashes of the whole prompt: ``(ok bool[B], lanes uint32[B, N, LANES], chain uint32[B,
    CHAIN_WORDS])``, the lanes and the chain state :func:`~flatkv_jax.prefix.keys.extend_chain`
    would return for the step's tokens from the chain state at ``hit``.

    ``ok`` where the step has tokens and the chain state at its end is exact (the end is the
    prompt's length or a multiple of the hash's sub-unit: :func:`~flatkv_jax.prefix.keys.
    chain_state`). ``(False, None, None)`` (static) where the state keeps no lanes (publish
    unit 1) or the match's unit does not divide the publish unit."""
    n = admit_lanes_width(plan)
    unit = publish_unit(plan)
    if n == 0 or unit % ph.unit or ph.lanes.shape[1] == 0:
        return jnp.zeros_like(hit, dtype=bool), None, None
    end = hit + count
    ok = (count > 0) & ((end % ph.sub_unit == 0) | (end == prompt_len))
    # extend_chain's entry j: the prefix ending at (start // unit + 1 + j) * unit, start = hit.
    ends = (hit[:, None] // unit + 1 + jnp.arange(n, dtype=_I32)[None, :]) * unit
    at = jnp.clip(ends // ph.unit - 1, 0, ph.lanes.shape[1] - 1)
    lanes = jnp.take_along_axis(ph.lanes, at[:, :, None], axis=1)
    return ok, lanes, keys_lib.chain_state(ph, end)


def _start_requests(
    state: CacheState, s: jax.Array, served: jax.Array, hit: jax.Array, count: jax.Array
) -> CacheState:
    """Served rows become live requests: ``committed = hit``, ``extent = hit + count`` and, if
    ``count > 0``, one in-flight step ``(hit, count)``."""
    r = state.max_requests
    has_step = served & (count > 0)
    return replace(
        state,
        live=set_rows(state.live, s, served, True),
        pending=set_rows(state.pending, s, served, 0),
        extent=set_rows(state.extent, s, served, hit + count),
        committed=set_rows(state.committed, s, served, hit),
        fifo_head=set_rows(state.fifo_head, s, served, 0),
        fifo_len=set_rows(state.fifo_len, s, served, has_step.astype(_I32)),
        fifo_start=state.fifo_start.at[jnp.where(has_step, s, r), 0].set(hit, mode="drop"),
        fifo_count=state.fifo_count.at[jnp.where(has_step, s, r), 0].set(count, mode="drop"),
        fifo_cap=state.fifo_cap.at[jnp.where(has_step, s, r), 0].set(count, mode="drop"),
    )


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
    slot, ``count`` outside ``[1, max_count]``, or above the width of ``batch.tokens`` when
    tokens are given: a row carries all its tokens), ``FIFO_FULL``, ``TOO_LONG`` (``n + count >
    max_context + verify_width``), ``STEP_FULL`` (the tokens would pass the step's
    ``step_tokens``; FIFO rule), ``OUT_OF_PAGES`` (FIFO rule), else ``OK``: every group gets
    the blocks ``[hi, ceil((n + count) / B))`` (history: every new column; window: every column the
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
    s, ok = lookup(state, batch.slot, batch.generation)
    stale = valid & (~ok | (state.pending[s] != 0))
    dup = later_duplicates(s, valid & ~stale, r)
    cnt = batch.count
    bad = valid & ~stale & (dup | (cnt < 1) | (cnt > mc))
    if batch.tokens is not None:
        # A row must carry its ``count`` tokens: padding the missing ones with zeros would
        # publish the step's blocks under keys of tokens it never held (another prompt
        # ending in those zeros would then be served this request's KV).
        bad = bad | (valid & ~stale & (cnt > batch.tokens.shape[1]))
    n_old = state.extent[s]
    flen = state.fifo_len[s]
    fifo_full = valid & ~stale & ~bad & (flen >= d)
    too_long = (
        valid & ~stale & ~bad & ~fifo_full & (n_old + cnt > lim.max_context + lim.verify_width)
    )
    want = valid & ~stale & ~bad & ~fifo_full & ~too_long
    step_full = over_step_budget(plan, want, cnt, same_step, mc)
    want = want & ~step_full
    state, part = grow(plan, state, s, want, n_old + cnt, pages_per_row(plan, mc))
    served = part.served
    status = pick_status(
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
    state = replace(
        state,
        extent=set_rows(state.extent, s, served, n_old + cnt),
        fifo_len=set_rows(state.fifo_len, s, served, flen + 1),
        fifo_start=state.fifo_start.at[srow, pos].set(n_old, mode="drop"),
        fifo_count=state.fifo_count.at[srow, pos].set(cnt, mode="drop"),
        fifo_cap=state.fifo_cap.at[srow, pos].set(cnt, mode="drop"),
    )
    if batch.tokens is not None:
        require_prefix(state, "ExtendBatch.tokens")
    if batch.tokens is None:
        # The step's tokens are unknown: the request's committed chain would be too.
        state = replace(state, keyed=set_rows(state.keyed, s, served, False))
    else:
        # Only the columns a step of this call can count are written (``count <= mc``; later
        # columns are never read): a decode step writes one token per row, not the whole
        # ``limits.max_count``-wide FIFO row (at B = 256 and 4k chunks that was a 4 MB pad
        # and scatter on every step).
        w = min(plan.limits.max_count, max(batch.tokens.shape[1], mc))
        toks = batch.tokens[:, :w]
        toks = jnp.pad(toks, ((0, 0), (0, w - toks.shape[1])))
        state = replace(
            state,
            fifo_tokens=state.fifo_tokens.at[srow, pos, :w].set(toks, mode="drop"),
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
        zero=part.zero,
        step_index=len(same_step),
        max_count=mc,
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
    state, result, s = _retire(plan, state, batch, resolve_max_count(plan, max_count))
    # Deferred releases are rare: skip the sweeps (and their loops) on steps without one.
    # Their sweep walks a decode step's chunk (reclaim_chunk), not a release's: XLA:CPU
    # charges every call for the code it holds, run or not, and a release-sized chunk's
    # sweep cost each B = 256 decode step ~3 % more (ab_compiled x0.976 / x1.031 reversed).
    # (retire_reclaim_fn holds no second sweep at all.)
    release = result.released
    state = jax.lax.cond(
        jnp.any(release),
        lambda st: free_now(plan, st, s, release, reclaim_chunk(plan, s.shape[0])),
        lambda st: st,
        state,
    )
    return state, result


def retire_reclaim_fn(
    plan: CachePlan,
    state: CacheState,
    batch: RetireBatch,
    *,
    max_count: int | None = None,
    reclaim_max_count: int | None = None,
) -> tuple[CacheState, RetireReclaimResult]:
    """``retire_fn``, then ``reclaim_fn`` of the rows it committed, in one sweep.

    The result and the new state are those of::

        state, r = retire_fn(plan, state, batch, max_count=max_count)
        keep = (r.status == Status.OK) & ~r.released
        state, c = reclaim_fn(plan, state, HandleBatch(keep, batch.slot, batch.generation),
                              max_count=reclaim_max_count)

    with ``c.holes`` as the result's ``holes``: what a decode step runs after its model step.
    The difference is cost: the pages of requests whose deferred release this retire completes
    and the window pages behind every committed row are dropped by one sweep (the released
    rows' entries first in each pool, as the two calls drop them), where the two calls hold two
    sweeps, one of them for a release that decode steps seldom see. XLA:CPU charges every call
    for the code a program holds, run or not (docs/coordinator.md, cost rule 4).

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`retire_reclaim`).
      batch: handles and accepted counts.
      max_count: static, as :func:`retire_fn`'s (a decode-only batch:
        ``plan.limits.decode_tokens``).
      reclaim_max_count: static, optional, as :func:`reclaim_fn`'s ``max_count`` (sizes the
        sweep's chunks only; after a prefill pass, the chunk width).

    Returns:
      The new state and a :class:`RetireReclaimResult`.
    """
    check_state_for_plan(plan, state, "retire_reclaim")
    check_batch(batch, RetireBatch, "retire_reclaim")
    state, ret, s = _retire(plan, state, batch, resolve_max_count(plan, max_count))
    release = ret.released
    keep = (ret.status == Status.OK) & ~release
    b = s.shape[0]
    hi = state.hi[:, s]
    lo, new_lo = _behind_window(plan, state, s)
    # Segments [G, 2B]: in each group the released rows' [0, hi) (fill -1), then the kept
    # rows' [lo, new_lo) (holes): the order in which retire_fn's and reclaim_fn's sweeps
    # reach each pool, so frees and LRU pushes land in the same order.
    cat = jnp.concatenate
    state = sweep(
        plan,
        state,
        cat([s, s]),
        cat([release, keep]),
        cat([jnp.zeros_like(hi), lo], axis=1),
        cat([hi, new_lo], axis=1),
        cat([jnp.full((b,), -1, _I32), jnp.zeros((b,), _I32)]),
        reclaim_chunk(plan, b, reclaim_max_count),
        one_request=b == 1,  # a row either releases or is kept, never both
    )
    # The released rows' resets are ten row scatters that most decode steps need not run: a
    # cond with a small branch costs less than running them (B = 256 decode step, two runs:
    # x0.900 / x0.859 of the two calls with the cond, x0.940 / x0.914 without).
    state = jax.lax.cond(
        jnp.any(release), lambda st: forget_rows(st, s, release), lambda st: st, state
    )
    state = replace(state, lo=set_cols(state.lo, s, keep, new_lo))
    result = RetireReclaimResult(
        status=ret.status,
        committed=ret.committed,
        extent=ret.extent,
        released=release,
        holes=jnp.where(keep[:, None], (new_lo - lo).T, 0),
    )
    return state, result


def _retire(
    plan: CachePlan, state: CacheState, batch: RetireBatch, mc: int
) -> tuple[CacheState, RetireResult, jax.Array]:
    """retire_fn without freeing the rows it releases (``result.released``): returns the
    state, the result and the batch's slots ``s``."""
    r, d = state.max_requests, state.fifo_depth
    valid = batch.valid
    s, ok = lookup(state, batch.slot, batch.generation)
    stale = valid & ~ok
    dup = valid & later_duplicates(s, valid & ~stale, r)
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
    status = pick_status(
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
        # Publish the blocks this step completed (not for a request being aborted). Every
        # committed block is offered once, here: a block whose key another page holds is
        # shared instead (publish_blocks), so a release has nothing left to publish.
        pub = commit & state.keyed[s] & (pending != 1 + ReleaseMode.ABORT) & (a > 0)
        # The admission's step retired whole: its lanes and end state were kept at
        # admission (only the first retire of a request pops that step; it clears the mark
        # below whatever happens, so a later step never finds it).
        fresh = state.admit_hashed[s] & (a == cnt)
        a = jnp.where(commit, a, 0)
        state = publish_blocks(plan, state, s, pub, c_old, a, head, mc, fresh)
        state = replace(state, admit_hashed=set_rows(state.admit_hashed, s, go, False))
    state = replace(
        state,
        committed=set_rows(state.committed, s, go, c_new),
        extent=set_rows(state.extent, s, go, n_new),
        fifo_head=set_rows(state.fifo_head, s, go, (head + 1) % d),
        fifo_len=set_rows(state.fifo_len, s, go, len_new),
    )
    result = RetireResult(
        status=status,
        committed=jnp.where(go, c_new, -1),
        extent=jnp.where(go, n_new, -1),
        released=release,
    )
    return state, result, s


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
    s, ok = lookup(state, batch.slot, batch.generation)
    stale = valid & (~ok | (state.pending[s] != 0))
    e = batch.extent
    bad = (
        valid
        & ~stale
        & (
            later_duplicates(s, valid & ~stale, r)
            | (e < state.committed[s])
            | (e > state.extent[s])
        )
    )
    go = valid & ~stale & ~bad
    status = pick_status(
        Status.OK, (~valid, Status.IDLE), (stale, Status.STALE), (bad, Status.BAD_ARG)
    )
    j = jnp.arange(d, dtype=_I32)[None, :]
    in_flight = ((j - state.fifo_head[s][:, None]) % d) < state.fifo_len[s][:, None]
    starts = state.fifo_start[s]
    caps = state.fifo_cap[s]
    new_caps = jnp.where(in_flight, jnp.clip(e[:, None] - starts, 0, caps), caps)
    state = replace(
        state,
        extent=set_rows(state.extent, s, go, e),
        fifo_cap=set_rows(state.fifo_cap, s, go, new_caps),
    )
    return state, StatusResult(status)


def reclaim_fn(
    plan: CachePlan, state: CacheState, batch: HandleBatch, *, max_count: int | None = None
) -> tuple[CacheState, ReclaimResult]:
    """Window groups: columns wholly behind what ``committed`` on still reads become holes (0).

    Column ``i`` of a window group with span ``B`` is dropped iff ``i < lo = max(0,
    first_read(committed)) // B`` (:meth:`~flatkv_jax.groups.GroupSpec.first_read`:
    ``committed - W + 1`` for a sliding window of ``W``; a group with a ``period`` also drops
    what lies before its last period boundary less its ``carry``); its page is decref'd (freed
    unless the prefix index holds it). Cost O(columns dropped).

    Per row: ``IDLE``, ``STALE``, ``BAD_ARG`` (repeated slot), else ``OK`` (a request whose
    release is pending may still reclaim).

    Args:
      plan: the cache plan (static).
      state: the cache state (donated by :data:`reclaim`).
      batch: the handles.
      max_count: static, optional: about how many tokens each row committed since its last
        reclaim. It only sizes the sweep's chunks (the result is the same for any value):
        the default suits decode steps (one entry per row and chunk); after a prefill pass
        the chunk width (a 4,096-token prefill drops ~2,600 window columns per row on
        V4-Flash, which the default walks 64 at a time).
    """
    check_state_for_plan(plan, state, "reclaim")
    check_batch(batch, HandleBatch, "reclaim")
    r = state.max_requests
    b = batch.valid.shape[0]
    valid = batch.valid
    s, ok = lookup(state, batch.slot, batch.generation)
    stale = valid & ~ok
    bad = valid & later_duplicates(s, valid & ~stale, r)
    go = valid & ~stale & ~bad
    status = pick_status(
        Status.OK, (~valid, Status.IDLE), (stale, Status.STALE), (bad, Status.BAD_ARG)
    )
    lo, new_lo = _behind_window(plan, state, s)
    state = sweep(plan, state, s, go, lo, new_lo, 0, reclaim_chunk(plan, b, max_count))
    state = replace(state, lo=set_cols(state.lo, s, go, new_lo))
    return state, ReclaimResult(status, jnp.where(go[:, None], (new_lo - lo).T, 0))


def _behind_window(plan: CachePlan, state: CacheState, s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per group and row of ``s``: ``lo`` and the ``new_lo`` a reclaim moves it to
    (``int32[G, B]`` each; equal in history groups)."""
    lay = state_layout(plan)
    c = state.committed[s]
    lo, hi = state.lo[:, s], state.hi[:, s]  # [G, B]
    win = per_group(lay.window)[:, None]
    period, carry = per_group(lay.period)[:, None], per_group(lay.carry)[:, None]
    # GroupSpec.first_read, per group: a period group restarts at each multiple of its period
    # and reads back only its carry (V4's ratio-128 state: nothing before the boundary).
    start = c[None, :] - win + 1
    restart = div_groups(c[None, :], tuple(max(p, 1) for p in lay.period), 0) * period - carry
    start = jnp.where(period > 0, jnp.maximum(start, restart), start)
    behind = div_groups(jnp.maximum(0, start), lay.block_tokens, 0)
    new_lo = jnp.where(per_group(lay.is_window)[:, None], jnp.clip(behind, lo, hi), lo)
    return lo, new_lo


def release_fn(
    plan: CachePlan, state: CacheState, batch: ReleaseBatch
) -> tuple[CacheState, StatusResult]:
    """Finishes, aborts or retracts requests (``batch.mode``, a :class:`ReleaseMode`).

    Per row: ``IDLE``, ``STALE`` (incl. a release already pending), ``BAD_ARG`` (repeated slot,
    unknown mode); ``DEFERRED`` if steps are in flight (the request takes no new steps and the
    ``retire`` that empties its FIFO frees it); else ``OK``: FINISH/RETRACT leave the blocks
    their retires published in the index (ABORT's in-flight steps published nothing),
    every table reference is dropped, the rows become -1, the slot is free and its generation
    is incremented.
    """
    check_state_for_plan(plan, state, "release")
    check_batch(batch, ReleaseBatch, "release")
    r = state.max_requests
    valid = batch.valid
    s, ok = lookup(state, batch.slot, batch.generation)
    stale = valid & (~ok | (state.pending[s] != 0))
    mode = batch.mode
    bad = (
        valid
        & ~stale
        & (later_duplicates(s, valid & ~stale, r) | (mode < 0) | (mode > max(ReleaseMode)))
    )
    go = valid & ~stale & ~bad
    deferred = go & (state.fifo_len[s] > 0)
    now = go & ~deferred
    status = pick_status(
        Status.OK,
        (~valid, Status.IDLE),
        (stale, Status.STALE),
        (bad, Status.BAD_ARG),
        (deferred, Status.DEFERRED),
    )
    state = replace(state, pending=set_rows(state.pending, s, deferred, mode + 1))
    state = free_now(plan, state, s, now)
    return state, StatusResult(status)


def _jit(fn, static: tuple[str, ...]):
    # Coordinator programs are hundreds of small thunks: XLA:CPU's split of "costly" fusions
    # across threads only adds hand-offs (flatkv_jax.compile_options).
    return jax.jit(
        fn,
        static_argnames=static,
        donate_argnames=("state",),
        compiler_options=COORDINATOR_COMPILER_OPTIONS,
    )


#: ``admit_fn`` jitted (plan and ``max_count`` static, state donated; compiled with
#: :data:`~flatkv_jax.compile_options.COORDINATOR_COMPILER_OPTIONS`, as every jitted op here).
admit = _jit(admit_fn, ("plan", "max_count"))
#: ``extend_fn`` jitted (plan and ``max_count`` static, state donated).
extend = _jit(extend_fn, ("plan", "max_count"))
#: ``retire_fn`` jitted (plan and ``max_count`` static, state donated).
retire = _jit(retire_fn, ("plan", "max_count"))
#: ``retire_reclaim_fn`` jitted (plan, ``max_count`` and ``reclaim_max_count`` static, state
#: donated).
retire_reclaim = _jit(retire_reclaim_fn, ("plan", "max_count", "reclaim_max_count"))
#: ``rewind_fn`` jitted (plan static, state donated).
rewind = _jit(rewind_fn, ("plan",))
#: ``reclaim_fn`` jitted (plan and ``max_count`` static, state donated).
reclaim = _jit(reclaim_fn, ("plan", "max_count"))
#: ``release_fn`` jitted (plan static, state donated).
release = _jit(release_fn, ("plan",))
