"""Statuses and bookkeeping of each oracle operation (docs/semantics.md, "Operations")."""

from __future__ import annotations

import numpy as np
from oracle_cases import Driver, full_plan, hybrid_plan, rng_tokens

from flatkv_jax.oracle import ReleaseMode, handle_batch
from flatkv_jax.status import Status


def test_admit_extend_retire_rewind_lifecycle():
    d = Driver(full_plan())
    st, h, hit = d.admit(rng_tokens(1, 10), first_chunk=8)
    assert (st, h, hit) == (Status.OK, (0, 0), 0) and d.state(h) == (8, 0)
    assert d.extend(h, [1, 2]) is Status.OK and d.state(h) == (10, 0)
    assert d.extend(h, [3]) is Status.FIFO_FULL  # depth 2
    assert d.retire(h, 9) is Status.BAD_ARG  # accepted > count: nothing changes
    assert d.retire(h, 8) is Status.OK and d.state(h) == (10, 8)
    assert d.retire(h, 1) is Status.OK and d.state(h) == (9, 9)  # one rejected: rewind
    assert d.retire(h, 0) is Status.NO_STEP
    assert d.extend(h, [4, 5, 6]) is Status.OK and d.rewind(h, 8) is Status.BAD_ARG  # below c
    assert d.rewind(h, 10) is Status.OK and d.state(h) == (10, 9)
    assert d.retire(h, 3) is Status.OK and d.state(h) == (10, 10)  # the cut step commits 1
    assert d.extend(h, []) is Status.BAD_ARG and d.extend(h, list(range(9))) is Status.BAD_ARG
    d.check()


def test_stale_handles_and_generations():
    d = Driver(full_plan())
    _, h, _ = d.admit(rng_tokens(2, 4))
    d.retire_all(h)
    assert d.release(h) is Status.OK
    for op in (
        lambda: d.extend(h, [1]),
        lambda: d.retire(h, 0),
        lambda: d.rewind(h, 0),
        lambda: d.reclaim(h),
        lambda: d.release(h),
    ):
        assert op() is Status.STALE
    _st, h2, _ = d.admit(rng_tokens(3, 4))
    assert h2 == (0, 1)  # the slot's generation moved on
    assert d.extend((0, 0), [1]) is Status.STALE and d.extend((9, 0), [1]) is Status.STALE
    assert d.extend((-1, 0), [1]) is Status.STALE
    d.check()


def test_deferred_release_and_discarded_steps():
    d = Driver(full_plan())
    _, h, _ = d.admit(rng_tokens(4, 8), first_chunk=8)
    assert d.extend(h, [1, 2, 3]) is Status.OK
    assert d.release(h, ReleaseMode.FINISH) is Status.DEFERRED
    assert d.extend(h, [4]) is Status.STALE and d.release(h) is Status.STALE  # no new steps
    assert d.reclaim(h) is Status.OK  # reclaim is still allowed
    assert d.retire(h, 8) is Status.OK and d.o.counts().live[0]
    assert d.retire(h, 3) is Status.OK and not d.o.counts().live[0]  # FIFO empty: freed
    assert d.o.counts().generation[0] == 1
    _st, h, _ = d.admit(rng_tokens(5, 8), first_chunk=8)
    assert d.extend(h, [1, 2, 3]) is Status.OK
    assert (
        d.retire(h, 4) is Status.OK and d.retire(h, 3) is Status.DISCARDED
    )  # step started at 8 > c = 4
    assert d.state(h) == (4, 4)
    assert d.release(h, 7) is Status.BAD_ARG
    d.check()


