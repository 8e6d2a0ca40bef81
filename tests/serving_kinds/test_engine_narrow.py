"""The engine's decode-only step kind (``split_steps=True``): steps in which no row, and no row
of the step they retire, holds more than a decode row run at ``max_count = 1 + drafts``.

Checked here: the kind runs (and only where it may), it changes no token, it publishes what
the wide kind publishes (accepted drafts included: a continuation hits them), the engine's
operations replay on the radix oracle with every status and hit agreeing, and its compiled
cost does not follow ``chunk_tokens`` while the wide kind's does.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_engine import assert_whole, base, serve, serve_continuation, serve_echo, setup, workload

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.demo import replay_ops
from flatkv_jax.model import DeepSeekV4, init_params, tiny_model
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from flatkv_jax.serving import Engine, EngineOptions


@functools.cache
def echo_engine():
    """Overlap, prefix cache, MTP, split step kinds, on the model whose drafts are mostly
    right (accepted and rejected drafts, rewinds, all in narrow steps too)."""
    return serve_echo(EngineOptions(record_ops=True))


def test_narrow_steps_run_and_keep_every_token():
    engine, _ = echo_engine()
    st = engine.stats
    assert 0 < st.narrow_steps < st.steps
    assert 0 < st.draft_accepted < st.draft_proposed
    # (Kinds compiled by an earlier engine of this module are shared: no exact count here.)
    assert st.compilations_after_warmup == 0
    assert_whole(engine)


def test_narrow_steps_publish_accepted_drafts():
    """A request decoded mostly in narrow steps publishes its generated blocks: a prompt that
    continues it hits them."""
    engine, _ = echo_engine()
    before = engine.stats.narrow_steps
    serve_continuation(engine, np.random.default_rng(12))
    assert engine.stats.narrow_steps - before >= 5
    assert_whole(engine)


def test_narrow_steps_replay_on_the_oracle():
    """Every operation of the runs above (narrow and wide steps) replays on the radix oracle
    with the same statuses and hits."""
    engine, _ = echo_engine()
    _, plan, _ = setup()
    seqs = {rid: tuple(o.prompt) + tuple(o.tokens) for rid, o in engine.outputs.items()}
    res = replay_ops(plan, engine.op_log, seqs, prefix_reuse=True)
    assert res.agrees, res.mismatches + res.violations
    assert res.admissions == len(engine.outputs)


def test_the_main_workload_is_unchanged_by_narrow_steps():
    """The preempting workload of test_engine.py, with prefix cache, MTP and overlap on and
    split step kinds: the baseline's tokens."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions())
    got = serve(engine, workload())
    assert got == base()[1]
    assert engine.stats.narrow_steps > 0 and engine.stats.retractions > 0
    assert_whole(engine)


def _plan(cfg, chunk: int):
    lim = ServingLimits(
        max_requests=4, max_context=64, chunk_tokens=chunk, verify_width=2, step_tokens=64
    )
    return plan_with_pages(deepseek_v4_groups(cfg.cache, verify_width=2), lim, 24)


def test_narrow_kind_cost_does_not_follow_chunk_tokens():
    """Two plans that differ only in ``chunk_tokens`` (12 and 48): the compiled narrow step
    costs the same FLOPs in both, where the wide (no-admission) step costs more at 48."""
    cfg = tiny_model()
    model = DeepSeekV4.from_params(cfg, init_params(cfg, 0))
    flops = {}
    for chunk in (12, 48):
        engine = Engine(model, _plan(cfg, chunk), EngineOptions(overlap=False))
        for narrow in (False, True):
            flops[chunk, narrow] = engine.compiled_step(False, narrow=narrow).cost_analysis()[
                "flops"
            ]
    assert flops[12, True] == flops[48, True], flops
    assert flops[48, False] > flops[12, False] > flops[12, True], flops


def test_no_narrow_admitting_kind():
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(overlap=False))
    with pytest.raises(ValueError, match=r"narrow=True is invalid.*pass admit=False"):
        engine.compiled_step(True, narrow=True)
