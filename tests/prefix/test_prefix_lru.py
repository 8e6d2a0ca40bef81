"""LRU of cached-only pages: release order == eviction order, re-hits, overflow, wraparound."""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import examples

from flatkv_jax.prefix import index as I
from flatkv_jax.prefix import keys as K
from flatkv_jax.prefix import lru as L

release = jax.jit(L.cache)
acquire = jax.jit(L.take)
evict = jax.jit(L.evict, static_argnames="max_pages")


def _pages(*p):
    return jnp.asarray(np.array(p, np.int32))


def _full_index(num_pages):
    """An index holding every usable page (so eviction has entries to remove)."""
    n = num_pages - 2
    t = jnp.asarray(np.arange(n, dtype=np.int32)[None, :])
    k, _ = jax.jit(K.block_keys, static_argnames="block_tokens")(
        t, jnp.array([n], jnp.int32), 0, seed=0, block_tokens=1
    )
    idx, taken = jax.jit(I.insert)(
        I.create_index(num_pages), k[0], jnp.arange(1, n + 1, dtype=jnp.int32), None
    )
    assert np.asarray(taken).all()
    return idx


def test_release_order_is_eviction_order():
    lru, idx = L.create_lru(12), _full_index(12)
    lru = release(lru, _pages(5, 3, 9), None)
    lru = release(lru, _pages(1, 7), None)
    assert int(L.evictable(lru)) == 5
    lru, idx, out, n = evict(lru, idx, jnp.int32(2), max_pages=4)
    assert np.asarray(out).tolist() == [5, 3, -1, -1] and int(n) == 2
    assert (
        not np.asarray(I.holds(idx, _pages(5, 3))).any()
        and np.asarray(I.holds(idx, _pages(9, 1, 7))).all()
    )
    assert int(idx.count) == 8
    # Asking for more than there is returns what there is; max_pages caps a call.
    lru, idx, out, n = evict(lru, idx, jnp.int32(9), max_pages=2)
    assert np.asarray(out).tolist() == [9, 1] and int(n) == 2
    lru, idx, out, n = evict(lru, idx, jnp.int32(9), max_pages=4)
    assert np.asarray(out).tolist() == [7, -1, -1, -1] and int(n) == 1 and int(lru.count) == 0
    lru, idx, out, n = evict(lru, idx, jnp.int32(3), max_pages=4)
    assert int(n) == 0 and np.asarray(out).tolist() == [-1] * 4


def test_rehit_page_leaves_the_lru_and_returns_at_the_tail():
    lru, idx = L.create_lru(12), _full_index(12)
    lru = release(lru, _pages(1, 2, 3, 4), None)
    lru, was = acquire(lru, _pages(2, 2, 8, 3), jnp.array([True, True, True, False]))
    assert np.asarray(was).tolist() == [True, True, False, False]
    assert int(lru.count) == 3
    lru = release(lru, _pages(2), None)  # released again: most recent
    lru, idx, out, _ = evict(lru, idx, jnp.int32(4), max_pages=4)
    assert np.asarray(out).tolist() == [1, 3, 4, 2]
    # A page released twice in one batch (or while cached) keeps only its latest position.
    lru = release(lru, _pages(5, 6, 5), None)
    lru = release(lru, _pages(6), None)
    assert int(lru.count) == 2
    lru, idx, out, _ = evict(lru, idx, jnp.int32(2), max_pages=2)
    assert np.asarray(out).tolist() == [5, 6]
    # Reserved pages never enter.
    lru = release(lru, _pages(0, 11, -1, 12), None)
    assert int(lru.count) == 0


def _run_model(lru, idx, ops, num_pages, drain=True):
    """Drives the LRU with (kind, pages) ops against an OrderedDict model (then, with
    ``drain``, evicts everything and checks the order)."""
    model: collections.OrderedDict[int, None] = collections.OrderedDict()
    for kind, pages in ops:
        pages = [p for p in pages if 1 <= p <= num_pages - 2]
        if kind == "release":
            for p in pages:
                model.pop(p, None)
                model[p] = None
            width = num_pages - 2
            arr = np.zeros(width, np.int32)
            arr[: len(pages)] = pages
            lru = release(lru, jnp.asarray(arr), jnp.asarray(np.arange(width) < len(pages)))
        elif kind == "acquire":
            arr = np.zeros(4, np.int32)
            arr[: len(pages)] = pages[:4]
            lru, _ = acquire(lru, jnp.asarray(arr), jnp.asarray(np.arange(4) < len(pages[:4])))
            for p in pages[:4]:
                model.pop(p, None)
        else:
            n = len(pages)
            lru, idx, out, got = evict(lru, idx, jnp.int32(n), max_pages=3)
            want = [model.popitem(last=False)[0] for _ in range(min(n, 3, len(model)))]
            assert np.asarray(out).tolist() == want + [-1] * (3 - len(want))
            assert int(got) == len(want)
        assert int(lru.count) == len(model)
        assert np.flatnonzero(np.asarray(lru.cached)).tolist() == sorted(model)
        assert (lru.tail - lru.head) <= lru.ring_size
    if not drain:
        assert _live_order(lru) == list(model)
        return lru
    # Drain: everything comes out in model order.
    rest = []
    while True:
        lru, idx, out, got = evict(lru, idx, jnp.int32(3), max_pages=3)
        if int(got) == 0:
            break
        rest += np.asarray(out)[: int(got)].tolist()
    assert rest == list(model)
    return lru


