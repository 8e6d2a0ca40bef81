"""GPU decision for the page kernels: XLA scatter (``reference.py``) is the GPU path.

There is deliberately no GPU Pallas ``write_rows``/``zero_pages`` kernel. Measured with jax
0.10.2 by lowering from a CPU machine with ``jax.export(..., platforms=("cuda",))`` (see
``probe_mosaic_gpu_row_copy`` below and tests/kernels/test_lowering.py):

* Scalar prefetch (how the TPU kernel gets its slots) does not exist on GPU:
  ``NotImplementedError: Scalar prefetch not supported in Mosaic GPU lowering.``
* A Mosaic GPU kernel (the default ``pallas_call`` backend on GPU) that reads the slots from
  SMEM and moves each row GMEM -> SMEM -> GMEM with TMA copies lowers only for rows whose byte
  size is a multiple of 128 and with <= 256 elements per dimension:

  - uint8 (584,): ``NotImplementedError: Only copies transferring a number of bytes divisible
    by the warpgroup size are supported. Got bytes=584 but warpgroup size is 128``
  - uint32 (146,) (the same row reinterpreted as words): same error, bytes=584
  - uint8 (132,): same error, bytes=132 (and 68 for the 68-byte rows)
  - bfloat16 (512,): ``ValueError: Async copies only support copying <=256 elements along each
    dimension, got (1, 512)``
  - float32 (128,): lowers.

  The packed fp8/MXFP4 rows (584, 132, 68 bytes) are the rows that matter most, and the pool
  layout is fixed (rows cannot be padded to 640 bytes without changing every pool). Splitting a
  row into a 512-byte TMA copy plus a 72-byte tail still leaves a tail that TMA cannot move, so
  it would need a second, register-level code path per row format.
* ``pl.pallas_call`` for Mosaic GPU is itself deprecated in jax 0.10.2 ("Please migrate to
  ``plgpu.kernel``"), and ``plgpu.kernel`` takes no ``input_output_aliases``, so an in-place
  pool update would rest on a deprecated entry point.
* The Triton backend is deprecated on the accelerator images (jax 0.11.x) and needs
  power-of-two block sizes; 584 would be masked to 1024 lanes per row.

XLA's GPU scatter is already what such a kernel would be: one fused kernel with one thread per
updated element, cost proportional to the rows written, updating a donated pool in place (see
tests/kernels/test_no_copies.py for the aliasing guard). Our reference maps every skipped or
out-of-range slot to a distinct out-of-range sentinel with ``mode="drop"``, so it never wraps,
never clamps and never touches a page it was not asked to. H200 bandwidth numbers for the
scatter are pending (no GPU was available when this was written); docs/benchmarks.md.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def probe_mosaic_gpu_row_copy(
    row_shape: tuple[int, ...], dtype: jnp.dtype, *, rows_per_page: int = 4, num_pages: int = 6
) -> str | None:
    """Tries to lower a minimal Mosaic GPU row-copy ``write_rows`` for CUDA.

    The kernel is the most direct GPU translation of the TPU kernel (slots in SMEM, each row
    copied GMEM -> SMEM -> GMEM by TMA). It exists to keep the decision above checkable: it is
    run by the lowering tests, and when a JAX upgrade makes it lower for 584-byte rows the
    decision should be revisited.

    Args:
        row_shape: the pool's row shape, e.g. ``(584,)``.
        dtype: the pool dtype.
        rows_per_page: rows per page of the probe pool.
        num_pages: pages of the probe pool.

    Returns:
        ``None`` if it lowers, else ``"ExceptionType: first line of the message"``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = 32  # 32 int32 slots = 128 bytes, the smallest SMEM copy Mosaic GPU accepts.
    row_shape = tuple(row_shape)

    def kernel(slots_smem, rows_gmem, pool_in, pool_out, buf, bar):
        del pool_in
        i = pl.program_id(0)
        slot = slots_smem[i]

        @pl.when(slot >= 0)
        def _():
            page = lax.div(slot, rows_per_page)
            row = lax.rem(slot, rows_per_page)
            plgpu.copy_gmem_to_smem(rows_gmem.at[pl.ds(i, 1)], buf, bar)
            plgpu.barrier_wait(bar)
            plgpu.copy_smem_to_gmem(buf, pool_out.at[page, pl.ds(row, 1)])
            plgpu.wait_smem_to_gmem(0)

    pool_shape = (num_pages, rows_per_page, *row_shape)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(pool_shape, dtype),
        grid=(n,),
        in_specs=[
            pl.BlockSpec(memory_space=plgpu.SMEM),
            pl.BlockSpec(memory_space=plgpu.GMEM),
            pl.BlockSpec(memory_space=plgpu.GMEM),
        ],
        out_specs=pl.BlockSpec(memory_space=plgpu.GMEM),
        scratch_shapes=[plgpu.SMEM((1, *row_shape), dtype), plgpu.Barrier(num_arrivals=1)],
        input_output_aliases={2: 0},
    )
    args = (
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n, *row_shape), dtype),
        jax.ShapeDtypeStruct(pool_shape, dtype),
    )
    try:
        with warnings.catch_warnings():
            # jax 0.10.2 deprecates pallas_call for Mosaic GPU in favour of plgpu.kernel, which
            # has no input_output_aliases; the probe needs aliasing, so it keeps pallas_call.
            warnings.filterwarnings("ignore", message=".*pallas_call.*Mosaic GPU.*deprecated")
            jax.export.export(jax.jit(call), platforms=("cuda",))(*args)
    except Exception as e:  # The point is to record whatever the lowering raises.
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None
