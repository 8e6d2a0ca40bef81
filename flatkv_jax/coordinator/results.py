"""Results of the coordinator operations: per-row statuses plus what changed.

Every field is an array; ``status`` is ``int32[B]`` of :class:`flatkv_jax.status.Status`
codes. A row whose status is not ``OK`` (or ``DEFERRED``/``DISCARDED`` where noted) changed
nothing.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """Result of ``admit`` and ``extend``: the step each served row schedules.

    ``admit`` and ``extend`` results both feed :func:`~flatkv_jax.coordinator.step_metadata`.

    Attributes:
      status: ``int32[B]``.
      slot, generation: ``int32[B]``, the request's handle (admit: the slot it claimed;
        -1 where not served).
      start: ``int32[B]``, first position the step writes (the old extent; for admit the
        prefix hit ``h``); -1 where not served.
      count: ``int32[B]``, tokens the step writes (0 where not served).
      hit: ``int32[B]``, prefix-hit tokens (admit; 0 until the prefix index exists).
      short_group: ``int32[B]``, on the first ``OUT_OF_PAGES`` row, the first short pool (plan
        order); -1 elsewhere.
      short_pages: ``int32[B]``, pages missing in that pool; 0 elsewhere.
      zero: ``int32[G, B * K]`` (``K = ceil(max_count / smallest block_tokens)``): per group,
        every page handed out by this call, padded with -1. The step must zero these pages in
        every pool array of the group (target and draft pools alike) before any kernel reads
        them.
      step_index: static: the call's place in its step, ``len(same_step)`` of the call that
        produced it (0: the step's first call). ``step_metadata`` accepts ``steps`` only in
        this order, so every call of a step was checked against the same token budget.
      max_count: static: the ``max_count`` the call ran with (its rows' ``count`` bound);
        ``step_metadata`` refuses a smaller ``max_count`` (its window spans would cut the
        reads of longer rows short). None where unknown (a result built by hand).
    """

    status: jax.Array
    slot: jax.Array
    generation: jax.Array
    start: jax.Array
    count: jax.Array
    hit: jax.Array
    short_group: jax.Array
    short_pages: jax.Array
    zero: jax.Array
    step_index: int = dataclasses.field(default=0, metadata=dict(static=True))
    max_count: int | None = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetireResult:
    """Result of ``retire``.

    Attributes:
      status: ``int32[B]``: ``OK`` (committed), ``DISCARDED`` (popped, nothing committed), or a
        failure (nothing changed).
      committed: ``int32[B]``, the request's committed length after the call (-1 if not OK or
        DISCARDED).
      extent: ``int32[B]``, its extent after the call (-1 likewise).
      released: ``bool[B]``, this retire emptied the FIFO of a request whose release was
        deferred, and freed it (its handle is now stale).
    """

    status: jax.Array
    committed: jax.Array
    extent: jax.Array
    released: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetireReclaimResult:
    """Result of ``retire_reclaim``: :class:`RetireResult`'s fields plus the reclaim's holes.

    Attributes:
      status, committed, extent, released: as :class:`RetireResult`.
      holes: ``int32[B, G]``, table slots the reclaim turned into holes per group (as
        :class:`ReclaimResult`); 0 on every row it did not reclaim (all but the ``OK`` rows
        that did not release).
    """

    status: jax.Array
    committed: jax.Array
    extent: jax.Array
    released: jax.Array
    holes: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReclaimResult:
    """Result of ``reclaim``.

    Attributes:
      status: ``int32[B]``.
      holes: ``int32[B, G]``, table slots turned into holes per group (0 for history groups).
    """

    status: jax.Array
    holes: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StatusResult:
    """Result of ``rewind`` and ``release`` (``release``: ``OK`` freed now, ``DEFERRED``
    recorded, to be freed by the ``retire`` that empties the FIFO).

    Attributes:
      status: ``int32[B]``.
    """

    status: jax.Array
