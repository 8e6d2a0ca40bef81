"""Split step kinds on two data-parallel ranks (the plan and workload of
tests/serving/test_engine_sharded.py)."""

from __future__ import annotations

import numpy as np
from test_engine_sharded import OPTS, serve, setup, single, tokens

from flatkv_jax.coordinator.audit import check_state
from flatkv_jax.serving import Engine, EngineOptions


def test_split_step_kinds_on_two_ranks():
    """With split step kinds the ranks run decode-only (narrow) steps together when no rank
    schedules or retires more than a decode row, and admit into the smallest of two widths
    that holds every rank's prompts; the tokens are the single-device engine's."""
    plan, model = setup()
    opts = {**OPTS, "split_steps": True, "admit_widths": (36,)}
    engine = Engine(model, plan, EngineOptions(devices=2, **opts))
    serve(engine)
    assert tokens(engine) == tokens(single())
    assert 0 < engine.stats.narrow_steps < engine.stats.steps
    assert engine.stats.compilations_after_warmup == 0
    # Prompts of 34-38 tokens (and shorter): some steps fit 36 columns, some need 64 (a
    # width too small for any rank's prompt would refuse it, and the tokens would differ).
    assert set(engine.stats.admit_width_steps) == {36, plan.limits.max_context}
    for r in range(engine.ranks):
        check_state(plan, engine.rank_state(r), shared_ok=True)


def test_ranks_admit_at_the_width_of_the_longest_prompt():
    """Rank 0 admits a prompt of 10 tokens and rank 1 one of 50 in the same step: the step
    admits at max_context (64), the smallest width that holds rank 1's prompt too; a width
    taken from rank 0 alone (16) would refuse rank 1's row, which the engine raises."""
    plan, model = setup()
    opts = {**OPTS, "split_steps": True, "admit_widths": (16,), "routing": "least_loaded"}
    engine = Engine(model, plan, EngineOptions(devices=2, **opts))
    rng = np.random.default_rng(5)
    ids = [engine.submit(rng.integers(1, 64, n).tolist(), 3) for n in (10, 50)]
    out = engine.run()
    assert [len(out[i].tokens) for i in ids] == [3, 3]
    assert engine.stats.admit_width_steps == {plan.limits.max_context: 1}
