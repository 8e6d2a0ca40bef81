"""The derived layout of a plan: every constant the state and the operations derive from it.

One frozen, hashable :class:`StateLayout` per plan (:func:`state_layout`, computed once per
plan): where each pool and each table lives in the flat buffers and the per-group constants
the vectorised operations read. It is the static field of the state pytree, so a state
carries the layout of the plan it was created for.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.block_pool import PoolLayout
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Static placement of the flat buffers and the per-group constants of one plan (hashable;
    a static field of the state pytree). Build it with :func:`state_layout`.

    Attributes:
      pools: where each pool's allocator lives in the allocator arrays.
      table_offset: per group, offset of its table in ``table_buffer``.
      table_width: per group, its row stride (``plan.table_width(g)``).
      max_requests: request slots (table rows).
      plan_key: a fingerprint of the plan's groups, limits and page counts (its name aside):
        the operations refuse a state built for another plan (:func:`check_state_for_plan`).
      block_tokens: per group, raw tokens per table column (``rows_per_page * tokens_per_row``).
      rows_per_page: per group, rows of one page.
      tokens_per_row: per group, raw tokens per row (1 for raw rows).
      is_window: per group, whether it keeps only a window.
      window: per group, its window in tokens (0 for history groups).
      hit_reach: per group, :attr:`~flatkv_jax.groups.GroupSpec.hit_reach` (tokens behind a
        prefix-hit boundary still read; 0 for history groups).
      period: per group, its ``period`` (0: none); carry: per group, its ``carry``
        (:meth:`~flatkv_jax.groups.GroupSpec.first_read`).
      table_size: entries of the flat ``table_buffer`` (every group's table).
    """

    pools: PoolLayout
    table_offset: tuple[int, ...]
    table_width: tuple[int, ...]
    max_requests: int
    plan_key: str = ""
    block_tokens: tuple[int, ...] = ()
    rows_per_page: tuple[int, ...] = ()
    tokens_per_row: tuple[int, ...] = ()
    is_window: tuple[bool, ...] = ()
    window: tuple[int, ...] = ()
    hit_reach: tuple[int, ...] = ()
    period: tuple[int, ...] = ()
    carry: tuple[int, ...] = ()
    table_size: int = 0


def per_group(values: tuple) -> jax.Array:
    """A per-group constant of :class:`StateLayout` as a ``[G]`` array (bool or int32)."""
    dtype = jnp.bool_ if values and isinstance(values[0], bool) else _I32
    return jnp.asarray(values, dtype)