_ops = st.lists(
    st.tuples(
        st.sampled_from(["release", "acquire", "evict"]), st.lists(st.integers(1, 10), max_size=6)
    ),
    max_size=25,
)


@settings(max_examples=examples(15), deadline=None)
@given(_ops)
def test_matches_an_lru_model_with_ring_overflow(ops):
    # Smallest legal ring (2 x usable pages): frequent compactions under re-hit churn.
    lru = L.create_lru(12, ring_size=32)
    _run_model(lru, _full_index(12), ops, 12)


def test_churn_overflows_the_ring_and_keeps_order():
    lru, idx = L.create_lru(12, ring_size=32), _full_index(12)
    ops = []
    for r in range(40):  # every cycle leaves stale entries: the ring must compact repeatedly
        ops += [("release", [1 + r % 10, 1 + (r + 3) % 10]), ("acquire", [1 + (r + 3) % 10])]
    ops += [("release", [4, 2, 9])]
    lru = _run_model(lru, idx, ops, 12)


def test_sequence_wraparound():
    lru = L.create_lru(12, ring_size=32)
    start = jnp.uint32(2**32 - 5)
    lru = dataclasses.replace(lru, head=start, tail=start)
    ops = [("release", [3, 1, 2]), ("acquire", [1]), ("release", [5, 6, 7, 1]), ("evict", [0, 0])]
    ops += [("release", [8, 9, 10]), ("acquire", [9]), ("release", [9])] * 6
    _run_model(lru, _full_index(12), ops, 12)


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_compact_in_chunks_keeps_live_entries_in_order(chunk):
    """Compaction runs in place a chunk at a time; any chunk size gives the same ring."""
    lru, idx = L.create_lru(12, ring_size=32), _full_index(12)
    ops = []
    for r in range(9):  # stale entries between live ones, some pages re-released
        ops += [("release", [1 + r % 10, 1 + (r + 3) % 10]), ("acquire", [1 + (r + 3) % 10])]
    lru = _run_model(lru, idx, ops, 12, drain=False)
    live = _live_order(lru)
    out = jax.jit(L.compact, static_argnames="chunk")(lru, chunk=chunk)
    assert int(out.tail - out.head) == len(live) == int(out.count)
    assert _live_order(out) == live
    ring = np.asarray(out.ring)
    seq = [(int(out.head) + i) % 2**32 for i in range(len(live))]
    assert [int(ring[q % 32]) for q in seq] == live  # packed from the head
    assert all(int(np.asarray(out.seq_of_page)[p]) == q for p, q in zip(live, seq, strict=True))


def _live_order(lru):
    """Pages of the live ring entries, head to tail (host model of the LRU order)."""
    ring, sop, cached = (np.asarray(x) for x in (lru.ring, lru.seq_of_page, lru.cached))
    out = []
    for i in range(int(lru.tail - lru.head)):
        q = (int(lru.head) + i) % 2**32
        p = int(ring[q % lru.ring_size])
        if cached[p] and int(sop[p]) == q:
            out.append(p)
    return out


def test_errors():
    with pytest.raises(ValueError, match="the ring is a power of two >= 2 x usable pages"):
        L.create_lru(12, ring_size=16)
    with pytest.raises(ValueError, match="the ring is a power of two"):
        L.create_lru(12, ring_size=48)
    lru = L.create_lru(12)
    with pytest.raises(ValueError, match="pages are int32"):
        L.cache(lru, jnp.zeros((2,), jnp.uint32))
    with pytest.raises(ValueError, match="a bool mask shaped like pages"):
        L.take(lru, jnp.zeros((2,), jnp.int32), jnp.zeros((3,), bool))
    with pytest.raises(ValueError, match="max_pages=-1 is invalid"):
        L.evict(lru, I.create_index(12), jnp.int32(1), max_pages=-1)
    assert L.default_ring_size(10) == 64 and len(L.create_lrus.__doc__) > 0


