"""``EngineOptions.admit_rows``: the admitting step's batch holds that many rows (default
``min(max_requests, 16)``), so an admission's cost follows it, not ``max_requests``."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import assert_whole, base, serve, setup, workload

from flatkv_jax import ServingLimits
from flatkv_jax.demo import replay_ops
from flatkv_jax.serving import Engine, EngineOptions


def test_one_admission_row_serves_the_workload_one_admission_a_step():
    """The preempting workload with one admission per step: the baseline's tokens, every
    logged admit call holds one row, and the operations replay on the radix oracle."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(admit_rows=1, record_ops=True, mtp=False))
    assert engine.admit_rows == 1
    got = serve(engine, workload())
    assert got == base()[1]
    admits = [rows for name, rows in engine.op_log if name == "admit"]
    assert len(admits) >= len(workload()) and all(len(rows) == 1 for rows in admits)
    seqs = {rid: tuple(o.prompt) + tuple(o.tokens) for rid, o in engine.outputs.items()}
    res = replay_ops(plan, engine.op_log, seqs, prefix_reuse=True)
    assert res.agrees, res.mismatches + res.violations
    assert_whole(engine)


def test_admission_rows_default_and_bound():
    _, plan, model = setup()  # max_requests = 4
    assert Engine(model, plan, EngineOptions(overlap=False)).admit_rows == 4
    assert Engine(model, plan, EngineOptions(overlap=False, admit_rows=99)).admit_rows == 4


def test_admission_cost_follows_admit_rows():
    """The admitting kind's FLOPs less the non-admitting kind's (the admission's share) grow
    with the admission rows, about linearly; the non-admitting kind does not change."""
    _, plan, model = setup(
        ServingLimits(
            max_requests=8, max_context=64, chunk_tokens=12, verify_width=2, step_tokens=32
        ),
        40,
    )
    flops = {}
    for rows in (1, 8):
        engine = Engine(model, plan, EngineOptions(overlap=False, admit_rows=rows))
        flops[rows] = tuple(
            engine.compiled_step(admit).cost_analysis()["flops"] for admit in (True, False)
        )
    assert flops[1][1] == flops[8][1], flops
    share = {rows: f[0] - f[1] for rows, f in flops.items()}
    assert 0 < 6 * share[1] < share[8], share


@pytest.mark.parametrize("name", ["admit_rows", "prefill_rows"])
@pytest.mark.parametrize(
    "value, exc, message",
    [
        (0, ValueError, r"=0 is invalid: it must be positive\. Fix: pass {name} >= 1"),
        (True, TypeError, r"=True is invalid: it must be an int\. Fix"),
        (2.5, TypeError, r"=2\.5 is invalid: it must be an int\. Fix"),
    ],
)
def test_row_bound_errors(name, value, exc, message):
    """``admit_rows`` and ``prefill_rows`` (test_engine_prefill_rows.py) share the rule."""
    with pytest.raises(exc, match=name + message.format(name=name)):
        EngineOptions(**{name: value})


def test_row_bounds_take_numpy_ints():
    """The library's size rule (errors.is_int): NumPy integers count, bools do not."""
    assert EngineOptions(admit_rows=np.int64(2)).admit_rows == 2
    assert EngineOptions(prefill_rows=np.int64(3)).prefill_rows == 3
