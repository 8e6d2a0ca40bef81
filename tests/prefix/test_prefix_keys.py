"""Chained block keys: prefix identity, chaining, namespaces, padding, incremental hashing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import examples

from flatkv_jax.prefix import keys as K

block_keys = jax.jit(K.block_keys, static_argnames="block_tokens")
chain_sums = jax.jit(K.chain_sums, static_argnames="unit")
extend_sums = jax.jit(K.extend_sums)


def _tok(rows):
    return jnp.asarray(np.asarray(rows, np.int32))


def test_key_layout_and_same_prefix_same_keys(rng):
    base = rng.integers(0, 50_000, 64)
    other = base.copy()
    other[40] += 1  # block 5 of 8-token blocks
    keys, valid = block_keys(_tok([base, other]), jnp.array([64, 64], jnp.int32), 7, block_tokens=8)
    keys, valid = np.asarray(keys), np.asarray(valid)
    assert keys.shape == (2, 8, K.KEY_WORDS) and keys.dtype == np.uint32 and valid.all()
    np.testing.assert_array_equal(keys[0, :5], keys[1, :5])
    # A difference in block 5 changes every key from block 5 on, in every hash lane.
    assert (keys[0, 5:, : K.LANES] != keys[1, 5:, : K.LANES]).all()
    np.testing.assert_array_equal(keys[0, :, K.NS_WORD], 7)
    np.testing.assert_array_equal(keys[0, :, K.NS_WORD + 1], 0)
    np.testing.assert_array_equal(keys[0, :, K.END_WORD], np.arange(1, 9) * 8)


@settings(max_examples=examples(25), deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=48),
    st.data(),
)
def test_change_at_i_changes_keys_from_i_only(tokens, data):
    n = len(tokens)
    pos = data.draw(st.integers(0, n - 1))
    new = data.draw(st.integers(0, 2**31 - 1).filter(lambda v: v != tokens[pos]))
    other = list(tokens)
    other[pos] = new
    pad = 48
    a = np.zeros((2, pad), np.int32)
    a[0, :n], a[1, :n] = tokens, other
    keys, valid = block_keys(jnp.asarray(a), jnp.array([n, n], jnp.int32), 0, block_tokens=4)
    keys, valid = np.asarray(keys), np.asarray(valid)
    nb = n // 4
    assert valid[:, :nb].all() and not valid[:, nb:].any()
    first = pos // 4
    np.testing.assert_array_equal(keys[0, : min(first, nb)], keys[1, : min(first, nb)])
    # A single substituted token never collides: each term is a bijection of the token id.
    for i in range(first, nb):
        assert (keys[0, i, : K.LANES] != keys[1, i, : K.LANES]).all()


def test_namespace_isolates(rng):
    toks = _tok(np.broadcast_to(rng.integers(0, 1000, 32), (4, 32)))
    ns = jnp.asarray(np.array([[0, 0], [1, 0], [0, 1], [2**32 - 1, 5]], np.uint32))
    keys, _ = block_keys(toks, jnp.full((4,), 32, jnp.int32), ns, block_tokens=8)
    keys = np.asarray(keys)
    for i in range(4):
        for j in range(i + 1, 4):
            assert (keys[i, :, : K.LANES] != keys[j, :, : K.LANES]).all()
    np.testing.assert_array_equal(keys[3, 0, K.NS_WORD : K.NS_WORD + 2], [2**32 - 1, 5])
    # Int and pair forms are the same namespace.
    a, _ = K.block_keys(toks[:1], jnp.array([32], jnp.int32), (3 << 32) | 9, block_tokens=8)
    b, _ = K.block_keys(toks[:1], jnp.array([32], jnp.int32), (9, 3), block_tokens=8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A traced int32 scalar is the low word.
    c, _ = block_keys(toks[:1], jnp.array([32], jnp.int32), jnp.int32(9), block_tokens=8)
    d, _ = K.block_keys(toks[:1], jnp.array([32], jnp.int32), (9, 0), block_tokens=8)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(d))


def test_padding_beyond_length_ignored(rng):
    t = rng.integers(0, 1000, (3, 40)).astype(np.int32)
    lengths = jnp.array([40, 21, 3], jnp.int32)
    t2 = t.copy()
    for r, n in enumerate([40, 21, 3]):
        t2[r, n:] = rng.integers(-5, 10**6, 40 - n)
    k1, v1 = block_keys(jnp.asarray(t), lengths, 0, block_tokens=4)
    k2, v2 = block_keys(jnp.asarray(t2), lengths, 0, block_tokens=4)
    v1 = np.asarray(v1)
    np.testing.assert_array_equal(v1, np.asarray(v2))
    np.testing.assert_array_equal(v1.sum(1), [10, 5, 0])
    np.testing.assert_array_equal(np.asarray(k1)[v1], np.asarray(k2)[v1])
    # Batched == one prompt at a time.
    for r in range(3):
        kr, _ = block_keys(jnp.asarray(t[r : r + 1]), lengths[r : r + 1], 0, block_tokens=4)
        np.testing.assert_array_equal(np.asarray(kr)[0][v1[r]], np.asarray(k1)[r][v1[r]])


def test_units_agree_and_incremental_extension_matches_bulk(rng):
    t = rng.integers(0, 1 << 20, (2, 64)).astype(np.int32)
    lengths = jnp.array([64, 50], jnp.int32)
    ns = jnp.asarray(np.array([[5, 6], [7, 8]], np.uint32))
    sums4 = chain_sums(jnp.asarray(t), lengths, ns, unit=4)
    ends = jnp.array([16, 32, 48, 64], jnp.int32)
    ka, va = K.keys_at(sums4, 4, lengths, ns, ends)
    kb, vb = block_keys(jnp.asarray(t), lengths, ns, block_tokens=16)
    np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    np.testing.assert_array_equal(np.asarray(ka), np.asarray(kb))
    # Extending a chain state chunk by chunk (unaligned chunks) gives the bulk states.
    state = jnp.zeros((2, K.LANES), jnp.uint32)
    start = 0
    for chunk in (5, 11, 16, 1, 31):
        count = jnp.array([chunk, max(0, min(chunk, 50 - start))], jnp.int32)
        run = extend_sums(
            state,
            jnp.asarray(t[:, start : start + chunk]),
            jnp.full((2,), start, jnp.int32),
            count,
            ns,
        )
        state = run[:, -1]
        start += chunk
        if start % 4 == 0:
            np.testing.assert_array_equal(
                np.asarray(state)[0], np.asarray(sums4)[0, start // 4 - 1]
            )
    full1 = chain_sums(jnp.asarray(t[1:, :50]), jnp.array([50], jnp.int32), ns[1], unit=50)
    np.testing.assert_array_equal(np.asarray(state)[1], np.asarray(full1)[0, 0])


def test_no_collisions_among_many_keys():
    # 256 prompts x 512 blocks = 131k keys of prompts sharing prefixes in a tree: no two
    # distinct prefixes share even the first 64 hash bits (the 128-bit keys never will).
    rng = np.random.default_rng(1)
    t = rng.integers(0, 8, (256, 512)).astype(np.int32)  # tiny vocabulary: many near-duplicates
    t[:, :8] = 3
    keys, _ = block_keys(jnp.asarray(t), jnp.full((256,), 512, jnp.int32), 0, block_tokens=1)
    keys = np.asarray(keys).reshape(-1, K.KEY_WORDS)
    prefixes = {}
    for r in range(256):
        for i in range(512):
            prefixes.setdefault(tuple(keys[r * 512 + i, :2]), set()).add(t[r, : i + 1].tobytes())
    assert all(len(v) == 1 for v in prefixes.values())


def test_errors():
    with pytest.raises(
        ValueError, match=r"namespace=-1 is invalid: a namespace int must lie in \[0, 2\*\*64\)"
    ):
        K.namespace_words(-1)
    with pytest.raises(ValueError, match="a namespace pair holds two ints"):
        K.namespace_words((1, 2**32))
    with pytest.raises(TypeError, match="a namespace is an int or a pair of uint32 words"):
        K.namespace_words("tenant")
    t = jnp.zeros((2, 8), jnp.int32)
    n = jnp.array([8, 8], jnp.int32)
    with pytest.raises(TypeError, match="token ids are int32"):
        K.block_keys(t.astype(jnp.float32), n, 0, block_tokens=4)
    with pytest.raises(ValueError, match=r"token ids are a \[B, L\] batch"):
        K.block_keys(t[0], n, 0, block_tokens=4)
    with pytest.raises(ValueError, match="one int32 per prompt"):
        K.block_keys(t, n[:1], 0, block_tokens=4)
    with pytest.raises(TypeError, match="namespace words are uint32"):
        K.block_keys(t, n, jnp.zeros((2,), jnp.float32), block_tokens=4)
    with pytest.raises(TypeError, match="namespace words are uint32"):
        K.block_keys(t, n, jnp.zeros((2, 2), jnp.int32), block_tokens=4)
    with pytest.raises(ValueError, match=r"one namespace \(2,\) or one per prompt \(2, 2\)"):
        K.block_keys(t, n, jnp.zeros((3, 2), jnp.uint32), block_tokens=4)
    with pytest.raises(ValueError, match="block_tokens=0 is invalid: it must be positive"):
        K.block_keys(t, n, 0, block_tokens=0)
    with pytest.raises(ValueError, match=r"the chain state is uint32\[B, 4\]"):
        K.extend_sums(jnp.zeros((2, 2), jnp.uint32), t, n, n, 0)
