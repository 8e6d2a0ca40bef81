"""Prefix reuse in the device coordinator (issue 5): scenarios of docs/semantics.md,
"Prefix reuse", on the tiny-V4 plan (granularity 16: history blocks of 16 tokens, window and
state blocks of 4; windows 8 and 20).

The randomized cross-check is the oracle differential
(tests/oracle/test_differential.py::test_device_coordinator_matches_the_oracle and
``python -m flatkv_jax.oracle.long_run --device``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from coordinator_cases import (
    ABORT,
    FINISH,
    PLAN,
    RETRACT,
    Driver,
    Status,
    assert_same,
    audit,
    host,
    make_plan,
    ops,
    snapshot,
)

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator.alloc import evict_bounds
from flatkv_jax.coordinator.publish import publish_strides, publish_unit
from flatkv_jax.oracle import RadixOracle
from flatkv_jax.oracle import admit_batch as oracle_admit_batch
from flatkv_jax.oracle import extend_batch as oracle_extend_batch
from flatkv_jax.recipes import deepseek_v4_groups, v4_flash

CHUNK = PLAN.limits.chunk_tokens
SYS = list(range(1000, 1032))  # a 32-token "system prompt"


class PrefixDriver(Driver):
    """A :class:`Driver` whose audit allows pages shared through prefix hits."""

    def _run(self, op, batch, **kw):
        self.state, res = op(self.plan, self.state, batch, **kw)
        audit.check_state(self.plan, self.state, shared_ok=True)
        return res

    def admit_tokens(self, tokens, first_chunk=None, ns=0):
        fc = min(CHUNK, len(tokens)) if first_chunk is None else first_chunk
        res = self._run(
            ops.admit,
            host.admit_batch(self.plan, [(len(tokens), fc)], tokens=[tokens], namespace=[ns]),
        )
        return res

    def prefill(self, tokens, ns=0):
        """Admits ``tokens`` and commits the whole prompt; returns (handle, hit)."""
        res = self.admit_tokens(tokens, ns=ns)
        assert host.statuses(res, 1) == [Status.OK]
        h, hit = host.handles(res, 1)[0], int(res.hit[0])
        c = hit
        count = int(res.count[0])
        while True:
            if count:
                assert host.statuses(self.retire((h, count)), 1) == [Status.OK]
                c += count
            if c >= len(tokens):
                return h, hit
            count = min(CHUNK, len(tokens) - c)
            self.step(h, tokens[c : c + count])

    def step(self, h, tokens):
        res = self._run(
            ops.extend, host.extend_batch(self.plan, [(h, len(tokens))], tokens=[tokens])
        )
        assert host.statuses(res, 1) == [Status.OK]
        return res

    def hit(self, tokens, ns=0):
        """The hit an admission of ``tokens`` gets (the request is released again, ABORT)."""
        res = self.admit_tokens(tokens, first_chunk=0, ns=ns)
        assert host.statuses(res, 1) == [Status.OK]
        self.release((host.handles(res, 1)[0], ABORT))
        return int(res.hit[0])

    def cached(self, group):
        return self.counts()[group].cached_only


def test_shared_system_prompt_hits_and_shares_pages():
    d = PrefixDriver()
    a, hit = d.prefill([*SYS, 1, 2, 3, 4, 5, 6, 7, 8])
    assert hit == 0
    # While A is live, B shares its pages (refcount 2, never copied).
    res = d.admit_tokens([*SYS, 9, 9, 9, 9, 9])
    b = host.handles(res, 1)[0]
    assert int(res.hit[0]) == 32 and int(res.start[0]) == 32 and int(res.count[0]) == 5
    assert d.n_c(b) == (37, 32)
    pa, pb = d.pages_of(a), d.pages_of(b)
    assert pb["c4_kv"][:2] == pa["c4_kv"][:2] and pb["c16_kv"][:2] == pa["c16_kv"][:2]
    # Window groups hold only the trailing run of the hit (holes before it).
    row = np.asarray(d.state.tables[PLAN.group_index("swa_kv")][b[0]])
    assert row[:6].tolist() == [0] * 6 and np.all(row[6:8] >= 1)
    d.release((a, FINISH))
    d.release((b, FINISH))
    assert d.hit([*SYS, 4, 4]) == 32


def test_divergence_inside_a_block_hits_the_common_whole_blocks():
    d = PrefixDriver()
    base = list(range(1, 41))
    d.release((d.prefill(base)[0], FINISH))
    other = base[:20] + [77] * 20  # shares 20 tokens: one whole 16-token block
    assert d.hit(other) == 16
    assert d.hit(base[:15] + [77] * 25) == 0
    assert d.hit(base) == 32  # never the last prompt token (h <= prompt_len - 1)
    assert d.hit(base[:33]) == 32 and d.hit(base[:32]) == 16


def test_namespaces_isolate():
    d = PrefixDriver()
    d.release((d.prefill([*SYS, 1], ns=1)[0], FINISH))
    assert d.hit([*SYS, 1], ns=2) == 0
    assert d.hit([*SYS, 1], ns=1) == 32


def test_rejected_drafts_are_not_published_and_never_hit():
    d = PrefixDriver()
    toks = list(range(1, 41))
    res = d.admit_tokens(toks[:16])
    h = host.handles(res, 1)[0]
    d.retire((h, 16))
    d.step(h, toks[16:32])  # a 16-token "draft" step
    d.retire((h, 3))  # 3 accepted: c = 19
    assert d.n_c(h) == (19, 19)
    assert d.hit(toks) == 16
    d.release((h, FINISH))
    assert d.hit(toks) == 16


def test_finish_or_retract_then_readmit_hits_its_own_prefix():
    d = PrefixDriver()
    toks = list(range(5, 45))
    h, _ = d.prefill(toks)
    d.release((h, RETRACT))
    h, hit = d.prefill(toks)
    assert hit == 32
    d.release((h, FINISH))
    assert d.hit(toks) == 32


def test_abort_never_publishes_its_in_flight_steps():
    d = PrefixDriver()
    toks = list(range(7, 47))
    res = d.admit_tokens(toks)
    h = host.handles(res, 1)[0]
    assert host.statuses(d.release((h, ABORT)), 1) == [Status.DEFERRED]
    d.retire((h, 16))  # commits, but the request is being aborted: nothing published
    assert all(int(ix.count) == 0 for ix in d.state.indexes)
    assert d.hit(toks) == 0


def test_a_window_groups_trailing_run_decides_the_boundary():
    d = PrefixDriver()
    toks = list(range(1, 50))
    h, _ = d.prefill(toks)  # c = 49: blocks ending <= 48 published
    d.reclaim(h)  # window slots behind the window become holes (their pages stay cached)
    d.release((h, FINISH))
    assert d.hit(toks) == 48
    # The hit's swa_kv row (W = 8, B = 4): blocks 10..11 hold positions 41..47, the window
    # of position 48; older slots are holes even though their pages are cached. c4_state
    # (period 4, carry 4) takes only block 11; c16_state (period 16, no carry) nothing.
    res = d.admit_tokens(toks, first_chunk=0)
    h2 = host.handles(res, 1)[0]
    for name, first in (("swa_kv", 10), ("c4_state", 11), ("c16_state", 12)):
        row = np.asarray(d.state.tables[PLAN.group_index(name)][h2[0]])
        assert row[:first].tolist() == [0] * first, name
        assert np.all(row[first:12] >= 1) and row[12] == -1, name
    # Nothing of c16_state was published: no admission can read it from the index.
    assert int(d.state.indexes[PLAN.group_index("c16_state")].count) == 0
    d.release((h2, ABORT))


def test_lru_evicts_least_recently_released_first_and_free_pages_before_cached():
    plan = make_plan(pages=40, c4_kv=5, c16_kv=5)
    d = PrefixDriver(plan)
    a_toks, b_toks = list(range(1, 18)), list(range(101, 118))
    d.release((d.prefill(a_toks)[0], FINISH))  # A's pages become cached-only first
    d.release((d.prefill(b_toks)[0], FINISH))
    before = d.counts()["c4_kv"]
    assert (before.cached_only, before.free) == (2, 3)
    # 64 tokens need 4 history pages: the 3 free ones first, then A's (least recent).
    fill = d.new(16)
    d.retire((fill, 16))
    for _ in range(3):
        d.step(fill, [0] * 16)
        d.retire((fill, 16))
    after = d.counts()["c4_kv"]
    assert (after.cached_only, after.free, after.in_use) == (1, 0, 4)
    assert d.hit(b_toks) == 16
    assert d.hit(a_toks) == 0


def test_failed_admission_touches_nothing_not_even_lru_order():
    plan = make_plan(pages=12)
    d = PrefixDriver(plan)
    toks = list(range(1, 34))
    d.release((d.prefill(toks)[0], FINISH))
    for _ in range(2):  # the hogs hold every swa_kv page but the cached ones
        hog = d.new(16)
        d.retire((hog, 16))
    before = snapshot(d.state)
    assert d.counts()["swa_kv"].free == 0 and d.counts()["swa_kv"].cached_only == 4
    # A hit plus more pages than exist: OUT_OF_PAGES, and nothing changes (pins included).
    batch = host.admit_batch(plan, [(64, 16), (33, 16)], tokens=[list(range(1, 65)), toks])
    d.state, res = ops.admit(plan, d.state, batch)
    assert host.statuses(res, 2) == [Status.OUT_OF_PAGES] * 2
    assert_same(d.state, before)
    audit.check_state(plan, d.state, shared_ok=True)


def test_window_churn_does_not_evict_cached_history():
    d = PrefixDriver()
    toks = list(range(1, 34))
    d.release((d.prefill(toks)[0], FINISH))
    cached = d.cached("c4_kv")
    hs = [d.new(16) for _ in range(3)]
    for h in hs:
        d.retire((h, 16))
    for _ in range(12):
        for h in hs:
            d._run(ops.extend, host.extend_batch(PLAN, [(h, 1)]))
            d.retire((h, 1))
            d.reclaim(h)
    assert d.cached("c4_kv") == cached
    assert d.hit(toks) == 32


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(namespace=[1]), "a namespace only matters with tokens"),
        (dict(tokens=[[1, 2]]), "the prompt has prompt_len = 3 tokens"),
        (dict(tokens=[[1, 2, 3], [4]]), "one token list per row"),
        (dict(tokens=[[1, 2, 3]], namespace=[1, 2]), "one int per row"),
    ],
)
def test_host_token_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        host.admit_batch(PLAN, [(3, 3)], **kw)


def test_host_step_tokens_too_long():
    with pytest.raises(ValueError, match="at most 16 tokens fit a row"):
        host.extend_batch(PLAN, [((0, 0), 1)], tokens=[list(range(17))])


def test_prefix_state_is_a_pytree_of_arrays():
    d = PrefixDriver()
    leaves = jax.tree.leaves(d.state)
    assert all(isinstance(x, jax.Array) for x in leaves)


def _lifecycle(d, with_tokens):
    """One request through prefill, decode with a rejected draft, reclaim and FINISH."""
    toks = list(range(40))
    kw = {"tokens": [toks]} if with_tokens else {}
    res = d._run(ops.admit, host.admit_batch(d.plan, [(40, CHUNK)], **kw))
    h = host.handles(res, 1)[0]
    c = CHUNK
    d.retire((h, CHUNK))
    while c < 40:
        n = min(CHUNK, 40 - c)
        kw = {"tokens": [toks[c : c + n]]} if with_tokens else {}
        d._run(ops.extend, host.extend_batch(d.plan, [(h, n)], **kw))
        d.retire((h, n))
        c += n
    for step in range(6):
        kw = {"tokens": [[7, 8]]} if with_tokens else {}
        d._run(ops.extend, host.extend_batch(d.plan, [(h, 2)], **kw))
        d.retire((h, 1 + step % 2))  # every other step one draft token is rejected
        d.reclaim(h)
    d.release((h, FINISH))
    return h


def test_state_without_prefix_index_runs_the_same_lifecycle():
    """``create_state(prefix=False)``: no index leaves, identical tables and statuses to a
    prefix state driven without tokens, and everything freed at the end."""
    lean, full = PrefixDriver(prefix=False), PrefixDriver()
    assert not lean.state.prefix and full.state.prefix
    assert lean.state.indexes == () and lean.state.lrus == () and lean.state.pinned is None
    # The prefix state is flat across groups: 4 index leaves, 6 LRU leaves and one pin mask
    # whatever the number of groups (each donated leaf costs at dispatch).
    assert len(PLAN.groups) > 1
    assert len(jax.tree.leaves(full.state)) - len(jax.tree.leaves(lean.state)) == 4 + 6 + 1
    for d in (lean, full):
        _lifecycle(d, with_tokens=False)
        assert d.all_free()
    np.testing.assert_array_equal(lean.state.table_buffer, full.state.table_buffer)
    np.testing.assert_array_equal(lean.state.allocator.free_ids, full.state.allocator.free_ids)


def test_retire_max_count_bounds_accepted_and_publishes_the_same():
    d = PrefixDriver()
    h, _ = d.prefill(SYS)
    d.step(h, [5, 6])
    before = snapshot(d.state)
    res = d._run(ops.retire, host.retire_batch(d.plan, [(h, 2)]), max_count=1)
    assert host.statuses(res, 1) == [Status.BAD_ARG]
    assert_same(before, d.state)  # a rejected row changes nothing
    # A decode-width retire publishes exactly what the default (chunk-width) retire does.
    other = PrefixDriver()
    h2, _ = other.prefill(SYS)
    other.step(h2, [5, 6])
    dec = d.plan.limits.decode_tokens
    published = sum(int(ix.count) for ix in d.state.indexes)
    for drv, hh, kw in ((d, h, {"max_count": dec}), (other, h2, {})):
        for i in range(8):  # commits up to 48: blocks ending at 44 and 48 are in a hit run
            drv._run(ops.retire, host.retire_batch(drv.plan, [(hh, 2)]), **kw)
            drv.step(hh, [9 + i, 10 + i])
    assert_same(snapshot(d.state.indexes), snapshot(other.state.indexes))
    assert_same(snapshot(d.state.chain), snapshot(other.state.chain))
    assert sum(int(ix.count) for ix in d.state.indexes) > published  # decode blocks published


def test_a_block_computed_twice_shares_the_indexed_page_and_frees_the_copy():
    d = PrefixDriver()
    toks = [*SYS[:16], 1]
    # B is admitted before A publishes: both compute the 16-token block.
    a = host.handles(d.admit_tokens(toks), 1)[0]
    b = host.handles(d.admit_tokens(toks), 1)[0]
    in_use = d.held("c4_kv")
    assert in_use == 2
    d.retire((a, 16))
    pa = d.pages_of(a)
    d.retire((b, 16))
    # B's committed blocks now point at A's (indexed) pages; B's copies went back free.
    pb = d.pages_of(b)
    for g in ("c4_kv", "c16_kv"):
        assert pb[g] == pa[g], g
    # Window 8: only blocks 2-3 (the 16-token boundary's trailing run) are published and
    # shared; blocks 0-1 stay the request's own, unpublished pages. c4_state (period 4,
    # carry 4) publishes block 3 only, c16_state (period 16, no carry) nothing.
    for g, run in (("swa_kv", 2), ("c4_state", 3), ("c16_state", 4)):
        assert pb[g][run:] == pa[g][run:], g
        assert not set(pb[g][:run]) & set(pa[g][:run]), g
    assert d.held("c4_kv") == 1
    page = pa["c4_kv"][0]
    off = d.plan.group_index("c4_kv")
    assert int(d.state.pools[off].refcount[page]) == 3  # A, B and the index
    d.release((a, FINISH))
    d.release((b, FINISH))
    assert d.cached("c4_kv") == 1 and d.held("c4_kv") == 0
    assert d.hit([*SYS[:16], 5, 6]) == 16


def test_a_prefix_evicted_in_one_group_is_recomputed_and_shared_in_the_others():
    plan = make_plan(pages=12)  # the plan of the failed-admission test: no new compilation
    d = PrefixDriver(plan)
    toks = [*SYS[:16], 1]
    d.release((d.prefill(toks)[0], FINISH))
    # Window groups publish only the trailing run of the 16-token boundary: for swa_kv
    # (4-token blocks, window 8) blocks 2 and 3, for c4_state (period 4, carry 4) block 3;
    # the others went back free.
    counts = d.counts()
    assert counts["swa_kv"].cached_only == 2 and counts["c4_state"].cached_only == 1
    assert counts["c4_kv"].cached_only == 1
    assert d.hit(toks) == 16
    # Token-less requests take every c4_state page: the prefix's state pages are evicted, its
    # c4_kv page stays indexed (3 of 12 pages taken), so the prefix no longer hits.
    hogs = [d.new(16) for _ in range(3)]
    for h in hogs:
        d.retire((h, 16))
        d.release((h, ABORT))
    assert d.hit(toks) == 0 and d.counts()["c4_kv"].cached_only == 1
    # Recomputing it publishes the state pages again and shares the indexed c4_kv page.
    h, hit = d.prefill(toks)
    assert hit == 0
    # c4_kv: the shared indexed page (no longer cached-only) + the page of token 17.
    kv = d.counts()["c4_kv"]
    assert (kv.in_use, kv.cached_only) == (2, 0)
    d.release((h, FINISH))
    assert d.hit(toks) == 16


def _fresh_retire():
    """``ops.retire`` traced anew: ``jax.jit(ops.retire_fn, ...)`` would share the jitted
    op's trace cache (keyed on the function), so a monkeypatched helper would go unseen."""

    def retire(plan, state, batch, max_count=None):
        return ops.retire_fn(plan, state, batch, max_count=max_count)

    return jax.jit(retire, static_argnames=("plan", "max_count"), donate_argnums=1)


