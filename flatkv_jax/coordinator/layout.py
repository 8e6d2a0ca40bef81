"""The derived layout of a plan: the per-group constants and static bounds the operations use.

Everything here is a pure function of the (static, hashable) plan and is computed once per plan.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flatkv_jax.coordinator.state import table_offset
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan

_I32 = jnp.int32


def resolve_max_count(plan: CachePlan, max_count: int | None) -> int:
    """The static per-row token bound of admit/extend (default ``max(chunk, 1 + verify)``).

    A smaller bound (``plan.limits.decode_tokens`` for a decode-only batch) shrinks the zero
    lists and the per-row table scatter.
    """
    lim = plan.limits
    default = max(lim.chunk_tokens, lim.decode_tokens)
    if max_count is None:
        return default
    check_positive_int("max_count", max_count)
    if max_count > default:
        fail(
            "max_count",
            max_count,
            f"a step writes at most max(chunk_tokens, 1 + verify_width) = {default} tokens per request",
            f"pass max_count <= {default} or None",
        )
    return max_count


def pages_per_row(plan: CachePlan, max_count: int) -> int:
    """The most pages one row of admit/extend can take in any pool: ``ceil(max_count / B)``
    for the smallest block span ``B`` (a step of ``n <= max_count`` tokens opens at most
    ``ceil(n / B)`` new blocks, since blocks ``< hi`` are already allocated)."""
    return -(-max_count // min(g.block_tokens for g in plan.groups))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-group constants of a plan, as tuples (turned into small constant arrays in jit)."""

    block_tokens: tuple[int, ...]
    rows_per_page: tuple[int, ...]
    tokens_per_row: tuple[int, ...]
    width: tuple[int, ...]
    table_offset: tuple[int, ...]
    is_window: tuple[bool, ...]
    window: tuple[int, ...]

    def a(self, name: str) -> jax.Array:
        """The named constant as a ``[G]`` array."""
        dtype = jnp.bool_ if name == "is_window" else _I32
        return jnp.asarray(getattr(self, name), dtype)


@functools.cache
def geometry(plan: CachePlan) -> Geometry:
    """The per-group constants the vectorised operations need."""
    return Geometry(
        block_tokens=tuple(g.block_tokens for g in plan.groups),
        rows_per_page=tuple(g.rows_per_page for g in plan.groups),
        tokens_per_row=tuple(g.tokens_per_row for g in plan.groups),
        width=tuple(plan.table_width(g) for g in plan.groups),
        table_offset=table_offset(plan),
        is_window=tuple(g.is_window for g in plan.groups),
        window=tuple(g.window or 0 for g in plan.groups),
    )
