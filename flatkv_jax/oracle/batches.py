"""Batch-shaped inputs and outputs of the oracle (and of any backend the harness drives).

Every batch is a set of ``[B]`` NumPy arrays with a validity mask, mirroring the device
coordinator's batches; rows with ``valid == False`` report ``Status.IDLE``. A handle is
``(slot, generation)`` as returned by ``admit``. Builders (:func:`admit_batch` and friends)
turn Python rows into padded arrays and reject malformed input with ``ValueError`` /
``TypeError`` (outside jit); values that are well-formed but break a rule of the contract
(``accepted > count``, a stale handle, ...) are *not* rejected here: they are statuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# The release modes are the coordinator's own (one enum, the same codes on both sides).
from flatkv_jax.coordinator.batches import ReleaseMode as ReleaseMode
from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan, check_plan

_I32 = np.int32
_TOKEN_MAX = 2**31 - 1


class Handle(NamedTuple):
    """A request handle: its slot and the slot's generation when it was admitted."""

    slot: int
    generation: int


@dataclasses.dataclass(frozen=True)
class OracleAdmitBatch:
    """New requests.

    Attributes:
      valid: ``bool[B]``.
      namespace: ``int32[B]``; requests in different namespaces never share a block.
      tokens: ``int32[B, max_context]``, the prompt, zero-padded.
      prompt_len: ``int32[B]``, prompt tokens (1 .. max_context).
      first_chunk: ``int32[B]``, tokens the admit schedules as its first step, clipped to
        ``prompt_len - hit`` (0 schedules nothing).
    """

    valid: np.ndarray
    namespace: np.ndarray
    tokens: np.ndarray
    prompt_len: np.ndarray
    first_chunk: np.ndarray


@dataclasses.dataclass(frozen=True)
class OracleExtendBatch:
    """Next-step tokens of running requests.

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``, the handle.
      count: ``int32[B]``, new tokens.
      tokens: ``int32[B, step_tokens]``, the tokens at positions ``[n, n + count)`` (the
        prefix keys of the blocks they complete), zero-padded.
    """

    valid: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    count: np.ndarray
    tokens: np.ndarray


@dataclasses.dataclass(frozen=True)
class OracleHandleBatch:
    """Handles plus one int argument per row.

    ``arg`` is ``accepted`` for ``retire``, the new extent for ``rewind``, a
    :class:`ReleaseMode` for ``release`` and unused (0) for ``reclaim``.

    Attributes:
      valid: ``bool[B]``.
      slot, generation: ``int32[B]``.
      arg: ``int32[B]``.
    """

    valid: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    arg: np.ndarray


@dataclasses.dataclass(frozen=True)
class OpResult:
    """Per-row outcome of one batched operation.

    Attributes:
      status: ``int32[B]`` of :class:`flatkv_jax.status.Status`.
      slot, generation: ``int32[B]``, admit: the handle claimed (-1 where not served);
        other ops: -1.
      hit: ``int32[B]``, admit: prefix-hit tokens; 0 elsewhere.
      count: ``int32[B]``, admit/extend: tokens the row's new step writes (0 if none).
      short_group: ``int32[B]``, on the first ``OUT_OF_PAGES`` row of admit/extend the first
        short pool (plan order), -1 elsewhere.
      short_pages: ``int32[B]``, pages missing in that pool; 0 elsewhere.
    """

    status: np.ndarray
    slot: np.ndarray
    generation: np.ndarray
    hit: np.ndarray
    count: np.ndarray
    short_group: np.ndarray
    short_pages: np.ndarray


@dataclasses.dataclass(frozen=True)
class Counts:
    """Page and request counters a backend exposes after every operation.

    Attributes:
      free, in_use, cached_only: ``int64[G]`` per pool; they sum to the usable pages.
      live: ``bool[R]``, the slot holds a request.
      generation: ``int64[R]``.
      extent, committed: ``int64[R]`` (``n`` and ``c``; 0 for free slots).
      in_flight: ``int64[R]``, steps extended and not yet retired.
      pending: ``int64[R]``, 0 or ``1 + ReleaseMode`` of a deferred release.
    """

    free: np.ndarray
    in_use: np.ndarray
    cached_only: np.ndarray
    live: np.ndarray
    generation: np.ndarray
    extent: np.ndarray
    committed: np.ndarray
    in_flight: np.ndarray
    pending: np.ndarray