def test_publishing_in_chunks_gives_the_single_pass_result(monkeypatch):
    """Publish compacts the offered blocks and inserts them in chunks of
    ``publish.publish_chunk(N)`` rows, each chunk seeing what earlier ones indexed. With chunks
    of one row (every block its own pass) the state after a retire of two requests computing
    the same prompt (the second shares the first's pages), then decode steps, is the state of
    the default single chunk, page for page."""
    from flatkv_jax.coordinator import publish

    toks = [*SYS[:CHUNK], 1, 2, 3]

    def run(retire):
        d = PrefixDriver()
        ra, rb = d.admit_tokens(toks), d.admit_tokens(toks)
        a, b = host.handles(ra, 1)[0], host.handles(rb, 1)[0]
        n = int(ra.count[0])
        res = d._run(retire, host.retire_batch(d.plan, [(a, n), (b, n)]))
        assert host.statuses(res, 2) == [Status.OK, Status.OK]
        for i in range(6):
            d._run(ops.extend, host.extend_batch(d.plan, [(a, 1), (b, 1)], tokens=[[i], [i]]))
            res = d._run(retire, host.retire_batch(d.plan, [(a, 1), (b, 1)]))
            assert host.statuses(res, 2) == [Status.OK, Status.OK]
        return d, a, b

    whole, a, b = run(ops.retire)
    # The second request shares the first one's published pages (one indexed copy).
    assert whole.pages_of(b)["c4_kv"][0] == whole.pages_of(a)["c4_kv"][0]
    monkeypatch.setattr(publish, "publish_chunk", lambda n: 1)
    chunked, _, _ = run(_fresh_retire())
    assert_same(snapshot(whole.state), snapshot(chunked.state))


