"""The admission's hashes: a prefill's retire publishes from what admit kept, not by hashing again.

``admit`` hashes every prompt from position 0 to match it; for each served row whose first
step's end state is exact it keeps the lanes that step's publish reads and the chain state at
its end (``CacheState.admit_hashed`` / ``admit_lanes`` / ``admit_chain``). The request's first
retire takes them when every publishing row has them and retires its step whole; it clears the
mark whatever happens. Checked here on the differential harness's random traces (rewinds,
partial accepts, discards, deferred releases, stale handles): every retire runs three times on
copies of one state — as is, with every mark cleared (so it hashes), and with the kept words
poisoned — the first two must agree bit for bit on every state leaf but the marks, and the
poisoned run must differ on some retires (so the kept words were used, and read right); the
trace itself agrees with the radix oracle.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import PLAN, snapshot

from flatkv_jax import coordinator as coord
from flatkv_jax.coordinator import audit, host
from flatkv_jax.coordinator.layout import admit_lanes_width, publish_unit
from flatkv_jax.oracle import RadixOracle, TraceConfig, random_trace, run_trace
from flatkv_jax.oracle.device_adapter import DeviceBackend
from flatkv_jax.oracle.long_run import diff_plan
from flatkv_jax.status import Status

DIFF = diff_plan()
_RETIRE_FIELDS = ("status", "committed", "extent", "released")
_MARKS = ("admit_",)  # the marks and the kept words themselves


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def _leaves(state) -> dict:
    """Every leaf of a host snapshot by its path, the marks left out."""
    flat = jax.tree_util.tree_flatten_with_path(snapshot(state))[0]
    out = {jax.tree_util.keystr(p): x for p, x in flat}
    return {k: v for k, v in out.items() if not any(m in k for m in _MARKS)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class _HashChecked(DeviceBackend):
    """Runs every retire (and retire_reclaim) as is, without the admission's marks, and with
    the kept words poisoned; the trace goes on with the first."""

    def __init__(self, plan, seen: dict):
        self.seen = seen
        super().__init__(plan)

    def _checked(self, op):
        def run(plan, state, batch, **kw):
            marked = bool(np.asarray(state.admit_hashed).any())
            plain = dataclasses.replace(
                _copy(state), admit_hashed=jnp.zeros_like(state.admit_hashed)
            )
            poisoned = dataclasses.replace(
                _copy(state),
                admit_lanes=state.admit_lanes ^ jnp.uint32(0x9E3779B9),
                admit_chain=state.admit_chain ^ jnp.uint32(0x7F4A7C15),
            )
            plain, pr = op(plan, plain, batch, **kw)
            poisoned, _ = op(plan, poisoned, batch, **kw)
            state, r = op(plan, state, batch, **kw)
            for f in _RETIRE_FIELDS:
                np.testing.assert_array_equal(np.asarray(getattr(r, f)), np.asarray(getattr(pr, f)))
            got = _leaves(state)
            assert _same(got, _leaves(plain)), "the kept hashes published other words"
            # A retire that pops a row's step (OK or DISCARDED) clears its mark whatever the
            # outcome; the audit checks every mark left (a live request's unretired head).
            status, slot = np.asarray(r.status), np.asarray(batch.slot)
            popped = slot[(status == Status.OK) | (status == Status.DISCARDED)]
            assert not np.asarray(state.admit_hashed)[popped].any()
            audit.check_state(plan, state, shared_ok=True)
            if marked:
                self.seen["retires with a mark"] += 1
            if not _same(got, _leaves(poisoned)):
                self.seen["retires that used the kept hashes"] += 1
            return state, r

        run.__name__ = op.__name__
        return run

    def admit(self, batch):
        out = super().admit(batch)
        self.seen["admits leaving marked slots"] += int(np.asarray(self.state.admit_hashed).any())
        audit.check_state(self.plan, self.state, shared_ok=True)
        return out

    def retire(self, batch):
        return self._status_only(self._checked(coord.retire), self._retire_batch(batch))

    def retire_reclaim(self, batch):
        return self._status_only(self._checked(coord.retire_reclaim), self._retire_batch(batch))


def test_plans_keep_lanes_at_the_publish_unit():
    """The differential plan publishes at multiples of 4 tokens and keeps ``max_count / 4 + 1``
    lanes per slot; without a prefix index nothing is kept."""
    assert publish_unit(DIFF) == 4
    assert admit_lanes_width(DIFF) == DIFF.limits.max_count // 4 + 1
    st = coord.create_state(DIFF, seed=1)
    assert st.admit_lanes.shape == (DIFF.limits.max_requests, admit_lanes_width(DIFF), 4)
    assert coord.create_state(DIFF, prefix=False).admit_lanes.shape[1] == 0


def test_prefill_retire_publishes_the_words_hashing_would():
    """40 random traces: every retire's state equals (bit for bit, marks aside) the state of
    the same retire made to hash; some retires did take the kept words (their poisoned copy
    differs), and the trace agrees with the oracle."""
    seen = {
        "admits leaving marked slots": 0,
        "retires with a mark": 0,
        "retires that used the kept hashes": 0,
    }
    cfg = TraceConfig(num_ops=50)
    for seed in range(40):
        rep = run_trace(
            random_trace(DIFF, seed, cfg),
            RadixOracle(DIFF),
            _HashChecked(DIFF, seen),
            names=("oracle", "hash-checked"),
        )
        assert rep.ok, rep.divergence
    print(seen)
    assert all(v > 0 for v in seen.values()), seen


def test_a_partial_accept_or_a_rewind_hashes():
    """The kept words cover the admission's step whole: a retire accepting fewer tokens, or
    one after a rewind cut the step, hashes the tokens it commits (its words are those of a
    state without the mark), and either clears the mark."""
    plan = PLAN
    prompt = list(range(1, 15))  # 14 tokens: one step of 14, an exact end (the prompt's)
    for case in ("partial", "rewind", "whole"):
        state = coord.create_state(plan, seed=3)
        state, res = coord.admit(
            plan, state, host.admit_batch(plan, [(14, 14)], tokens=[prompt], width=64)
        )
        assert res.status[0] == Status.OK
        (h,) = host.handles(res, 1)
        assert bool(state.admit_hashed[h[0]])
        if case == "rewind":
            state, rw = coord.rewind(plan, state, host.rewind_batch(plan, [(h, 9)]))
            assert rw.status[0] == Status.OK
        accepted = 14 if case != "partial" else 7
        rb = host.retire_batch(plan, [(h, accepted)])
        plain = dataclasses.replace(_copy(state), admit_hashed=jnp.zeros_like(state.admit_hashed))
        poisoned = dataclasses.replace(_copy(state), admit_chain=state.admit_chain ^ jnp.uint32(1))
        state, r = coord.retire(plan, state, rb)
        plain, _ = coord.retire(plan, plain, rb)
        poisoned, _ = coord.retire(plan, poisoned, rb)
        assert r.status[0] == Status.OK
        assert not bool(state.admit_hashed[h[0]])
        assert _same(_leaves(state), _leaves(plain))
        # Only the whole step takes the kept words (the poisoned chain state shows it).
        assert _same(_leaves(state), _leaves(poisoned)) == (case != "whole"), case


@pytest.mark.parametrize("shape", ["admit_hashed", "admit_lanes", "admit_chain"])
def test_a_state_with_a_wrong_hash_leaf_is_refused(shape):
    """A state whose admission-hash leaves have another shape (another plan's, or edited):
    ValueError naming the leaf, the shape the plan wants and the fix."""
    state = coord.create_state(PLAN, seed=1)
    leaf = getattr(state, shape)
    bad = dataclasses.replace(state, **{shape: leaf[:-1]})
    with pytest.raises(ValueError, match=rf"state\.{shape}.*retire.*create_state"):
        coord.retire(PLAN, bad, host.retire_batch(PLAN, [((0, 0), 1)]))


def test_the_audit_checks_the_marks():
    """``audit.check_state`` accepts a marked slot whose admission step is the FIFO head and
    names the slot when a mark outlives it (a free slot marked, or a retired head)."""
    plan = PLAN
    state = coord.create_state(plan, seed=5)
    state, res = coord.admit(
        plan, state, host.admit_batch(plan, [(14, 14)], tokens=[list(range(1, 15))], width=64)
    )
    (h,) = host.handles(res, 1)
    audit.check_state(plan, state)
    free = int(np.flatnonzero(~np.asarray(state.live))[0])
    stray = dataclasses.replace(state, admit_hashed=state.admit_hashed.at[free].set(True))
    with pytest.raises(audit.StateInvariantError, match=rf"slot {free}: admit_hashed is set"):
        audit.check_state(plan, stray)
    state, _ = coord.retire(plan, state, host.retire_batch(plan, [(h, 14)]))
    audit.check_state(plan, state)
    stale = dataclasses.replace(state, admit_hashed=state.admit_hashed.at[h[0]].set(True))
    with pytest.raises(audit.StateInvariantError, match=rf"slot {h[0]}: .*not the FIFO head"):
        audit.check_state(plan, stale)
