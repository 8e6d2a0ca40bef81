"""Pallas TPU kernel of ``zero_pages``: one HBM->HBM DMA per (page, pool array).

All arrays of a group go through ONE ``pallas_call``: page ids are scalar-prefetched into
SMEM, every pool array stays in ``pl.ANY`` (HBM) and is aliased input->output, and each page is
overwritten by a DMA from a small all-zero page (one per distinct page shape/dtype, built by XLA
outside the kernel). A whole-page DMA is aligned to the TPU tiling whatever the row shape, and
the kernel does no vector work at all, so 8-bit and odd row widths need nothing special.
Work is O(K * arrays * page bytes); the pool is never swept.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import _compat

DEFAULT_BLOCK_PAGES = 64


def _kernel(ids_ref, *refs, num_arrays, num_zeros, zero_index, block_pages):
    # refs: pool inputs (aliased, unused), zero pages, pool outputs, DMA semaphore.
    zero_refs = refs[num_arrays : num_arrays + num_zeros]
    out_refs = refs[num_arrays + num_zeros : 2 * num_arrays + num_zeros]
    sem = refs[-1]
    base = pl.program_id(0) * block_pages

    def for_valid_pages(action):
        def body(k, carry):
            page = ids_ref[base + k]

            # Skipped entries carry -1 (the wrapper maps every out-of-range id to -1).
            @pl.when(page >= 0)
            def _():
                for a in range(num_arrays):
                    copy = _compat.make_async_copy(
                        zero_refs[zero_index[a]], out_refs[a].at[page], sem
                    )
                    action(copy)

            return carry

        lax.fori_loop(0, block_pages, body, 0)

    for_valid_pages(lambda c: c.start())
    for_valid_pages(lambda c: c.wait())


def zero_pages(
    pools: Any,
    page_ids: jax.Array,
    *,
    interpret: Any = False,
    block_pages: int = DEFAULT_BLOCK_PAGES,
) -> Any:
    """Pallas TPU ``zero_pages``. Same contract as ``reference.zero_pages``.

    Args:
        pools: pytree of ``[num_pages, rows_per_page, *row_shape]`` arrays sharing
            ``num_pages``; each is aliased input->output (donate them).
        page_ids: ``int32[K]``; ids outside ``[0, num_pages)`` (including -1) skip.
        interpret: ``False`` on TPU, ``True`` (CPU interpret mode) or
            ``pltpu.InterpretParams()`` (TPU interpret mode; tiny pools only).
        block_pages: page ids handled per grid step.

    Returns:
        ``pools`` with the pages zeroed, same structure.
    """
    leaves, treedef = jax.tree.flatten(pools)
    k = page_ids.shape[0]
    if k == 0 or not leaves:
        return pools
    num_pages = leaves[0].shape[0]
    block_pages = max(1, min(block_pages, k))
    num_blocks = pl.cdiv(k, block_pages)
    valid = (page_ids >= 0) & (page_ids < num_pages)
    ids = jnp.where(valid, page_ids, -1)
    if num_blocks * block_pages != k:
        ids = jnp.concatenate([ids, jnp.full((num_blocks * block_pages - k,), -1, jnp.int32)])

    # One zero page per distinct (page shape, dtype), shared by the arrays that match it.
    signatures: list[tuple[tuple[int, ...], Any]] = []
    zero_index = []
    for leaf in leaves:
        sig = (tuple(leaf.shape[1:]), jnp.dtype(leaf.dtype))
        if sig not in signatures:
            signatures.append(sig)
        zero_index.append(signatures.index(sig))
    zeros = [jnp.zeros(shape, dtype) for shape, dtype in signatures]

    num_arrays, num_zeros = len(leaves), len(zeros)
    kernel = functools.partial(
        _kernel,
        num_arrays=num_arrays,
        num_zeros=num_zeros,
        zero_index=tuple(zero_index),
        block_pages=block_pages,
    )
    any_spec = pl.BlockSpec(memory_space=_compat.ANY)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
        grid_spec=_compat.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(num_blocks,),
            in_specs=[any_spec] * (num_arrays + num_zeros),
            out_specs=[any_spec] * num_arrays,
            scratch_shapes=[_compat.dma_semaphore()],
        ),
        # Operand 0 is the page ids (scalar prefetch); operands 1..num_arrays are the pools.
        input_output_aliases={1 + a: a for a in range(num_arrays)},
        compiler_params=_compat.tpu_compiler_params(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="flatkv_zero_pages",
    )(ids, *leaves, *zeros)
    return jax.tree.unflatten(treedef, outs)