def test_one_row_batches_publish_reclaim_and_release_as_wider_batches_do():
    """A batch of one row skips the batch rules that only rows of several requests can need
    (one request's blocks and pages are distinct): the index's duplicate rules
    (``insert_in(distinct=True)``) and the repeated-page check of a sweep
    (``decref_left(distinct=True)``); a wider batch checks them. Two requests
    computing the same prompt, retired one at a time (the second shares the pages the first
    published), reclaimed and released (their pages cached-only), then a third that hits
    them (pinned and taken out of the LRU), its decode steps and reclaim leave the same state
    either way."""
    toks = [*SYS[:CHUNK], 1, 2, 3]

    def admit(d, size):
        batch = host.admit_batch(d.plan, [(len(toks), CHUNK)], size, tokens=[toks])
        res = d._run(ops.admit, batch)
        assert host.statuses(res, 1) == [Status.OK]
        return host.handles(res, 1)[0], res

    def run(size):
        d = PrefixDriver()
        (a, ra), (b, rb) = admit(d, size), admit(d, size)
        for h, r in ((a, ra), (b, rb)):
            res = d._run(ops.retire, host.retire_batch(d.plan, [(h, int(r.count[0]))], size))
            assert host.statuses(res, 1) == [Status.OK]
        # The second request shares the first one's published pages (one indexed copy).
        assert d.pages_of(b)["c4_kv"][0] == d.pages_of(a)["c4_kv"][0]
        for h in (a, b):
            rec = d._run(ops.reclaim, host.handle_batch(d.plan, [h], size), max_count=CHUNK)
            assert host.statuses(rec, 1) == [Status.OK]
            assert int(np.asarray(rec.holes).sum()) > 0  # window pages dropped
            res = d._run(ops.release, host.release_batch(d.plan, [(h, FINISH)], size))
            assert host.statuses(res, 1) == [Status.OK]
        cached = int(np.asarray(d.state.lru.count).sum())
        assert cached > 0  # the published prompt is cached-only now
        c, rc = admit(d, size)
        assert int(rc.hit[0]) >= CHUNK  # its pages leave the LRU (pinned, then taken)
        assert int(np.asarray(d.state.lru.count).sum()) < cached
        res = d._run(ops.retire, host.retire_batch(d.plan, [(c, int(rc.count[0]))], size))
        assert host.statuses(res, 1) == [Status.OK]
        for i in range(6):
            d._run(ops.extend, host.extend_batch(d.plan, [(c, 1)], size, tokens=[[i]]))
            res = d._run(ops.retire, host.retire_batch(d.plan, [(c, 1)], size))
            assert host.statuses(res, 1) == [Status.OK]
        rec = d._run(ops.reclaim, host.handle_batch(d.plan, [c], size), max_count=CHUNK)
        assert host.statuses(rec, 1) == [Status.OK]
        return d

    one = run(1)
    wide = run(None)
    assert wide.plan.limits.max_requests > 1
    assert_same(snapshot(one.state), snapshot(wide.state))


