"""``retire_reclaim``: one sweep, the same result and state as ``retire`` then ``reclaim``.

The composition it replaces is checked against the radix oracle elsewhere (test_differential,
the state machines); here both run side by side on the differential harness's random traces
(deferred releases, rewinds, discarded steps, stale handles, eviction under small pools). The
harness compares every op's statuses, the page counts per pool and the tables and cache
contents up to a relabelling of page ids (which page of a pool a free hands back next is not
part of the contract: a chunk that lists a page twice frees its pages in page order); after
every retire the results must be equal and every state leaf that names no page identical.
The same traces also run the op against the radix oracle's ``retire_reclaim`` directly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import PLAN, assert_same, snapshot

from flatkv_jax import coordinator as coord
from flatkv_jax.coordinator import HandleBatch, ReleaseBatch, ReleaseMode, RetireBatch, host
from flatkv_jax.oracle import RadixOracle, TraceConfig, random_trace, run_trace
from flatkv_jax.oracle.device_adapter import DeviceBackend
from flatkv_jax.oracle.long_run import diff_plan
from flatkv_jax.status import Status

_I32 = jnp.int32
DIFF = diff_plan()


def _unnamed(state):
    """The state's leaves that name no page (and the free and cached counts per pool)."""
    named = {"allocator", "table_buffer", "index", "lru", "pinned"}
    rest = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    rest = {k: v for k, v in rest.items() if k not in named and k != "layout"}
    return snapshot((rest, state.allocator.top, state.lru.count, state.index.count))


class _Sequential(DeviceBackend):
    """retire, then reclaim of the rows it committed (what a serving step ran so far)."""

    def reset(self):
        super().reset()
        # One key seed for both backends, so that their states can be equal leaf by leaf.
        self.state = coord.create_state(
            self.plan, self.fifo_depth, prefix=self.prefix_reuse, seed=7
        )
        self.result = self.holes = None

    def retire(self, batch):
        b = self._retire_batch(batch)
        self.state, r = coord.retire(self.plan, self.state, b)
        keep = (r.status == Status.OK) & ~r.released
        self.state, c = coord.reclaim(
            self.plan, self.state, HandleBatch(keep, b.slot, b.generation)
        )
        self.result, self.holes = r, np.asarray(c.holes)
        return self._statuses(r)


class _Fused(_Sequential):
    """retire_reclaim, checked against its twin after every retire."""

    def __init__(self, plan, twin: _Sequential, seen: dict):
        self.twin, self.seen = twin, seen
        super().__init__(plan)

    def retire(self, batch):
        b = self._retire_batch(batch)
        self.state, r = coord.retire_reclaim(self.plan, self.state, b)
        t = self.twin.result
        for f in ("status", "committed", "extent", "released"):
            np.testing.assert_array_equal(np.asarray(getattr(r, f)), np.asarray(getattr(t, f)), f)
        np.testing.assert_array_equal(np.asarray(r.holes), self.twin.holes, "holes")
        assert_same(_unnamed(self.state), _unnamed(self.twin.state))
        self.seen["released"] += int(np.sum(np.asarray(r.released)))
        self.seen["holes"] += int(np.sum(np.asarray(r.holes)))
        self.seen["retires"] += 1
        return self._statuses(r)


def test_retire_reclaim_is_retire_then_reclaim_on_random_traces():
    """Equal results and states after every retire of 30 random traces; over the run some
    retire completed a deferred release and some reclaim dropped window pages (a run that
    never gets there proves nothing)."""
    seen = {"released": 0, "holes": 0, "retires": 0}
    seq = _Sequential(DIFF)
    fused = _Fused(DIFF, seq, seen)
    cfg = TraceConfig(num_ops=60)
    for seed in range(30):
        rep = run_trace(random_trace(DIFF, seed, cfg), seq, fused, names=("seq", "fused"))
        assert rep.ok, rep.divergence
    assert seen["released"] > 0 and seen["holes"] > 0 and seen["retires"] > 100, seen


