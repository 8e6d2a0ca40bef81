"""Plain-JAX reference of ``zero_pages``: one XLA scatter of zeros per pool array.

This is the default implementation on every platform and the GPU path (docs/kernels.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def zero_pages(pools: Any, page_ids: jax.Array) -> Any:
    """Zeros pages ``page_ids`` of every array in ``pools``; ids outside the pool are dropped.

    Args:
        pools: a pytree (tuple, dict, ...) of ``[num_pages, rows_per_page, *row_shape]`` arrays
            of one group (same ``num_pages``; dtype and row shape may differ). Donate it.
        page_ids: ``int32[K]``; ``-1`` (or any id outside ``[0, num_pages)``) skips.

    Returns:
        ``pools`` with the pages zeroed, same structure, shapes and dtypes.
    """
    k = page_ids.shape[0]

    def zero_one(pool: jax.Array) -> jax.Array:
        num_pages = pool.shape[0]
        valid = (page_ids >= 0) & (page_ids < num_pages)
        # Distinct out-of-range sentinels: dropped by mode="drop" (negative ids never wrap)
        # and pairwise distinct, so the scatter stays a plain set.
        ids = jnp.where(valid, page_ids, num_pages + jnp.arange(k, dtype=jnp.int32))
        return pool.at[ids].set(jnp.zeros((), pool.dtype), mode="drop")

    return jax.tree.map(zero_one, pools)
