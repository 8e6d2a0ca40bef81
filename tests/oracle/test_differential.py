"""The differential harness: the oracle against itself, against planted bugs, and (when
available) against the device coordinator.

Long runs (not in CI): ``python -m flatkv_jax.oracle.long_run --ops 100000 [--device]``, or
``FLATKV_ORACLE_DEVICE_TRACES=8192 pytest tests/oracle/test_differential.py -k device``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_cases import full_plan, hybrid_plan

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.oracle import (
    RadixOracle,
    TraceConfig,
    device_adapter,
    lockstep,
    random_trace,
    run_trace,
)
from flatkv_jax.oracle.long_run import diff_plan, main
from flatkv_jax.oracle.oracle import HostPool
from flatkv_jax.oracle.traces import OpKind
from flatkv_jax.recipes import hybrid_swa_groups, mla_groups

PLAN = diff_plan()


def mla_plan(pages: int = 24):
    """MLA: one latent history group (rank 8 + rope 4, 2 layers), blocks of 4 tokens."""
    groups = mla_groups(2, kv_lora_rank=8, rope_dim=4, dtype="float32", rows_per_page=4)
    lim = ServingLimits(max_requests=4, max_context=48, chunk_tokens=16, verify_width=2)
    return plan_with_pages(groups, lim, pages)


#: The generic recipes at CI scale (small pools: OUT_OF_PAGES, LRU eviction and pinning).
GENERIC_PLANS = {
    "full": lambda: full_plan(pages=14, max_context=32),
    "full+swa": lambda: hybrid_plan(full=20, swa=10),
    "mla": mla_plan,
}


def test_traces_are_deterministic_and_exercise_everything():
    a, b = random_trace(PLAN, 3), random_trace(PLAN, 3)
    assert a.ops == b.ops and a.ops != random_trace(PLAN, 4).ops
    statuses, kinds = set(), set()
    o = RadixOracle(PLAN)
    for seed in range(25):
        tr = random_trace(PLAN, seed)
        kinds |= {op.kind for op in tr.ops}
        rep = run_trace(tr, _Recorder(o, statuses))
        assert rep.ok, rep.divergence
    names = {s.name for s in statuses}
    want = {
        "OK",
        "IDLE",
        "STALE",
        "OUT_OF_PAGES",
        "FIFO_FULL",
        "BAD_ARG",
        "DEFERRED",
        "DISCARDED",
        "NO_SLOT",
        "NO_STEP",
        "TOO_LONG",
        "STEP_FULL",
    }
    assert want <= names, want - names
    assert len(kinds) == 6


class _Recorder:
    """Wraps a backend and records every status it returns."""

    def __init__(self, inner, statuses):
        self.inner, self.statuses, self.plan = inner, statuses, inner.plan

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("admit", "extend", "retire", "rewind", "reclaim", "release"):
            return attr

        def call(batch):
            from flatkv_jax.status import Status

            res = attr(batch)
            self.statuses.update(Status(int(s)) for s in res.status)
            return res

        return call


@pytest.mark.parametrize(
    "plan", [PLAN, *(make() for make in GENERIC_PLANS.values())], ids=["v4", *GENERIC_PLANS]
)
def test_oracle_against_itself(plan):
    a, b = RadixOracle(plan), RadixOracle(plan)
    hits = 0
    for seed in range(20):
        rep = run_trace(random_trace(plan, seed), a, b, names=("a", "b"))
        assert rep.ok, rep.divergence
        hits += rep.hit_tokens
    assert hits > 0


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 12),
    accept_full=st.floats(0, 1),
    p_stale=st.floats(0, 0.5),
    p_bad=st.floats(0, 0.3),
)
def test_oracle_invariants_hold_on_random_traces(seed, vocab, accept_full, p_stale, p_bad):
    cfg = TraceConfig(
        num_ops=30, vocab=vocab, accept_full=accept_full, p_stale=p_stale, p_bad=p_bad
    )
    rep = run_trace(random_trace(PLAN, seed, cfg), RadixOracle(PLAN))
    assert rep.ok, rep.divergence


# --- planted bugs: a harness that cannot catch them is a defect ---------------------------------
class _ShortTrailingRun(RadixOracle):
    """Off by one: a window group's trailing run is one block short."""

    @staticmethod
    def _run_start(g, h):
        return RadixOracle._run_start(g, h) + (1 if g.is_window and h >= g.window else 0)