def _admitted(plan, n_tokens, rows=1):
    """A state with ``rows`` requests admitted with ``n_tokens`` tokens each, prefill in
    flight."""
    state = coord.create_state(plan, seed=3)
    r = plan.limits.max_requests
    toks = np.zeros((r, plan.limits.max_context), np.int32)
    toks[:rows, :n_tokens] = np.arange(n_tokens) % 50 + 1
    valid = np.arange(r) < rows
    batch = coord.AdmitBatch(
        valid=jnp.asarray(valid),
        prompt_len=jnp.where(jnp.asarray(valid), n_tokens, 0).astype(_I32),
        first_chunk=jnp.where(jnp.asarray(valid), n_tokens, 0).astype(_I32),
        tokens=jnp.asarray(toks),
        namespace=jnp.zeros((r,), _I32),
    )
    state, res = coord.admit(plan, state, batch)
    assert np.all(np.asarray(res.status)[:rows] == Status.OK), res.status
    return state, res


@pytest.mark.parametrize("fused_first", [True, False])
def test_a_deferred_release_and_a_reclaim_in_one_call(fused_first):
    """Row 0's release is deferred; one retire_reclaim frees it (stale handle, every page
    back) while row 1 commits and drops its window pages: as the two calls do."""
    plan = PLAN
    state, res = _admitted(plan, 16, rows=2)
    rel = ReleaseBatch(
        valid=jnp.asarray([True, False, False, False]),
        slot=res.slot,
        generation=res.generation,
        mode=jnp.full((4,), int(ReleaseMode.FINISH), _I32),
    )
    state, st = coord.release(plan, state, rel)
    assert int(st.status[0]) == Status.DEFERRED
    b = RetireBatch(
        valid=jnp.asarray([True, True, False, False]),
        slot=res.slot,
        generation=res.generation,
        accepted=jnp.full((4,), 16, _I32),
    )
    a = jax.tree.map(jnp.copy, state)
    if fused_first:
        state, r = coord.retire_reclaim(plan, state, b)
        a, ra = coord.retire(plan, a, b)
        a, ca = coord.reclaim(
            plan, a, HandleBatch(jnp.asarray([False, True, False, False]), b.slot, b.generation)
        )
    else:
        a, ra = coord.retire(plan, a, b)
        a, ca = coord.reclaim(
            plan, a, HandleBatch(jnp.asarray([False, True, False, False]), b.slot, b.generation)
        )
        state, r = coord.retire_reclaim(plan, state, b)
    for f in ("status", "committed", "extent", "released"):
        np.testing.assert_array_equal(np.asarray(getattr(r, f)), np.asarray(getattr(ra, f)), f)
    assert np.asarray(r.released).tolist() == [True, False, False, False]
    assert int(r.status[0]) == Status.OK and int(r.status[1]) == Status.OK
    assert np.sum(np.asarray(r.holes)[1]) > 0 and np.sum(np.asarray(r.holes)[0]) == 0
    np.testing.assert_array_equal(np.asarray(r.holes), np.asarray(ca.holes))
    assert_same(snapshot(state), snapshot(a))
    assert not bool(state.live[int(res.slot[0])])


def test_retire_reclaim_names_itself_in_its_errors():
    """A handle batch where a retire batch belongs, a state of another plan, an accepted
    count above ``max_count``: the first two raise naming the op and the fix; the last is a
    value (``BAD_ARG``, state unchanged), as ``retire``."""
    state = coord.create_state(PLAN, seed=1)
    with pytest.raises(TypeError, match=r"retire_reclaim takes a RetireBatch.*retire_batch"):
        coord.retire_reclaim(PLAN, state, host.handle_batch(PLAN, [(0, 0)]))
    other = coord.create_state(DIFF, seed=1)
    with pytest.raises(ValueError, match="retire_reclaim"):
        coord.retire_reclaim(PLAN, other, host.retire_batch(PLAN, [((0, 0), 1)]))
    state, res = _admitted(PLAN, 16)
    h = host.handles(res, 1)[0]
    before = snapshot(state)
    state, r = coord.retire_reclaim(PLAN, state, host.retire_batch(PLAN, [(h, 16)]), max_count=8)
    assert host.statuses(r, 1) == [Status.BAD_ARG]
    assert np.asarray(r.holes).sum() == 0 and not bool(r.released[0])
    assert_same(snapshot(state), before)