@dataclasses.dataclass(frozen=True)
class LogicalView:
    """What every request slot maps to, read through the backend's own tables.

    Attributes:
      tables: per group, ``int32[R, width_g]`` (-1 unallocated, 0 hole, >= 1 page id). Page
        ids are backend-private; compare them only up to relabelling.
      rows: per group, per field, per layer: ``[R, width_g * rows_per_page, *row_shape]``, the
        row that absolute row index ``j`` of slot ``s`` reads (page ``tables[s, j // rpp]``,
        row ``j % rpp``; the null page for holes and unallocated entries).
    """

    tables: tuple[np.ndarray, ...]
    rows: tuple[tuple[tuple[np.ndarray, ...], ...], ...]


def _batch_size(plan: CachePlan, rows: Sequence, size: int | None) -> int:
    if not isinstance(rows, Sequence) or isinstance(rows, str | bytes):
        fail(
            "rows",
            type(rows).__name__,
            "rows must be a sequence (one entry per batch row, None = masked)",
            "pass a list",
            exc=TypeError,
        )
    b = plan.limits.max_requests if size is None else size
    if not isinstance(b, int) or isinstance(b, bool) or b < 1:
        fail(
            "size",
            size,
            "the batch size must be a positive int",
            "pass size >= 1 or leave it None (max_requests)",
        )
    if len(rows) > b:
        fail(
            "rows",
            len(rows),
            f"at most {b} rows fit a batch of size {b}",
            "split the rows over several calls or raise size",
        )
    return b


def _tokens(what: str, tokens: object, width: int) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        fail(
            what,
            tokens if arr.size < 8 else f"array{arr.shape}",
            "tokens must be a 1-D sequence of ints",
            "pass a list of token ids",
            exc=TypeError,
        )
    if arr.size > width:
        fail(
            what,
            f"{arr.size} tokens",
            f"at most {width} tokens fit this batch",
            "shorten the row or split it into chunks",
        )
    if arr.size and (arr.min() < 0 or arr.max() > _TOKEN_MAX):
        fail(
            what,
            (int(arr.min()), int(arr.max())),
            "token ids must lie in [0, 2**31 - 1]",
            "map the token ids into int32",
        )
    return arr.astype(_I32)


def _int(what: str, value: object) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        fail(what, value, "it must be an int", f"pass {what} as an int", exc=TypeError)
    if not -(2**31) <= int(value) < 2**31:
        fail(what, value, "it must fit int32", f"pass a smaller {what}")
    return int(value)


def _handle(what: str, h: object) -> tuple[int, int]:
    if not isinstance(h, tuple) or len(h) != 2:
        fail(
            what,
            h,
            "a handle is a (slot, generation) pair",
            "pass the Handle admit returned",
            exc=TypeError,
        )
    return _int(f"{what}.slot", h[0]), _int(f"{what}.generation", h[1])


def admit_batch(
    plan: CachePlan,
    rows: Sequence[tuple[int, Sequence[int], int] | None],
    *,
    size: int | None = None,
) -> OracleAdmitBatch:
    """Builds an :class:`OracleAdmitBatch`.

    Args:
      plan: the cache plan (sizes the token axis: ``max_context``).
      rows: per batch row ``(namespace, prompt_tokens, first_chunk)`` or ``None`` (masked).
      size: batch size (default ``max_requests``); rows beyond ``len(rows)`` are masked.
    """
    plan = check_plan(plan)
    b = _batch_size(plan, rows, size)
    width = plan.limits.max_context
    out = OracleAdmitBatch(
        valid=np.zeros(b, bool),
        namespace=np.zeros(b, _I32),
        tokens=np.zeros((b, width), _I32),
        prompt_len=np.zeros(b, _I32),
        first_chunk=np.zeros(b, _I32),
    )
    for i, row in enumerate(rows):
        if row is None:
            continue
        if not isinstance(row, tuple) or len(row) != 3:
            fail(
                f"rows[{i}]",
                row,
                "an admit row is (namespace, prompt_tokens, first_chunk)",
                "pass a 3-tuple or None",
                exc=TypeError,
            )
        ns, toks, chunk = row
        toks = _tokens(f"rows[{i}].tokens", toks, width)
        out.valid[i] = True
        out.namespace[i] = _int(f"rows[{i}].namespace", ns)
        out.tokens[i, : toks.size] = toks
        out.prompt_len[i] = toks.size
        out.first_chunk[i] = _int(f"rows[{i}].first_chunk", chunk)
    return out


