"""The per-group hash index: lookup, first publisher wins, capacity, removal, vs a dict model."""

from __future__ import annotations

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

insert = jax.jit(I.insert)
lookup = jax.jit(I.lookup)
remove = jax.jit(I.remove)


def _keys(n, seed=0, ns=0):
    """n distinct keys (blocks of one random prompt, 1 token per block)."""
    t = np.random.default_rng(seed).integers(0, 1 << 30, (1, n)).astype(np.int32)
    k, _ = K.block_keys(jnp.asarray(t), jnp.array([n], jnp.int32), ns, seed=0, block_tokens=1)
    return k[0]


def _check_consistent(idx):
    """slot_of_page and the table agree, count == entries, no key twice."""
    pages = np.asarray(idx.pages).reshape(-1)
    keys = np.asarray(idx.keys).reshape(-1, K.KEY_WORDS)
    sop = np.asarray(idx.slot_of_page)
    used = np.flatnonzero(pages)
    assert int(idx.count) == used.size
    assert len({tuple(keys[s]) for s in used}) == used.size
    held = np.flatnonzero(sop >= 0)
    assert sorted(pages[used].tolist()) == held.tolist()
    for p in held:
        assert pages[sop[p]] == p
    return {tuple(keys[s]): int(pages[s]) for s in used}


