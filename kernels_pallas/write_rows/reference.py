"""Plain-JAX reference of ``write_rows``: one XLA scatter with explicit drop sentinels.

This is the default implementation on every platform and the GPU path (docs/kernels.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_rows(pool: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes ``rows[i]`` into slot ``slots[i]`` of ``pool``; slots outside the pool are dropped.

    Args:
        pool: ``[num_pages, rows_per_page, *row_shape]``, any dtype. Donate it (``jax.jit(...,
            donate_argnums=...)``) so the scatter updates it in place.
        rows: ``[N, *row_shape]``, same dtype as ``pool``.
        slots: ``int32[N]``, ``page * rows_per_page + row``; ``-1`` (or any id outside
            ``[0, num_pages * rows_per_page)``) skips the row.

    Returns:
        The updated pool, same shape and dtype.
    """
    num_pages, rows_per_page = pool.shape[0], pool.shape[1]
    n = rows.shape[0]
    valid = (slots >= 0) & (slots < num_pages * rows_per_page)
    # Scatter on (page, row) coordinates rather than on a reshaped [P*R, ...] view: on TPU a
    # reshape that merges the second-minor (tiled) axis is a physical copy of the whole pool.
    # Skipped rows get page ids num_pages + i: out of range (dropped by mode="drop", never
    # wrapped like NumPy negatives) and pairwise distinct, so unique_indices=True is truthful
    # whenever the real slots are duplicate-free (the contract; see check_write_slots).
    sentinel = num_pages + jnp.arange(n, dtype=jnp.int32)
    page = jnp.where(valid, slots // rows_per_page, sentinel)
    row = jnp.where(valid, slots % rows_per_page, 0)
    return pool.at[page, row].set(rows, mode="drop", unique_indices=True)