def test_without_a_prefix_index_it_is_retire_then_reclaim():
    """``create_state(prefix=False)``: no index, no LRU; the one sweep frees the released
    rows' pages and drops the window pages as the two calls do (states equal leaf by leaf)."""
    plan = PLAN
    state = coord.create_state(plan, prefix=False)
    batch = host.admit_batch(plan, [(16, 16), (16, 16)])
    state, res = coord.admit(plan, state, batch)
    h = host.handles(res, 2)
    state, st = coord.release(plan, state, host.release_batch(plan, [(h[0], ReleaseMode.ABORT)]))
    assert host.statuses(st, 1) == [Status.DEFERRED]
    b = host.retire_batch(plan, [(h[0], 16), (h[1], 16)])
    a = jax.tree.map(jnp.copy, state)
    state, r = coord.retire_reclaim(plan, state, b)
    a, ra = coord.retire(plan, a, b)
    keep = (ra.status == Status.OK) & ~ra.released
    a, ca = coord.reclaim(plan, a, HandleBatch(keep, b.slot, b.generation))
    assert np.asarray(r.released)[:2].tolist() == [True, False]
    np.testing.assert_array_equal(np.asarray(r.holes), np.asarray(ca.holes))
    assert np.asarray(r.holes)[1].sum() > 0
    assert_same(snapshot(state), snapshot(a))


class _Fusing:
    """A backend whose ``retire`` is its ``retire_reclaim``: a trace's retires run fused."""

    def __init__(self, inner, seen: dict | None = None):
        self.inner, self.plan, self.seen = inner, inner.plan, seen

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def retire(self, batch):
        if self.seen is not None:  # requests this retire will free: a pending release
            c = self.inner.counts()
            ok = batch.valid & (c.pending[batch.slot] > 0) & (c.in_flight[batch.slot] == 1)
            self.seen["pending"] += int(np.sum(ok))
        return self.inner.retire_reclaim(batch)


def test_retire_reclaim_against_the_oracle_on_random_traces():
    """The device's one-sweep op against the host oracle's retire-then-reclaim (an
    implementation sharing no code with it) on 30 random traces: every status, page count
    and table (up to page relabelling) after every op, and the oracle's invariants."""
    seen = {"pending": 0}
    oracle = _Fusing(RadixOracle(DIFF))
    device = _Fusing(DeviceBackend(DIFF), seen)
    cfg = TraceConfig(num_ops=60)
    for seed in range(30):
        rep = run_trace(random_trace(DIFF, seed, cfg), oracle, device, names=("oracle", "device"))
        assert rep.ok, rep.divergence
    assert seen["pending"] > 0, seen


def test_rows_not_committed_are_not_reclaimed():
    """A ``DISCARDED`` row (a rewind cut its whole step) and a ``NO_STEP`` row keep the window
    pages behind them (``holes`` 0, tables as ``retire`` alone leaves them); a ``reclaim``
    afterwards drops them."""
    plan = PLAN
    state, res = _admitted(plan, 16, rows=2)
    h = host.handles(res, 2)
    # Commit both prefills without reclaiming: each row's window lags behind its commit.
    state, _ = coord.retire(plan, state, host.retire_batch(plan, [(h[0], 16), (h[1], 16)]))
    state, _ = coord.extend(plan, state, host.extend_batch(plan, [(h[0], 2)]))
    state, st = coord.rewind(plan, state, host.rewind_batch(plan, [(h[0], 16)]))
    assert host.statuses(st, 1) == [Status.OK]
    b = host.retire_batch(plan, [(h[0], 0), (h[1], 0)])
    a = jax.tree.map(jnp.copy, state)
    state, r = coord.retire_reclaim(plan, state, b)
    a, ra = coord.retire(plan, a, b)
    assert host.statuses(r, 2) == [Status.DISCARDED, Status.NO_STEP] == host.statuses(ra, 2)
    assert np.asarray(r.holes).sum() == 0
    assert_same(snapshot(state), snapshot(a))
    state, c = coord.reclaim(plan, state, host.handle_batch(plan, h))
    assert np.asarray(c.holes)[0].sum() > 0 and np.asarray(c.holes)[1].sum() > 0
