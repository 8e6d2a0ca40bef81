"""The consumer side of the coordinator's step metadata: where the model reads its rows.

The coordinator computes every address the step needs (docs/coordinator.md, "Step metadata");
this module only *reads* them, the way a kernel would:

- **writes** are ``meta.write_slot[g]`` as published (no formula here);
- **window groups** (sliding-window KV, compressor state): the token of metadata row ``i`` at
  position ``p`` reads positions ``q`` in ``[p - span + 1, p]`` from
  ``window_pages[i, off + q // block_tokens - window_first_block[g, i]]`` at in-page row
  ``(q // tokens_per_row) % rows_per_page`` (``(off, n) = window_columns(plan, max_count)[g]``);
- **history groups** (compressed chains): row ``j`` of request slot ``s`` is in the flat table
  buffer at ``table_offset[g] + s * table_width[g] + j // rows_per_page``.

Every address that is not a page (``< 1``: hole, unallocated, outside the published columns or
the table) is redirected to the null page and reported as not ``ok``, so callers mask it out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flatkv_jax.coordinator.metadata import StepMetadata
from flatkv_jax.coordinator.state import state_layout
from flatkv_jax.plan import CachePlan


def window_positions(pos: jax.Array, span: int) -> jax.Array:
    """Raw positions ``p - span + 1 .. p`` of each token, oldest first: int32 ``[N, span]``."""
    return pos[:, None] - span + 1 + jnp.arange(span, dtype=jnp.int32)[None, :]


def _null(ok: jax.Array, page: jax.Array, row: jax.Array):
    return jnp.where(ok, page, 0), jnp.where(ok, row, 0), ok


def window_address(
    plan: CachePlan,
    gi: int,
    columns: tuple[tuple[int, int], ...],
    meta: StepMetadata,
    row: jax.Array,
    q: jax.Array,
):
    """Addresses of raw positions ``q [N, E]`` of window group ``gi`` for tokens of metadata
    rows ``row [N]`` (``-1`` = idle token).

    Args:
      plan: the cache plan (static).
      gi: the group's index in ``plan.groups`` (a window group).
      columns: ``window_columns(plan, max_count)`` of the metadata.
      meta: the step's metadata.
      row: int32 ``[N]`` metadata row of each token.
      q: int32 ``[N, E]`` positions to read (``< 0`` = none).

    Returns:
      ``(page, row_in_page, ok)``, each ``[N, E]``; null-page addresses where not ``ok``.
    """
    g = plan.groups[gi]
    off, span = columns[gi]
    s = meta.row_slot.shape[0]
    r = jnp.clip(row, 0, s - 1)
    j = q // g.block_tokens - meta.window_first_block[gi, r][:, None]
    inside = (row >= 0)[:, None] & (q >= 0) & (j >= 0) & (j < span)
    page = meta.window_pages[r[:, None], off + jnp.clip(j, 0, span - 1)]
    return _null(inside & (page >= 1), page, (q // g.tokens_per_row) % g.rows_per_page)


def history_address(
    plan: CachePlan, gi: int, table_buffer: jax.Array, slot: jax.Array, rows: jax.Array
):
    """Addresses of rows ``rows [N, E]`` of history group ``gi`` for request slots ``slot [N]``
    (``-1`` = idle), read from the coordinator's flat table buffer.

    Returns:
      ``(page, row_in_page, ok)``, each ``[N, E]``; null-page addresses where not ``ok``.
    """
    g = plan.groups[gi]
    layout = state_layout(plan)
    base, width = layout.table_offset[gi], layout.table_width[gi]
    r = layout.max_requests
    block = rows // g.rows_per_page
    inside = (slot >= 0)[:, None] & (rows >= 0) & (block < width)
    flat = base + jnp.clip(slot, 0, r - 1)[:, None] * width + jnp.clip(block, 0, width - 1)
    page = table_buffer[flat]
    return _null(inside & (page >= 1), page, rows % g.rows_per_page)


def gather(pool: jax.Array, page: jax.Array, row: jax.Array) -> jax.Array:
    """``pool[page, row]`` for in-range addresses (the callers pass null-page addresses for
    everything they mask; ``mode="clip"`` keeps even a corrupt table inside the pool)."""
    return pool.at[page, row].get(mode="clip")
