"""``EngineOptions.prefill_rows``: a step with prefill work extends and retires its decode
lanes at a decode row's width and at most ``prefill_rows`` prefill lanes at ``chunk_tokens``
(default ``min(max_requests, 16)``), so a mixed step's cost follows what it holds, not
``max_requests x chunk_tokens``."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_engine import assert_whole, base, serve, serve_continuation, serve_echo, setup, workload

from flatkv_jax import ServingLimits
from flatkv_jax.demo import replay_ops
from flatkv_jax.serving import Engine, EngineOptions


def split_steps(engine: Engine) -> tuple[int, int]:
    """(extend calls directly after an extend, retire calls followed by another retire within
    two operations): the steps whose rows went into two calls."""
    names = [name for name, _ in engine.op_log]
    ext = sum(a == b == "extend" for a, b in itertools.pairwise(names))
    ret = sum(
        names[i] == "retire" and "retire" in names[i + 1 : i + 3] for i in range(len(names) - 1)
    )
    return ext, ret


def test_one_prefill_row_splits_mixed_steps_and_keeps_everything():
    """The preempting workload with one prefill row and one admission row a step (prefix
    cache, MTP, overlap): steps whose decode and prefill rows go into two calls run, the
    baseline's tokens, and the operations (two extend / retire calls in those steps) replay on
    the radix oracle with every status and hit agreeing."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(prefill_rows=1, admit_rows=1, record_ops=True))
    assert engine.prefill_rows == 1
    got = serve(engine, workload())
    assert got == base()[1]
    ext, ret = split_steps(engine)
    assert ext > 0 and ret > 0, (ext, ret)
    assert engine.stats.retractions > 0 and engine.stats.narrow_steps > 0
    seqs = {rid: tuple(o.prompt) + tuple(o.tokens) for rid, o in engine.outputs.items()}
    res = replay_ops(plan, engine.op_log, seqs, prefix_reuse=True)
    assert res.agrees, res.mismatches + res.violations
    assert_whole(engine)


def test_without_the_split_every_step_is_one_call():
    """The control for ``split_steps``: with ``prefill_rows = max_requests`` (the default on
    this 4-lane plan) no step makes two extend or two retire calls."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(admit_rows=1, record_ops=True))
    assert engine.prefill_rows == plan.limits.max_requests
    assert serve(engine, workload()) == base()[1]
    assert split_steps(engine) == (0, 0)


def test_split_steps_publish_accepted_drafts():
    """On the draft-accepting model with one prefill row: every token follows its rule, and a
    continuation hits the blocks generated across split and narrow steps."""
    engine, rng = serve_echo(EngineOptions(prefill_rows=1, admit_rows=1, record_ops=True))
    assert split_steps(engine) != (0, 0)
    assert 0 < engine.stats.draft_accepted < engine.stats.draft_proposed
    serve_continuation(engine, rng)
    assert_whole(engine)


def test_a_scheduler_over_prefill_rows_is_caught():
    """The step checks the host's bound: more prefill rows than the compiled step holds raise
    RuntimeError naming it (here the host's own bound is lifted on purpose)."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(prefill_rows=1, admit_rows=1))
    engine.prefill_rows = 4  # the host no longer holds back prefill rows: a scheduler bug
    rng = np.random.default_rng(2)
    for _ in range(3):  # long prompts: two of them prefill in one step (12 + 4 tokens)
        engine.submit(rng.integers(0, 64, 40).tolist(), 5)
    with pytest.raises(
        RuntimeError, match=r"step \d+ scheduled more prefill rows than its compiled prefill_rows"
    ):
        engine.run()


def test_mixed_step_cost_follows_prefill_rows_not_lanes():
    """Bytes the non-admitting wide kind's compiled program accesses (XLA's cost analysis) on
    a 16-lane plan of 128-token chunks: fewer with 1 prefill row than with 8, and fewer with 8
    than unsplit (every lane at ``chunk_tokens``). Its FLOPs say nothing here: the tiny model's
    forward over the step's token layout dominates them, the same in every variant."""
    _, plan, model = setup(
        ServingLimits(
            max_requests=16, max_context=256, chunk_tokens=128, verify_width=2, step_tokens=128
        ),
        512,
    )
    accessed = {}
    for rows in (1, 8, 16):
        engine = Engine(model, plan, EngineOptions(overlap=False, admit_rows=1, prefill_rows=rows))
        accessed[rows] = engine.compiled_step(False).cost_analysis()["bytes accessed"]
    assert accessed[1] < accessed[8] < accessed[16], accessed
