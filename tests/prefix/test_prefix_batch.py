"""The batch helpers behind first-publisher-wins, checked against plain Python."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatkv_jax.prefix import _batch
from flatkv_jax.prefix._batch import first_index, first_occurrence, last_occurrence, rank_within


def test_first_index_and_first_occurrence_match_a_python_scan():
    rng = np.random.default_rng(11)
    fi, fo = jax.jit(first_index), jax.jit(first_occurrence)
    for n in (0, 1, 7, 40):
        a = rng.integers(0, 3, n).astype(np.int32)
        b = rng.integers(0, 2, n).astype(np.uint32)
        valid = rng.random(n) < 0.7
        want_idx, want_first, seen = [], [], {}
        for i in range(n):
            key = (int(a[i]), int(b[i]))
            if not valid[i]:
                want_idx.append(-1)
                want_first.append(False)
                continue
            want_first.append(key not in seen)
            want_idx.append(seen.setdefault(key, i))
        cols = (jnp.asarray(a), jnp.asarray(b))
        got_idx = fi(cols, jnp.asarray(valid)) if n else first_index(cols, jnp.asarray(valid))
        got_first = fo(cols, jnp.asarray(valid)) if n else first_occurrence(cols, valid)
        assert np.asarray(got_idx).tolist() == want_idx
        assert np.asarray(got_first).tolist() == want_first


def _scan(cols, valid):
    """Python reference: first index, first occurrence, last occurrence, rank in group."""
    n = len(valid)
    keys = [tuple(int(c[i]) for c in cols) for i in range(n)]
    first, idx, rank, seen, count = [], [], [], {}, {}
    for i in range(n):
        if not valid[i]:
            first.append(False)
            idx.append(-1)
            rank.append(None)
            continue
        first.append(keys[i] not in seen)
        idx.append(seen.setdefault(keys[i], i))
        rank.append(count.get(keys[i], 0))
        count[keys[i]] = count.get(keys[i], 0) + 1
    later = set()
    last = [False] * n
    for i in reversed(range(n)):
        if valid[i]:
            last[i] = keys[i] not in later
            later.add(keys[i])
    return first, idx, last, rank


@pytest.mark.parametrize("n", [1, 32, 33, 128, 300, 512, 513, 1000, 3000])
def test_batch_rules_are_exact_on_every_path(n):
    """Pairwise (n <= PAIRWISE), hashed suspects compared pairwise, and the sorted fallback
    (more suspects than SUSPECTS: many repeats) all give the Python scan's answers, for
    wide uint32 columns (hash-slot collisions among distinct rows) and repeats alike."""
    rng = np.random.default_rng(n)
    fns = [jax.jit(f) for f in (first_occurrence, first_index, last_occurrence)]
    rank = jax.jit(rank_within)
    for repeats in (0.0, 0.02, 0.5):
        a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        b = rng.integers(0, 3, n).astype(np.int32)
        dup = rng.random(n) < repeats
        src = rng.integers(0, n, n)
        a[dup], b[dup] = a[src[dup]], b[src[dup]]
        valid = rng.random(n) < 0.8
        cols = (jnp.asarray(b), jnp.asarray(a))
        first, idx, last, rk = _scan((b, a), valid)
        v = jnp.asarray(valid)
        assert np.asarray(fns[0](cols, v)).tolist() == first, repeats
        assert np.asarray(fns[1](cols, v)).tolist() == idx, repeats
        assert np.asarray(fns[2](cols, v)).tolist() == last, repeats
        # rank_within on one column (a bucket): few buckets (many rows share one) and many
        # (rows rarely share one), so a rank is checked both in crowded and sparse buckets.
        for span in (max(1, n // 4), 64 * n):
            bucket = rng.integers(0, span, n).astype(np.int32)
            _, _, _, rk = _scan((bucket,), valid)
            got = np.asarray(rank(jnp.asarray(bucket), v))
            assert all(r is None or int(g) == r for g, r in zip(got, rk, strict=True)), span


def test_hashed_path_is_taken_and_the_sort_only_beyond_the_suspect_bound(monkeypatch):
    """The sort runs only when more than SUSPECTS rows are suspects: with the sort replaced by
    a sentinel, few repeats give exact answers and many give the sentinel."""
    n = 1000
    cols = (jnp.arange(n, dtype=jnp.int32),)
    valid = jnp.ones((n,), bool)
    monkeypatch.setattr(_batch, "_runs", lambda columns, valid: _sentinel_runs(valid))
    got = np.asarray(jax.jit(first_occurrence)(cols, valid))
    assert got.all()  # distinct rows: hashed path, exact, no sort
    rep = (jnp.arange(n, dtype=jnp.int32) // 2,)  # every row repeats: 1000 suspects
    got = np.asarray(jax.jit(first_occurrence)(rep, valid))
    assert not got.any()  # the (sentinel) sort answered


def _sentinel_runs(valid):
    n = valid.shape[0]
    return jnp.ones((n,), jnp.int32), jnp.arange(n, dtype=jnp.int32), jnp.zeros((n,), bool)