class _PublishesDrafts(RadixOracle):
    """Publishes the blocks completed by the extent (rejected drafts included)."""

    def _publish(self, req):
        c = req.c
        req.c = req.n
        try:
            super()._publish(req)
        finally:
            req.c = c


class _NoZeroing(RadixOracle):
    """Hands out recycled pages without zeroing them."""

    def _take(self, gi, pinned):
        pool = self.pools[gi]
        saved = pool._zero
        pool._zero = lambda page: None
        try:
            return super()._take(gi, pinned)
        finally:
            pool._zero = saved


def _first_divergence(bug, seeds=range(60)):
    for seed in seeds:
        rep = run_trace(
            random_trace(PLAN, seed), RadixOracle(PLAN), bug(PLAN), names=("oracle", "bug")
        )
        if not rep.ok:
            return rep.divergence
    return None


@pytest.mark.parametrize(
    "bug, where",
    [
        (_ShortTrailingRun, ""),
        (_PublishesDrafts, ""),
        (_NoZeroing, "not zero|content of"),
        (lambda plan: RadixOracle(plan, tail_first=False), ""),
    ],
    ids=["short-trailing-run", "publishes-drafts", "no-zeroing", "lru-head-first"],
)
def test_harness_catches_planted_bugs(bug, where):
    div = _first_divergence(bug)
    assert div is not None, "the harness missed a planted bug"
    assert any(w in div.what for w in where.split("|"))
    text = str(div)
    assert f"op #{div.op_index}" in text and "oracle" in text


def test_divergence_report_is_readable():
    div = _first_divergence(_ShortTrailingRun)
    lines = str(div).splitlines()
    assert lines[0].startswith("divergence at op #") and "seed" in lines[0]
    assert ": oracle=[" in lines[1] and "bug=[" in lines[1] and "preceding ops:" in lines[2]


def test_harness_checks_contents_against_the_prefix_pattern():
    """A backend that serves a wrong page is caught even if it agrees with nobody."""

    class Scrambled(RadixOracle):
        def view(self):
            v = super().view()
            for per_field in v.rows[2]:
                for a in per_field:
                    a[:, 0] = a[:, 0][::-1]  # slot order of row 0 reversed: wrong content
            return v

    bad = None
    for seed in range(20):
        rep = run_trace(random_trace(PLAN, seed), Scrambled(PLAN))
        if not rep.ok:
            bad = rep.divergence
            break
    assert bad is not None and "pattern of its prefix" in bad.what


