"""Status codes returned (as int32 arrays) by every coordinator operation.

Failure is a value: inside jit an operation that cannot be done returns one of these and
leaves the state unchanged. The host oracle returns the same codes.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """Per-request outcome of a batched operation (see docs/semantics.md)."""

    OK = 0
    #: The batch row was masked off; nothing was done for it.
    IDLE = 1
    #: The handle's generation does not match the slot, or the slot is not live.
    STALE = 2
    #: admit found no free request slot.
    NO_SLOT = 3
    #: Some pool is short of pages; nothing changed (see the result's short_group/short_pages).
    OUT_OF_PAGES = 4
    #: The extent would pass max_context + verify_width.
    TOO_LONG = 5
    #: The request's in-flight step FIFO is full.
    FIFO_FULL = 6
    #: retire found no in-flight step.
    NO_STEP = 7
    #: An argument is out of range (e.g. accepted > written, count > chunk_tokens).
    BAD_ARG = 8
    #: release was recorded and waits for the request's in-flight steps to retire.
    DEFERRED = 9
    #: A retired step started past the committed length (an earlier step was partly
    #: rejected); its tokens were dropped.
    DISCARDED = 10
    #: admit/extend: the row's tokens would pass the step's flat token axis
    #: (``limits.step_tokens``, counting the tokens already scheduled by the calls passed as
    #: ``same_step`` and by earlier rows of this call); nothing changed. FIFO rule as for
    #: ``OUT_OF_PAGES``: every later row that asks for tokens fails too (docs/coordinator.md).
    STEP_FULL = 11
