"""Device metadata of one step: where each new token writes, what each request reads.

:func:`step_metadata_fn` turns the state (after ``admit``/``extend``) and the step results of
those calls into fixed-shape arrays for the kernels. Nothing here copies a table: kernels read
the tables straight from ``state.table_buffer[g]`` (``[max_requests, table_width(g)]``, passed
with their strides as data), so the step stays "mutate first, read last".

The step's tokens lie on a flat axis of ``T = plan.limits.step_tokens`` entries: the rows of
the given results, in order, each contribute their ``count`` tokens at ``row_offset``. The
results must be every ``admit``/``extend`` result of the step in call order, each call made
with ``same_step=`` the results before it (checked at trace time through
``StepResult.step_index``): the ops then refused (``STEP_FULL``) every row that would not fit,
so the step's tokens always fit ``T``. ``overflow`` stays as a cross-check (always False for
results made that way).

How kernels read, per group kind:

- **writes** (every group): ``write_slot[g][t] = page * rows_per_page + row`` for the token at
  flat index ``t`` and position ``p``: row ``p // tokens_per_row`` of block ``p // block_tokens``
  when the token completes the row (``(p + 1) % tokens_per_row == 0``), else -1. Window and
  compressor-state groups (``tokens_per_row == 1``) write every token; a compressed chain only
  where a ratio window completes.
- **window groups** (sliding-window KV, compressor state): with ``(off, span) =
  window_columns(plan, max_count)[g]``, ``window_pages[i, off + j]`` is the page of block
  ``window_first_block[g, i] + j``; together they cover every position the row's new tokens
  read, ``[row_start - window + 1, row_start + row_count)``. The token at position ``p`` reads
  positions ``q`` in ``[p - window + 1, p]`` (``q >= 0``) at slot
  ``window_pages[i, off + q // block_tokens - window_first_block[g, i]] * rows_per_page +
  (q // tokens_per_row) % rows_per_page`` (-1: before position 0 or past the step).
- **history groups** (compressed chains, full attention): the table is the read index. Row
  ``q`` of request slot ``s`` lies at ``tables[g][s, q // rows_per_page] * rows_per_page +
  q % rows_per_page``; a request has ``seq_len[i] // tokens_per_row`` complete rows after the
  step (dense ratio-128 attention reads them all; ratio-4 top-k picks among them).
- **zeroing**: ``zero[g]`` lists every page handed out by the listed calls (padded with -1).
  Zero them in *every* pool array of the group — target and draft alike — before writing;
  per pool per step: zero, then write, then read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator.checks import check_state_for_plan, check_step_results
from flatkv_jax.coordinator.layout import (
    div_groups,
    mod_groups,
    per_group,
    resolve_max_count,
    state_layout,
)
from flatkv_jax.coordinator.results import StepResult
from flatkv_jax.coordinator.segments import segment_rows
from flatkv_jax.coordinator.state import CacheState
from flatkv_jax.errors import fail
from flatkv_jax.groups import blocks_for_span
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.status import Status

_I32 = jnp.int32


def window_columns(plan: CachePlan, max_count: int | None = None) -> tuple[tuple[int, int], ...]:
    """Per group, ``(offset, span)`` of its columns in :attr:`StepMetadata.window_pages`:
    ``span = blocks_for_span(window - 1 + max_count, block_tokens)`` for window groups, 0 for
    history groups (static, from the plan)."""
    mc = resolve_max_count(plan, max_count)
    spans = [
        blocks_for_span(g.window - 1 + mc, g.block_tokens) if g.is_window else 0
        for g in plan.groups
    ]
    offs = np.cumsum([0, *spans[:-1]])
    return tuple((int(o), n) for o, n in zip(offs, spans, strict=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Fixed-shape device metadata of one step (``T = step_tokens``, ``S`` = step rows).

    Attributes:
      token_slot: ``int32[T]``, request slot of each flat token (-1 idle).
      token_pos: ``int32[T]``, absolute position of each flat token (-1 idle).
      token_row: ``int32[T]``, step row of each flat token (-1 idle).
      row_slot: ``int32[S]``, request slot of each step row (-1 for rows that schedule nothing).
      row_start: ``int32[S]``, first new position (-1 idle).
      row_count: ``int32[S]``, new tokens (0 idle).
      row_offset: ``int32[S]``, flat index of the row's first token (-1 idle).
      seq_len: ``int32[S]``, ``row_start + row_count`` (-1 idle): positions the request has
        after the step.
      write_slot: ``int32[G, T]``, per group (see the module docstring).
      window_pages: ``int32[S, C]``: group ``g``'s columns are ``[offset, offset + span)``
        of :func:`window_columns`; column ``offset + j`` holds the page of block
        ``window_first_block[g, i] + j`` (-1 before block 0, past the step's last block, or
        for idle rows). History groups have no columns.
      window_first_block: ``int32[G, S]``, ``floor((row_start - window + 1) / block_tokens)``
        (0 for history groups and idle rows).
      zero: ``int32[G, K]``, per group the pages to zero before anything reads them (-1 pad).
      num_tokens: ``int32[]``, tokens of the step that fit the flat axis.
      overflow: ``bool[]``, some token did not fit ``step_tokens`` (a cross-check: never set
        for results made as :func:`step_metadata_fn` requires).
    """

    token_slot: jax.Array
    token_pos: jax.Array
    token_row: jax.Array
    row_slot: jax.Array
    row_start: jax.Array
    row_count: jax.Array
    row_offset: jax.Array
    seq_len: jax.Array
    write_slot: jax.Array
    window_pages: jax.Array
    window_first_block: jax.Array
    zero: jax.Array
    num_tokens: jax.Array
    overflow: jax.Array


