"""The per-pool allocator: atomic in-order allocation, dedup on return, no pool-sized copies."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import PLAN

from flatkv_jax import ServingLimits, block_pool, plan_with_pages
from flatkv_jax.block_pool import (
    PoolLayout,
    allocate,
    create_block_pool_set,
    decref,
    decref_left,
    incref,
)
from flatkv_jax.coordinator import create_state, host, ops
from flatkv_jax.recipes import hybrid_swa_groups


def _free(pools, layout, g):
    return np.asarray(pools.pool(layout, g)[0]).tolist()


LAYOUT = PoolLayout((6, 7))  # 4 and 5 usable pages
allocate_j = jax.jit(allocate, static_argnums=(1, 4))
decref_j = jax.jit(decref, static_argnums=1)
incref_j = jax.jit(incref, static_argnums=1)
pop_fitted_j = jax.jit(block_pool.pop_fitted, static_argnums=(1, 6))


def _holding(rng, most: int):
    """Fresh pools with up to ``most`` pages held once each per pool (the cached-only pages
    an eviction takes), and their allocation (pages ``[1, 2, most + 1]``, -1 padded)."""
    held = jnp.asarray(rng.integers(0, most + 1, size=(1, 2)), jnp.int32)
    pools = create_block_pool_set(LAYOUT)
    return allocate_j(pools, LAYOUT, held, jnp.asarray([True]), most + 1)


def test_acquire_serves_a_prefix_and_changes_nothing_for_the_rest():
    pools = create_block_pool_set(LAYOUT)
    needs = jnp.asarray([[2, 1], [0, 0], [3, 0], [1, 1]], jnp.int32)
    want = jnp.asarray([True, False, True, True])
    new, got = allocate_j(pools, LAYOUT, needs, want, 3)
    assert got.served.tolist() == [True, False, False, False]
    assert got.short_group.tolist() == [-1, -1, 0, -1] and got.short_pages.tolist() == [0, 0, 1, 0]
    assert got.pages[0].tolist() == [[1, 2, -1], [1, -1, -1]]
    assert (np.asarray(got.pages[1:]) == -1).all()
    assert new.top.tolist() == [2, 4]
    assert np.asarray(new.pool(LAYOUT, 0)[2]).tolist() == [0, 1, 1, 0, 0, 0]
    assert np.asarray(new.pool(LAYOUT, 1)[2]).tolist() == [0, 1, 0, 0, 0, 0, 0]


def test_pop_fitted_after_a_larger_supply_and_refill_equals_allocate():
    """grow's path: fit against free + evictable pages, push the evicted ones onto the
    stacks, then pop the fitted rows without fitting again. The same pages and stacks as
    one allocate of the served rows on the refilled stacks, for random needs and masks."""
    rng = np.random.default_rng(7)
    for trial in range(20):
        pools, got = _holding(rng, 3)
        evictable = jnp.sum(got.pages[0] >= 0, axis=1, dtype=jnp.int32)
        needs = jnp.asarray(rng.integers(0, 3, size=(5, 2)), jnp.int32)
        want = jnp.asarray(rng.random(5) < 0.8)
        supply = pools.top + evictable
        # fit_sums and pop_fitted are group-major ([G, B]); fit and allocate row-major.
        served, sg, sp, total, incl = block_pool.fit_sums(needs.T, want, supply)
        for a, b in zip((served, sg, sp, total), block_pool.fit(needs, want, supply), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), trial
        masked = np.where(np.asarray(want)[:, None], np.asarray(needs), 0)
        assert np.array_equal(np.asarray(incl), np.cumsum(masked, axis=0).T), trial
        # The eviction: every held page back onto its stack (the stacks now hold `supply`).
        group = jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32)[:, None], (2, 4)).reshape(-1)
        pools, _ = decref_j(pools, LAYOUT, group, got.pages[0].reshape(-1))
        assert np.array_equal(np.asarray(pools.top), np.asarray(supply)), trial
        a_pools, a_pages = pop_fitted_j(pools, LAYOUT, needs.T, served, incl, total, 3)
        b_pools, b_got = allocate_j(pools, LAYOUT, needs, served, 3)
        assert np.array_equal(np.asarray(a_pages).transpose(1, 0, 2), b_got.pages), trial
        for x, y in zip(jax.tree.leaves(a_pools), jax.tree.leaves(b_pools), strict=True):
            assert np.array_equal(np.asarray(x), np.asarray(y)), trial


def test_pop_fitted_takes_evicted_pages_over_as_a_decref_and_pop_would():
    """grow's eviction hands the evicted pages to the served rows with the index's reference
    (``Evicted``): the same pages, row by row, the same tops, refcounts and free stacks (below
    the tops) as a decref of them onto the stacks followed by the pops, for random evicted
    prefixes of each pool's cached pages, needs and masks."""
    rng = np.random.default_rng(13)
    for trial in range(25):
        pools, got = _holding(rng, 4)
        listing = np.asarray(got.pages[0])  # [2, 5]: each pool's held pages, then -1
        needs = jnp.asarray(rng.integers(0, 3, size=(5, 2)), jnp.int32)
        want = jnp.asarray(rng.random(5) < 0.8)
        # As grow: fit against free + cached, evict what the stacks lack.
        supply = pools.top + jnp.sum(got.pages[0] >= 0, axis=1, dtype=jnp.int32)
        served, _, _, total, incl = block_pool.fit_sums(needs.T, want, supply)
        n_ev = np.maximum(np.asarray(total) - np.asarray(pools.top), 0).astype(np.int32)
        evicted = np.where(np.arange(5)[None, :] < n_ev[:, None], listing, -1)
        ev = block_pool.Evicted(jnp.asarray(evicted.reshape(-1)), jnp.asarray(n_ev), (0, 5))
        a_pools, a_pages = pop_fitted_j(pools, LAYOUT, needs.T, served, incl, total, 3, ev)
        group = jnp.asarray(np.repeat(np.arange(2, dtype=np.int32), 5))
        pushed, _ = decref_j(pools, LAYOUT, group, jnp.asarray(evicted.reshape(-1)))
        b_pools, b_pages = pop_fitted_j(pushed, LAYOUT, needs.T, served, incl, total, 3)
        assert np.array_equal(np.asarray(a_pages), np.asarray(b_pages)), trial
        assert np.array_equal(np.asarray(a_pools.top), np.asarray(b_pools.top)), trial
        assert np.array_equal(np.asarray(a_pools.refcount), np.asarray(b_pools.refcount)), trial
        for g in range(2):
            assert _free(a_pools, LAYOUT, g) == _free(b_pools, LAYOUT, g), trial
        # Every evicted page was handed out once and holds one reference (the table's).
        taken = np.asarray(a_pages)  # [G, B, K]
        for g in range(2):
            for page in evicted[g][: n_ev[g]]:
                assert (taken[g] == page).sum() == 1, trial
                assert int(a_pools.refcount[LAYOUT.page_offset[g] + page]) == 1, trial


