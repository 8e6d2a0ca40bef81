"""The model protocol the engine drives: what a served flax model provides.

A served model is a ``flax.nnx.Module`` with a ``cfg`` (:class:`flatkv_jax.model.ModelConfig`:
``hidden``, ``vocab``, ``has_mtp`` and ``cache``, the recipe its plan was built from) and the
three methods of :class:`ServedModel`. :class:`flatkv_jax.model.DeepSeekV4` is one; a user's
own model plugs in by implementing the same methods. The engine splits it once
(``nnx.split``) and merges it inside its jitted step (``nnx.merge``), so the methods must be
traceable and must not mutate the module.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from flax import nnx

from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan


@runtime_checkable
class ServedModel(Protocol):
    """What the engine calls (see docs/model.md for the meaning of every argument).

    - ``step(pools, batch: StepBatch, meta: StepMetadata, table_buffer, *, plan,
      max_count=None, impl=...) -> (StepOutput, Pools)``: the target step over the
      metadata's flat tokens (the engine samples ``argmax(logits)``); the MTP layer, if any,
      runs over the same tokens.
    - ``propose(pools, batch: DraftBatch, meta, table_buffer, *, plan, num_draft=None,
      max_count=None, impl=...) -> (DraftOutput, Pools)``: greedy drafts into each active
      row's verify block (only called with MTP on).
    - ``dense(tokens int32[T]) -> (logits, hidden, draft_logits | None)``: cache-free
      recompute (parity checks).
    """

    cfg: object

    def step(self, pools, batch, meta, table_buffer, *, plan, max_count=None, impl=...): ...

    def propose(
        self, pools, batch, meta, table_buffer, *, plan, num_draft=None, max_count=None,
        impl=...,
    ): ...  # fmt: skip

    def dense(self, tokens): ...


def check_model(model: object, plan: CachePlan) -> None:
    """Raises ``TypeError`` / ``ValueError`` unless ``model`` can serve ``plan``."""
    if not isinstance(model, nnx.Module):
        fail(
            "model",
            type(model).__name__,
            "the engine serves a flax.nnx.Module",
            "pass e.g. flatkv_jax.model.DeepSeekV4(tiny_model(), rngs=nnx.Rngs(0))",
            exc=TypeError,
        )
    for name in ("cfg", "step", "propose", "dense"):
        if not hasattr(model, name):
            fail(
                "model",
                type(model).__name__,
                f"a served model needs `{name}` (flatkv_jax.serving.model.ServedModel)",
                f"implement {name} as DeepSeekV4 does",
                exc=TypeError,
            )
    from flatkv_jax.model.cache_io import check_plan as check_model_plan

    check_model_plan(model.cfg, plan)