def test_reclaim_max_count_sizes_the_chunks_not_the_result():
    """``reclaim(max_count=...)`` only sizes the sweep's chunks (a prefill drops many window
    columns per row): the state is the one of the default decode-sized chunks."""
    toks = [*SYS[:CHUNK], 1, 2, 3]
    states = []
    for kw in ({}, {"max_count": CHUNK}):
        d = PrefixDriver()
        res = d.admit_tokens(toks)
        h = host.handles(res, 1)[0]
        d.retire((h, int(res.count[0])))
        rec = d._run(ops.reclaim, host.handle_batch(d.plan, [h]), **kw)
        assert host.statuses(rec, 1) == [Status.OK]
        assert int(np.asarray(rec.holes).sum()) > 0  # window columns were dropped
        states.append(snapshot(d.state))
    assert_same(*states)
    with pytest.raises(ValueError, match="max_count"):
        ops.reclaim(d.plan, d.state, host.handle_batch(d.plan, [h]), max_count=0)


@pytest.mark.parametrize("recipe", ["tiny", "flash"])
def test_publish_strides_cover_every_block_the_oracle_would_publish(recipe):
    """Publishing takes candidate blocks only at multiples of each group's stride
    (``publish_strides``) and hashes lanes only at multiples of their gcd: every block the
    oracle finds readable by some admission (its own brute-force rule over the boundaries)
    ends at a multiple of the stride, the stride is the gcd of those ends (no looser), and a
    group with stride 0 (V4's ratio-128 state, which carries nothing) has no such block."""
    if recipe == "tiny":
        plan = PLAN
    else:
        groups = deepseek_v4_groups(
            v4_flash(c4_rows=32, c128_rows=1, kv_format="bf16", indexer_format="bf16"),
            verify_width=2,
        )
        plan = plan_with_pages(groups, ServingLimits(2, 1024, 256, 2), 600)
    oracle = RadixOracle(plan)
    gran = plan.prefix_granularity
    strides = publish_strides(plan)
    for gi, (g, stride) in enumerate(zip(plan.groups, strides, strict=True)):
        ends = [
            (i + 1) * g.block_tokens
            for i in range(4 * gran // g.block_tokens)
            if oracle._hit_readable(gi, i)
        ]
        if stride == 0:
            assert ends == [], g.name
            continue
        assert all(e % stride == 0 for e in ends), (g.name, stride)
        assert math.gcd(*ends) == stride, (g.name, stride, ends[:4])
    assert publish_unit(plan) == math.gcd(*[s for s in strides if s])
    if recipe == "flash":
        named = dict(zip((g.name for g in plan.groups), strides, strict=True))
        assert named == {
            "swa_kv": 64,
            "mtp_swa_kv": 64,
            "c4_kv": 128,
            "c4_state": 128,
            "c4_index_state": 128,
            "c128_kv": 128,
            "c128_state": 0,
        }


def test_eviction_bounds_cover_every_grow_and_follow_each_pools_span():
    """A grow of ``k`` pages per row evicts at most ``b * min(k, ceil(k * B_min / B_g))`` pages
    from pool ``g`` (``evict_bounds``): every row's needs in every pool, for any extent and any
    step of at most ``max_count`` tokens, fit that bound (so eviction never clips a shortage);
    on V4-Flash (with its MTP window) a 4,096-token admission walks 2,752 eviction entries
    instead of 7 x 1,024."""
    groups = deepseek_v4_groups(
        v4_flash(c4_rows=32, c128_rows=1, kv_format="bf16", indexer_format="bf16"), verify_width=0
    )
    plan = plan_with_pages(groups, ServingLimits(4, 8192, 4096, 0), 3000)
    spans = [g.block_tokens for g in plan.groups]
    rng = np.random.default_rng(3)
    for mc in (1, 3, 64, 2048, 4096):
        k = ops.pages_per_row(plan, mc)
        bounds = evict_bounds(plan, 1, k)
        assert evict_bounds(plan, 5, k) == tuple(5 * x for x in bounds)
        for n_old, cnt in zip(
            rng.integers(0, 4000, 300), rng.integers(1, mc + 1, 300), strict=True
        ):
            for bt, bound in zip(spans, bounds, strict=True):
                needs = -(-(int(n_old) + int(cnt)) // bt) - -(-int(n_old) // bt)
                assert needs <= bound, (mc, bt, n_old, cnt)
    named = dict(zip((g.name for g in plan.groups), evict_bounds(plan, 1, 1024), strict=True))
    assert named == {
        "swa_kv": 64,
        "mtp_swa_kv": 64,
        "c4_kv": 32,
        "c4_state": 1024,
        "c4_index_state": 1024,
        "c128_kv": 32,
        "c128_state": 512,
    }


def test_decode_publish_of_few_rows_is_the_publish_of_every_row(monkeypatch):
    """A decode step hashes and offers only the rows that reach a block end, compacted
    (``publish.publish_rows``: 8 of 32 rows on V4-Flash, where blocks end every 64 tokens);
    the others add their token's term to the chain. 32 requests (a shared 128-token system
    prompt, twelve of them one token short of a chain-block end, so every 64th decode step has
    more reaching rows than the compacted batch holds and takes the every-row path) decode 140
    steps: the state after every step is the one of a run that hashes every row."""
    from flatkv_jax.coordinator import publish

    groups = deepseek_v4_groups(
        v4_flash(c4_rows=32, c128_rows=1, kv_format="bf16", indexer_format="bf16"), verify_width=0
    )
    plan = plan_with_pages(groups, ServingLimits(32, 1024, 256, 0, step_tokens=32 * 256), 4000)
    b = plan.limits.max_requests
    assert publish.publish_rows(plan, b, 1) == 8
    rng = np.random.default_rng(7)
    system = rng.integers(0, 30_000, 128).tolist()
    lengths = [127] * 12 + rng.integers(130, 256, b - 12).tolist()
    prompts = [(system if i % 2 else []) + rng.integers(0, 30_000, 256).tolist() for i in range(b)]
    prompts = [p[:n] for p, n in zip(prompts, lengths, strict=True)]
    reaching = []

    def run(retire):
        d = PrefixDriver(plan)
        res = d._run(
            ops.admit,
            host.admit_batch(plan, [(n, n) for n in lengths], tokens=prompts),
        )
        assert host.statuses(res, b) == [Status.OK] * b
        hs = host.handles(res, b)
        counts = [int(c) for c in np.asarray(res.count)[:b]]
        pos = [int(h) + c for h, c in zip(np.asarray(res.hit)[:b], counts, strict=True)]
        res = d._run(retire, host.retire_batch(plan, list(zip(hs, counts, strict=True))))
        assert host.statuses(res, b) == [Status.OK] * b
        states = []
        for i in range(140):
            reaching.append(sum((p + 1) % 64 == 0 for p in pos))
            toks = [[(7 * i + r) % 30_000] for r in range(b)]
            res = d._run(ops.extend, host.extend_batch(plan, [(h, 1) for h in hs], tokens=toks))
            assert host.statuses(res, b) == [Status.OK] * b
            res = d._run(retire, host.retire_batch(plan, [(h, 1) for h in hs]), max_count=1)
            assert host.statuses(res, b) == [Status.OK] * b
            d._run(ops.reclaim, host.handle_batch(plan, hs))
            pos = [p + 1 for p in pos]
            states.append(snapshot(d.state))
        return states

    compacted = run(ops.retire)
    # Both paths ran: steps where the twelve reach together, and steps with a few rows.
    assert reaching[0] == 12 and sum(1 <= r <= 8 for r in reaching) > 20
    monkeypatch.setattr(publish, "publish_rows", lambda plan, b, width: b)
    for x, y in zip(compacted, run(_fresh_retire()), strict=True):
        _assert_same_up_to_bucket_placement(x, y)


def _index_entries(ixs):
    """The set of ``(group, key words, page)`` an index set holds, and the held pages (where
    in its bucket pair each key sits is left out)."""
    keys, pages = np.asarray(ixs.keys), np.asarray(ixs.pages)
    group = np.repeat(np.arange(len(ixs.num_buckets)), ixs.num_buckets)
    rows, ways = np.nonzero(pages > 0)
    entries = {
        (int(group[r]), tuple(keys[r, w].tolist()), int(pages[r, w]))
        for r, w in zip(rows, ways, strict=True)
    }
    return entries, np.flatnonzero(np.asarray(ixs.slot_of_page) >= 0)


def _assert_same_up_to_bucket_placement(a, b):
    """Equal states, except that a key may sit in the other bucket of its pair (an insert
    picks the less loaded one as loaded before the call, so inserts split over several calls
    can place a key differently from one call): the index holds the same keys -> pages."""
    ea, eb = _index_entries(a.index), _index_entries(b.index)
    assert ea[0] == eb[0]
    np.testing.assert_array_equal(ea[1], eb[1])
    np.testing.assert_array_equal(np.asarray(a.index.count), np.asarray(b.index.count))
    strip = dict(keys=None, pages=None, slot_of_page=None)
    a = dataclasses.replace(a, index=dataclasses.replace(a.index, **strip))
    b = dataclasses.replace(b, index=dataclasses.replace(b.index, **strip))
    assert_same(a, b)


def test_an_extend_row_short_of_its_count_tokens_is_refused():
    """A row whose tokens are fewer than its count would publish the step's blocks under
    zeros where its tokens were missing (another prompt ending in those zeros would then be
    served this request's KV): the device says ``BAD_ARG`` and changes nothing, the oracle
    says the same, and the host builder raises."""
    prompt = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8]
    d = PrefixDriver()
    h, _ = d.prefill(prompt[:36])
    full = host.extend_batch(d.plan, [(h, 4)], tokens=[prompt[36:40]])
    short = dataclasses.replace(full, tokens=full.tokens[:, :1])
    before = snapshot(d.state)
    assert host.statuses(d._run(ops.extend, short), 1) == [Status.BAD_ARG]
    assert_same(before, d.state)
    assert host.statuses(d._run(ops.extend, full), 1) == [Status.OK]  # the whole row is served

    oracle = RadixOracle(d.plan)
    ob = oracle_admit_batch(d.plan, [(0, prompt[:36], 16)])
    res = oracle.admit(ob)
    oh = (int(res.slot[0]), int(res.generation[0]))
    ext = oracle_extend_batch(d.plan, [(oh, prompt[36:40])])
    short_o = dataclasses.replace(ext, tokens=ext.tokens[:, :1])
    assert Status(int(oracle.extend(short_o).status[0])) == Status.BAD_ARG
    assert Status(int(oracle.extend(ext).status[0])) == Status.OK

    with pytest.raises(ValueError, match=r"tokens\[0\]='1 tokens' is invalid: a row carries"):
        host.extend_batch(d.plan, [(h, 4)], tokens=[prompt[36:37]])