def test_insert_lookup_and_misses():
    idx = I.create_index(66)
    k = _keys(40)
    idx, taken = insert(idx, k[:32], jnp.arange(1, 33, dtype=jnp.int32), None)
    assert np.asarray(taken).all()
    got = np.asarray(lookup(idx, k, None))
    np.testing.assert_array_equal(got[:32], np.arange(1, 33))
    np.testing.assert_array_equal(got[32:], 0)
    # Same key under another namespace or end position misses (those words are compared).
    other = np.asarray(k).copy()
    other[:, K.NS_WORD] += 1
    assert not np.asarray(lookup(idx, jnp.asarray(other), None)).any()
    other = np.asarray(k).copy()
    other[:, K.END_WORD] += 1
    assert not np.asarray(lookup(idx, jnp.asarray(other), None)).any()
    # valid masks a row; batched shapes are kept.
    v = jnp.asarray(np.arange(40) % 2 == 0)
    np.testing.assert_array_equal(
        np.asarray(lookup(idx, k, v)), np.where(np.arange(40) % 2 == 0, got, 0)
    )
    assert lookup(idx, k.reshape(4, 10, K.KEY_WORDS), None).shape == (4, 10)
    assert I.holds(idx, jnp.array([0, 1, 32, 33, 65, 66, -1], jnp.int32)).tolist() == [
        False,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    _check_consistent(idx)


def test_first_publisher_wins():
    idx = I.create_index(20)
    k = _keys(6)
    idx, taken = insert(idx, k[:2], jnp.array([1, 2], jnp.int32), None)
    # Row 0: key already present -> keeps page 1. Rows 1,3: same new key -> first wins.
    # Row 4: page 5 again (second row with page 5) -> not taken. Row 5: page 2 already held.
    batch = jnp.stack([k[0], k[2], k[3], k[2], k[4], k[5]])
    pages = jnp.array([7, 3, 5, 4, 5, 2], jnp.int32)
    idx, taken = insert(idx, batch, pages, None)
    assert np.asarray(taken).tolist() == [False, True, True, False, False, False]
    assert np.asarray(lookup(idx, k, None)).tolist() == [1, 2, 3, 5, 0, 0]
    # Reserved pages (null, scratch) and invalid rows never enter.
    idx, taken = insert(idx, k[4:6], jnp.array([0, 19], jnp.int32), None)
    assert not np.asarray(taken).any()
    idx, taken = insert(idx, k[4:6], jnp.array([8, 9], jnp.int32), jnp.array([False, True]))
    assert np.asarray(taken).tolist() == [False, True]
    assert _check_consistent(idx) and int(idx.count) == 5


def test_capacity_overflow_is_a_miss_never_a_wrong_hit():
    idx = I.create_index(202, num_buckets=2)  # 16 entries for 200 usable pages
    k = _keys(100, seed=3)
    idx, taken = insert(idx, k, jnp.arange(1, 101, dtype=jnp.int32), None)
    taken = np.asarray(taken)
    assert taken.sum() == 16 == int(idx.count)
    got = np.asarray(lookup(idx, k, None))
    np.testing.assert_array_equal(got, np.where(taken, np.arange(1, 101), 0))
    _check_consistent(idx)
    # Freeing entries makes room again.
    idx, removed = remove(idx, jnp.asarray(np.flatnonzero(taken)[:4] + 1, np.int32), None)
    assert np.asarray(removed).all() and int(idx.count) == 12
    idx, taken2 = insert(idx, k, jnp.arange(1, 101, dtype=jnp.int32), None)
    assert np.asarray(taken2).sum() == 4


def test_default_capacity_holds_every_page():
    idx = I.create_index(1002)
    assert idx.capacity >= 4000
    k = _keys(1000, seed=5)
    idx, taken = insert(idx, k, jnp.arange(1, 1001, dtype=jnp.int32), None)
    assert np.asarray(taken).all()


def test_remove_and_remove_keys():
    idx = I.create_index(20)
    k = _keys(5)
    idx, _ = insert(idx, k, jnp.arange(1, 6, dtype=jnp.int32), None)
    idx, removed = remove(idx, jnp.array([2, 2, 9, 0, 19, 4], jnp.int32), None)
    assert np.asarray(removed).tolist() == [True, True, False, False, False, True]
    assert int(idx.count) == 3
    assert np.asarray(lookup(idx, k, None)).tolist() == [1, 0, 3, 0, 5]
    idx, pages = jax.jit(I.remove_keys)(idx, k[:3], None)
    assert np.asarray(pages).tolist() == [1, 0, 3]
    assert np.asarray(lookup(idx, k, None)).tolist() == [0, 0, 0, 0, 5]
    _check_consistent(idx)
    assert int(I.clear(idx).count) == 0
    # distinct=True (pages known distinct, as an LRU eviction's): the same result, no sort.
    both = []
    for distinct in (False, True):
        ix = insert(I.create_index(20), k, jnp.arange(1, 6, dtype=jnp.int32), None)[0]
        f = jax.jit(I.remove, static_argnames="distinct")
        ix, removed = f(ix, jnp.array([2, 9, 0, 4], jnp.int32), None, distinct=distinct)
        assert np.asarray(removed).tolist() == [True, False, False, True]
        assert int(ix.count) == 3
        _check_consistent(ix)
        both.append(ix)
    for a, b in zip(jax.tree.leaves(both[0]), jax.tree.leaves(both[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=examples(20), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.lists(st.tuples(st.integers(0, 23), st.integers(0, 21)), min_size=1, max_size=8),
        ),
        max_size=8,
    )
)
def test_matches_a_dict_model(ops):
    """Random inserts/removes (fixed batch width 8) against a dict; capacity never binds."""
    pool = 22
    keys = np.asarray(_keys(24, seed=11))
    idx = I.create_index(pool)
    model: dict[int, int] = {}  # key id -> page
    for is_insert, rows in ops:
        rows = rows + [(0, 0)] * (8 - len(rows))
        valid = np.array([r != (0, 0) for r in rows])
        kid = np.array([r[0] for r in rows])
        pg = np.array([r[1] for r in rows], np.int32)
        if is_insert:
            idx, taken = insert(idx, jnp.asarray(keys[kid]), jnp.asarray(pg), jnp.asarray(valid))
            elig = [
                bool(
                    valid[i]
                    and 1 <= pg[i] <= pool - 2
                    and kid[i] not in model
                    and pg[i] not in model.values()
                )
                for i in range(8)
            ]
            want = [
                elig[i]
                and not any(elig[j] and (kid[j] == kid[i] or pg[j] == pg[i]) for j in range(i))
                for i in range(8)
            ]
            model.update({int(kid[i]): int(pg[i]) for i in range(8) if want[i]})
            assert np.asarray(taken).tolist() == want
        else:
            idx, removed = remove(idx, jnp.asarray(pg), jnp.asarray(valid))
            want = [bool(valid[i] and pg[i] in model.values()) for i in range(8)]
            assert np.asarray(removed).tolist() == want
            model = {
                k: p for k, p in model.items() if not any(valid[i] and pg[i] == p for i in range(8))
            }
        got = np.asarray(lookup(idx, jnp.asarray(keys), None))
        assert got.tolist() == [model.get(i, 0) for i in range(24)]
        _check_consistent(idx)


def test_compiles_once_and_errors():
    idx = I.create_index(20)
    traces = []

    def publish(idx, keys, pages):
        traces.append(1)
        return I.insert(idx, keys, pages)

    f = jax.jit(publish)
    for s in range(3):
        idx, _ = f(idx, _keys(4, seed=s), jnp.arange(1 + 4 * s, 5 + 4 * s, dtype=jnp.int32))
    assert len(traces) == 1 and int(idx.count) == 12
    with pytest.raises(ValueError, match=r"keys are uint32\[..., 7\]"):
        I.lookup(idx, jnp.zeros((3, 6), jnp.uint32))
    with pytest.raises(ValueError, match=r"one int32 page per key, shape \(3,\)"):
        I.insert(idx, jnp.zeros((3, 7), jnp.uint32), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"a bool mask of shape \(3,\)"):
        I.lookup(idx, jnp.zeros((3, 7), jnp.uint32), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="pages are int32"):
        I.remove(idx, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="bucket counts are powers of two >= 2"):
        I.create_index(20, num_buckets=3)
    with pytest.raises(ValueError, match="a pool needs more than the 2 reserved pages"):
        I.create_index(2)
    with pytest.raises(TypeError, match="it must be a CachePlan"):
        I.create_indexes("plan")


def test_insert_groups_equals_one_insert_per_index():
    """One batched insert into three indexes gives exactly the per-index results: duplicate
    keys and pages within an index (first wins), the same key in two indexes (both take it),
    tiny indexes whose buckets overflow, keys already present, pages already held."""
    rng = np.random.default_rng(7)
    sizes = (24, 0, 40, 17)
    nbuckets = (2, 4, 8, 2)  # 16-entry tables: overflow and second-bucket placement happen
    pool = (30, 10, 60, 25)
    indexes = tuple(I.create_index(p, num_buckets=b) for p, b in zip(pool, nbuckets, strict=True))
    shared = _keys(64, seed=11)
    # Pre-populate: a few keys present, a few pages held.
    indexes = tuple(
        I.insert(ix, shared[:5], jnp.arange(1, 6, dtype=jnp.int32) + i, None)[0]
        for i, ix in enumerate(indexes)
    )
    for trial in range(3):
        ks, ps, vs = [], [], []
        for n, p in zip(sizes, pool, strict=True):
            ks.append(shared[rng.integers(0, 40, n)])  # duplicates within and across indexes
            ps.append(jnp.asarray(rng.integers(0, p, n), jnp.int32))  # incl. reserved, dups
            vs.append(jnp.asarray(rng.random(n) < 0.85))
        want = [I.insert_held(ix, k, p, v) for ix, k, p, v in zip(indexes, ks, ps, vs, strict=True)]
        got_ix, taken, held = jax.jit(I.insert_groups, static_argnums=1)(
            indexes, sizes, jnp.concatenate(ks), jnp.concatenate(ps), jnp.concatenate(vs)
        )
        np.testing.assert_array_equal(np.asarray(taken), np.concatenate([w[1] for w in want]))
        np.testing.assert_array_equal(np.asarray(held), np.concatenate([w[2] for w in want]))
        assert np.asarray(taken).any() and not np.asarray(taken).all(), trial
        for g, w in zip(got_ix, want, strict=True):
            for a, b in zip(
                jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w[0]), strict=True
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            _check_consistent(g)
        indexes = got_ix
    with pytest.raises(ValueError, match="one non-negative int per index"):
        I.insert_groups(indexes, (1, 2), shared[:3], jnp.ones((3,), jnp.int32), jnp.ones(3, bool))
    with pytest.raises(ValueError, match="sum\\(sizes\\)"):
        I.insert_groups(
            indexes, (1, 0, 1, 0), shared[:3], jnp.ones((3,), jnp.int32), jnp.ones(3, bool)
        )


def test_insert_mixed_equals_one_insert_per_index():
    """Rows of several indexes interleaved in any order (the coordinator's compacted publish
    chunks) give one insert_held per index on its rows, within-index order kept:
    duplicates, overflowing buckets, keys present, pages held; ``present`` is the lookup
    before the call."""
    rng = np.random.default_rng(3)
    sizes = (24, 0, 40, 17)
    pool = (30, 10, 60, 25)
    indexes = tuple(
        I.create_index(p, num_buckets=b) for p, b in zip(pool, (2, 4, 8, 2), strict=True)
    )
    shared = _keys(64, seed=12)
    indexes = tuple(
        I.insert(ix, shared[:5], jnp.arange(1, 6, dtype=jnp.int32) + i, None)[0]
        for i, ix in enumerate(indexes)
    )
    mixed = jax.jit(I.insert_mixed)
    for trial in range(3):
        ks, ps, vs = [], [], []
        for n, p in zip(sizes, pool, strict=True):
            ks.append(shared[rng.integers(0, 40, n)])
            ps.append(jnp.asarray(rng.integers(0, p, n), jnp.int32))
            vs.append(jnp.asarray(rng.random(n) < 0.85))
        keys, pages, valid = jnp.concatenate(ks), jnp.concatenate(ps), jnp.concatenate(vs)
        group = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
        want = [I.insert_held(ix, k, p, v) for ix, k, p, v in zip(indexes, ks, ps, vs, strict=True)]
        want_ix = [w[0] for w in want]
        want_taken = np.concatenate([w[1] for w in want])
        want_held = np.concatenate([w[2] for w in want])
        # Interleave: a random order that keeps each index's rows in their order.
        pos = {g: iter(np.flatnonzero(group == g)) for g in range(len(sizes))}
        gseq = rng.permutation(group)
        perm = np.array([next(pos[g]) for g in gseq])
        got_ix, taken, held, present = mixed(
            indexes, jnp.asarray(group[perm]), keys[perm], pages[perm], valid[perm]
        )
        np.testing.assert_array_equal(np.asarray(taken), np.asarray(want_taken)[perm])
        np.testing.assert_array_equal(np.asarray(held), np.asarray(want_held)[perm])
        before = np.concatenate(
            [np.asarray(I.lookup(ix, k, v)) for ix, k, v in zip(indexes, ks, vs, strict=True)]
        )
        np.testing.assert_array_equal(np.asarray(present), before[perm])
        assert np.asarray(taken).any() and not np.asarray(taken).all(), trial
        for g, w in zip(got_ix, want_ix, strict=True):
            for a, b in zip(
                jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w), strict=True
            ):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            _check_consistent(g)
        indexes = got_ix
    with pytest.raises(ValueError, match="one int32 index number per key"):
        I.insert_mixed(indexes, jnp.zeros(3), shared[:3], jnp.ones(3, jnp.int32), jnp.ones(3, bool))
    with pytest.raises(ValueError, match="one int32 page per key"):
        I.insert_mixed(
            indexes, jnp.zeros(3, jnp.int32), shared[:3], jnp.ones(2, jnp.int32), jnp.ones(3, bool)
        )


