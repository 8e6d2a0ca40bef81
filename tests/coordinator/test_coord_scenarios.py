"""Scenario tests of the request lifecycle (docs/semantics.md), one behaviour each.

Every op in the Driver is followed by a full invariant audit (audit.check_state).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import ABORT, FINISH, PLAN, RETRACT, Driver, assert_same, make_plan, snapshot

from flatkv_jax.coordinator import ReleaseBatch, audit, host, ops
from flatkv_jax.coordinator.alloc import reclaim_chunk
from flatkv_jax.coordinator.state import table
from flatkv_jax.status import Status

OK, IDLE, STALE = Status.OK, Status.IDLE, Status.STALE
C4 = PLAN.group_index("c4_kv")


def st(res, n=None):
    return host.statuses(res, n)


def test_all_or_nothing_across_pools_and_nothing_touched_on_failure():
    d = Driver(make_plan(c4_kv=5))  # c4_kv blocks span 16 tokens; every other pool is roomy
    a, b, c = d.new(16), d.new(16), d.new(16)
    d.new(10)
    assert d.counts()["c4_kv"].free == 1
    res = d.extend((a, 16), (b, 16))
    assert st(res, 2) == [OK, Status.OUT_OF_PAGES]
    assert int(res.short_group[1]) == C4 and int(res.short_pages[1]) == 1
    assert int(res.short_group[0]) == -1
    # b got nothing in any pool, although only c4_kv was short.
    assert d.n_c(b) == (16, 0) and len(d.pages_of(b)["swa_kv"]) == 4
    before = snapshot(d.state)
    res = d.extend((c, 16))
    assert st(res, 1) == [Status.OUT_OF_PAGES]
    assert int(res.short_pages[0]) == 1
    assert all(int(z.max()) == -1 for z in res.zero)
    assert_same(before, d.state)


def test_in_batch_fifo_rule_blocks_later_rows_even_if_they_fit():
    d = Driver(make_plan(c4_kv=5))
    a, b, _ = d.new(16), d.new(16), d.new(16)
    dd = d.new(10)  # its next token needs no new page anywhere
    d.extend((a, 16))  # takes the last c4_kv page
    before = snapshot(d.state)
    res = d.extend((b, 16), (dd, 1))
    assert st(res, 2) == [Status.OUT_OF_PAGES, Status.OUT_OF_PAGES]
    assert int(res.short_group[0]) == C4 and int(res.short_group[1]) == -1
    assert_same(before, d.state)
    # Alone, the same row is served: only the batch order blocked it.
    assert st(d.extend((dd, 1)), 1) == [OK]


def test_admit_is_atomic_and_names_the_short_pool():
    d = Driver(make_plan(c16_state=10))
    d.new(16)  # c16_state (window 20, blocks of 4) takes 4 pages for 16 tokens
    d.new(16)
    before = snapshot(d.state)
    res = d.admit((16, 16))
    assert st(res, 1) == [Status.OUT_OF_PAGES]
    assert int(res.short_group[0]) == PLAN.group_index("c16_state") and int(res.short_pages[0]) == 2
    assert int(res.slot[0]) == -1
    assert_same(before, d.state)


def test_window_working_set_plateaus_while_history_grows():
    d = Driver()
    h = d.new(8)
    d.retire((h, 8))
    window = [g for g in PLAN.groups if g.is_window]
    hist_held = []
    for step in range(24):
        d.extend((h, 2))
        d.retire((h, 1 if step % 5 == 0 else 2))
        d.reclaim(h)
        n, c = d.n_c(h)
        assert n == c
        counts = d.counts()
        for g in window:
            assert counts[g.name].in_use <= g.live_blocks(PLAN.limits.decode_tokens), (g.name, step)
        hist_held.append(counts["c4_kv"].in_use)
        assert counts["c4_kv"].in_use == -(-n // 16) and counts["c16_kv"].in_use == -(-n // 16)
    assert hist_held[-1] > hist_held[0]
    swa = d.pages_of(h)["swa_kv"]
    assert len(swa) <= 3 and np.asarray(table(PLAN, d.state, 0))[h[0], :10].tolist().count(0) >= 8


def test_pages_restored_after_finish_abort_and_retract():
    d = Driver()
    a, b, c = d.new(20, 16), d.new(30, 16), d.new(5)
    d.retire((a, 16), (b, 16), (c, 5))
    d.extend((a, 4), (b, 14), (c, 2))
    d.retire((a, 4), (b, 10), (c, 1))
    d.reclaim(a, b, c)
    assert not d.all_free()
    res = d.release((a, FINISH), (b, ABORT), (c, RETRACT))
    assert st(res, 3) == [OK, OK, OK]
    assert d.all_free()
    for gi, g in enumerate(PLAN.groups):
        free, _, refcount = audit.pool_arrays(PLAN, d.state, gi)
        assert refcount.max() == 0
        assert sorted(free.tolist()) == list(range(1, PLAN.usable_pages(g) + 1))
    assert not np.asarray(d.state.live).any()
    assert np.asarray(d.state.generation)[:3].tolist() == [1, 1, 1]


def test_readmission_after_retraction():
    d = Driver()
    a = d.new(16)
    d.retire((a, 16))
    pages_first = d.pages_of(a)
    assert st(d.release((a, RETRACT)), 1) == [OK]
    a2 = d.new(16)
    assert a2 == (a[0], a[1] + 1)
    assert {k: len(v) for k, v in d.pages_of(a2).items()} == {
        k: len(v) for k, v in pages_first.items()
    }
    assert st(d.extend((a, 1)), 1) == [STALE]
    assert st(d.retire((a2, 16)), 1) == [OK]


def test_admit_claims_the_lowest_free_slots_and_reports_no_slot():
    d = Driver()
    hs = [d.new(4) for _ in range(4)]
    assert [h[0] for h in hs] == [0, 1, 2, 3]
    assert st(d.admit((4, 4)), 1) == [Status.NO_SLOT]
    d.retire((hs[1], 4), (hs[2], 4))
    d.release((hs[2], FINISH), (hs[1], ABORT))
    res = d.admit((4, 4), (4, 4), (4, 4))
    assert st(res, 3) == [OK, OK, Status.NO_SLOT]
    assert host.handles(res, 2) == [(1, 1), (2, 1)]


def test_rewind_keeps_committed_pages():
    d = Driver()
    h = d.new(7)
    d.retire((h, 7))
    committed = d.pages_of(h)
    res = d.extend((h, 2))  # positions 7, 8: position 8 opens swa block 2
    new_swa = [int(p) for p in np.asarray(res.zero[0]) if p > 0]
    assert len(new_swa) == 1
    r = d.retire((h, 1))  # the draft token at 8 is rejected
    assert st(r, 1) == [OK] and (int(r.committed[0]), int(r.extent[0])) == (8, 8)
    after = d.pages_of(h)
    for g, pages in committed.items():
        assert after[g][: len(pages)] == pages  # nothing committed is lost
    assert after["swa_kv"][-1] == new_swa[0]  # the tail page is kept for the overwrite
    res = d.extend((h, 2))  # positions 8, 9 reuse the kept page
    assert int(np.asarray(res.zero[0]).max()) == -1
    assert d.pages_of(h)["swa_kv"] == after["swa_kv"]


def test_explicit_rewind_cuts_in_flight_steps():
    d = Driver()
    h = d.new(8)
    d.retire((h, 8))
    d.extend((h, 2))  # (8, 2) in flight, n = 10
    assert st(d.rewind((h, 9)), 1) == [OK]
    assert d.n_c(h) == (9, 8)
    r = d.retire((h, 2))  # token 9 was cut by the rewind: only 8 commits
    assert st(r, 1) == [OK] and d.n_c(h) == (9, 9)
    d.extend((h, 2))  # (9, 2)
    d.rewind((h, 9))  # cuts the whole step
    assert st(d.retire((h, 2)), 1) == [Status.DISCARDED] and d.n_c(h) == (9, 9)
    assert st(d.rewind((h, 10)), 1) == [Status.BAD_ARG]  # past the extent
    assert st(d.rewind((h, 8)), 1) == [Status.BAD_ARG]  # below committed


def test_pipelined_step_after_partial_accept_is_discarded():
    d = Driver()
    h = d.new(8)
    d.retire((h, 8))
    d.extend((h, 2))  # (8, 2)
    d.extend((h, 2))  # (10, 2), scheduled before the first result
    assert d.n_c(h) == (12, 8)
    held = d.counts()
    r = d.retire((h, 1))
    assert st(r, 1) == [OK] and d.n_c(h) == (9, 9)
    r = d.retire((h, 2))
    assert st(r, 1) == [Status.DISCARDED] and d.n_c(h) == (9, 9)
    assert d.counts() == held  # rewinds keep pages


def test_stale_generation_is_rejected_and_changes_nothing():
    d = Driver()
    a = d.new(8)
    d.retire((a, 8))
    d.release((a, FINISH))
    b = d.new(8)  # reuses slot 0 with generation 1
    assert b == (0, 1)
    before = snapshot(d.state)
    assert st(d.extend((a, 1)), 1) == [STALE]
    assert st(d.retire((a, 1)), 1) == [STALE]
    assert st(d.rewind((a, 8)), 1) == [STALE]
    assert st(d.reclaim(a), 1) == [STALE]
    assert st(d.release((a, ABORT)), 1) == [STALE]
    assert st(d.extend(((9, 0), 1)), 1) == [STALE]  # no such slot
    assert st(d.extend(((-1, 0), 1)), 1) == [STALE]
    assert_same(before, d.state)


def test_deferred_release_frees_only_after_retirement():
    d = Driver()
    a = d.new(8)  # (0, 8) in flight
    d.extend((a, 2))  # (8, 2) in flight
    held = d.counts()
    assert st(d.release((a, FINISH)), 1) == [Status.DEFERRED]
    assert d.counts() == held
    assert st(d.extend((a, 1)), 1) == [STALE]  # no new steps
    assert st(d.release((a, ABORT)), 1) == [STALE]  # already pending
    r = d.retire((a, 8))
    assert st(r, 1) == [OK] and not bool(r.released[0])
    assert st(d.reclaim(a), 1) == [OK]
    r = d.retire((a, 2))
    assert st(r, 1) == [OK] and bool(r.released[0])
    assert d.all_free()
    assert st(d.retire((a, 0)), 1) == [STALE]


def test_a_deferred_release_of_a_long_request_frees_every_page_in_several_chunks():
    """The retire that frees a deferred release sweeps in a decode step's chunks
    (``reclaim_chunk``): a request holding more table entries than one chunk is freed
    whole, its pages back on the free stacks or cached, the audit clean after each op."""
    d = Driver()
    a = d.new(16)
    d.retire((a, 16))
    for _ in range(2):
        d.extend((a, 16))
        d.retire((a, 16))
    d.extend((a, 15))  # 63 tokens, the last 15 in flight
    entries = int(np.asarray(d.state.hi)[:, a[0]].sum())
    assert entries > reclaim_chunk(d.plan, d.state.max_requests)
    assert st(d.release((a, FINISH)), 1) == [Status.DEFERRED]
    r = d.retire((a, 15))
    assert st(r, 1) == [OK] and bool(r.released[0])
    assert d.all_free()
    assert st(d.reclaim(a), 1) == [STALE]


def test_deferred_abort_frees_after_a_discarded_step():
    d = Driver()
    a = d.new(8)
    d.extend((a, 2))
    assert st(d.release((a, ABORT)), 1) == [Status.DEFERRED]
    d.retire((a, 3))  # 3 of 8: the next step is discarded
    r = d.retire((a, 2))
    assert st(r, 1) == [Status.DISCARDED] and bool(r.released[0])
    assert d.all_free()


def test_two_requests_never_share_a_page():
    d = Driver()
    hs = [d.new(16, 16), d.new(9), d.new(3), d.new(12, 5)]
    d.retire(*[(h, c) for h, c in zip(hs, (16, 9, 3, 5), strict=True)])
    for _ in range(3):
        d.extend(*[(h, 2) for h in hs])
        d.retire(*[(h, 2) for h in hs])
        d.reclaim(*hs)
    for g in PLAN.groups:
        seen = [set(d.pages_of(h)[g.name]) for h in hs]
        assert sum(len(s) for s in seen) == len(set().union(*seen)), g.name


def test_error_statuses():
    d = Driver()
    a = d.new(8)
    assert st(d.admit((0, 0), (4, 5), (4, 17), (65, 1)), 4) == [
        Status.BAD_ARG, Status.BAD_ARG, Status.BAD_ARG, Status.TOO_LONG,
    ]  # fmt: skip
    assert st(d.extend((a, 0)), 1) == [Status.BAD_ARG]
    assert st(d.extend((a, 17)), 1) == [Status.BAD_ARG]
    assert st(d.extend((a, 1), (a, 1)), 2) == [OK, Status.BAD_ARG]  # a slot once per batch
    assert st(d.extend((a, 1)), 1) == [Status.FIFO_FULL]
    assert st(d.retire((a, 9)), 1) == [Status.BAD_ARG]  # accepted > count
    d.retire((a, 8))
    d.retire((a, 1))
    assert st(d.retire((a, 0)), 1) == [Status.NO_STEP]
    for _ in range(3):
        d.extend((a, 16))
        d.retire((a, 16))
    assert d.n_c(a) == (57, 57)
    assert st(d.extend((a, 9)), 1) == [Status.TOO_LONG]  # 57 + 9 > 64 + 1
    assert st(d.extend((a, 8)), 1) == [OK]
    # An unknown mode (the host builder only takes ReleaseMode values).
    batch = ReleaseBatch(
        *(jnp.asarray(x) for x in ([True] + [False] * 3, [0] * 4, [0] * 4, [7, 0, 0, 0]))
    )
    d.state, res = ops.release(PLAN, d.state, batch)
    assert st(res, 1) == [Status.BAD_ARG]
    assert st(d.release((a, FINISH)), 1) == [Status.DEFERRED]
    assert st(d.extend(), 1) == [IDLE]


def test_reclaim_drops_a_period_groups_state_before_its_last_boundary():
    """A group with a period reads back only its carry across a period boundary, so reclaim
    drops what lies before it: c16_state (period 16, no carry, window 20 = five 4-token
    columns) holds nothing from before the last multiple of 16, while a sliding window of 20
    would keep four columns; c4_state (period 4, carry 4) keeps one column before its last
    boundary; swa_kv (sliding, window 8) keeps what its window reads. The oracle reclaims by
    the same rule (tests/oracle differential), and GroupSpec.first_read states it."""
    d = Driver()
    h = d.new(16)
    d.retire((h, 16))
    s16, s4, swa = (PLAN.group(n) for n in ("c16_state", "c4_state", "swa_kv"))
    seen = []
    for c in range(17, 36):
        d.extend((h, 1))
        d.retire((h, 1))
        d.reclaim(h)
        row = {
            g.name: np.asarray(table(PLAN, d.state, PLAN.group_index(g.name)))[h[0]]
            for g in (s16, s4, swa)
        }
        lo = {name: int((r == 0).sum()) for name, r in row.items()}  # leading holes
        assert lo["c16_state"] == c // 16 * 16 // 4, (c, lo)
        assert s16.first_read(c) == max(c - 19, c // 16 * 16)
        assert lo["c4_state"] == (c // 4 * 4 - 4) // 4, (c, lo)
        assert lo["swa_kv"] == max(0, c - 7) // 4, (c, lo)
        seen.append(lo["c16_state"] - max(0, c - 19) // 4)
    # Right after the boundary at 32 the period rule frees five more columns than a sliding
    # window would; just before it (c = 31) one.
    assert seen[32 - 17] == 5 and seen[31 - 17] == 1
    with pytest.raises(ValueError, match=r"group='c4_kv' is invalid: first_read is defined"):
        PLAN.group("c4_kv").first_read(5)
