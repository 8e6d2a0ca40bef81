"""Split step kinds on two data-parallel ranks (the plan and workload of
tests/serving/test_engine_sharded.py)."""

from __future__ import annotations

from test_engine_sharded import OPTS, serve, setup, single, tokens

from flatkv_jax.coordinator.audit import check_state
from flatkv_jax.serving import Engine, EngineOptions


def test_split_step_kinds_on_two_ranks():
    """With split step kinds the ranks run decode-only (narrow) steps together when no rank
    schedules or retires more than a decode row; the tokens are the single-device engine's."""
    plan, model = setup()
    opts = {**OPTS, "split_steps": True}
    engine = Engine(model, plan, EngineOptions(devices=2, **opts))
    serve(engine)
    assert tokens(engine) == tokens(single())
    assert 0 < engine.stats.narrow_steps < engine.stats.steps
    assert engine.stats.compilations_after_warmup == 0
    for r in range(engine.ranks):
        check_state(plan, engine.rank_state(r), shared_ok=True)
