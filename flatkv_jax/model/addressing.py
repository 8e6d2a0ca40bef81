"""Where a token's rows live: write slots and read addresses from absolute tables.

The formulas of docs/semantics.md ("Step metadata"), for one group ``g`` with
``B = rows_per_page * tokens_per_row``:

- the token at position ``p`` completes row ``p // tokens_per_row`` iff
  ``(p + 1) % tokens_per_row == 0``;
- row ``i`` lives in table slot ``i // rows_per_page`` (= block ``p // B``) at row
  ``i % rows_per_page`` of that page; its write slot is ``page * rows_per_page + row``;
- a table entry ``>= 1`` is a page; ``0`` (hole) and ``-1`` (not allocated / idle) are never
  read or written: writes get slot ``-1`` (skipped by the kernels) and reads are redirected to
  the null page and masked out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flatkv_jax.groups import GroupSpec


def row_address(g: GroupSpec, table: jax.Array, slot: jax.Array, row: jax.Array):
    """Page and in-page row of row ``row`` of request ``slot`` in group ``g``.

    Args:
      g: the group.
      table: int32 ``[max_requests, width]`` absolute table of ``g``.
      slot: int32 request slots (``-1`` = idle), broadcastable against ``row``.
      row: int32 row indices of ``g`` (``< 0`` = none).

    Returns:
      ``(page, row_in_page, ok)`` with the shape of ``row``: where ``ok`` is False the
      address is ``(0, 0)``, the null page.
    """
    slot, row = jnp.broadcast_arrays(slot, row)
    r, width = table.shape
    block = row // g.rows_per_page
    inside = (slot >= 0) & (slot < r) & (row >= 0) & (block < width)
    page = table[jnp.clip(slot, 0, r - 1), jnp.clip(block, 0, width - 1)]
    ok = inside & (page >= 1)
    return jnp.where(ok, page, 0), jnp.where(ok, row % g.rows_per_page, 0), ok


def write_slots(
    g: GroupSpec, table: jax.Array, token_slot: jax.Array, token_pos: jax.Array
) -> jax.Array:
    """Write slot of each step token in group ``g``: ``int32[S]``, ``-1`` = no row to write.

    A token writes iff it is live (slot and position ``>= 0``), it completes a row
    (``(p + 1) % tokens_per_row == 0``) and the table holds a page for that row.
    """
    completes = (token_pos + 1) % g.tokens_per_row == 0
    page, r, ok = row_address(
        g, table, token_slot, jnp.where(token_pos >= 0, token_pos // g.tokens_per_row, -1)
    )
    return jnp.where(ok & completes, page * g.rows_per_page + r, -1).astype(jnp.int32)


def window_positions(token_pos: jax.Array, span: int) -> jax.Array:
    """Raw positions ``p - span + 1 .. p`` of each token, oldest first: int32 ``[S, span]``."""
    return token_pos[:, None] - span + 1 + jnp.arange(span, dtype=jnp.int32)[None, :]


def gather(pool: jax.Array, page: jax.Array, row: jax.Array) -> jax.Array:
    """``pool[page, row]`` for in-range addresses (the callers pass null-page addresses for
    everything they mask; ``mode="clip"`` keeps even a corrupt table inside the pool)."""
    return pool.at[page, row].get(mode="clip")
