"""Continuous-batching serving engine over the jitted coordinator and a flax model.

- :class:`Engine`, :class:`EngineOptions`: submit / abort / step / run (:mod:`.engine`)
- results: :class:`RequestOutput`, :class:`StepRecord`, :class:`EngineStats`
- the model protocol: :class:`ServedModel` (:mod:`.model`)
- the jitted step: :mod:`.device`
- several data-parallel ranks: ``EngineOptions(devices=N)``; routing: :class:`Router`,
  :class:`RoutingStats` (docs/routing.md)

Contract, scheduling policy and failure modes: docs/serving.md.
"""

from flatkv_jax.serving.engine import (
    Engine,
    EngineOptions,
    EngineStats,
    RequestOutput,
    Router,
    RoutingStats,
    StepRecord,
)
from flatkv_jax.serving.model import ServedModel, check_model

__all__ = [
    "Engine",
    "EngineOptions",
    "EngineStats",
    "RequestOutput",
    "Router",
    "RoutingStats",
    "ServedModel",
    "StepRecord",
    "check_model",
]
