"""Page kernels of flatkv_jax: write token rows into pages, zero recycled pages.

Each op lives in its own folder (``write_rows/``, ``zero_pages/``) with a plain-JAX
``reference.py`` (the default, and the CPU/GPU path), a Pallas TPU kernel (``pallas_tpu.py``),
``validation.py`` and ``api.py``. The implementation is always chosen by an explicit ``impl=``
argument (``Impl.REFERENCE`` by default), never by the environment. Version-specific Pallas
spellings live in ``_compat.py``; the helpers both ops share in ``_common.py``; why the
GPU path is the reference in ``gpu_decision.py``. Contract and decisions: docs/kernels.md.
"""

from kernels_pallas._common import Impl
from kernels_pallas.write_rows import check_write_slots, write_rows
from kernels_pallas.zero_pages import check_page_ids, zero_pages

__all__ = ["Impl", "check_page_ids", "check_write_slots", "write_rows", "zero_pages"]
