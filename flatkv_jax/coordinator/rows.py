"""Row and table helpers shared by the operations: handle lookup, per-row status, masked
row/column writes and the step's token budget. All of them work on one batch of rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flatkv_jax.coordinator.results import StepResult
from flatkv_jax.coordinator.state import CacheState
from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan
from flatkv_jax.status import Status

_I32 = jnp.int32


def pick_status(default: int, *checks: tuple[jax.Array, int]) -> jax.Array:
    """The code of the first true check per row (checks in priority order), else ``default``."""
    out = jnp.full(checks[0][0].shape, default, _I32)
    for cond, code in reversed(checks):
        out = jnp.where(cond, jnp.asarray(code, _I32), out)
    return out


def lookup(
    state: CacheState, slot: jax.Array, generation: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Clipped slots and whether each handle names a live request of that generation."""
    r = state.max_requests
    in_range = (slot >= 0) & (slot < r)
    s = jnp.clip(slot, 0, r - 1)
    return s, in_range & state.live[s] & (state.generation[s] == generation)


def later_duplicates(s: jax.Array, mask: jax.Array, num_slots: int) -> jax.Array:
    """Rows of ``mask`` naming a slot an earlier row of ``mask`` already names."""
    b = s.shape[0]
    rows = jnp.arange(b, dtype=_I32)
    first = jnp.full((num_slots,), b, _I32).at[jnp.where(mask, s, num_slots)].min(rows, mode="drop")
    return mask & (first[s] != rows)


def set_rows(x: jax.Array, s: jax.Array, mask: jax.Array, value) -> jax.Array:
    """``x[s[i]] = value[i]`` for rows of ``mask`` (other rows dropped)."""
    return x.at[jnp.where(mask, s, x.shape[0])].set(value, mode="drop")


def set_cols(x: jax.Array, s: jax.Array, mask: jax.Array, value) -> jax.Array:
    """``x[:, s[i]] = value[:, i]`` for rows of ``mask`` (``x``: ``[G, R]``)."""
    g, r = x.shape
    gi = jnp.arange(g, dtype=_I32)[:, None]
    return x.at[gi, jnp.where(mask, s, r)[None, :]].set(value, mode="drop")


def ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + (b - 1)) // b


def over_step_budget(
    plan: CachePlan,
    asking: jax.Array,
    count: jax.Array,
    same_step: tuple[StepResult, ...],
    max_count: int,
) -> jax.Array:
    """Rows of ``asking`` that the step's token budget refuses (``STEP_FULL``).

    The step's flat token axis holds ``plan.limits.step_tokens`` tokens; the calls in
    ``same_step`` already scheduled their OK rows' tokens. Rows of ``asking`` add their
    ``count`` in batch order; the first row that passes the budget and every later asking
    row are refused (the FIFO rule of ``OUT_OF_PAGES``: a long chunk is never starved by
    later short rows of the same call). A row that fits is then still subject to the page
    check, and keeps its tokens counted even if it runs out of pages (every later row does
    then too).

    ``max_count`` (static) bounds ``count`` on the rows of ``asking`` (the callers refuse
    larger counts first): a call that opens its step and cannot pass the budget even if every
    row asks for ``max_count`` tokens (a decode batch) refuses nothing, with no scan at all.
    """
    if not same_step and asking.shape[0] * max_count <= plan.limits.step_tokens:
        return jnp.zeros_like(asking)
    used = jnp.zeros((), _I32)
    for x in same_step:
        used = used + jnp.sum(jnp.where(x.status == Status.OK, x.count, 0), dtype=_I32)
    total = used + jnp.cumsum(jnp.where(asking, count, 0), dtype=_I32)
    over = asking & (total > plan.limits.step_tokens)
    return asking & (jnp.cumsum(over.astype(_I32)) > 0)


def require_prefix(state: CacheState, what: str) -> None:
    """Tokens mean prefix reuse: the state must keep a prefix index (checked at trace time)."""
    if not state.prefix:
        fail(
            what,
            "an int32 token array",
            "tokens turn prefix reuse on, but this state was created without a prefix index",
            "build the state with create_state(plan, prefix=True) or pass tokens=None",
        )


def replace(state: CacheState, **kw) -> CacheState:
    return dataclasses.replace(state, **kw)
