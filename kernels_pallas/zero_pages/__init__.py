"""``zero_pages``: zero a list of pages in every pool array of one group, in place.

Files: ``reference.py`` (plain JAX, exported, default; also the GPU path), ``pallas_tpu.py``
(Pallas TPU DMA kernel), ``validation.py`` (static and opt-in dynamic checks), ``api.py``
(dispatch). The GPU decision for both ops is in ``kernels_pallas/gpu_decision.py`` and
docs/kernels.md.
"""

from kernels_pallas.zero_pages import reference
from kernels_pallas.zero_pages.api import zero_pages
from kernels_pallas.zero_pages.validation import check_page_ids, check_zero_pages_static

__all__ = ["check_page_ids", "check_zero_pages_static", "reference", "zero_pages"]
