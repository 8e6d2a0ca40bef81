"""Engine.sleep / Engine.wake on the tiny model.

Reuses the model, plan and ``FULL`` options of test_engine.py (overlap, prefix cache, MTP, one
step kind), so no step function is compiled here beyond the ones test_engine.py compiles; the
drain before a sleep is a step of that same kind that schedules nothing. The reference outputs
are the uninterrupted ``base`` run of the same workload.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import FULL, assert_whole, base, setup, workload

from flatkv_jax.coordinator import SleepMode
from flatkv_jax.coordinator.audit import check_state, page_counts
from flatkv_jax.serving import Engine


def engine_with_workload(first=()):
    _, plan, model = setup()
    engine = Engine(model, plan, FULL)
    pre = [engine.submit(p, m) for p, m in first]
    ids = [engine.submit(p, m) for p, m in workload()]
    return engine, pre, ids


def test_offload_mid_run_continues_with_identical_outputs():
    engine, _, ids = engine_with_workload()
    for _ in range(6):
        engine.step()
    assert 0 < sum(len(engine.outputs[i].tokens) for i in ids) < sum(m for _, m in workload())
    asleep = engine.sleep(SleepMode.OFFLOAD)
    assert engine.asleep and engine.state is None and engine.pools is None
    assert asleep.host_bytes == asleep.device_bytes > 0
    assert engine.wake() == ()
    assert not engine.asleep
    check_state(setup()[1], engine.state, shared_ok=True)
    out = engine.run()
    assert [out[i].tokens for i in ids] == base()[1]
    assert all(out[i].retractions == engine.outputs[i].retractions for i in ids)
    assert_whole(engine)
    assert engine.stats.compilations_after_warmup == 0


def _phase(engine, rid):
    q = engine._requests[rid]
    if q.out.finished:
        return "finished"
    if q.lane is None:
        return "waiting"
    return "decoding" if q.out.tokens else "prefilling"


def test_discard_mid_run_recomputes_every_request_and_serves_no_stale_hit():
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 64, 40).tolist()
    engine, (early,), ids = engine_with_workload(first=[(shared, 2)])
    # Run until the early request is finished and released (its blocks cached-only), with a
    # request decoding, one prefilling and one waiting.
    phases: dict[str, list[int]] = {}
    for _ in range(40):
        engine.step()
        phases = {}
        for rid in ids:
            phases.setdefault(_phase(engine, rid), []).append(rid)
        done = engine._requests[early].lane is None and engine.outputs[early].finished
        if done and {"decoding", "prefilling", "waiting"} <= set(phases):
            break
    assert {"decoding", "prefilling", "waiting"} <= set(phases), phases
    assert sum(engine.records[-1].cached) > 0  # the early request's prefix is cached
    engine.sleep("discard")
    # Running now (the drain read the last steps): these lose their pages and recompute.
    running = sorted(rid for rid in ids if _phase(engine, rid) in ("decoding", "prefilling"))
    assert running
    preempted = {rid for _, rid, mode in engine._releases if mode.name == "RETRACT"}
    before = {rid: engine.outputs[rid].retractions for rid in ids}
    # Requests queue while asleep; this one's prompt is the cached prefix (a hit of >= 16
    # tokens on an uninterrupted engine: test_prefix_hit_gives_the_same_tokens).
    late = engine.submit([*shared[:34], 1, 2, 3, 4, 5, 6], 4)
    requeued = engine.wake()
    assert sorted(requeued) == running
    _, plan, _ = setup()
    check_state(plan, engine.state, shared_ok=True)
    counts = page_counts(plan, engine.state)
    assert all(c.free == c.total for c in counts.values()), counts
    assert not np.asarray(engine.state.live).any()
    mark = len(engine.op_log)
    out = engine.run()
    assert [out[i].tokens for i in ids] == base()[1]
    assert out[late].finished and out[late].hit_tokens == 0
    for rid in set(running) - preempted:  # the repair retracted them (a preemption counts once)
        assert out[rid].retractions > before[rid], rid
    # A requeued request's first readmission cannot hit: only its own prefix was ever
    # published (the prompts are random) and that was dropped with the pools.
    first_hit = {}
    for name, rows in engine.op_log[mark:]:
        if name == "admit":
            for rid, _, _, _, status, hit in rows:
                if status == 0:
                    first_hit.setdefault(rid, hit)
    assert {rid: first_hit[rid] for rid in running} == dict.fromkeys(running, 0)
    assert_whole(engine)
    assert engine.stats.compilations_after_warmup == 0


def test_sleep_and_wake_misuse_raise_clear_errors():
    _, plan, model = setup()
    engine = Engine(model, plan, FULL)
    with pytest.raises(ValueError, match=r"engine='awake'.*call engine\.sleep\(mode\) first"):
        engine.wake()
    with pytest.raises(ValueError, match=r"mode='nap'.*'offload' or 'discard'"):
        engine.sleep("nap")
    with pytest.raises(TypeError, match=r"mode='int'.*SleepMode"):
        engine.sleep(3)
    engine.sleep("offload")
    with pytest.raises(ValueError, match=r"engine='asleep \(offload\)'.*call engine\.wake\(\)"):
        engine.sleep(SleepMode.DISCARD)
    rid = engine.submit([1, 2, 3], 2)  # queues while asleep
    with pytest.raises(ValueError, match=r"step\(\) needs the pools.*before engine\.step\(\)"):
        engine.step()
    with pytest.raises(ValueError, match=r"before engine\.step\(\)"):
        engine.run()
    engine.abort(rid)  # host-only: allowed while asleep
    assert engine.wake() == ()
    engine.run()
    assert engine.outputs[rid].aborted and not engine.has_work()
