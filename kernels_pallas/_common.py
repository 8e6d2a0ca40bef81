"""Shared pieces of the page kernels: the implementation choice and the validation helpers
both ops use (errors in the library's one form, :func:`flatkv_jax.errors.fail`)."""

from __future__ import annotations

import enum
from typing import Any

import jax
import numpy as np

from flatkv_jax.errors import fail
from flatkv_jax.plan import MAX_POOL_ROWS


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
    fail(
        "impl",
        impl,
        f"{op} runs a known implementation, which this is not",
        f"pass one of {choices}, e.g. impl=Impl.REFERENCE",
    )


def check_interpret(impl: Impl, interpret: Any, *, op: str) -> None:
    """``interpret`` only means something to a Pallas implementation."""
    if interpret is not False and impl is not Impl.PALLAS_TPU:
        fail(
            "interpret",
            interpret,
            f"{op}: interpret only applies to Pallas impls, but impl is Impl.{impl.name}",
            "drop interpret or pass impl=Impl.PALLAS_TPU",
        )


def check_ids_array(ids: Any, *, name: str, op: str) -> None:
    """Static (trace-time) checks of an id vector: rank 1, dtype int32."""
    shape = getattr(ids, "shape", None)
    dtype = getattr(ids, "dtype", None)
    if shape is None or dtype is None:
        fail(
            name,
            type(ids).__name__,
            f"{op}: {name} must be a jax/numpy array of int32",
            f"wrap it with jnp.asarray({name}, dtype=jnp.int32)",
            exc=TypeError,
        )
    if len(shape) != 1:
        fail(
            name,
            f"an array of shape {tuple(shape)}",
            f"{op}: {name} must have rank 1 (one id per entry, -1 = skip)",
            f"flatten it with {name}.reshape(-1)",
        )
    if np.dtype(dtype) != np.dtype(np.int32):
        fail(
            name,
            f"an array of dtype {np.dtype(dtype).name}",
            f"{op}: {name} must have dtype int32 (ids are never wrapped or truncated silently)",
            f"cast it with {name}.astype(jnp.int32)",
            exc=TypeError,
        )


def check_pool_array(pool: Any, *, name: str, op: str) -> None:
    """Static checks of one pool: an array of rank >= 2 with >= 3 pages."""
    shape = getattr(pool, "shape", None)
    if shape is None or getattr(pool, "dtype", None) is None:
        fail(
            name,
            type(pool).__name__,
            f"{op}: {name} must be an array [num_pages, rows_per_page, *row_shape]",
            "pass the pool array of one field",
            exc=TypeError,
        )
    if len(shape) < 2:
        fail(
            name,
            f"an array of shape {tuple(shape)}",
            f"{op}: {name} must have rank >= 2 [num_pages, rows_per_page, *row_shape]",
            "add a trailing row axis (e.g. pool[..., None])",
        )
    if shape[0] < 3:
        fail(
            name,
            f"an array of shape {tuple(shape)}",
            f"{op}: {name} has {shape[0]} pages but needs >= 3 (page 0 is the null page, "
            "page num_pages-1 is the scratch page, and at least one real page)",
            "size the pool with two extra pages",
        )
    if shape[0] * shape[1] > MAX_POOL_ROWS:
        fail(
            name,
            f"an array of shape {tuple(shape)}",
            f"{op}: {name} has {shape[0]} * {shape[1]} row addresses, too many for int32 slot "
            f"ids (limit {MAX_POOL_ROWS})",
            "split the pool",
        )


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def concrete_ids(ids: Any, *, name: str, fn: str) -> np.ndarray:
    """``ids`` as an int64 NumPy vector, for the opt-in dynamic checks (outside jit only)."""
    if is_tracer(ids):
        fail(
            name,
            "a tracer",
            f"{fn} reads the ids and must run outside jax.jit",
            "call it on concrete arrays, e.g. in tests or a debug step",
            exc=TypeError,
        )
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        fail(
            name,
            f"an array of shape {arr.shape} dtype {arr.dtype}",
            f"{fn}: {name} must be a rank-1 integer array",
            f"pass {name} as an int32[N] array",
        )
    return arr.astype(np.int64)


def positions(mask: np.ndarray, limit: int = 8) -> str:
    """The first ``limit`` true positions of ``mask``, for error messages."""
    idx = np.flatnonzero(mask)
    shown = ", ".join(str(i) for i in idx[:limit])
    return shown + (", ..." if idx.size > limit else "")