def extend_batch(
    plan: CachePlan,
    rows: Sequence[tuple[tuple[int, int], Sequence[int]] | None],
    *,
    size: int | None = None,
) -> OracleExtendBatch:
    """Builds an :class:`OracleExtendBatch`.

    Args:
      plan: the cache plan (sizes the token axis: ``limits.step_tokens``).
      rows: per batch row ``(handle, tokens)`` (``count = len(tokens)``) or ``None``.
      size: batch size (default ``max_requests``).
    """
    plan = check_plan(plan)
    b = _batch_size(plan, rows, size)
    width = plan.limits.step_tokens
    out = OracleExtendBatch(
        valid=np.zeros(b, bool),
        slot=np.zeros(b, _I32),
        generation=np.zeros(b, _I32),
        count=np.zeros(b, _I32),
        tokens=np.zeros((b, width), _I32),
    )
    for i, row in enumerate(rows):
        if row is None:
            continue
        if not isinstance(row, tuple) or len(row) != 2:
            fail(
                f"rows[{i}]",
                row,
                "an extend row is (handle, tokens)",
                "pass a 2-tuple or None",
                exc=TypeError,
            )
        slot, gen = _handle(f"rows[{i}].handle", row[0])
        toks = _tokens(f"rows[{i}].tokens", row[1], width)
        out.valid[i] = True
        out.slot[i], out.generation[i], out.count[i] = slot, gen, toks.size
        out.tokens[i, : toks.size] = toks
    return out


def handle_batch(
    plan: CachePlan,
    rows: Sequence[tuple[tuple[int, int], int] | tuple[int, int] | None],
    *,
    size: int | None = None,
) -> OracleHandleBatch:
    """Builds a :class:`OracleHandleBatch` for ``retire``, ``rewind``, ``release`` or ``reclaim``.

    Args:
      plan: the cache plan.
      rows: per batch row ``(handle, arg)`` — ``arg`` is ``accepted`` (retire), the new extent
        (rewind) or a :class:`ReleaseMode` (release) — or a bare handle (reclaim), or ``None``.
      size: batch size (default ``max_requests``).
    """
    plan = check_plan(plan)
    b = _batch_size(plan, rows, size)
    out = OracleHandleBatch(
        valid=np.zeros(b, bool),
        slot=np.zeros(b, _I32),
        generation=np.zeros(b, _I32),
        arg=np.zeros(b, _I32),
    )
    for i, row in enumerate(rows):
        if row is None:
            continue
        if isinstance(row, tuple) and len(row) == 2 and isinstance(row[0], tuple):
            handle, arg = row
        else:
            handle, arg = row, 0
        slot, gen = _handle(f"rows[{i}].handle", handle)
        out.valid[i] = True
        out.slot[i], out.generation[i], out.arg[i] = slot, gen, _int(f"rows[{i}].arg", arg)
    return out


def empty_result(size: int) -> OpResult:
    """An all-``IDLE`` result of ``size`` rows (the starting point of every operation)."""
    from flatkv_jax.status import Status

    return OpResult(
        status=np.full(size, int(Status.IDLE), _I32),
        slot=np.full(size, -1, _I32),
        generation=np.full(size, -1, _I32),
        hit=np.zeros(size, _I32),
        count=np.zeros(size, _I32),
        short_group=np.full(size, -1, _I32),
        short_pages=np.zeros(size, _I32),
    )
