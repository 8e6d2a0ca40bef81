"""The batch helpers behind first-publisher-wins, checked against plain Python."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.prefix._batch import first_index, first_occurrence


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
