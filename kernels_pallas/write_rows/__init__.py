"""``write_rows``: write N token rows into (page, row) slots of a donated pool.

Files: ``reference.py`` (plain JAX, exported, default; also the GPU path), ``pallas_tpu.py``
(Pallas TPU DMA kernel), ``validation.py`` (static and opt-in dynamic checks), ``api.py``
(dispatch). The GPU decision for both ops (no GPU Pallas kernel) is in
``kernels_pallas/gpu_decision.py``.
"""

from kernels_pallas.write_rows import reference
from kernels_pallas.write_rows.api import write_rows
from kernels_pallas.write_rows.validation import check_write_rows_static, check_write_slots

__all__ = ["check_write_rows_static", "check_write_slots", "reference", "write_rows"]
