"""Prefix-reuse scenarios of issue 5, run on the oracle alone (docs/semantics.md, "Prefix reuse")."""

from __future__ import annotations

import numpy as np
from oracle_cases import Driver, full_plan, hybrid_plan, rng_tokens, v4_plan

from flatkv_jax.oracle import ReleaseMode, run_trace
from flatkv_jax.oracle.traces import Op, OpKind, Trace
from flatkv_jax.status import Status


def _views_share(d: Driver, group: str, a, b, blocks: int) -> bool:
    t = d.o.view().tables[d.plan.group_index(group)]
    return bool(
        np.array_equal(t[a[0], :blocks], t[b[0], :blocks]) and (t[a[0], :blocks] >= 1).all()
    )


def test_shared_system_prompt_hits_while_running_and_after_finish():
    d = Driver(v4_plan())
    system = rng_tokens(1, 40)
    a, _ = d.run(system + rng_tokens(2, 10))
    # Running A published its committed blocks at retire: B hits the common whole blocks.
    st, b, hit = d.admit(system + rng_tokens(3, 10))
    assert st is Status.OK and hit == 32  # 40 common tokens, granularity 16
    assert _views_share(d, "c4_kv", a, b, 2) and _views_share(d, "c16_kv", a, b, 2)
    # B's window slots before its trailing run are holes; the trailing run is A's pages.
    t_b = d.o.view().tables[d.plan.group_index("swa_kv")][b[0]]
    t_a = d.o.view().tables[d.plan.group_index("swa_kv")][a[0]]
    assert (t_b[:6] == 0).all() and np.array_equal(t_b[6:8], t_a[6:8])
    d.retire_all(b)
    assert d.release(a) is Status.OK and d.release(b) is Status.OK
    st, _c, hit = d.admit(system + rng_tokens(4, 20))
    assert st is Status.OK and hit == 32
    d.check()


def test_divergence_inside_a_block_hits_only_common_whole_blocks():
    d = Driver(full_plan())
    a_toks = rng_tokens(5, 30)
    _a, _ = d.run(a_toks)
    for common, want in [(17, 16), (16, 16), (15, 12), (3, 0), (29, 28)]:
        st, h, hit = d.admit(a_toks[:common] + [5000 + common] * 5, first_chunk=1)
        assert st is Status.OK and hit == want, (common, hit)
        assert d.release(h, ReleaseMode.ABORT) is Status.DEFERRED
        d.retire_all(h)
    d2 = Driver(v4_plan())
    a_toks = rng_tokens(6, 48)
    d2.run(a_toks)
    for common, want in [(37, 32), (31, 16), (15, 0)]:
        st, h, hit = d2.admit(a_toks[:common] + [7000] * 3, first_chunk=1)
        assert st is Status.OK and hit == want, (common, hit)
    d.check()
    d2.check()


def _hybrid_with_evicted_tail(evict: bool):
    d = Driver(hybrid_plan(full=40, swa=12))
    a_toks = rng_tokens(7, 40)
    a, _ = d.run(a_toks)  # 10 swa pages, none reclaimed
    assert d.release(a) is Status.OK
    assert d.counts("swa_kv") == (2, 0, 10)
    if evict:
        # Another namespace needs 4 swa pages: 2 free ones, then the 2 least recently
        # released cached-only pages (A's tail blocks 9 and 8 went cached-only first).
        st, _c, _ = d.admit(rng_tokens(8, 16), namespace=1)
        assert st is Status.OK and d.counts("swa_kv") == (0, 4, 8)
        assert d.counts("full_kv") == (26, 4, 10)  # history untouched
    return d, a_toks


def test_window_trailing_run_decides_the_boundary():
    d, a_toks = _hybrid_with_evicted_tail(evict=False)
    assert d.admit([*a_toks, 1])[2] == 40
    d, a_toks = _hybrid_with_evicted_tail(evict=True)
    # History holds all 10 blocks, but the window needs blocks [h/4 - 2, h/4): h = 40 and
    # h = 36 lack swa block 8, h = 32 has blocks 6 and 7.
    st, _, hit = d.admit([*a_toks, 1])
    assert st is Status.OK and hit == 32
    d.check()


def test_swa_churn_does_not_evict_cached_history():
    plan = hybrid_plan(full=80, swa=40)
    gi_full = plan.group_index("full_kv")
    for waves, want_full_hit in [(1, True), (3, False)]:
        d = Driver(plan)
        a_toks = rng_tokens(9, 24)
        a, _ = d.run(a_toks)
        d.release(a)
        assert d.counts("full_kv")[2] == 6 and d.counts("swa_kv")[2] == 6
        for wave in range(waves):
            hs = [
                d.run(rng_tokens(100 + 10 * wave + i, 8), namespace=1, reclaim=True)[0]
                for i in range(3)
            ]
            for step in range(34):
                for i, h in enumerate(hs):
                    d.decode(h, [step * 7 + i], reclaim=True)
            for h in hs:
                d.release(h)
        # Churn cycled far more window pages than the window pool holds, yet no cached
        # history page was evicted: A's six history blocks are all still in the index.
        a_history = [p for p in d.o.node_of[gi_full] if d.o.pools[gi_full].refcount[p] == 1]
        assert len(a_history) >= 6
        st, _, hit = d.admit([*a_toks, 1])
        assert st is Status.OK
        if want_full_hit:
            # Free pages (never published) are reused before any cached-only page.
            assert hit == 24
        d.check()


