"""Checks for ``write_rows``: static (always, at trace time) and dynamic (opt-in, outside jit)."""

from __future__ import annotations

from typing import Any

import numpy as np

from flatkv_jax.errors import fail
from kernels_pallas import _common
from kernels_pallas._common import concrete_ids, positions

_OP = "write_rows"


def check_write_rows_static(pool: Any, rows: Any, slots: Any) -> None:
    """Trace-time checks of shapes and dtypes. Raises ``TypeError``/``ValueError``.

    Args:
        pool: ``[num_pages, rows_per_page, *row_shape]``.
        rows: ``[N, *row_shape]`` with ``pool``'s dtype.
        slots: ``int32[N]``.
    """
    _common.check_pool_array(pool, name="pool", op=_OP)
    if getattr(rows, "shape", None) is None or getattr(rows, "dtype", None) is None:
        fail(
            "rows",
            type(rows).__name__,
            f"{_OP}: rows must be an array [N, *row_shape]",
            "pass the rows as a jax/numpy array",
            exc=TypeError,
        )
    _common.check_ids_array(slots, name="slots", op=_OP)
    row_shape = tuple(pool.shape[2:])
    if len(rows.shape) != 1 + len(row_shape) or tuple(rows.shape[1:]) != row_shape:
        fail(
            "rows",
            f"an array of shape {tuple(rows.shape)}",
            f"{_OP}: pool {tuple(pool.shape)} stores rows of shape {row_shape}; rows must be "
            f"[N, *{row_shape}] (one leading N axis, then exactly the pool's row shape)",
            "reshape rows, or pick the pool of the right field",
        )
    if np.dtype(rows.dtype) != np.dtype(pool.dtype):
        fail(
            "rows",
            f"an array of dtype {np.dtype(rows.dtype).name}",
            f"{_OP}: rows dtype {np.dtype(rows.dtype).name} != pool dtype "
            f"{np.dtype(pool.dtype).name}; rows must match the pool exactly (no implicit casts)",
            "cast with rows.astype(pool.dtype) or bitcast packed data with "
            "jax.lax.bitcast_convert_type",
            exc=TypeError,
        )
    if slots.shape[0] != rows.shape[0]:
        fail(
            "slots",
            f"an array of {slots.shape[0]} entries",
            f"{_OP}: slots has {slots.shape[0]} entries but rows has {rows.shape[0]}; one slot "
            "per row",
            "pad both to the same N, with slot -1 for padding rows",
        )


def _num_pages_rows(pool_or_shape: Any) -> tuple[int, int]:
    shape = tuple(getattr(pool_or_shape, "shape", pool_or_shape))
    if len(shape) < 2:
        fail(
            "pool_or_shape",
            shape,
            "check_write_slots: a pool shape is [num_pages, rows_per_page, ...]",
            "pass the pool or its full shape",
        )
    return int(shape[0]), int(shape[1])


def check_write_slots(pool_or_shape: Any, slots: Any) -> None:
    """Opt-in dynamic check of write slots. Call outside ``jax.jit`` on concrete values.

    Valid slots are -1 (skip) or ``page * rows_per_page + row`` with ``1 <= page <=
    num_pages - 2`` (not the null page 0, not the scratch page ``num_pages - 1``), and no slot
    may appear twice (the order of duplicate writes is unspecified on every impl).

    Args:
        pool_or_shape: the pool, or its shape ``(num_pages, rows_per_page, *row_shape)``.
        slots: integer ``[N]``.

    Raises:
        ValueError: naming the offending positions and values and the rule they break.
        TypeError: if ``slots`` is a tracer (inside jit).
    """
    fn = "check_write_slots"
    num_pages, rows_per_page = _num_pages_rows(pool_or_shape)
    s = concrete_ids(slots, name="slots", fn=fn)
    total = num_pages * rows_per_page
    bad_neg = s < -1
    if bad_neg.any():
        fail(
            "slots",
            f"slots at positions [{positions(bad_neg)}] ({s[bad_neg][0]}, ...)",
            f"{fn}: they are negative but only -1 means skip; negative ids are never wrapped",
            "use -1 for padding",
        )
    too_big = s >= total
    if too_big.any():
        fail(
            "slots",
            f"slots at positions [{positions(too_big)}] ({s[too_big][0]}, ...)",
            f"{fn}: they are out of range; a slot must be < num_pages * rows_per_page = "
            f"{num_pages} * {rows_per_page} = {total}",
            "check the page table / rows_per_page",
        )
    live = s >= 0
    page = np.where(live, s // rows_per_page, -1)
    null = page == 0
    if null.any():
        fail(
            "slots",
            f"slots at positions [{positions(null)}] ({s[null][0]}, ...)",
            f"{fn}: they target page 0, the null page, which must stay zero",
            "allocate a real page (1 .. num_pages-2) or pass -1 to skip",
        )
    scratch = page == num_pages - 1
    if scratch.any():
        fail(
            "slots",
            f"slots at positions [{positions(scratch)}] ({s[scratch][0]}, ...)",
            f"{fn}: they target page {num_pages - 1}, the reserved scratch page (num_pages - 1)",
            "allocate a real page (1 .. num_pages-2) or pass -1 to skip",
        )
    vals, counts = np.unique(s[live], return_counts=True)
    dup = vals[counts > 1]
    if dup.size:
        where = positions(s == dup[0])
        fail(
            "slots",
            f"slot {dup[0]} at positions [{where}]",
            f"{fn}: slot {dup[0]} appears {counts[counts > 1][0]} times and {dup.size} slot(s) "
            "are duplicated; each slot may be written once per call (which duplicate wins is "
            "unspecified)",
            "deduplicate the writes",
        )
