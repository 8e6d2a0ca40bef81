"""Public entry point of ``zero_pages``: validation, then dispatch on an explicit ``Impl``."""

from __future__ import annotations

from typing import Any

import jax

from kernels_pallas._common import Impl, as_impl, check_interpret
from kernels_pallas.zero_pages import pallas_tpu, reference
from kernels_pallas.zero_pages.validation import check_zero_pages_static


def zero_pages(
    pools: Any,
    page_ids: jax.Array,
    *,
    impl: Impl | str = Impl.REFERENCE,
    interpret: Any = False,
) -> Any:
    """Zeros a list of pages in every pool array of one group, in place, in one call.

    Used when pages are recycled, so freed pages never leak data to the next owner. Cost is
    proportional to ``K * sum(page bytes)``, never to the pool size, provided the caller donates
    ``pools``. Inside one jitted function, zero before writing and reading the same pool.

    Args:
        pools: pytree (tuple, dict, ...) of the arrays of ONE group (all fields x layers),
            each ``[num_pages, rows_per_page, *row_shape]`` with a shared ``num_pages``; dtype
            and row shape may differ. Donated by the caller; the Pallas kernel aliases every
            array input->output.
        page_ids: ``int32[K]`` padded with ``-1``. Ids outside ``[0, num_pages)`` are dropped
            on every impl. Page 0 may appear (it stays zero). Zeroing the scratch page is not
            caught here; use ``check_page_ids`` outside jit.
        impl: ``Impl.REFERENCE`` (default; XLA scatter — the CPU and GPU path) or
            ``Impl.PALLAS_TPU``.
        interpret: only for ``Impl.PALLAS_TPU``: ``True`` (CPU interpret mode) or
            ``pltpu.InterpretParams()`` (TPU interpret mode; tiny pools only).

    Returns:
        ``pools`` with the pages zeroed, same structure, shapes and dtypes.

    Raises:
        TypeError, ValueError: at trace time, for wrong ranks, page counts, dtypes or ``impl``.
    """
    impl = as_impl(impl, op="zero_pages")
    check_zero_pages_static(pools, page_ids)
    if impl is Impl.PALLAS_TPU:
        return pallas_tpu.zero_pages(pools, page_ids, interpret=interpret)
    check_interpret(impl, interpret, op="zero_pages")
    return reference.zero_pages(pools, page_ids)