def test_rejected_drafts_are_not_published_and_never_hit():
    d = Driver(full_plan())
    base = rng_tokens(10, 6)
    a, _ = d.run(base)
    assert d.extend(a, [500, 501, 502]) is Status.OK  # positions 6..8; block 1 is complete
    assert d.retire(a, 1) is Status.OK  # only token 6 accepted: c = 7
    assert d.state(a) == (7, 7)
    st, _b, hit = d.admit([*base, 500, 501, 502, 503], first_chunk=1)
    assert st is Status.OK and hit == 4  # block 1 was written with rejected drafts: no hit
    assert d.extend(a, [600]) is Status.OK and d.retire(a, 1) is Status.OK
    assert d.admit([*base, 500, 600, 1], first_chunk=1)[2] == 8
    assert d.admit([*base, 500, 501, 502, 503], first_chunk=1)[2] == 4
    # Pipelined steps: the second one starts past the rejected tokens and is DISCARDED.
    assert d.extend(a, [700, 701, 702]) is Status.OK and d.extend(a, [703, 704, 705]) is Status.OK
    assert d.retire(a, 1) is Status.OK and d.retire(a, 3) is Status.DISCARDED
    assert d.state(a) == (9, 9)
    d.release(a)
    st, _, hit = d.admit([*base, 500, 600, 700, 701, 702, 703, 704, 705])
    assert st is Status.NO_SLOT or hit == 8
    d.check()


def test_finish_then_readmit_hits_its_own_prefix():
    for mode in (ReleaseMode.FINISH, ReleaseMode.RETRACT):
        d = Driver(v4_plan())
        prompt = rng_tokens(11, 40)
        a, _ = d.run(prompt, reclaim=True)
        out = rng_tokens(12, 10)
        d.decode(a, out, reclaim=True)
        assert d.release(a, mode) is Status.OK
        st, _, hit = d.admit(prompt + out + [3, 4])
        assert st is Status.OK and hit == 48
        d.check()


def test_abort_never_hits():
    d = Driver(v4_plan())
    prompt = rng_tokens(13, 40)
    _st, a, _ = d.admit(prompt)
    assert d.release(a, ReleaseMode.ABORT) is Status.DEFERRED
    d.retire_all(a)  # the in-flight step is accepted, but an aborted request publishes nothing
    c = d.o.counts()
    assert not c.live.any() and (c.cached_only == 0).all()
    assert (c.free == [d.plan.usable_pages(g) for g in d.plan.groups]).all()
    assert d.admit(prompt)[2] == 0
    d.check()


def test_lru_order_and_hits_refresh():
    plan = full_plan(pages=8, max_context=16, chunk=8)
    prompts = [rng_tokens(20 + i, 8) for i in range(3)]

    def setup():
        d = Driver(plan)
        for p in prompts:
            h, _ = d.run(p)
            d.release(h)
        assert d.counts("kv") == (2, 0, 6)
        return d

    d = setup()
    held = [d.run(rng_tokens(30 + i, 8), namespace=1)[0] for i in range(2)]  # 2 free + evict A
    assert d.counts("kv") == (0, 4, 4)
    assert [d.probe([*p, 1]) for p in prompts] == [0, 8, 8]
    del held
    # A hit takes A's pages off the LRU list; released again, they are the most recent.
    d = setup()
    assert d.probe(prompts[0] + [1]) == 8
    d.run(rng_tokens(40, 8), namespace=1)
    d.run(rng_tokens(41, 8), namespace=1)
    assert [d.probe([*p, 1]) for p in prompts] == [8, 0, 8]
    # Within one release the tail block goes cached-only first, so it is evicted first.
    d = setup()
    d.run(rng_tokens(42, 8), namespace=1)
    d.run(rng_tokens(43, 4), namespace=1)  # 2 free + 1 evicted: A's block 1
    assert [d.probe([*p, 1]) for p in prompts] == [4, 8, 8]
    d.check()


