"""Shared pieces of the page kernels: the implementation choice and static validation helpers."""

from __future__ import annotations

import enum
from typing import Any

import jax
import numpy as np

_INT32_MAX = int(np.iinfo(np.int32).max)


class Impl(enum.StrEnum):
    """Which implementation of a page operation to run. Always chosen by an argument.

    Attributes:
        REFERENCE: plain ``jax.numpy`` (XLA scatter with explicit drop sentinels). The default,
            the CPU path and — by documented decision (docs/kernels.md) — the GPU path.
        PALLAS_TPU: Pallas TPU kernel (scalar-prefetched ids, pool in ``pl.ANY``, one DMA per
            row/page). Runs on TPU, and on CPU with ``interpret=True`` or
            ``interpret=pltpu.InterpretParams()``.
    """

    REFERENCE = "reference"
    PALLAS_TPU = "pallas_tpu"


def as_impl(impl: Any, *, op: str) -> Impl:
    """Normalizes ``impl`` (an ``Impl`` or its string value) or raises a clear error."""
    if isinstance(impl, Impl):
        return impl
    if isinstance(impl, str):
        try:
            return Impl(impl)
        except ValueError:
            pass
    choices = ", ".join(f"Impl.{m.name} ({m.value!r})" for m in Impl)
    raise ValueError(
        f"{op}: impl={impl!r} is not a known implementation; pass one of {choices}, "
        "e.g. impl=Impl.REFERENCE."
    )


def check_ids_array(ids: Any, *, name: str, op: str) -> None:
    """Static (trace-time) checks of an id vector: rank 1, dtype int32."""
    shape = getattr(ids, "shape", None)
    dtype = getattr(ids, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"{op}: {name} must be a jax/numpy array of int32, got {type(ids).__name__}; "
            f"wrap it with jnp.asarray({name}, dtype=jnp.int32)."
        )
    if len(shape) != 1:
        raise ValueError(
            f"{op}: {name} must have rank 1 (one id per entry, -1 = skip), got shape "
            f"{tuple(shape)}; flatten it with {name}.reshape(-1)."
        )
    if np.dtype(dtype) != np.dtype(np.int32):
        raise TypeError(
            f"{op}: {name} must have dtype int32, got {np.dtype(dtype).name}; "
            f"cast it with {name}.astype(jnp.int32) (ids are never wrapped or truncated silently)."
        )


def check_pool_array(pool: Any, *, name: str, op: str) -> None:
    """Static checks of one pool: an array of rank >= 2 with >= 3 pages."""
    shape = getattr(pool, "shape", None)
    if shape is None or getattr(pool, "dtype", None) is None:
        raise TypeError(
            f"{op}: {name} must be an array [num_pages, rows_per_page, *row_shape], "
            f"got {type(pool).__name__}."
        )
    if len(shape) < 2:
        raise ValueError(
            f"{op}: {name} must have rank >= 2 [num_pages, rows_per_page, *row_shape], got "
            f"shape {tuple(shape)}; add a trailing row axis (e.g. pool[..., None])."
        )
    if shape[0] < 3:
        raise ValueError(
            f"{op}: {name} has {shape[0]} pages but needs >= 3 (page 0 is the null page, "
            f"page num_pages-1 is the scratch page, and at least one real page); got shape "
            f"{tuple(shape)}. Size the pool with two extra pages."
        )
    if shape[0] * shape[1] > _INT32_MAX // 2:
        raise ValueError(
            f"{op}: {name} has {shape[0]} * {shape[1]} slots, too many for int32 slot ids "
            f"(limit {_INT32_MAX // 2}); split the pool."
        )


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)