def test_donated_updates_are_in_place():
    """With the state donated, insert/remove/evict/release alias it and need only batch-sized
    temporaries."""
    idx, lru = I.create_index(20_002), L.create_lru(20_002)

    def nbytes(*trees):
        return sum(x.nbytes for t in trees for x in jax.tree_util.tree_leaves(t))

    keys, pages = jnp.zeros((64, K.KEY_WORDS), jnp.uint32), jnp.zeros((64,), jnp.int32)
    cases = [
        (jax.jit(I.insert, donate_argnums=0).lower(idx, keys, pages, None), nbytes(idx), True),
        (jax.jit(I.remove, donate_argnums=0).lower(idx, pages, None), nbytes(idx), True),
        (
            jax.jit(L.evict, donate_argnums=(0, 1), static_argnames="max_pages").lower(
                lru, idx, jnp.int32(3), max_pages=64
            ),
            nbytes(lru, idx),
            True,
        ),
        # release may compact: in place, chunk by chunk (no ring-sized temporaries either)
        (jax.jit(L.cache, donate_argnums=0).lower(lru, pages, None), nbytes(lru), False),
    ]
    for lowered, state_bytes, tiny_temp in cases:
        mem = lowered.compile().memory_analysis()
        assert mem.alias_size_in_bytes == state_bytes
        # Batch-sized, or (release) compaction-chunk-sized: far below the 512 KiB ring.
        limit = 64 * 1024 if tiny_temp else 32 * L.COMPACT_CHUNK
        assert mem.temp_size_in_bytes < limit, mem.temp_size_in_bytes
    assert lru.ring.nbytes // 2 > 32 * L.COMPACT_CHUNK


def test_release_groups_equals_one_release_per_lru():
    """One batched push into three LRUs gives exactly the per-LRU results: duplicates in a
    batch, pages of another pool's range, reserved pages, acquires in between (stale entries)
    and small rings that must compact."""
    rng = np.random.default_rng(3)
    pool = (12, 20, 9)
    lrus = tuple(L.create_lru(p, ring_size=r) for p, r in zip(pool, (32, 64, 16), strict=True))
    batched = jax.jit(L.cache_groups)
    compacted = False
    for _ in range(12):
        n = 24
        group = rng.integers(0, 3, n).astype(np.int32)
        pages = rng.integers(-1, 21, n).astype(np.int32)  # incl. -1, 0, scratch, out of range
        valid = rng.random(n) < 0.8
        want = tuple(
            L.cache(lr, jnp.asarray(pages), jnp.asarray(valid & (group == g)))
            for g, lr in enumerate(lrus)
        )
        got = batched(lrus, jnp.asarray(group), jnp.asarray(pages), jnp.asarray(valid))
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for g, (lr, old) in enumerate(zip(got, lrus, strict=True)):
            ok = valid & (group == g) & (pages >= 1) & (pages <= pool[g] - 2)
            compacted |= int(lr.tail) != int(old.tail) + len(set(pages[ok].tolist()))
        # Re-hit some pages: their ring entries go stale, so the rings fill and compact.
        lrus = tuple(
            acquire(lr, jnp.asarray(rng.integers(1, p - 1, 4).astype(np.int32)), None)[0]
            for lr, p in zip(got, pool, strict=True)
        )
    assert compacted and any(int(lr.count) > 0 for lr in lrus)
    with pytest.raises(ValueError, match="one int32 LRU number per page"):
        L.cache_groups(lrus, jnp.zeros((3,), jnp.int32), _pages(1, 2), jnp.ones(2, bool))
    # repeats=False (a traced promise that no page is listed twice) skips the dedupe: the
    # same LRUs as the sorted path on distinct pages; repeats=True (traced) dedupes.
    promised = jax.jit(lambda lr, g, p, v, r: L.cache_groups(lr, g, p, v, repeats=r))
    for distinct in (True, False):
        pages = np.arange(1, 9, dtype=np.int32) if distinct else np.array([1, 2, 2, 3] * 2)
        pages = pages.astype(np.int32)
        group = (np.arange(pages.size) % 2).astype(np.int32)
        valid = np.ones(pages.size, bool)
        args = (lrus, jnp.asarray(group), jnp.asarray(pages), jnp.asarray(valid))
        want = batched(*args)
        got = promised(*args, jnp.asarray(not distinct))
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_take_groups_equals_one_take_per_lru():
    """One batched take from three LRUs gives exactly the per-LRU results: duplicates,
    pages not cached, reserved and out-of-range pages, masked rows."""
    rng = np.random.default_rng(7)
    pool = (12, 20, 9)
    lrus = tuple(L.create_lru(p) for p in pool)
    lrus = tuple(
        L.cache(lr, jnp.asarray(np.arange(1, p - 1, dtype=np.int32)))
        for lr, p in zip(lrus, pool, strict=True)
    )
    batched = jax.jit(L.take_groups)
    for _ in range(6):
        n = 16
        group = rng.integers(0, 3, n).astype(np.int32)
        pages = rng.integers(-1, 21, n).astype(np.int32)
        valid = rng.random(n) < 0.8
        want = tuple(
            L.take(lr, jnp.asarray(pages), jnp.asarray(valid & (group == g)))[0]
            for g, lr in enumerate(lrus)
        )
        got = batched(lrus, jnp.asarray(group), jnp.asarray(pages), jnp.asarray(valid))
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        lrus = got
    assert sum(int(lr.count) for lr in lrus) < sum(p - 2 for p in pool)
    with pytest.raises(ValueError, match="one int32 LRU number per page"):
        L.take_groups(lrus, jnp.zeros((3,), jnp.int32), _pages(1, 2), jnp.ones(2, bool))