def test_in_order_allocation_with_pins_and_failed_admission_touches_nothing():
    plan = full_plan(pages=8, max_context=16, chunk=8, max_requests=6)

    def setup():
        d = Driver(plan)
        for i in range(3):
            h, _ = d.run(rng_tokens(20 + i, 8))
            d.release(h)
        return d

    d = setup()
    d.run(rng_tokens(30, 8), namespace=1)  # free 0, cached-only 6
    # Row 2 hits prompt 0 (pinning its 2 pages): supply is 4 unpinned cached-only pages; rows
    # 0 and 1 take 2 each (evicting), row 2 needs 1 more and is the first short row; row 3
    # could be served alone but the FIFO rule stops it.
    res = d.admit_many(
        [
            (1, rng_tokens(50, 8), 8),
            (1, rng_tokens(51, 8), 8),
            (0, [*rng_tokens(20, 8), 1], 8),
            (1, [7], 1),
        ]
    )
    assert [Status(int(s)) for s in res.status[:4]] == [
        Status.OK,
        Status.OK,
        Status.OUT_OF_PAGES,
        Status.OUT_OF_PAGES,
    ]
    assert res.short_group[:4].tolist() == [-1, -1, 0, -1] and res.short_pages[:4].tolist() == [
        0,
        0,
        1,
        0,
    ]
    assert d.probe([*rng_tokens(20, 8), 1]) == 8  # the pinned pages survived
    d.check()
    # A failed admission changes nothing: no slot, no refcount, no eviction, no LRU touch.
    d = setup()
    for i in range(3):
        d.run(rng_tokens(30 + i, 8), namespace=1)  # 6 in use, prompt 2's 2 pages cached-only
    lru, before = list(d.o.pools[0].lru), d.o.counts()
    refs = d.o.pools[0].refcount.copy()
    res = d.admit_many([(0, [*rng_tokens(22, 8), 1], 8)])
    assert Status(int(res.status[0])) is Status.OUT_OF_PAGES and int(res.short_pages[0]) == 1
    after = d.o.counts()
    assert list(d.o.pools[0].lru) == lru and np.array_equal(d.o.pools[0].refcount, refs)
    assert all(
        np.array_equal(getattr(before, f), getattr(after, f))
        for f in ("free", "in_use", "cached_only", "live", "generation")
    )
    d.check()


def test_pinned_pages_are_not_supply_in_a_batched_admit():
    plan = full_plan(pages=8, max_context=16, chunk=8)
    d = Driver(plan)
    a_toks = rng_tokens(60, 8)
    a, _ = d.run(a_toks)
    d.release(a)  # 2 cached-only
    d.run(rng_tokens(61, 16), namespace=1)  # 4 in use
    d.run(rng_tokens(62, 8), namespace=1)  # 2 in use: free 0
    alone = Driver(plan)
    alone.o = __import__("copy").deepcopy(d.o)
    # Alone, a new 4-token request evicts one of A's cached-only pages...
    assert Status(int(alone.admit_many([(1, [1, 2, 3, 4], 4)]).status[0])) is Status.OK
    # ...but not in a batch where another row hits A: A's pages are pinned for the call.
    res = d.admit_many([(1, [1, 2, 3, 4], 4), (0, [*a_toks, 9], 1)])
    assert [Status(int(s)) for s in res.status[:2]] == [Status.OUT_OF_PAGES, Status.OUT_OF_PAGES]
    assert (int(res.short_group[0]), int(res.short_pages[0])) == (0, 1)
    d.check()


def test_namespaces_isolate():
    d = Driver(full_plan())
    t = rng_tokens(70, 20)
    _a, _ = d.run(t, namespace=0)
    assert d.admit([*t, 1], namespace=1, first_chunk=1)[2] == 0
    assert d.admit([*t, 1], namespace=0, first_chunk=1)[2] == 20
    d.check()


def test_same_prompt_twice_in_one_admit_batch_does_not_hit_itself():
    d = Driver(full_plan())
    t = rng_tokens(71, 12)
    res = d.admit_many([(0, t, 8), (0, t, 8)])
    assert res.hit[:2].tolist() == [0, 0] and res.status[:2].tolist() == [0, 0]
    d.check()


def test_hand_written_trace_replays_through_the_harness():
    plan = full_plan()
    t = tuple(rng_tokens(72, 10))
    ops = (
        Op(OpKind.ADMIT, ((0, 0, t, 8), None, None, None)),
        Op(OpKind.RETIRE, ((0, 8), None, None, None)),
        Op(OpKind.EXTEND, ((0, t[8:]), None, None, None)),
        Op(OpKind.RETIRE, ((0, 2), None, None, None)),
        Op(OpKind.RELEASE, ((0, int(ReleaseMode.FINISH)), None, None, None)),
        Op(OpKind.ADMIT, ((1, 0, (*t, 5), 8), None, None, None)),
        Op(OpKind.EXTEND, ((0, (1,)), None, None, None)),  # a stale handle
    )
    rep = run_trace(Trace(plan, 0, ops), Driver(plan).o)
    assert rep.ok, rep.divergence
    assert (rep.admitted, rep.hit_tokens, rep.prompt_tokens) == (2, 8, 21)