def _group_axis(values: tuple[int, ...], ndim: int, axis: int) -> tuple[int, ...]:
    """The broadcast shape of a ``[G]`` constant placed on ``axis`` of an ``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = len(values)
    return tuple(shape)


def _shifts(values: tuple[int, ...]) -> tuple[int, ...] | None:
    """``log2`` of each value if every value is a positive power of two, else None."""
    if all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in values):
        return tuple(v.bit_length() - 1 for v in values)
    return None


def div_groups(x: jax.Array, values: tuple[int, ...], axis: int) -> jax.Array:
    """``x // values[g]`` (floor) for int32 ``x`` whose ``axis`` runs over the groups.

    ``values`` (static, positive: a :class:`StateLayout` field) are usually powers of two
    (V4's spans: 4 to 128 tokens): then it is an arithmetic shift, which floors negative ``x``
    as ``//`` does. XLA cannot strength-reduce a division by an array, and on CPU an int32
    division costs about ten times a shift (a B = 256 decode step's reclaim and grow spent
    ~25 us in four of them).
    """
    shape = _group_axis(values, x.ndim, axis)
    k = _shifts(values)
    if k is None:
        return x // jnp.asarray(values, _I32).reshape(shape)
    return x >> jnp.asarray(k, _I32).reshape(shape)


def ceil_div_groups(x: jax.Array, values: tuple[int, ...], axis: int) -> jax.Array:
    """``ceil(x / values[g])``, as :func:`div_groups` floors."""
    shape = _group_axis(values, x.ndim, axis)
    return div_groups(x + jnp.asarray([v - 1 for v in values], _I32).reshape(shape), values, axis)


def mod_groups(x: jax.Array, values: tuple[int, ...], axis: int) -> jax.Array:
    """``x % values[g]`` (floor modulo, as :func:`div_groups` divides): a mask for powers of
    two."""
    shape = _group_axis(values, x.ndim, axis)
    if _shifts(values) is None:
        return x % jnp.asarray(values, _I32).reshape(shape)
    return x & jnp.asarray([v - 1 for v in values], _I32).reshape(shape)


@functools.cache
def state_layout(plan: CachePlan) -> StateLayout:
    """The layout of ``plan``'s state (computed once per plan)."""
    widths = tuple(plan.table_width(g) for g in plan.groups)
    r = plan.limits.max_requests
    sizes = [r * w for w in widths]
    return StateLayout(
        pools=PoolLayout(plan.num_pages),
        table_offset=tuple(int(x) for x in np.cumsum([0, *sizes[:-1]])),
        table_width=widths,
        max_requests=r,
        plan_key=_plan_key(plan),
        block_tokens=tuple(g.block_tokens for g in plan.groups),
        rows_per_page=tuple(g.rows_per_page for g in plan.groups),
        tokens_per_row=tuple(g.tokens_per_row for g in plan.groups),
        is_window=tuple(g.is_window for g in plan.groups),
        window=tuple(g.window or 0 for g in plan.groups),
        hit_reach=tuple(g.hit_reach for g in plan.groups),
        period=tuple(g.period or 0 for g in plan.groups),
        carry=tuple(g.carry for g in plan.groups),
        table_size=sum(sizes),
    )


def _plan_key(plan: CachePlan) -> str:
    # Deterministic across processes (unlike hash() of strings): the frozen dataclasses'
    # reprs spell every field.
    text = repr((plan.groups, plan.limits, plan.num_pages))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pool_layout(plan: CachePlan) -> PoolLayout:
    """Where every pool of ``plan`` lives in the flat allocator arrays."""
    return state_layout(plan).pools


def table_offset(plan: CachePlan) -> tuple[int, ...]:
    """Per group, the offset of its table in the flat ``tables`` buffer (row stride:
    ``plan.table_width(g)``)."""
    return state_layout(plan).table_offset


def table_size(plan: CachePlan) -> int:
    """Entries of the flat ``tables`` buffer (``plan.total_table_bytes / 4``)."""
    return state_layout(plan).table_size


def resolve_max_count(plan: CachePlan, max_count: int | None) -> int:
    """The static per-row token bound of admit/extend (default ``plan.limits.max_count``,
    ``max(chunk_tokens, 1 + verify_width)``).

    A smaller bound (``plan.limits.decode_tokens`` for a decode-only batch) shrinks the zero
    lists and the per-row table scatter.
    """
    default = plan.limits.max_count
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
    return -(-max_count // min(state_layout(plan).block_tokens))


def hit_run_start(block_tokens: int, reach: int, granularity: int, ends, xp=jnp):
    """For a window group's block ending at ``ends``: the first block of the trailing run of
    the nearest hit boundary at or after it (``h``, the next multiple of ``granularity``).

    A match at ``h`` needs the blocks ``[max(0, (h - reach) // B), h / B)`` (``reach``: the
    group's :attr:`~flatkv_jax.groups.GroupSpec.hit_reach`, ``W - 1`` for a sliding window);
    later boundaries start their runs later still, so a block below this start is in no run
    and no admission can ever read it from the index: it is not published (its page is
    freed, not cached, when the request lets it go). ``xp``: ``jnp``, or ``np`` for static
    ends (:func:`publish_strides`).
    """
    h = (ends + granularity - 1) // granularity * granularity
    run = (h - reach) // block_tokens
    return xp.maximum(run, 0)


@functools.cache
def publish_strides(plan: CachePlan) -> tuple[int, ...]:
    """Per group (static): the spacing of the block ends it can ever publish, 0 if none.

    A history group publishes every block (its span). A window group publishes only the
    blocks of some boundary's trailing run (:func:`hit_run_start`); their ends repeat with
    the granularity, and the stride is their gcd (V4: the sliding window's 64-token blocks
    every 64 tokens, a 4-token compressor state only the block ending at each 128-token
    boundary, the ratio-128 state, which carries nothing, never). Candidates are taken at
    multiples of the stride only: the others could never pass the run test.
    """
    lay = state_layout(plan)
    gran = plan.prefix_granularity
    out = []
    for bt, win, reach in zip(lay.block_tokens, lay.is_window, lay.hit_reach, strict=True):
        if not win:
            out.append(bt)
            continue
        # The rule repeats with the granularity (a multiple of bt); three periods cover the
        # clipped start.
        ends = np.arange(1, 3 * gran // bt + 1) * bt
        ok = ends // bt - 1 >= hit_run_start(bt, reach, gran, ends, xp=np)
        out.append(int(np.gcd.reduce(ends[ok])) if ok.any() else 0)
    return tuple(out)


def publish_unit(plan: CachePlan) -> int:
    """The gcd of every group's publish stride (static): the spacing of the ends whose lanes
    publishing hashes (the granularity if no group publishes)."""
    strides = [st for st in publish_strides(plan) if st]
    return math.gcd(*strides) if strides else plan.prefix_granularity


@functools.cache
def admit_lanes_width(plan: CachePlan) -> int:
    """Lanes per request slot in ``CacheState.admit_lanes`` (static): those a publish of up
    to ``limits.max_count`` tokens reads, ``max_count // publish_unit + 1``; 0 when the
    publish unit is 1 (lanes at every token: the admission's are not kept)."""
    unit = publish_unit(plan)
    return plan.limits.max_count // unit + 1 if unit > 1 else 0
