"""Pallas TPU kernel of ``write_rows``: one HBM->HBM DMA per written row.

Layout: ``slots`` is scalar-prefetched into SMEM; ``rows`` and the pool stay in ``pl.ANY``
(HBM) so no VMEM block has to match the TPU (8, 128) tiling — a 584-byte row is fine. The
grid walks blocks of ``block_rows`` rows; each step starts the DMAs of its valid rows on one
DMA semaphore, then waits for each of them, so up to ``block_rows`` copies are in flight. Work is
O(N); the pool is never read or swept.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import _compat

DEFAULT_BLOCK_ROWS = 128


def _kernel(slots_ref, rows_hbm, pool_in_hbm, pool_hbm, sem, *, block_rows, rows_per_page):
    del pool_in_hbm  # Aliased to pool_hbm; everything goes through the output ref.
    base = pl.program_id(0) * block_rows

    def row_copy(i):
        slot = slots_ref[base + i]
        # lax.div/rem, not // and %: the slot is known non-negative here, and jnp's floor
        # division lowers through sign(), which Mosaic can only lower with a real TPU attached.
        page = lax.div(slot, rows_per_page)
        row = lax.rem(slot, rows_per_page)
        return _compat.make_async_copy(rows_hbm.at[base + i], pool_hbm.at[page, row], sem)

    def for_valid_rows(action):
        def body(i, carry):
            # Skipped rows carry -1 (the wrapper maps every out-of-range slot to -1).
            @pl.when(slots_ref[base + i] >= 0)
            def _():
                action(row_copy(i))

            return carry

        lax.fori_loop(0, block_rows, body, 0)

    for_valid_rows(lambda c: c.start())
    for_valid_rows(lambda c: c.wait())


def write_rows(
    pool: jax.Array,
    rows: jax.Array,
    slots: jax.Array,
    *,
    interpret: Any = False,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> jax.Array:
    """Pallas TPU ``write_rows``. Same contract as ``reference.write_rows``.

    Args:
        pool: ``[num_pages, rows_per_page, *row_shape]``; aliased input->output, donate it.
        rows: ``[N, *row_shape]``, same dtype as ``pool``.
        slots: ``int32[N]``; ids outside ``[0, num_pages * rows_per_page)`` (including -1) skip.
        interpret: ``False`` on TPU, ``True`` for CPU interpret mode, or
            ``pltpu.InterpretParams()`` for TPU interpret mode (tiny pools only).
        block_rows: rows handled per grid step (max DMAs in flight).

    Returns:
        The updated pool (the same buffer when donated).
    """
    n = rows.shape[0]
    if n == 0:
        return pool
    num_pages, rows_per_page = pool.shape[0], pool.shape[1]
    block_rows = max(1, min(block_rows, n))
    num_blocks = pl.cdiv(n, block_rows)
    # Out-of-range ids become -1 here so the kernel never issues an out-of-bounds DMA (TPU
    # would fault or corrupt; interpret mode would clamp onto the scratch page).
    valid = (slots >= 0) & (slots < num_pages * rows_per_page)
    slots = jnp.where(valid, slots, -1)
    padded = num_blocks * block_rows
    if padded != n:
        slots = jnp.concatenate([slots, jnp.full((padded - n,), -1, jnp.int32)])

    kernel = functools.partial(_kernel, block_rows=block_rows, rows_per_page=rows_per_page)
    any_spec = pl.BlockSpec(memory_space=_compat.ANY)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid_spec=_compat.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_blocks,),
            in_specs=[any_spec, any_spec],
            out_specs=any_spec,
            scratch_shapes=[_compat.dma_semaphore()],
        ),
        # Operand 0 is slots (scalar prefetch), 1 rows, 2 the pool -> output 0.
        input_output_aliases={2: 0},
        compiler_params=_compat.tpu_compiler_params(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="flatkv_write_rows",
    )(slots, rows, pool)
