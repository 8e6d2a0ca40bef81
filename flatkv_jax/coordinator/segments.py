"""Flattened segments: map a window of flat indices back to the batch row that owns each.

Rows ``r`` own consecutive flat ranges ``[excl[r], excl[r] + length[r])`` (``excl`` is the
exclusive prefix sum of ``length``). Used for the step's flat token axis and for chunked
sweeps over table segments. O(rows + window), no search loop and no sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_I32 = jnp.int32


def segment_rows(excl: jax.Array, length: jax.Array, base: jax.Array | int, size: int) -> jax.Array:
    """For flat indices ``base + [0, size)``, the row whose range holds each (clipped to a
    valid row where none does; callers mask with ``index < total``).

    Args:
      excl: ``int32[B]``, exclusive prefix sums of ``length``.
      length: ``int32[B]``, >= 0.
      base: first flat index of the window (int32 scalar).
      size: static window size.
    """
    b = excl.shape[0]
    rows = jnp.arange(b, dtype=_I32)
    # The row already open at `base`: rows whose range ends at or before it come first.
    open_row = jnp.sum((excl + length <= base) & (rows < b), dtype=_I32)
    at = excl - base
    starts = jnp.where((length > 0) & (at >= 0) & (at < size), at, size)
    marks = jnp.full((size,), -1, _I32).at[starts].max(rows, mode="drop")
    row = jnp.maximum(jax.lax.cummax(marks, axis=0), open_row)
    return jnp.clip(row, 0, b - 1)