def test_long_run_command(capsys):
    assert main(["--ops", "60", "--trace-ops", "30"]) == 0
    out = capsys.readouterr().out
    assert "2 traces, 60 ops, 0 divergences" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ops", "-5"], "argument --ops: -5 is invalid: it must be positive. Fix: pass --ops 1 or more"),
        (["--ops", "0"], "argument --ops: 0 is invalid: it must be positive"),
        (["--ops", "x"], "argument --ops: 'x' is invalid: it must be a whole number. Fix: pass --ops as an integer"),
        (["--trace-ops", "-1"], "argument --trace-ops: -1 is invalid: it must be positive. Fix: pass --trace-ops 1 or more"),
        (["--lanes", "0"], "argument --lanes: 0 is invalid: it must be positive. Fix: pass --lanes 1 or more"),
        (["--seed", "-1"], "argument --seed: -1 is invalid: it must be >= 0. Fix: pass --seed 0 or more"),
    ],
)  # fmt: skip
def test_long_run_rejects_bad_counts(capsys, argv, message):
    # A short valid run first: a regression that accepts the bad value ends quickly.
    with pytest.raises(SystemExit) as e:
        main(["--ops", "1", "--trace-ops", "1", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m flatkv_jax.oracle.long_run: error: {message}"), err


def test_long_run_refuses_empty_traces():
    """``--trace-ops 0`` never advanced the total (an endless loop): now a usage error. In a
    subprocess with a timeout, so a regression fails instead of hanging the suite."""
    cmd = [sys.executable, "-m", "flatkv_jax.oracle.long_run", "--ops", "10", "--trace-ops", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert "argument --trace-ops: 0 is invalid: it must be positive" in r.stderr


def test_host_pool_counts_add_up():
    pool = HostPool(PLAN, 0)
    free, in_use, cached = pool.counts()
    assert (free, in_use, cached) == (PLAN.usable_pages(0), 0, 0)
    assert np.all(pool.refcount == 0)


# --- the device coordinator --------------------------------------------------------------------
#: Random device-vs-oracle traces in CI, run LANES at a time in lockstep (one device call
#: advances every lane by one op; flatkv_jax/oracle/lockstep.py). The cost is per trace (the
#: host harness, ~0.1 s a trace, against one ~50 s compilation), so CI runs 512: every op kind
#: appears in >= 232 of them and every status the coordinator returns in >= 60, except
#: TOO_LONG (1 trace; the coordinator tests cover it). A longer local run:
#: FLATKV_ORACLE_DEVICE_TRACES=8192 pytest tests/oracle/test_differential.py -k device
DEVICE_TRACES = int(os.environ.get("FLATKV_ORACLE_DEVICE_TRACES", "512"))
DEVICE_OPS = 25
LANES = 256


@pytest.fixture(scope="module")
def lockstep_device():
    dev = lockstep.LockstepDevice(PLAN, LANES)
    # The default follows the coordinator's batches: they carry tokens, so prefix reuse is on
    # and the differential covers matching, pinning, eviction and publishing.
    assert dev.prefix_reuse and lockstep.prefix_api()
    return dev


def test_device_coordinator_matches_the_oracle(lockstep_device):
    dev = lockstep_device
    cfg = TraceConfig(num_ops=DEVICE_OPS)
    traces = [random_trace(PLAN, 5000 + seed, cfg) for seed in range(DEVICE_TRACES)]
    assert {op.kind for tr in traces for op in tr.ops} == set(OpKind)
    reports = lockstep.run_lockstep(traces, dev)
    bad = [r.divergence for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} traces diverge; first:\n{bad[0]}"
    assert sum(r.ops for r in reports) == DEVICE_TRACES * DEVICE_OPS
    assert sum(r.admitted for r in reports) > DEVICE_TRACES
    assert sum(r.hit_tokens for r in reports) > 0  # served hits, equal to the oracle's


def test_lockstep_catches_a_planted_bug(lockstep_device):
    """The lockstep harness stops each lane at its first divergence and reports it."""
    dev = lockstep_device
    traces = [random_trace(PLAN, seed) for seed in range(16)]
    reports = lockstep.run_lockstep(
        traces, dev, oracle=lambda p: _NoZeroing(p, prefix_reuse=dev.prefix_reuse)
    )
    bad = [r for r in reports if not r.ok]
    assert bad, "the lockstep harness missed a planted bug"
    assert all(r.ops <= 40 for r in reports)
    assert "divergence at op #" in str(bad[0].divergence) and "oracle" in bad[0].divergence.what


def test_lockstep_rejects_bad_arguments():
    with pytest.raises(TypeError, match="it must be a CachePlan"):
        lockstep.LockstepDevice("plan", 4)
    with pytest.raises(ValueError, match="lanes"):
        lockstep.LockstepDevice(PLAN, 0)


def test_prefix_reuse_needs_the_prefix_api(monkeypatch):
    with pytest.raises(TypeError, match="it must be a CachePlan"):
        device_adapter.DeviceBackend("plan")
    monkeypatch.setattr(lockstep, "prefix_api", lambda: False)
    with pytest.raises(ValueError, match="has no tokens field"):
        lockstep.LockstepDevice(PLAN, 2, prefix_reuse=True)


# --- the generic recipes on the device ---------------------------------------------------------
GENERIC_LANES = 32


@pytest.mark.parametrize("recipe", list(GENERIC_PLANS))
def test_device_matches_the_oracle_on_generic_recipes(recipe):
    """CI scale (one compilation per recipe, 32 lanes x 25 ops): full attention, full +
    sliding window and MLA agree with the oracle, with prefix hits served; the same lanes
    then catch a planted bug on the recipe (the comparison is live, not vacuous)."""
    plan = GENERIC_PLANS[recipe]()
    kinds = {"full": {False}, "full+swa": {False, True}, "mla": {False}}[recipe]
    assert {g.is_window for g in plan.groups} == kinds
    dev = lockstep.LockstepDevice(plan, GENERIC_LANES)
    assert dev.prefix_reuse
    cfg = TraceConfig(num_ops=DEVICE_OPS)
    traces = [random_trace(plan, 9000 + seed, cfg) for seed in range(GENERIC_LANES)]
    reports = lockstep.run_lockstep(traces, dev)
    bad = [r.divergence for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} traces diverge; first:\n{bad[0]}"
    assert sum(r.ops for r in reports) == GENERIC_LANES * DEVICE_OPS
    assert sum(r.admitted for r in reports) > GENERIC_LANES
    assert sum(r.hit_tokens for r in reports) > 0
    buggy = lockstep.run_lockstep(traces, dev, oracle=_NoZeroing)
    assert any(not r.ok for r in buggy), "the device differential missed a planted bug"


# --- 1-token window blocks ---------------------------------------------------------------------
def one_token_window_plan():
    """``full_kv`` + ``swa_kv`` (window 8) with 1-token blocks: the prefix granularity is 1, so
    hits land at every length and nothing rounds the window's trailing run to a block edge (an
    off-by-one in its first block shows at once)."""
    groups = hybrid_swa_groups("SF", 1, 4, 8, dtype="float32", rows_per_page=1)
    lim = ServingLimits(max_requests=4, max_context=48, chunk_tokens=16, verify_width=2)
    return plan_with_pages(groups, lim, {"full_kv": 96, "swa_kv": 24})


def test_window_trailing_run_starts_at_the_first_position_the_hit_reads():
    """A hit at ``h`` computes position ``h`` first; its window reaches back to ``h - W + 1``."""
    swa = one_token_window_plan().group("swa_kv")
    assert (swa.block_tokens, swa.window) == (1, 8)
    assert [RadixOracle._run_start(swa, h) for h in (1, 7, 8, 9, 16)] == [0, 0, 1, 2, 9]
    v4_swa = PLAN.group("swa_kv")  # 4-token blocks, window 8: positions 9..16 -> blocks 2..3
    assert RadixOracle._run_start(v4_swa, 16) == 2


def test_device_matches_the_oracle_on_one_token_window_blocks():
    """CI scale (one compilation, 128 lanes x 25 ops): the device and the oracle agree on
    1-token window blocks, where the trailing run's first block is exactly ``h - W + 1``."""
    from flatkv_jax.oracle.lockstep import LockstepDevice, run_lockstep

    plan = one_token_window_plan()
    traces = [random_trace(plan, 5000 + seed, TraceConfig(num_ops=25)) for seed in range(128)]
    reports = run_lockstep(traces, LockstepDevice(plan, 128))
    bad = [r.divergence for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} traces diverge; first:\n{bad[0]}"
    assert sum(r.ops for r in reports) == 128 * 25
    assert sum(r.hit_tokens for r in reports) > 0


# --- eviction ahead of demand ------------------------------------------------------------------
@pytest.mark.parametrize(("recipe", "ahead"), [("full+swa", 2), ("full", 3)])
def test_device_matches_the_oracle_when_evicting_ahead(recipe, ahead):
    """``CachePlan.evict_ahead_tokens``: an admission that runs a pool dry then tops up every
    pool's free stack with its next LRU pages. Device and oracle agree on every op of
    random traces (statuses, hits, pool counts, contents), the oracle did evict ahead (the
    comparison is not vacuous), and hits are still served."""
    plan = dataclasses.replace(GENERIC_PLANS[recipe](), evict_ahead_tokens=ahead)
    assert all(plan.evict_ahead_pages(g) >= 1 for g in plan.groups)
    dev = lockstep.LockstepDevice(plan, GENERIC_LANES)
    made = []

    def oracle(p):
        made.append(RadixOracle(p, prefix_reuse=dev.prefix_reuse))
        return made[-1]

    # Longer traces than the other device tests: pools run dry later in a trace (60 ops: ~30
    # pages evicted ahead over the 32 traces, against a handful at 25 ops).
    cfg = TraceConfig(num_ops=60)
    traces = [random_trace(plan, 9500 + seed, cfg) for seed in range(GENERIC_LANES)]
    reports = lockstep.run_lockstep(traces, dev, oracle=oracle)
    bad = [r.divergence for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} traces diverge; first:\n{bad[0]}"
    assert sum(o.evicted_ahead for o in made) >= 20
    assert sum(r.hit_tokens for r in reports) > 0
    # An oracle that evicts only the shortfall diverges from this device: the rule is live.
    exact = dataclasses.replace(plan, evict_ahead_tokens=0)
    lazy = lockstep.run_lockstep(
        traces, dev, oracle=lambda p: RadixOracle(exact, prefix_reuse=dev.prefix_reuse)
    )
    assert any(not r.ok for r in lazy), "the differential missed eviction ahead"
