"""Public entry point of ``write_rows``: validation, then dispatch on an explicit ``Impl``."""

from __future__ import annotations

from typing import Any

import jax

from kernels_pallas._common import Impl, as_impl, check_interpret
from kernels_pallas.write_rows import pallas_tpu, reference
from kernels_pallas.write_rows.validation import check_write_rows_static


def write_rows(
    pool: jax.Array,
    rows: jax.Array,
    slots: jax.Array,
    *,
    impl: Impl | str = Impl.REFERENCE,
    interpret: Any = False,
) -> jax.Array:
    """Writes token rows into (page, row) slots of one pool, in place.

    Cost is proportional to ``N`` (rows written), never to the pool size, provided the caller
    donates the pool: ``jax.jit(step, donate_argnums=...)``. Without donation XLA must copy the
    whole pool. Inside one jitted function, mutate a pool before reading it (zero -> write ->
    read); a read before a write forces a full copy (docs/kernels.md).

    Args:
        pool: ``[num_pages, rows_per_page, *row_shape]``, any dtype; page 0 is the null page and
            page ``num_pages - 1`` the scratch page. Donated by the caller; the Pallas kernel
            aliases it input->output.
        rows: ``[N, *row_shape]``, exactly ``pool.dtype``.
        slots: ``int32[N]``, ``page * rows_per_page + row``; ``-1`` skips the row. Ids outside
            ``[0, num_pages * rows_per_page)`` are dropped on every impl (never wrapped or
            clamped). Writes to page 0 / the scratch page / duplicate slots are *not* caught
            here (data-dependent); use ``check_write_slots`` outside jit to catch them.
        impl: ``Impl.REFERENCE`` (default; XLA scatter — the CPU and GPU path) or
            ``Impl.PALLAS_TPU``.
        interpret: only for ``Impl.PALLAS_TPU``: ``True`` (CPU interpret mode) or
            ``pltpu.InterpretParams()`` (TPU interpret mode; tiny pools only).

    Returns:
        The updated pool, same shape and dtype.

    Raises:
        TypeError, ValueError: at trace time, for wrong ranks, shapes, dtypes or ``impl``.
    """
    impl = as_impl(impl, op="write_rows")
    check_write_rows_static(pool, rows, slots)
    if impl is Impl.PALLAS_TPU:
        return pallas_tpu.write_rows(pool, rows, slots, interpret=interpret)
    check_interpret(impl, interpret, op="write_rows")
    return reference.write_rows(pool, rows, slots)