def test_no_slot_out_of_pages_and_atomicity():
    plan = full_plan(pages=13, max_requests=2)
    d = Driver(plan)
    # Two chunks of 8 are two steps: one call of both would pass step_tokens = 8 + 3.
    res = d.admit_many([(0, rng_tokens(6, 8), 8)])
    assert res.status[:1].tolist() == [0]
    res = d.admit_many([(0, rng_tokens(7, 8), 8)])
    assert res.status[:1].tolist() == [0]
    res = d.admit_many([(0, [1], 1)])
    assert Status(int(res.status[0])) is Status.NO_SLOT
    st_before = d.o.counts()
    # Slot 0 grows to 40 tokens (10 pages) + slot 1's 2: one page left; a 2-page extension
    # is short by 1, and the FIFO rule stops the next row too.
    h0 = (0, 0)
    d.retire_all(h0)
    for _ in range(4):
        d.extend(h0, list(range(8)))
        d.retire_all(h0)
    assert d.counts("kv") == (1, 12, 0)
    from flatkv_jax.oracle import extend_batch

    r = d.o.extend(extend_batch(plan, [(h0, list(range(8))), ((1, 0), [1])]))
    assert [Status(int(s)) for s in r.status[:2]] == [Status.OUT_OF_PAGES, Status.OUT_OF_PAGES]
    assert (int(r.short_group[0]), int(r.short_pages[0])) == (0, 1)
    assert d.counts("kv") == (1, 12, 0) and d.state(h0) == (40, 40)
    assert st_before.generation.tolist() == [0, 0]
    d.check()


def test_batch_rows_repeat_a_slot_and_masked_rows_idle():
    d = Driver(full_plan())
    _st, h, _ = d.admit(rng_tokens(8, 4))
    res = d.o.retire(handle_batch(d.plan, [None, (h, 4), (h, 4)]))
    assert [Status(int(s)) for s in res.status] == [
        Status.IDLE,
        Status.OK,
        Status.BAD_ARG,
        Status.IDLE,
    ]
    # A stale row naming the same slot does not make the live row a duplicate.
    res = d.o.reclaim(handle_batch(d.plan, [(0, 5), h]))
    assert [Status(int(s)) for s in res.status[:2]] == [Status.STALE, Status.OK]


def test_rows_repeating_a_slot_see_the_state_before_the_call():
    # Every row is judged against the state before the call (the device does the same): a
    # row that defers or frees a request does not make a later row of the same slot STALE.
    d = Driver(full_plan())
    _st, h, _ = d.admit(rng_tokens(10, 4))  # one step in flight
    finish = ReleaseMode.FINISH
    res = d.o.release(handle_batch(d.plan, [(h, finish), (h, finish)]))
    assert [Status(int(s)) for s in res.status[:2]] == [Status.DEFERRED, Status.BAD_ARG]
    # The retire that empties the FIFO frees the request; the repeated row is still BAD_ARG.
    res = d.o.retire(handle_batch(d.plan, [(h, 4), (h, 4)]))
    assert [Status(int(s)) for s in res.status[:2]] == [Status.OK, Status.BAD_ARG]
    assert not d.o.counts().live[0]
    _st, h, _ = d.admit(rng_tokens(11, 4))
    d.retire_all(h)
    res = d.o.release(handle_batch(d.plan, [(h, finish), (h, finish)]))
    assert [Status(int(s)) for s in res.status[:2]] == [Status.OK, Status.BAD_ARG]
    d.check()


def test_reclaim_makes_holes_and_pools_are_whole_after_everything():
    d = Driver(hybrid_plan(full=40, swa=12))
    h, _ = d.run(rng_tokens(9, 30))
    gi = d.plan.group_index("swa_kv")
    assert (d.o.view().tables[gi][0][:8] >= 1).all()
    assert d.reclaim(h) is Status.OK
    t = d.o.view().tables[gi][0]
    lo = (30 - 8 + 1) // 4
    assert (t[:lo] == 0).all() and (t[lo:8] >= 1).all()
    assert d.counts("swa_kv")[2] == lo  # published at retire, so cached-only, not free
    assert d.release(h) is Status.OK
    d.o.clear_index()
    c = d.o.counts()
    assert c.free.tolist() == [d.plan.usable_pages(g) for g in d.plan.groups]
    assert not np.any(c.cached_only)
    d.check()


def test_prefix_reuse_off_never_hits():
    from flatkv_jax.oracle import RadixOracle

    d = Driver(full_plan())
    d.o = RadixOracle(d.plan, prefix_reuse=False)
    t = rng_tokens(10, 12)
    h, _ = d.run(t)
    d.release(h)
    assert d.admit([*t, 1])[2] == 0 and d.o.counts().cached_only.tolist() == [0]