def _same_index(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_index_set_equals_one_index_per_group():
    """A PrefixIndexSet (every group's tables in one set of arrays, the coordinator's state)
    behaves as one PrefixIndex per group: inserts of rows of every group interleaved, lookups,
    holds and removals (duplicates, overflowing buckets, pages outside a pool, unknown groups)
    give each group's own results, and its views are those indexes, counts included."""
    rng = np.random.default_rng(5)
    pool = (30, 10, 60, 25)
    indexes = tuple(
        I.create_index(p, num_buckets=b) for p, b in zip(pool, (2, 4, 8, 2), strict=True)
    )
    shared = _keys(64, seed=13)
    ixs = I.pack(indexes)
    assert (ixs.num_buckets, ixs.num_pages, ixs.bucket_offset) == (
        (2, 4, 8, 2),
        pool,
        (0, 2, 6, 14),
    )
    assert len(jax.tree_util.tree_leaves(ixs)) == 4  # whatever the number of groups
    insert_in, remove_in = jax.jit(I.insert_in), jax.jit(I.remove_in, static_argnames="distinct")
    for trial in range(4):
        n = 90
        group = rng.integers(-1, len(pool) + 1, n).astype(np.int32)  # -1 and 4: unknown
        keys = shared[rng.integers(0, 40, n)]
        pages = np.array(
            [rng.integers(-1, pool[g] + 2) if 0 <= g < len(pool) else 3 for g in group]
        )
        pages = jnp.asarray(pages, jnp.int32)
        valid = jnp.asarray(rng.random(n) < 0.85)
        ixs, taken, held, present = insert_in(ixs, jnp.asarray(group), keys, pages, valid)
        for g, ix in enumerate(indexes):
            mine = np.flatnonzero(group == g)
            before = I.lookup(ix, keys[mine], valid[mine])
            ix, t, h = I.insert_held(ix, keys[mine], pages[mine], valid[mine])
            np.testing.assert_array_equal(np.asarray(taken)[mine], np.asarray(t))
            np.testing.assert_array_equal(np.asarray(held)[mine], np.asarray(h))
            np.testing.assert_array_equal(np.asarray(present)[mine], np.asarray(before))
            _same_index(I.view(ixs, g), ix)
            _check_consistent(I.view(ixs, g))
            np.testing.assert_array_equal(
                np.asarray(I.lookup_in(ixs, g, shared, None)), np.asarray(I.lookup(ix, shared))
            )
            probe = jnp.arange(-1, pool[g] + 1, dtype=jnp.int32)
            np.testing.assert_array_equal(
                np.asarray(I.holds_in(ixs, g, probe)), np.asarray(I.holds(ix, probe))
            )
        unknown = (group < 0) | (group >= len(pool))
        assert not np.asarray(taken)[unknown].any() and not np.asarray(present)[unknown].any()
        assert np.asarray(taken).any() and not np.asarray(taken).all(), trial
        indexes = I.unpack(ixs)
        # Removal: some held pages (listed twice), some not.
        rg = rng.integers(0, len(pool), 30).astype(np.int32)
        rp = jnp.asarray([rng.integers(0, pool[g]) for g in rg], jnp.int32)
        ixs, removed = remove_in(ixs, jnp.asarray(rg), rp, None)
        for g, ix in enumerate(indexes):
            mine = np.flatnonzero(rg == g)
            ix, r = I.remove(ix, rp[mine])
            np.testing.assert_array_equal(np.asarray(removed)[mine], np.asarray(r))
            _same_index(I.view(ixs, g), ix)
        indexes = I.unpack(ixs)
    _same_index(I.pack(I.unpack(ixs)), ixs)
    cleared = I.clear_set(ixs)
    assert not np.asarray(cleared.count).any() and not np.asarray(cleared.pages).any()
    with pytest.raises(ValueError, match="one int32 group number per key"):
        I.insert_in(ixs, jnp.zeros(3), shared[:3], jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="one int32 page per key"):
        I.insert_in(ixs, 0, shared[:3], jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="pages are int32"):
        I.remove_in(ixs, 0, jnp.ones((2, 2), jnp.int32))


def test_insert_in_distinct_gives_the_checked_result_when_rows_are_distinct():
    """``insert_in(distinct=True)`` (one request's blocks: no two rows share a group and a key
    or a group and a page) skips the duplicate rules: on such rows, some keys and pages
    already indexed and some buckets overflowing, it gives the checked call's index, taken,
    held and present."""
    rng = np.random.default_rng(11)
    pool = (40, 30, 70)
    ixs = I.pack(
        tuple(I.create_index(p, num_buckets=b) for p, b in zip(pool, (2, 4, 8), strict=True))
    )
    shared = _keys(120, seed=17)
    plain = jax.jit(I.insert_in)
    promised = jax.jit(functools.partial(I.insert_in, distinct=True))
    checked = 0
    for _ in range(5):
        n = 48
        group = np.sort(rng.integers(0, len(pool), n)).astype(np.int32)
        # Distinct keys and, per group, distinct pages (some already indexed: earlier trials).
        keys = shared[rng.permutation(120)[:n]]
        pages = np.zeros(n, np.int32)
        for g in range(len(pool)):
            mine = np.flatnonzero(group == g)
            pages[mine] = rng.permutation(np.arange(1, pool[g] - 1))[: mine.size]
        valid = jnp.asarray(rng.random(n) < 0.9)
        args = (jnp.asarray(group), keys, jnp.asarray(pages), valid)
        a, *ra = plain(ixs, *args)
        b, *rb = promised(ixs, *args)
        _same_index(a, b)
        for x, y in zip(ra, rb, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        checked += int(np.asarray(ra[0]).sum()) > 0 and int((~np.asarray(ra[0])).sum()) > 0
        ixs = a
    assert checked >= 3