def test_decref_of_distinct_pages_equals_the_checked_decref():
    """``distinct=True`` (an eviction's pages) skips the repeat check: the same refcounts,
    stacks and freed counts as the checked path for listings without repeats, pages with one
    reference or more, some listings skipped."""
    rng = np.random.default_rng(11)
    fast = jax.jit(functools.partial(decref, distinct=True), static_argnums=1)
    for trial in range(20):
        pools = create_block_pool_set(LAYOUT)
        pools, got = allocate_j(
            pools, LAYOUT, jnp.asarray([[4, 5]], jnp.int32), jnp.asarray([True]), 5
        )
        pages = np.asarray(got.pages[0])  # [2, 5], every usable page of both pools
        extra = np.where(rng.random(pages.shape) < 0.3, pages, -1)
        group = np.broadcast_to(np.arange(2, dtype=np.int32)[:, None], pages.shape)
        pools = incref_j(
            pools, LAYOUT, jnp.asarray(group.reshape(-1)), jnp.asarray(extra.reshape(-1))
        )
        listed = np.where(rng.random(pages.shape) < 0.6, pages, -1)  # each page at most once
        g, p_ = jnp.asarray(group.reshape(-1)), jnp.asarray(listed.reshape(-1))
        a_pools, a_freed = fast(pools, LAYOUT, g, p_)
        b_pools, b_freed = decref_j(pools, LAYOUT, g, p_)
        assert np.array_equal(np.asarray(a_freed), np.asarray(b_freed)), trial
        for x, y in zip(jax.tree.leaves(a_pools), jax.tree.leaves(b_pools), strict=True):
            assert np.array_equal(np.asarray(x), np.asarray(y)), trial


