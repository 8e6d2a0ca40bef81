"""The radix oracle: a host reference implementation of the coordinator contract.

- :class:`RadixOracle` — docs/semantics.md in plain Python/NumPy (token trie, free lists,
  LRU list, compact tables, contents written through its own tables).
- batches — :func:`admit_batch`, :func:`extend_batch`, :func:`handle_batch`, results, counts.
- :class:`Backend` — the adapter protocol the harness drives.
- traces — :func:`random_trace` (seeded agentic traces), :class:`TraceConfig`.
- differential — :func:`run_trace` (compare backends after every op).

See docs/oracle.md.
"""

from flatkv_jax.oracle.backend import Backend
from flatkv_jax.oracle.batches import (
    Counts,
    Handle,
    LogicalView,
    OpResult,
    OracleAdmitBatch,
    OracleExtendBatch,
    OracleHandleBatch,
    ReleaseMode,
    admit_batch,
    extend_batch,
    handle_batch,
)
from flatkv_jax.oracle.differential import Divergence, RunReport, canonical_tables, run_trace
from flatkv_jax.oracle.oracle import RadixOracle
from flatkv_jax.oracle.traces import Op, OpKind, Trace, TraceConfig, random_trace

__all__ = [
    "Backend",
    "Counts",
    "Divergence",
    "Handle",
    "LogicalView",
    "Op",
    "OpKind",
    "OpResult",
    "OracleAdmitBatch",
    "OracleExtendBatch",
    "OracleHandleBatch",
    "RadixOracle",
    "ReleaseMode",
    "RunReport",
    "Trace",
    "TraceConfig",
    "admit_batch",
    "canonical_tables",
    "extend_batch",
    "handle_batch",
    "random_trace",
    "run_trace",
]