def _same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_lru_set_equals_one_lru_per_pool():
    """A CachedLRUSet (every pool's LRU in one set of arrays, the coordinator's state)
    behaves as one CachedLRU per pool: batched pushes (duplicates, reserved and out-of-range
    pages, unknown pools, small rings that compact), takes, and evictions with pins give each
    pool's own results, and its views are those LRUs; a push listed in pool order gives the
    same set with ``grouped=True`` (the sweep's one running count)."""
    rng = np.random.default_rng(11)
    pool = (12, 20, 9)
    lrus = tuple(L.create_lru(p, ring_size=r) for p, r in zip(pool, (32, 64, 16), strict=True))
    s = L.pack(lrus)
    assert s.ring_offset == (0, 32, 96) and s.page_offset == (0, 12, 32)
    assert len(jax.tree_util.tree_leaves(s)) == 6
    cache_in, take_in = jax.jit(L.cache_in), jax.jit(L.take_in)
    cache_grouped = jax.jit(functools.partial(L.cache_in, grouped=True))
    evict_in = jax.jit(L.evict_in, static_argnames=("g", "max_pages", "pin_offset"))
    compacted = evicted = False
    for step in range(40):
        n = 24
        group = rng.integers(-1, 4, n).astype(np.int32)  # -1 and 3: unknown pools
        pages = rng.integers(-1, 21, n).astype(np.int32)
        valid = rng.random(n) < 0.8
        want = tuple(
            L.cache(lr, jnp.asarray(pages), jnp.asarray(valid & (group == g)))
            for g, lr in enumerate(lrus)
        )
        # A listing sorted by pool gives the same set with the grouped rank (a sweep's).
        o = np.argsort(group, kind="stable")
        sorted_rows = (jnp.asarray(group[o]), jnp.asarray(pages[o]), jnp.asarray(valid[o]))
        for a, b in zip(
            jax.tree.leaves(cache_in(s, *sorted_rows)),
            jax.tree.leaves(cache_grouped(s, *sorted_rows)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        s = cache_in(s, jnp.asarray(group), jnp.asarray(pages), jnp.asarray(valid))
        for g, w in enumerate(want):
            _same(L.view(s, g), w)
            ok = valid & (group == g) & (pages >= 1) & (pages <= pool[g] - 2)
            compacted |= int(w.tail) != int(lrus[g].tail) + len(set(pages[ok].tolist()))
        lrus = want
        # Takes (stale ring entries, so the rings fill and compact).
        tg = rng.integers(0, 3, 8).astype(np.int32)
        tp = rng.integers(0, 12, 8).astype(np.int32)
        s = take_in(s, jnp.asarray(tg), jnp.asarray(tp), jnp.ones(8, bool))
        lrus = tuple(
            L.take(lr, jnp.asarray(tp), jnp.asarray(tg == g))[0] for g, lr in enumerate(lrus)
        )
        for g in range(3):
            _same(L.view(s, g), lrus[g])
        if step % 4:
            continue
        # Evict from one pool, some pages pinned (a flat mask of every pool).
        g = int(rng.integers(0, 3))
        pinned = rng.random(sum(pool)) < 0.3
        k = jnp.int32(rng.integers(0, 4))
        s, out, got = evict_in(
            s, g, k, max_pages=4, pinned=jnp.asarray(pinned), pin_offset=s.page_offset[g]
        )
        p0 = s.page_offset[g]
        lr, _, w_out, w_got = L.evict(
            lrus[g], None, k, max_pages=4, pinned=jnp.asarray(pinned[p0 : p0 + pool[g]])
        )
        np.testing.assert_array_equal(np.asarray(out), np.asarray(w_out))
        assert int(got) == int(w_got)
        evicted |= int(got) > 0
        lrus = tuple(lr if i == g else x for i, x in enumerate(lrus))
        for i in range(3):
            _same(L.view(s, i), lrus[i])
    assert compacted, "no ring compacted"
    assert evicted, "nothing evicted"
    _same(L.pack(L.unpack(s)), s)


def test_evict_all_equals_one_evict_per_pool():
    """``evict_all`` (every pool's eviction in one loop, the coordinator's grow) gives the
    pages, counts and set of one ``evict_in`` per pool in turn: random pushes and takes (stale
    ring entries), pinned pages, wanted counts from none to more than a pool holds, bounds
    from 0 to past a small ring, including chunks wider than 64 entries."""
    rng = np.random.default_rng(5)
    pool = (12, 200, 9, 90)
    rings = (32, 512, 16, 256)
    s = L.pack(tuple(L.create_lru(p, ring_size=r) for p, r in zip(pool, rings, strict=True)))
    cache_in, take_in = jax.jit(L.cache_in), jax.jit(L.take_in)
    evict_in = jax.jit(L.evict_in, static_argnames=("g", "max_pages", "pin_offset"))
    evict_all = jax.jit(L.evict_all, static_argnames=("max_pages",))
    pinned_some = evicted_more_than_64 = False
    for step in range(30):
        m = 120
        group = rng.integers(0, 4, m).astype(np.int32)
        pages = rng.integers(1, 199, m).astype(np.int32)
        s = cache_in(s, jnp.asarray(group), jnp.asarray(pages), jnp.ones(m, bool))
        tg = rng.integers(0, 4, 20).astype(np.int32)
        tp = rng.integers(0, 199, 20).astype(np.int32)
        s = take_in(s, jnp.asarray(tg), jnp.asarray(tp), jnp.ones(20, bool))
        if step % 3 != 2:  # let the pools fill between evictions
            continue
        pinned = jnp.asarray(rng.random(sum(pool)) < (0.2 if step % 2 else 0.0))
        bounds = tuple(int(b) for b in rng.choice([0, 1, 3, 20, 100, 300], 4))
        n = jnp.asarray(rng.integers(0, 120, 4), jnp.int32)
        if step == 29:  # the last: as much as each pool holds, in chunks past 64 entries
            bounds, n = (300,) * 4, jnp.full((4,), 300, jnp.int32)
        want, outs, gots = s, [], []
        for g in range(4):
            want, out, got = evict_in(
                want,
                g,
                n[g],
                max_pages=bounds[g],
                pinned=pinned,
                pin_offset=want.page_offset[g],
            )
            outs.append(np.asarray(out))
            gots.append(int(got))
        s, pages_all, got_all = evict_all(s, n, max_pages=bounds, pinned=pinned)
        np.testing.assert_array_equal(np.asarray(pages_all), np.concatenate(outs))
        assert np.asarray(got_all).tolist() == gots
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        pinned_some |= bool(np.asarray(pinned).any()) and sum(gots) > 0
        evicted_more_than_64 |= max(gots) > 64
    assert pinned_some and evicted_more_than_64
    with pytest.raises(ValueError, match="one bound per pool"):
        L.evict_all(s, jnp.zeros(4, jnp.int32), max_pages=(1, 2))


def test_a_push_holds_one_compaction_whatever_the_pool_count():
    """Cost guard: the ring compaction (rare: a ring fills up) is one loop over the pools,
    not a copy per pool; XLA:CPU charges every call for the code a program holds, run or
    not. A push into six LRUs compiles to as many loops and conditionals as one into two."""

    def counts(n_pools):
        lrus = tuple(L.create_lru(12 + p, ring_size=32) for p in range(n_pools))
        g = jnp.zeros((8,), jnp.int32)
        pages = jnp.arange(1, 9, dtype=jnp.int32)
        text = jax.jit(L.cache_groups).lower(lrus, g, pages, jnp.ones(8, bool)).compile().as_text()
        return text.count(" while("), text.count(" conditional(")

    assert counts(6) == counts(2)