def test_decref_pushes_a_shared_page_once_onto_its_own_stack():
    pools = create_block_pool_set(LAYOUT)
    pools, _ = allocate_j(pools, LAYOUT, jnp.asarray([[3, 2]], jnp.int32), jnp.asarray([True]), 3)
    g0, g1 = jnp.zeros((3,), jnp.int32), jnp.ones((3,), jnp.int32)
    pools = incref_j(
        pools, LAYOUT, g0, jnp.asarray([2, 2, -1], jnp.int32)
    )  # page 2 of pool 0: 3 refs
    group = jnp.asarray([0, 0, 0, 0, 1, 0, 0, 1], jnp.int32)
    pages = jnp.asarray([2, 1, 2, -1, 2, 2, 3, 0], jnp.int32)  # pool 1's page 2 is another page
    pools, freed = decref_j(pools, LAYOUT, group, pages)
    assert freed.tolist() == [3, 1]
    assert sorted(_free(pools, LAYOUT, 0)) == [1, 2, 3, 4]
    assert sorted(_free(pools, LAYOUT, 1)) == [2, 3, 4, 5]
    assert np.asarray(pools.refcount).tolist() == [0] * 6 + [0, 1, 0, 0, 0, 0, 0]  # pool 1's page 1
    pools, freed = decref_j(pools, LAYOUT, g1, jnp.asarray([1, -1, 0], jnp.int32))
    assert freed.tolist() == [0, 1] and sorted(_free(pools, LAYOUT, 1)) == [1, 2, 3, 4, 5]
    assert int(jnp.max(pools.refcount)) == 0
    del g0


def test_decref_of_sole_references_in_two_pools():
    pools = create_block_pool_set(LAYOUT)
    pools, got = allocate_j(pools, LAYOUT, jnp.asarray([[3, 4]], jnp.int32), jnp.asarray([True]), 4)
    group = jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32)  # grouped by pool, as sweeps list them
    pages = jnp.asarray([3, -1, 1, 4, 2, 0], jnp.int32)
    pools, freed = decref_j(pools, LAYOUT, group, pages)
    assert freed.tolist() == [2, 2]
    assert _free(pools, LAYOUT, 0) == [4, 3, 1] and _free(pools, LAYOUT, 1) == [5, 4, 2]
    assert np.asarray(pools.pool(LAYOUT, 0)[2]).tolist() == [0, 0, 1, 0, 0, 0]
    assert np.asarray(pools.pool(LAYOUT, 1)[2]).tolist() == [0, 1, 0, 1, 0, 0, 0]
    del got


def _huge_plan(pages):
    groups = hybrid_swa_groups("SF", num_kv_heads=1, head_dim=8, window=16, rows_per_page=4)
    lim = ServingLimits(max_requests=8, max_context=256, chunk_tokens=16)
    return plan_with_pages(groups, lim, pages)


def _temp_and_alias(op, pages):
    plan = _huge_plan(pages)
    state = jax.eval_shape(lambda: create_state(plan))
    tokens = np.zeros((1, 32), np.int32)
    batch = {
        "extend": host.extend_batch(plan, [((0, 0), 1)]),
        "reclaim": host.handle_batch(plan, [(0, 0)]),
        "release": host.release_batch(plan, [((0, 0), host.ReleaseMode.FINISH)]),
        "retire": host.retire_batch(plan, [((0, 0), 1)]),
        "retire_reclaim": host.retire_batch(plan, [((0, 0), 1)]),
        "admit": host.admit_batch(plan, [(32, 16)], tokens=tokens.tolist()),
    }[op]
    compiled = getattr(ops, op).lower(plan, state, batch).compile()
    mem = compiled.memory_analysis()
    return plan, mem.temp_size_in_bytes, mem.alias_size_in_bytes


@pytest.mark.parametrize(
    "op", ["extend", "reclaim", "release", "retire", "retire_reclaim", "admit"]
)
def test_no_pool_sized_temporaries(op):
    """With the state donated, a 1M-page pool is updated in place: XLA's temporaries do not
    grow with the pools (a 256k-page plan compiles to the same temporaries) and stay far below
    one pool-sized int32 array (4 MiB). Guards against XLA copying state buffers: a cond
    with two writing branches, a buffer read inside a cond or loop and written after it
    without a data dependency, or a loop-invariant operand live after the loop
    (docs/coordinator.md, "Cost rules"). The batched publish and LRU push work on per-step
    rows of every group at once (about 0.6 MB here), which is why the bound is a quarter of
    one pool rather than an eighth."""
    plan, temp, alias = _temp_and_alias(op, 1 << 20)
    _, small_temp, _ = _temp_and_alias(op, 1 << 18)
    pool_bytes = 4 * plan.pages(0)
    assert temp == small_temp, (op, temp, small_temp)
    assert temp < pool_bytes // 4, (op, temp)
    assert alias >= 2 * pool_bytes * len(plan.groups)


