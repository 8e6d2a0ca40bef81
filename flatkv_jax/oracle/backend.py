"""The small adapter protocol the differential harness drives.

A backend is anything that implements the coordinator contract (docs/semantics.md) behind
these batch-shaped methods: the oracle itself (:class:`~flatkv_jax.oracle.oracle.RadixOracle`)
and the device coordinator through :mod:`flatkv_jax.oracle.device_adapter`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from flatkv_jax.oracle.batches import (
    Counts,
    LogicalView,
    OpResult,
    OracleAdmitBatch,
    OracleExtendBatch,
    OracleHandleBatch,
)
from flatkv_jax.plan import CachePlan


@runtime_checkable
class Backend(Protocol):
    """One implementation of the coordinator contract, driven from the host.

    Every operation takes a whole batch (``B`` rows, masked rows report ``IDLE``) and returns an
    :class:`OpResult` as NumPy arrays.
    """

    plan: CachePlan

    def reset(self) -> None:
        """Back to the empty state (every page free, slots free, generations 0, index empty)."""

    def admit(self, batch: OracleAdmitBatch) -> OpResult: ...

    def extend(self, batch: OracleExtendBatch) -> OpResult: ...

    def retire(self, batch: OracleHandleBatch) -> OpResult:
        """``batch.arg`` = accepted tokens of the oldest in-flight step."""

    def rewind(self, batch: OracleHandleBatch) -> OpResult:
        """``batch.arg`` = the new extent."""

    def reclaim(self, batch: OracleHandleBatch) -> OpResult: ...

    def release(self, batch: OracleHandleBatch) -> OpResult:
        """``batch.arg`` = a :class:`~flatkv_jax.oracle.batches.ReleaseMode`."""

    def counts(self) -> Counts: ...

    def view(self) -> LogicalView: ...

    def write(self, group: int, slots: np.ndarray, rows: np.ndarray, values) -> None:
        """Writes ``values[field][layer][k]`` into absolute row ``rows[k]`` of request slot
        ``slots[k]`` of group ``group``, through the backend's own tables."""
