"""``EngineOptions.admit_widths``: one admitting step kind per prompt-token width, each step
admitting into the smallest width that holds its longest prompt, so an admission's matching
costs ``admit_rows x`` that width, not ``admit_rows x max_context``."""

from __future__ import annotations

import pytest
from test_engine import assert_whole, base, serve, setup, workload

from flatkv_jax.demo import replay_ops
from flatkv_jax.serving import Engine, EngineOptions


def test_admission_widths_serve_the_workload():
    """The preempting workload with widths 8, 16, 32 (and max_context = 64): the baseline's
    tokens, admissions in several widths, only those, no compilation past one per kind, and
    the operations replay on the radix oracle with every status and hit agreeing."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(admit_widths=(16, 8, 32), record_ops=True))
    assert engine.admit_widths == (8, 16, 32, 64)
    assert serve(engine, workload()) == base()[1]
    used = engine.stats.admit_width_steps
    assert len(used) >= 2 and set(used) <= {8, 16, 32, 64}, used
    assert sum(used.values()) == sum(name == "admit" for name, _ in engine.op_log)
    assert engine.stats.compilations_after_warmup == 0
    seqs = {rid: tuple(o.prompt) + tuple(o.tokens) for rid, o in engine.outputs.items()}
    res = replay_ops(plan, engine.op_log, seqs, prefix_reuse=True)
    assert res.agrees, res.mismatches + res.violations
    assert_whole(engine)


def test_admission_cost_follows_the_width():
    """The admitting kind compiled at 16 prompt columns costs fewer FLOPs and bytes than at
    max_context (64); the kinds without admission do not change with the option."""
    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(overlap=False, admit_widths=(16,)))
    narrow = Engine(model, plan, EngineOptions(overlap=False))
    cost = {w: engine.compiled_step(True, width=w).cost_analysis() for w in (16, None)}
    for key in ("flops", "bytes accessed"):
        assert cost[16][key] < cost[None][key], (key, cost)
    assert (
        engine.compiled_step(False).cost_analysis()["flops"]
        == narrow.compiled_step(False).cost_analysis()["flops"]
    )


@pytest.mark.parametrize(
    "value, exc, message",
    [
        ((), TypeError, r"admit_widths=\(\) is invalid: it must be a non-empty tuple of ints"),
        ([16], TypeError, r"admit_widths=\[16\] is invalid: it must be a non-empty tuple"),
        ((16, 0), ValueError, r"admit_widths entry=0 is invalid: it must be positive"),
        ((True,), TypeError, r"admit_widths entry=True is invalid: it must be an int"),
    ],
)
def test_admit_widths_errors(value, exc, message):
    with pytest.raises(exc, match=message):
        EngineOptions(admit_widths=value)


def test_admit_widths_checked_against_the_plan():
    """A width past max_context is refused at Engine(...); compiled_step names only the
    engine's widths, and only for an admitting kind."""
    _, plan, model = setup()
    with pytest.raises(ValueError, match=r"admit_widths entry=65 is invalid: it must be <= "):
        Engine(model, plan, EngineOptions(admit_widths=(65,)))
    engine = Engine(model, plan, EngineOptions(overlap=False, admit_widths=(16,)))
    with pytest.raises(ValueError, match=r"width=5 is invalid: the engine's admission widths"):
        engine.compiled_step(True, width=5)
    with pytest.raises(ValueError, match=r"width=16 is invalid: a step kind that admits nothing"):
        engine.compiled_step(False, width=16)


def test_an_admission_the_device_refuses_is_raised(monkeypatch):
    """A row the host built that the device refuses for anything but pages or a slot is an
    engine bug, raised: here the width choice is broken on purpose (always the smallest), so
    a 20-token prompt meets an 8-column admission batch (BAD_ARG)."""
    import flatkv_jax.serving.engine as engine_module

    _, plan, model = setup()
    engine = Engine(model, plan, EngineOptions(overlap=False, admit_widths=(8,)))
    monkeypatch.setattr(engine_module, "_admission_width", lambda widths, need: widths[0])
    engine.submit(list(range(1, 21)), 2)
    with pytest.raises(
        RuntimeError,
        match=r"step 0 admitted request 0 with status BAD_ARG: an engine bug \(only NO_SLOT / "
        r"OUT_OF_PAGES send a request back to wait\)",
    ):
        engine.run()
