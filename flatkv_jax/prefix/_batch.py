"""Batch helpers shared by the index and the LRU: first occurrences and ranks within a batch.

Both sort the batch (O(N log N) in the batch size N, independent of the pool or table size),
which keeps every batched update free of duplicate-index scatters, whose winner XLA leaves
unspecified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _runs(columns: tuple[jax.Array, ...], valid: jax.Array):
    """Sorts the rows (valid first, then by the columns, then by index): returns the sorted
    invalid flags and row indexes and ``start``, whether each sorted row begins a run of
    equal rows."""
    n = valid.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    invalid = (~valid).astype(jnp.int32)
    sorted_ = jax.lax.sort((invalid, *columns, idx), num_keys=len(columns) + 2)
    inv_s, cols_s, idx_s = sorted_[0], sorted_[1:-1], sorted_[-1]
    same = jnp.ones((n - 1,), bool)
    for c in cols_s:
        same = same & (c[1:] == c[:-1])
    return inv_s, idx_s, jnp.concatenate([jnp.ones((1,), bool), ~same])


def first_occurrence(columns: tuple[jax.Array, ...], valid: jax.Array) -> jax.Array:
    """bool[N]: row ``i`` is valid and no valid row ``j < i`` has the same values in every column.

    Args:
      columns: arrays of shape [N] (any integer dtypes), compared lexicographically.
      valid: bool[N]; invalid rows are never first and never hide a valid row.
    """
    n = valid.shape[0]
    if n == 0:
        return valid
    inv_s, idx_s, start = _runs(columns, valid)
    return jnp.zeros((n,), bool).at[idx_s].set(start & (inv_s == 0))


def first_index(columns: tuple[jax.Array, ...], valid: jax.Array) -> jax.Array:
    """int32[N]: for a valid row, the index of the first valid row (in batch order) with the
    same values in every column (its own index if it is the first); -1 for invalid rows.

    Args:
      columns: arrays of shape [N] (any integer dtypes).
      valid: bool[N].
    """
    n = valid.shape[0]
    if n == 0:
        return jnp.zeros((0,), jnp.int32)
    inv_s, idx_s, start = _runs(columns, valid)
    # Sorted by index within a run of equal rows: the run's first entry is its first row.
    run_start = jax.lax.cummax(jnp.where(start, jnp.arange(n, dtype=jnp.int32), 0), axis=0)
    first = jnp.where(inv_s == 0, idx_s[run_start], -1)
    return jnp.zeros((n,), jnp.int32).at[idx_s].set(first)


def last_occurrence(columns: tuple[jax.Array, ...], valid: jax.Array) -> jax.Array:
    """bool[N]: row ``i`` is valid and no valid row ``j > i`` has the same values."""
    return first_occurrence(tuple(c[::-1] for c in columns), valid[::-1])[::-1]


def rank_within(group: jax.Array, valid: jax.Array) -> jax.Array:
    """int32[N]: for valid rows, how many valid rows before it (in batch order) share its group.

    Invalid rows get an unspecified rank.
    """
    n = valid.shape[0]
    if n == 0:
        return jnp.zeros((0,), jnp.int32)
    idx = jnp.arange(n, dtype=jnp.int32)
    invalid = (~valid).astype(jnp.int32)
    inv_s, g_s, idx_s = jax.lax.sort((invalid, group, idx), num_keys=3)
    start = jnp.concatenate(
        [jnp.ones((1,), bool), (g_s[1:] != g_s[:-1]) | (inv_s[1:] != inv_s[:-1])]
    )
    start_pos = jax.lax.cummax(jnp.where(start, idx, 0), axis=0)
    return jnp.zeros((n,), jnp.int32).at[idx_s].set(idx - start_pos)
