"""Every version-specific JAX / Pallas spelling used by ``kernels_pallas``, in one place.

The library is developed against jax 0.10.x (CPU, interpret mode) and deployed on accelerator
images with jax 0.11.x. Pallas moves names between releases (``TPUCompilerParams`` became
``CompilerParams``, ``TPUInterpretParams`` became ``InterpretParams``, ``pltpu.ANY`` became
``pl.ANY``, ...). Kernel files import the names below and never touch ``pl``/``pltpu``
attributes whose spelling has changed, so a rename is fixed here once.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def _first_attr(module: Any, *names: str) -> Any:
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    raise ImportError(
        f"none of {names} exists in {module.__name__} (jax {jax.__version__}); "
        "add the new spelling to kernels_pallas/_compat.py"
    )


# Memory space for refs the kernel reaches only through DMAs (HBM on TPU, GMEM on GPU).
ANY = getattr(pl, "ANY", None) or _first_attr(pltpu, "ANY")

# Grid spec whose leading operands are copied to SMEM before the grid runs (TPU only).
PrefetchScalarGridSpec = _first_attr(pltpu, "PrefetchScalarGridSpec")

# TPU compiler params (``TPUCompilerParams`` before jax 0.7).
TPUCompilerParams = _first_attr(pltpu, "CompilerParams", "TPUCompilerParams")

# TPU interpret mode parameters (``TPUInterpretParams`` in older releases).
TPUInterpretParams = _first_attr(pltpu, "InterpretParams", "TPUInterpretParams")

make_async_copy = pltpu.make_async_copy


def dma_semaphore() -> Any:
    """One scalar DMA semaphore as a scratch shape."""
    return pltpu.SemaphoreType.DMA(())


def tpu_compiler_params(*, dimension_semantics: tuple[str, ...]) -> Any:
    """TPU compiler params with the given grid dimension semantics."""
    return TPUCompilerParams(dimension_semantics=dimension_semantics)


__all__ = [
    "ANY",
    "JAX_VERSION",
    "PrefetchScalarGridSpec",
    "TPUCompilerParams",
    "TPUInterpretParams",
    "dma_semaphore",
    "make_async_copy",
    "tpu_compiler_params",
]
