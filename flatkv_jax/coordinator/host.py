"""Thin host-side helpers: build fixed-size batches from Python lists, read results back.

No state lives here and no decision is taken here: every transition happens in the jitted
operations. The builders only pad to a fixed batch size (``max_requests`` by default, so one
compilation serves every step) and check that the Python values are ints that fit int32.

Example::

    state, res = ops.admit(plan, state, admit_batch(plan, [(prompt_len, first_chunk)]))
    (handle,) = handles(res)[:1]
    state, res = ops.extend(plan, state, extend_batch(plan, [(handle, 1)]))
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.coordinator.batches import (
    AdmitBatch,
    ExtendBatch,
    HandleBatch,
    ReleaseBatch,
    ReleaseMode,
    RetireBatch,
    RewindBatch,
)
from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan
from flatkv_jax.status import Status

#: A request handle: ``(slot, generation)``.
Handle = tuple[int, int]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _size(plan: CachePlan, n: int, size: int | None) -> int:
    size = plan.limits.max_requests if size is None else size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        fail(
            "size",
            size,
            "the batch size must be an int >= 1",
            "pass size=None (max_requests) or a positive int",
            exc=TypeError if not isinstance(size, int) else ValueError,
        )
    if n > size:
        fail(
            "rows",
            n,
            f"a batch of size {size} holds at most {size} rows",
            "split the rows over several calls or pass a larger size",
        )
    return size


def _int(what: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer):
        fail(what, v, "it must be an int", f"pass {what} as a Python int", exc=TypeError)
    v = int(v)
    if not _INT32_MIN <= v <= _INT32_MAX:
        fail(what, v, "it must fit int32", f"pass {what} within [-2**31, 2**31)")
    return v


def _handle(what: str, h: object) -> Handle:
    if not isinstance(h, tuple) or len(h) != 2:
        fail(
            what,
            h,
            "a handle is a (slot, generation) tuple",
            "pass the handle returned by admit",
            exc=TypeError,
        )
    return _int(f"{what}.slot", h[0]), _int(f"{what}.generation", h[1])


def _columns(
    plan: CachePlan, rows: Sequence, size: int | None, n_cols: int
) -> tuple[jax.Array, list[jax.Array]]:
    if not isinstance(rows, Sequence) or isinstance(rows, str):
        fail(
            "rows",
            type(rows).__name__,
            "rows must be a list or tuple",
            "pass a list of tuples",
            exc=TypeError,
        )
    size = _size(plan, len(rows), size)
    valid = np.zeros((size,), np.bool_)
    valid[: len(rows)] = True
    cols = [np.zeros((size,), np.int32) for _ in range(n_cols)]
    return jnp.asarray(valid), cols


def _check_row_lengths(tokens: Sequence, need: Sequence[int], rule: str, fix: str) -> None:
    """Each ``tokens[i]`` is a sequence of at least ``need[i]`` token ids, else raises
    (``rule`` and ``fix`` are formatted with ``n = need[i]`` and ``i``)."""
    for i, (row, n) in enumerate(zip(tokens, need, strict=True)):
        if not isinstance(row, Sequence) or len(row) < n:
            fail(
                f"tokens[{i}]",
                f"{len(row)} tokens" if isinstance(row, Sequence) else type(row).__name__,
                rule.format(n=n, i=i),
                fix.format(n=n, i=i),
                exc=ValueError if isinstance(row, Sequence) else TypeError,
            )


def _token_rows(
    plan: CachePlan, what: str, tokens: Sequence, n: int, size: int, width: int
) -> jax.Array:
    if not isinstance(tokens, Sequence) or isinstance(tokens, str) or len(tokens) != n:
        fail(
            what,
            type(tokens).__name__ if not isinstance(tokens, Sequence) else f"{len(tokens)} rows",
            f"one token list per row ({n} rows)",
            f"pass {what} as a list of {n} lists of ints",
            exc=TypeError if not isinstance(tokens, Sequence) else ValueError,
        )
    del plan
    out = np.zeros((size, width), np.int32)
    for i, row in enumerate(tokens):
        vals = [_int(f"{what}[{i}][{j}]", t) for j, t in enumerate(row)]
        if len(vals) > width:
            fail(
                f"{what}[{i}]",
                f"{len(vals)} tokens",
                f"at most {width} tokens fit a row",
                "pass fewer tokens",
            )
        out[i, : len(vals)] = vals
    return jnp.asarray(out)


#: The narrowest admission token width :func:`token_width` picks.
MIN_TOKEN_WIDTH = 64


def token_width(plan: CachePlan, longest: int) -> int:
    """The token width of an admission whose longest prompt has ``longest`` tokens.

    The next power of two ``>= longest`` (at least :data:`MIN_TOKEN_WIDTH`), capped at
    ``max_context``: admission hashes and looks up only that many positions per row, so its
    cost follows the prompts present, and a serving loop compiles ``admit`` at most once per
    power of two up to ``max_context``.
    """
    cap = plan.limits.max_context
    w = MIN_TOKEN_WIDTH
    while w < longest:
        w *= 2
    return min(w, cap)


def admit_batch(
    plan: CachePlan,
    rows: Sequence[tuple[int, int]],
    size: int | None = None,
    *,
    tokens: Sequence[Sequence[int]] | None = None,
    namespace: Sequence[int] | None = None,
    width: int | None = None,
) -> AdmitBatch:
    """``rows``: ``(prompt_len, first_chunk)`` per new request.

    ``tokens`` (one list per row, at least ``prompt_len`` long; tokens past ``prompt_len`` are
    dropped) turns prefix reuse on for the batch; ``namespace`` (one int per row, default 0)
    goes with it. The token array is ``int32[size, width]``: by default
    ``token_width(plan, longest prompt)`` (a power of two, at most ``max_context``), or the
    given ``width`` (at least every prompt that fits ``max_context``), e.g. one fixed width
    for a whole serving loop.
    """
    valid, (pl, fc) = _columns(plan, rows, size, 2)
    for i, row in enumerate(rows):
        if not isinstance(row, tuple) or len(row) != 2:
            fail(
                f"rows[{i}]",
                row,
                "an admit row is (prompt_len, first_chunk)",
                "pass a 2-tuple of ints",
                exc=TypeError,
            )
        pl[i], fc[i] = _int(f"rows[{i}].prompt_len", row[0]), _int(f"rows[{i}].first_chunk", row[1])
    if tokens is None:
        if namespace is not None:
            fail(
                "namespace",
                namespace,
                "a namespace only matters with tokens",
                "pass tokens= too, or drop namespace=",
            )
        return AdmitBatch(valid, jnp.asarray(pl), jnp.asarray(fc))
    b = valid.shape[0]
    if not isinstance(tokens, Sequence) or isinstance(tokens, str) or len(tokens) != len(rows):
        _token_rows(plan, "tokens", tokens, len(rows), b, 0)  # raises the shape error
    _check_row_lengths(
        tokens, pl[: len(rows)], "the prompt has prompt_len = {n} tokens", "pass the whole prompt"
    )
    cap = plan.limits.max_context
    fitting = [int(p) for p in pl[: len(rows)] if 1 <= p <= cap]
    if width is None:
        width = token_width(plan, max(fitting, default=1))
    elif isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= cap:
        fail(
            "width",
            width,
            f"the token width is an int in [1, max_context = {cap}]",
            "pass None (a power of two fitting the longest prompt) or a valid int",
            exc=TypeError if not isinstance(width, int) or isinstance(width, bool) else ValueError,
        )
    elif fitting and max(fitting) > width:
        fail(
            "width",
            width,
            f"every prompt must fit the token width (the longest has {max(fitting)} tokens)",
            f"pass width >= {max(fitting)} or None",
        )
    trimmed = [list(row)[: min(max(int(p), 0), width)] for row, p in zip(tokens, pl, strict=False)]
    toks = _token_rows(plan, "tokens", trimmed, len(rows), b, width)
    ns = np.zeros((b,), np.int32)
    if namespace is not None:
        if not isinstance(namespace, Sequence) or len(namespace) != len(rows):
            fail(
                "namespace",
                namespace,
                f"one int per row ({len(rows)} rows)",
                "pass a list of ints",
                exc=TypeError if not isinstance(namespace, Sequence) else ValueError,
            )
        for i, x in enumerate(namespace):
            ns[i] = _int(f"namespace[{i}]", x)
    return AdmitBatch(valid, jnp.asarray(pl), jnp.asarray(fc), toks, jnp.asarray(ns))


def _handle_rows(plan: CachePlan, rows: Sequence, size: int | None, what: str):
    valid, (slot, gen, val) = _columns(plan, rows, size, 3)
    for i, row in enumerate(rows):
        if not isinstance(row, tuple) or len(row) != 2:
            fail(
                f"rows[{i}]",
                row,
                f"a row is (handle, {what})",
                f"pass ((slot, generation), {what})",
                exc=TypeError,
            )
        slot[i], gen[i] = _handle(f"rows[{i}].handle", row[0])
        val[i] = _int(f"rows[{i}].{what}", row[1])
    return valid, jnp.asarray(slot), jnp.asarray(gen), jnp.asarray(val)


def extend_batch(
    plan: CachePlan,
    rows: Sequence[tuple[Handle, int]],
    size: int | None = None,
    *,
    tokens: Sequence[Sequence[int]] | None = None,
) -> ExtendBatch:
    """``rows``: ``(handle, count)`` per running request; ``tokens``: optional, the step's
    token ids per row (its ``count`` tokens; needed for the request to keep publishing)."""
    valid, slot, gen, count = _handle_rows(plan, rows, size, "count")
    if tokens is None:
        return ExtendBatch(valid, slot, gen, count)
    if not isinstance(tokens, Sequence) or isinstance(tokens, str) or len(tokens) != len(rows):
        _token_rows(plan, "tokens", tokens, len(rows), valid.shape[0], 0)  # the shape error
    _check_row_lengths(
        tokens,
        [int(n) for _, n in rows],
        "a row carries its count's tokens (count {n}): a missing token would be published "
        "as a zero",
        "pass the step's {n} token ids for row {i}",
    )
    toks = _token_rows(plan, "tokens", tokens, len(rows), valid.shape[0], plan.limits.max_count)
    return ExtendBatch(valid, slot, gen, count, toks)


def retire_batch(
    plan: CachePlan, rows: Sequence[tuple[Handle, int]], size: int | None = None
) -> RetireBatch:
    """``rows``: ``(handle, accepted)`` per request whose oldest in-flight step completed."""
    return RetireBatch(*_handle_rows(plan, rows, size, "accepted"))


def rewind_batch(
    plan: CachePlan, rows: Sequence[tuple[Handle, int]], size: int | None = None
) -> RewindBatch:
    """``rows``: ``(handle, new_extent)``."""
    return RewindBatch(*_handle_rows(plan, rows, size, "extent"))


def release_batch(
    plan: CachePlan, rows: Sequence[tuple[Handle, ReleaseMode]], size: int | None = None
) -> ReleaseBatch:
    """``rows``: ``(handle, ReleaseMode)``."""
    for i, row in enumerate(rows):
        if isinstance(row, tuple) and len(row) == 2 and not isinstance(row[1], ReleaseMode):
            fail(
                f"rows[{i}].mode",
                row[1],
                "it must be a ReleaseMode",
                "pass ReleaseMode.FINISH, ABORT or RETRACT",
                exc=TypeError,
            )
    return ReleaseBatch(*_handle_rows(plan, rows, size, "mode"))


def handle_batch(
    plan: CachePlan, handles_: Sequence[Handle], size: int | None = None
) -> HandleBatch:
    """``handles_``: request handles (for ``reclaim``)."""
    valid, (slot, gen) = _columns(plan, handles_, size, 2)
    for i, h in enumerate(handles_):
        slot[i], gen[i] = _handle(f"handles[{i}]", h)
    return HandleBatch(valid, jnp.asarray(slot), jnp.asarray(gen))


def statuses(result, n: int | None = None) -> list[Status]:
    """The first ``n`` (default all) statuses of a result, as :class:`Status` values."""
    st = np.asarray(result.status)
    return [Status(int(x)) for x in (st if n is None else st[:n])]


def handles(result, n: int | None = None) -> list[Handle | None]:
    """The handles of an admit result's first ``n`` rows (``None`` where not admitted)."""
    st, slot, gen = (np.asarray(x) for x in (result.status, result.slot, result.generation))
    k = len(st) if n is None else n
    return [(int(slot[i]), int(gen[i])) if st[i] == Status.OK else None for i in range(k)]
