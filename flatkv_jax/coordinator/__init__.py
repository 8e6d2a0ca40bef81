"""The coordinator: the request lifecycle as pure, jitted functions over a pytree cache state.

- state: :class:`CacheState`, :func:`create_state`, :class:`StateLayout` (:mod:`.state`)
- inputs: :class:`AdmitBatch`, :class:`ExtendBatch`, :class:`RetireBatch`,
  :class:`RewindBatch`, :class:`HandleBatch`, :class:`ReleaseBatch`, :class:`ReleaseMode`
  (:mod:`.batches`)
- operations: ``admit``, ``extend``, ``retire``, ``rewind``, ``reclaim``, ``release`` (jitted,
  state donated) and their plain ``*_fn`` forms for composing inside your own jit; also
  ``retire_reclaim`` (a decode step's retire and reclaim in one sweep) (:mod:`.ops`)
- results: :class:`StepResult`, :class:`RetireResult`, :class:`ReclaimResult`,
  :class:`RetireReclaimResult`, :class:`StatusResult` (:mod:`.results`)
- step metadata: :class:`StepMetadata`, ``step_metadata`` / :func:`step_metadata_fn`
  (:mod:`.metadata`)
- host helpers: :mod:`.host` (batch builders); audit: :mod:`.audit` (page counts, invariants)
- sleep / wake: :func:`sleep`, :func:`wake`, :class:`SleepMode`, :class:`Sleeping`,
  :class:`Woken`, ``repair`` / :func:`repair_fn` (:mod:`.sleep`; docs/sleep.md)

Contract: docs/semantics.md; API and decisions: docs/coordinator.md.
"""

from flatkv_jax.coordinator.batches import (
    AdmitBatch,
    ExtendBatch,
    HandleBatch,
    ReleaseBatch,
    ReleaseMode,
    RetireBatch,
    RewindBatch,
)
from flatkv_jax.coordinator.metadata import (
    StepMetadata,
    step_metadata,
    step_metadata_fn,
    window_columns,
)
from flatkv_jax.coordinator.ops import (
    admit,
    admit_fn,
    extend,
    extend_fn,
    reclaim,
    reclaim_fn,
    release,
    release_fn,
    retire,
    retire_fn,
    retire_reclaim,
    retire_reclaim_fn,
    rewind,
    rewind_fn,
)
from flatkv_jax.coordinator.results import (
    ReclaimResult,
    RetireReclaimResult,
    RetireResult,
    StatusResult,
    StepResult,
)
from flatkv_jax.coordinator.sleep import (
    Sleeping,
    SleepMode,
    Woken,
    repair,
    repair_fn,
    sleep,
    wake,
)
from flatkv_jax.coordinator.state import CacheState, PoolView, StateLayout, create_state

__all__ = [
    "AdmitBatch",
    "CacheState",
    "ExtendBatch",
    "HandleBatch",
    "PoolView",
    "ReclaimResult",
    "ReleaseBatch",
    "ReleaseMode",
    "RetireBatch",
    "RetireReclaimResult",
    "RetireResult",
    "RewindBatch",
    "SleepMode",
    "Sleeping",
    "StateLayout",
    "StatusResult",
    "StepMetadata",
    "StepResult",
    "Woken",
    "admit",
    "admit_fn",
    "create_state",
    "extend",
    "extend_fn",
    "reclaim",
    "reclaim_fn",
    "release",
    "release_fn",
    "repair",
    "repair_fn",
    "retire",
    "retire_fn",
    "retire_reclaim",
    "retire_reclaim_fn",
    "rewind",
    "rewind_fn",
    "sleep",
    "step_metadata",
    "step_metadata_fn",
    "wake",
    "window_columns",
]