def step_metadata_fn(
    plan: CachePlan,
    state: CacheState,
    steps: tuple[StepResult, ...],
    *,
    max_count: int | None = None,
) -> StepMetadata:
    """Builds the step's metadata from the state after the step's ``admit``/``extend`` calls.

    Args:
      plan: the cache plan (static).
      state: the cache state *after* the calls that produced ``steps`` (read only).
      steps: the :class:`StepResult` of each admit/extend call of this step, in call order
        (a tuple; its length and each batch size are static); ``steps[i]`` must come from a
        call made with ``same_step=steps[:i]``.
      max_count: the static per-row token bound those calls used (sizes ``window_pages``).

    Returns:
      The :class:`StepMetadata`. Cost: O(step_tokens + rows * window blocks) per group.

    Raises:
      TypeError/ValueError: at trace time, ``steps`` not a tuple of results of one step in
        call order (a step whose calls were not checked against one token budget), a
        ``max_count`` below a call's, or a state (or results) of another plan.
    """
    check_step_results(check_plan(plan), steps, "steps", "step_metadata", allow_empty=False)
    check_state_for_plan(plan, state, "step_metadata")
    mc = resolve_max_count(plan, max_count)
    for i, x in enumerate(steps):
        if x.max_count is not None and x.max_count > mc:
            fail(
                "max_count",
                max_count,
                f"step_metadata sizes every row's window reads by max_count, and steps[{i}] "
                f"came from a call made with max_count={x.max_count} (its rows may write that "
                "many tokens: a smaller bound would silently cut their window reads short)",
                f"pass max_count >= {x.max_count} (the largest of the step's calls), or None",
            )
    t_len = plan.limits.step_tokens
    r = state.max_requests
    on = jnp.concatenate([x.status == Status.OK for x in steps]) & jnp.concatenate(
        [x.count > 0 for x in steps]
    )
    slot = jnp.where(on, jnp.concatenate([x.slot for x in steps]), -1)
    start = jnp.where(on, jnp.concatenate([x.start for x in steps]), -1)
    count = jnp.where(on, jnp.concatenate([x.count for x in steps]), 0)
    incl = jnp.cumsum(count, dtype=_I32)
    excl = incl - count
    total = incl[-1]

    t = jnp.arange(t_len, dtype=_I32)
    t_on = t < total
    row = segment_rows(excl, count, 0, t_len)
    pos = jnp.where(t_on, start[row] + t - excl[row], -1)
    tslot = jnp.where(t_on, slot[row], -1)
    s_safe = jnp.clip(tslot, 0, r - 1)

    lay = state_layout(plan)
    rpp = per_group(lay.rows_per_page)[:, None]
    width, base = per_group(lay.table_width)[:, None], per_group(lay.table_offset)[:, None]
    # Writes, every group at once: [G, T].
    p_safe = jnp.maximum(pos, 0)[None, :]
    blk = jnp.minimum(div_groups(p_safe, lay.block_tokens, 0), width - 1)
    page = state.table_buffer[base + s_safe[None, :] * width + blk]
    completes = mod_groups(p_safe + 1, lay.tokens_per_row, 0) == 0
    # Per-group spans are static powers of two on V4: shifts and masks, not divisions.
    row_in_page = mod_groups(div_groups(p_safe, lay.tokens_per_row, 0), lay.rows_per_page, 0)
    write_slot = jnp.where(t_on[None, :] & completes & (page > 0), page * rpp + row_in_page, -1)
    # Window read index: for each window group the pages of the blocks covering
    # [start - window + 1, start + count); the kernel turns a position into a slot itself, so
    # this costs a few entries per request, not one per row. Columns of all groups side by
    # side (window_columns), computed together.
    cols = window_columns(plan, mc)
    col_g = np.concatenate([np.full(n, gi, np.int32) for gi, (_, n) in enumerate(cols)])
    col_j = np.concatenate([np.arange(n, dtype=np.int32) for _, n in cols])
    win = per_group(lay.window)[:, None]
    first = jnp.where(
        on[None, :] & per_group(lay.is_window)[:, None],
        div_groups(start[None, :] - (win - 1), lay.block_tokens, 0),
        0,
    )
    if col_g.size:
        cg = jnp.asarray(col_g)
        blk = first[cg].T + jnp.asarray(col_j)[None, :]  # [S, C]
        cw, cbase = (per_group(v)[cg][None, :] for v in (lay.table_width, lay.table_offset))
        col_bt = tuple(lay.block_tokens[g] for g in col_g)
        last = div_groups((start + count - 1)[:, None], col_bt, 1)
        srow = jnp.clip(slot, 0, r - 1)[:, None]
        wpage = state.table_buffer[cbase + srow * cw + jnp.clip(blk, 0, cw - 1)]
        ok = on[:, None] & (blk >= 0) & (blk <= last) & (wpage > 0)
        window_pages = jnp.where(ok, wpage, -1)
    else:
        window_pages = jnp.zeros((on.shape[0], 0), _I32)
    zero = jnp.concatenate([x.zero for x in steps], axis=1)
    return StepMetadata(
        token_slot=tslot,
        token_pos=pos,
        token_row=jnp.where(t_on, row, -1),
        row_slot=slot,
        row_start=start,
        row_count=count,
        row_offset=jnp.where(on & (excl < t_len), excl, -1),
        seq_len=jnp.where(on, start + count, -1),
        write_slot=write_slot,
        window_pages=window_pages,
        window_first_block=first,
        zero=zero,
        num_tokens=jnp.minimum(total, t_len),
        overflow=total > t_len,
    )


#: ``step_metadata_fn`` jitted (plan and ``max_count`` static; the state is only read).
step_metadata = jax.jit(
    step_metadata_fn,
    static_argnames=("plan", "max_count"),
    compiler_options=COORDINATOR_COMPILER_OPTIONS,
)
