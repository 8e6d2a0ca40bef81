"""Batch helpers shared by the index and the LRU: first occurrences and ranks within a batch.

They keep every batched update free of duplicate-index scatters, whose winner XLA leaves
unspecified, and cost O(N) to O(N log N) in the batch size N, independent of the pool or
table size. Each answers from the rows that share their values with another row:

- ``N <= PAIRWISE``: every pair of rows is compared (``N x N`` compares, no sort).
- larger batches (first occurrences and indexes; ranks sort, since the rows they place share
  buckets by design): each row's values are hashed into a table of ``>= 32 N`` slots; a row
  alone in its slot equals no other row, and the rest (suspects: rows that repeat, and a few
  hash collisions) are compared pairwise, up to ``SUSPECTS`` of them. With more suspects the
  batch is sorted (the general path), so every answer is exact whatever the hash does.

On XLA:CPU a sort of the 9 key columns of 512 rows costs ~0.5 ms and of 2,048 rows ~2 ms;
the hashed path ~0.1-0.2 ms at either size (a prefill's publish chunks and LRU listings).
Every pair of up to 512 rows is one fused compare, cheaper than either: measured alone
(first occurrence on 8 columns plus a rank, dispatch included) 115 against 174 us at 128
rows and 310 against 459 us at 512, but 806 against 509 us at 1,024 (it grows as N^2); on
the vs_vllm trace, raising the bound from 32 to 512 made a B = 256 decode step x0.87 and
admissions x0.83-0.86 (benchmarks/ab_compiled.py, docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Batches of at most this many rows are compared pairwise, every pair (the knee measured
#: on XLA:CPU; see the module docstring).
PAIRWISE = 512
#: Suspects of a larger batch compared pairwise; more sort the batch.
SUSPECTS = 64


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

    def sorted_path():
        inv_s, idx_s, start = _runs(columns, valid)
        return jnp.zeros((n,), bool).at[idx_s].set(start & (inv_s == 0))

    return _by_pairs(
        columns, valid, lambda eq, before, me: valid[me] & ~jnp.any(eq & before, 1), sorted_path
    )


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

    def sorted_path():
        inv_s, idx_s, start = _runs(columns, valid)
        # Sorted by index within a run of equal rows: the run's first entry is its first row.
        run_start = jax.lax.cummax(jnp.where(start, jnp.arange(n, dtype=jnp.int32), 0), axis=0)
        first = jnp.where(inv_s == 0, idx_s[run_start], -1)
        return jnp.zeros((n,), jnp.int32).at[idx_s].set(first)

    def from_pairs(eq, before, me):
        # `me` lists the compared rows (ascending; n for unused slots).
        other = jnp.min(jnp.where(eq & before, me[None, :], n), axis=1)
        return jnp.where(valid[me], jnp.minimum(other, me), -1)

    return _by_pairs(
        columns, valid, from_pairs, sorted_path, alone=jnp.arange(n, dtype=jnp.int32), invalid=-1
    )


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

    def sorted_path():
        idx = jnp.arange(n, dtype=jnp.int32)
        invalid = (~valid).astype(jnp.int32)
        inv_s, g_s, idx_s = jax.lax.sort((invalid, group, idx), num_keys=3)
        start = jnp.concatenate(
            [jnp.ones((1,), bool), (g_s[1:] != g_s[:-1]) | (inv_s[1:] != inv_s[:-1])]
        )
        start_pos = jax.lax.cummax(jnp.where(start, idx, 0), axis=0)
        return jnp.zeros((n,), jnp.int32).at[idx_s].set(idx - start_pos)

    if n > PAIRWISE:
        # Ranks exist to place rows that share a bucket: in a large batch many do, so the
        # suspects would exceed the bound and the hashing would only add to the sort.
        return sorted_path()
    return _by_pairs(
        (group,),
        valid,
        lambda eq, before, me: jnp.sum(eq & before, 1, dtype=jnp.int32),
        sorted_path,
        alone=jnp.zeros((n,), jnp.int32),
        invalid=0,
    )


def _by_pairs(columns, valid, answer, sorted_path, *, alone=None, invalid=False):
    """Evaluates a per-row rule from pairwise row equality (see the module docstring).

    ``answer(eq, before, me)`` gets, for the compared rows ``me`` (int32[K], ascending row
    numbers, ``n`` for unused slots), ``eq[i, j]``: rows ``me[i]`` and ``me[j]`` are both valid
    and equal in every column, and ``before[i, j]``: ``me[j] < me[i]``; it returns the rows'
    answers ([K]). Rows that equal no other row get ``alone`` (default: their validity), invalid
    rows ``invalid``; ``sorted_path()`` answers when the suspects exceed ``SUSPECTS``.
    """
    n = valid.shape[0]
    cols = [jnp.asarray(c) for c in columns]
    base = valid if alone is None else jnp.where(valid, alone, invalid)

    def pairs(me):
        ok = me < n
        at = jnp.clip(me, 0, n - 1)
        v = valid[at] & ok
        eq = v[:, None] & v[None, :]
        for c in cols:
            x = c[at]
            eq = eq & (x[:, None] == x[None, :])
        before = me[None, :] < me[:, None]
        return answer(eq, before, at)

    if n <= PAIRWISE:
        return jnp.where(valid, pairs(jnp.arange(n, dtype=jnp.int32)), invalid)
    # Hash every row's values into >= 32 n slots; rows alone in their slot repeat nothing.
    bits = max(5, int(np.ceil(np.log2(n))) + 5)
    h = jnp.zeros((n,), jnp.uint32)
    for c in cols:
        h = (h ^ c.astype(jnp.uint32)) * jnp.uint32(0x9E3779B1)
        h = h ^ (h >> 15)
    slot = jnp.where(valid, (h >> (32 - bits)).astype(jnp.int32), 1 << bits)
    idx = jnp.arange(n, dtype=jnp.int32)
    lo = jnp.full((1 << bits,), n, jnp.int32).at[slot].min(idx, mode="drop")
    hi = jnp.full((1 << bits,), -1, jnp.int32).at[slot].max(idx, mode="drop")
    s = jnp.clip(slot, 0, (1 << bits) - 1)
    suspect = valid & (lo[s] != hi[s])
    me = jnp.nonzero(suspect, size=SUSPECTS, fill_value=n)[0].astype(jnp.int32)
    fast = base.at[me].set(pairs(me).astype(base.dtype), mode="drop")
    return jax.lax.cond(jnp.sum(suspect, dtype=jnp.int32) > SUSPECTS, sorted_path, lambda: fast)
