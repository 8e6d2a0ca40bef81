"""Checks for ``write_rows``: static (always, at trace time) and dynamic (opt-in, outside jit)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels_pallas import _common

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
        raise TypeError(f"{_OP}: rows must be an array [N, *row_shape], got {type(rows).__name__}.")
    _common.check_ids_array(slots, name="slots", op=_OP)
    row_shape = tuple(pool.shape[2:])
    if len(rows.shape) != 1 + len(row_shape) or tuple(rows.shape[1:]) != row_shape:
        raise ValueError(
            f"{_OP}: rows has shape {tuple(rows.shape)} but pool {tuple(pool.shape)} stores rows "
            f"of shape {row_shape}; rows must be [N, *{row_shape}] (one leading N axis, then "
            "exactly the pool's row shape). Reshape rows, or pick the pool of the right field."
        )
    if np.dtype(rows.dtype) != np.dtype(pool.dtype):
        raise TypeError(
            f"{_OP}: rows dtype {np.dtype(rows.dtype).name} != pool dtype "
            f"{np.dtype(pool.dtype).name}; rows must match the pool exactly (no implicit casts). "
            f"Cast with rows.astype(pool.dtype) or bitcast packed data with "
            f"jax.lax.bitcast_convert_type."
        )
    if slots.shape[0] != rows.shape[0]:
        raise ValueError(
            f"{_OP}: slots has {slots.shape[0]} entries but rows has {rows.shape[0]}; give one "
            "slot per row (pad both to the same N, with slot -1 for padding rows)."
        )


def _num_pages_rows(pool_or_shape: Any) -> tuple[int, int]:
    shape = tuple(getattr(pool_or_shape, "shape", pool_or_shape))
    if len(shape) < 2:
        raise ValueError(
            f"check_write_slots: pool shape {shape} must be [num_pages, rows_per_page, ...]."
        )
    return int(shape[0]), int(shape[1])


def _concrete_ids(ids: Any, *, name: str, fn: str) -> np.ndarray:
    if _common.is_tracer(ids):
        raise TypeError(
            f"{fn}: {name} is a tracer; this dynamic check reads the ids and must run outside "
            "jax.jit (call it on concrete arrays, e.g. in tests or a debug step)."
        )
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{fn}: {name} must be a rank-1 integer array, got shape {arr.shape} dtype {arr.dtype}."
        )
    return arr.astype(np.int64)


def _positions(mask: np.ndarray, limit: int = 8) -> str:
    idx = np.flatnonzero(mask)
    shown = ", ".join(str(i) for i in idx[:limit])
    return shown + (", ..." if idx.size > limit else "")


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
    s = _concrete_ids(slots, name="slots", fn=fn)
    total = num_pages * rows_per_page
    bad_neg = s < -1
    if bad_neg.any():
        raise ValueError(
            f"{fn}: slots at positions [{_positions(bad_neg)}] are negative ({s[bad_neg][0]}, "
            "...) but only -1 means skip; negative ids are never wrapped. Use -1 for padding."
        )
    too_big = s >= total
    if too_big.any():
        raise ValueError(
            f"{fn}: slots at positions [{_positions(too_big)}] are out of range "
            f"({s[too_big][0]}, ...); a slot must be < num_pages * rows_per_page = "
            f"{num_pages} * {rows_per_page} = {total}. Check the page table / rows_per_page."
        )
    live = s >= 0
    page = np.where(live, s // rows_per_page, -1)
    null = page == 0
    if null.any():
        raise ValueError(
            f"{fn}: slots at positions [{_positions(null)}] ({s[null][0]}, ...) target page 0, "
            "the null page, which must stay zero; allocate a real page (1 .. num_pages-2) or "
            "pass -1 to skip."
        )
    scratch = page == num_pages - 1
    if scratch.any():
        raise ValueError(
            f"{fn}: slots at positions [{_positions(scratch)}] ({s[scratch][0]}, ...) target "
            f"page {num_pages - 1}, the reserved scratch page (num_pages - 1); allocate a real "
            "page (1 .. num_pages-2) or pass -1 to skip."
        )
    vals, counts = np.unique(s[live], return_counts=True)
    dup = vals[counts > 1]
    if dup.size:
        where = _positions(s == dup[0])
        raise ValueError(
            f"{fn}: slot {dup[0]} appears {counts[counts > 1][0]} times (positions [{where}]); "
            f"{dup.size} slot(s) are duplicated. Each slot may be written once per call (which "
            "duplicate wins is unspecified); deduplicate the writes."
        )