def test_plan_used_by_scenarios_is_small():
    # Keeps the scenario tests fast: a few dozen pages per pool.
    assert max(PLAN.num_pages) < 64


def test_decref_left_with_held_sorts_only_for_pages_listed_twice():
    """``held`` (the index holds the page) lets decref skip its sort when no page is listed
    twice; the result (refcounts, stacks, freed, left) is the same as without it, and
    ``repeated`` tells whether a page was listed twice."""
    rng = np.random.default_rng(5)
    f = jax.jit(decref_left, static_argnums=1)
    for trial in range(6):
        pools = create_block_pool_set(LAYOUT)
        pools, _ = allocate_j(
            pools, LAYOUT, jnp.asarray([[4, 5]], jnp.int32), jnp.asarray([True]), 5
        )
        # Some pages gain an index reference (held), some a second table reference.
        held_pages = [(0, 1), (0, 3), (1, 2), (1, 5)]
        g_h = jnp.asarray([g for g, _ in held_pages], jnp.int32)
        p_h = jnp.asarray([p for _, p in held_pages], jnp.int32)
        pools = incref_j(pools, LAYOUT, g_h, p_h)
        twice = trial % 2 == 1
        if twice:
            pools = incref_j(
                pools, LAYOUT, jnp.asarray([0], jnp.int32), jnp.asarray([2], jnp.int32)
            )
        listing = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 5)]
        if twice:
            listing.append((0, 2))
        # Grouped by pool, as decref requires (sweeps list pool by pool); shuffled within.
        order = sorted(rng.permutation(len(listing)), key=lambda i: listing[i][0])
        group = jnp.asarray([listing[i][0] for i in order], jnp.int32)
        pages = jnp.asarray([listing[i][1] for i in order], jnp.int32)
        held = jnp.asarray([listing[i] in held_pages for i in order])
        a = f(pools, LAYOUT, group, pages, held)
        b = f(pools, LAYOUT, group, pages)
        # Refcounts, tops, freed and left are equal; which free page is on top is not part
        # of the contract (the sorted path pushes in page order), the free sets are equal.
        np.testing.assert_array_equal(np.asarray(a[0].refcount), np.asarray(b[0].refcount))
        np.testing.assert_array_equal(np.asarray(a[0].top), np.asarray(b[0].top))
        for x, y in zip(a[1:3], b[1:3], strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        for g in range(2):
            assert sorted(_free(a[0], LAYOUT, g)) == sorted(_free(b[0], LAYOUT, g))
        # Exact: pages shared with another holder but listed once do not count.
        assert bool(a[3]) == twice, trial
        assert bool(b[3]) == twice, trial


def test_listed_twice_compares_suspects_pairwise_and_falls_back_beyond_the_bound():
    """``_listed_twice`` (decref's sort test) is True exactly when two suspect listings name
    one page, and True (the sorted path) when there are more than ``SUSPECTS`` suspects."""
    rng = np.random.default_rng(11)
    f = jax.jit(block_pool._listed_twice)
    for trial in range(60):
        t = int(rng.choice([8, 64, 300]))
        flat = rng.integers(-1, 4 * t, size=t).astype(np.int32)
        suspect = (flat >= 0) & (rng.random(t) < rng.choice([0.05, 0.3, 1.0]))
        if trial % 3 == 0 and suspect.sum() >= 2:  # force a suspect repeated
            i, j = np.flatnonzero(suspect)[:2]
            flat[j] = flat[i]
        ids = flat[suspect]
        want = len(set(ids.tolist())) < len(ids) or suspect.sum() > block_pool.SUSPECTS
        got = bool(f(jnp.asarray(flat), jnp.asarray(suspect)))
        assert got == want, (trial, t, int(suspect.sum()))
    # A repeat among non-suspects is not looked for: only suspects can repeat (decref's rule).
    flat = jnp.asarray([3, 3, 5], jnp.int32)
    assert not bool(f(flat, jnp.asarray([False, False, True])))
    assert bool(f(flat, jnp.asarray([True, True, False])))
