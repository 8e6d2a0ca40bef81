"""Chained block keys: prefix identity, the secret seed, the non-linear chain, namespaces,
padding, incremental hashing."""

from __future__ import annotations

import functools
from pathlib import Path

import additive_collision
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import examples

from flatkv_jax.prefix import keys as K

SEED = 11
block_keys = jax.jit(K.block_keys, static_argnames="block_tokens")
chain_lanes = jax.jit(K.chain_lanes, static_argnames="unit")
extend_chain = jax.jit(K.extend_chain, static_argnames="unit")


def _tok(rows):
    return jnp.asarray(np.asarray(rows, np.int32))


def test_key_layout_and_same_prefix_same_keys(rng):
    base = rng.integers(0, 50_000, 64)
    other = base.copy()
    other[40] += 1  # block 5 of 8-token blocks
    keys, valid = block_keys(
        _tok([base, other]), jnp.array([64, 64], jnp.int32), 7, seed=SEED, block_tokens=8
    )
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
    st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=300),
    st.data(),
)
def test_change_at_i_changes_keys_from_i_only(tokens, data):
    n = len(tokens)
    pos = data.draw(st.integers(0, n - 1))
    new = data.draw(st.integers(0, 2**31 - 1).filter(lambda v: v != tokens[pos]))
    other = list(tokens)
    other[pos] = new
    pad = 300
    a = np.zeros((2, pad), np.int32)
    a[0, :n], a[1, :n] = tokens, other
    keys, valid = block_keys(
        jnp.asarray(a), jnp.array([n, n], jnp.int32), 0, seed=SEED, block_tokens=4
    )
    keys, valid = np.asarray(keys), np.asarray(valid)
    nb = n // 4
    assert valid[:, :nb].all() and not valid[:, nb:].any()
    first = pos // 4
    np.testing.assert_array_equal(keys[0, : min(first, nb)], keys[1, : min(first, nb)])
    for i in range(first, nb):
        assert (keys[0, i, : K.LANES] != keys[1, i, : K.LANES]).all()


def test_seed_makes_keys_secret():
    """Two states (seeds) give unrelated keys for the same prompt; the same seed gives the
    same keys; the seed forms agree; a drawn seed is fresh every time."""
    t = _tok(np.random.default_rng(0).integers(0, 1000, (1, 256)))
    n = jnp.array([256], jnp.int32)
    ka = np.asarray(block_keys(t, n, 0, seed=1, block_tokens=4)[0])
    kb = np.asarray(block_keys(t, n, 0, seed=2, block_tokens=4)[0])
    assert (ka[..., : K.LANES] != kb[..., : K.LANES]).all()  # every lane of every key
    np.testing.assert_array_equal(ka[..., K.LANES :], kb[..., K.LANES :])  # ns, end verbatim
    words = jnp.asarray(K.seed_words(2**96 + 5))
    np.testing.assert_array_equal(K.seed_words(2**96 + 5), [5, 0, 0, 1])
    kc = np.asarray(block_keys(t, n, 0, seed=words, block_tokens=4)[0])
    kd = np.asarray(block_keys(t, n, 0, seed=np.array([5, 0, 0, 1], np.uint32), block_tokens=4)[0])
    np.testing.assert_array_equal(kc, kd)
    assert (kc[..., : K.LANES] != ka[..., : K.LANES]).all()
    drawn = {K.new_seed().tobytes() for _ in range(8)}
    assert len(drawn) == 8 and all(len(x) == 4 * K.SEED_WORDS for x in drawn)


def test_chain_is_non_linear():
    """The additive scheme's identity ``S(P1) - S(P2) == S(P1') - S(P2')`` for prompts that
    differ only in their first block breaks: the chain step mixes the previous block's key
    non-linearly, so the difference made in block 0 does not carry over to later keys."""
    rng = np.random.default_rng(1)
    c = K.CHAIN_TOKENS
    x, y = rng.integers(0, 1000, (2, c))
    z1, z2 = rng.integers(0, 1000, (2, c))
    rows = [
        np.concatenate([x, z1]),
        np.concatenate([y, z1]),
        np.concatenate([x, z2]),
        np.concatenate([y, z2]),
    ]
    ph = chain_lanes(_tok(rows), jnp.full((4,), 2 * c, jnp.int32), 0, seed=SEED, unit=c)
    lanes = np.asarray(ph.lanes)[:, 1]  # the key of the whole 2-block prefix
    d1 = lanes[0] - lanes[1]
    d2 = lanes[2] - lanes[3]
    assert (d1 != d2).all()
    # One flipped token bit in block 0 flips about half of the 128 bits of the block-1 key.
    flips = []
    for i in range(16):
        v = x.copy()
        v[i * 8] ^= 1
        ph2 = chain_lanes(
            _tok([np.concatenate([v, z1])]), jnp.array([2 * c], jnp.int32), 0, seed=SEED, unit=c
        )
        diff = np.asarray(ph2.lanes)[0, 1] ^ lanes[0]
        flips.append(np.unpackbits(diff.view(np.uint8)).mean())
    assert 0.4 < np.mean(flips) < 0.6


def test_namespace_isolates(rng):
    toks = _tok(np.broadcast_to(rng.integers(0, 1000, 32), (4, 32)))
    ns = jnp.asarray(np.array([[0, 0], [1, 0], [0, 1], [2**32 - 1, 5]], np.uint32))
    keys, _ = block_keys(toks, jnp.full((4,), 32, jnp.int32), ns, seed=SEED, block_tokens=8)
    keys = np.asarray(keys)
    for i in range(4):
        for j in range(i + 1, 4):
            assert (keys[i, :, : K.LANES] != keys[j, :, : K.LANES]).all()
    np.testing.assert_array_equal(keys[3, 0, K.NS_WORD : K.NS_WORD + 2], [2**32 - 1, 5])
    one = jnp.array([32], jnp.int32)
    kw = dict(seed=SEED, block_tokens=8)
    # Int and pair forms are the same namespace.
    a, _ = K.block_keys(toks[:1], one, (3 << 32) | 9, **kw)
    b, _ = K.block_keys(toks[:1], one, (9, 3), **kw)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A traced int32 scalar is the low word.
    c, _ = block_keys(toks[:1], one, jnp.int32(9), **kw)
    d, _ = K.block_keys(toks[:1], one, (9, 0), **kw)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(d))


def test_padding_beyond_length_ignored(rng):
    t = rng.integers(0, 1000, (3, 300)).astype(np.int32)
    lengths = jnp.array([300, 141, 3], jnp.int32)
    t2 = t.copy()
    for r, n in enumerate([300, 141, 3]):
        t2[r, n:] = rng.integers(-5, 10**6, 300 - n)
    kb = functools.partial(block_keys, seed=SEED, block_tokens=4)
    k1, v1 = kb(jnp.asarray(t), lengths, 0)
    k2, v2 = kb(jnp.asarray(t2), lengths, 0)
    v1 = np.asarray(v1)
    np.testing.assert_array_equal(v1, np.asarray(v2))
    np.testing.assert_array_equal(v1.sum(1), [75, 35, 0])
    np.testing.assert_array_equal(np.asarray(k1)[v1], np.asarray(k2)[v1])
    # Batched == one prompt at a time (at a narrower width, too).
    for r in range(3):
        kr, _ = kb(jnp.asarray(t[r : r + 1, :160]), lengths[r : r + 1], 0)
        m = v1[r][:40]
        np.testing.assert_array_equal(np.asarray(kr)[0][m], np.asarray(k1)[r][:40][m])


def test_units_agree_and_incremental_extension_matches_bulk(rng):
    n = 3 * K.CHAIN_TOKENS + 40
    t = rng.integers(0, 1 << 20, (2, n)).astype(np.int32)
    lengths = jnp.array([n, 301], jnp.int32)
    ns = jnp.asarray(np.array([[5, 6], [7, 8]], np.uint32))
    ph4 = chain_lanes(jnp.asarray(t), lengths, ns, seed=SEED, unit=4)
    ends = jnp.array([16, 128, 256, 400], jnp.int32)
    ka, va = K.keys_at(ph4.lanes, 4, lengths, ns, ends)
    kb, vb = block_keys(jnp.asarray(t), lengths, ns, seed=SEED, block_tokens=16)
    np.testing.assert_array_equal(np.asarray(va), np.asarray(vb)[:, ends // 16 - 1])
    np.testing.assert_array_equal(np.asarray(ka), np.asarray(kb)[:, ends // 16 - 1])
    # A 256-token unit (wider than a chain block) agrees with the 4-token unit.
    ph256 = chain_lanes(jnp.asarray(t), lengths, ns, seed=SEED, unit=256)
    np.testing.assert_array_equal(np.asarray(ph256.lanes)[:, 0], np.asarray(ph4.lanes)[:, 63])
    # Extending a chain state chunk by chunk (unaligned chunks crossing chain blocks, an empty
    # one) gives the bulk lanes at every end and the bulk chain states.
    state = jnp.zeros((2, K.CHAIN_WORDS), jnp.uint32)
    start = 0
    lanes4 = np.asarray(ph4.lanes)
    for chunk in (5, 11, 16, 1, 131, 0, 200, 60):
        # Two widths (two compilations): one decode token, and 256 columns with `count` real.
        width = 1 if chunk == 1 else 256
        count = np.array([min(chunk, n - start), max(0, min(chunk, 301 - start))], np.int32)
        toks = np.zeros((2, width), np.int32)
        toks[:, : min(width, n - start)] = t[:, start : start + width]
        lanes, state = extend_chain(
            state,
            jnp.asarray(toks),
            jnp.full((2,), start, jnp.int32),
            jnp.asarray(count),
            ns,
            seed=SEED,
        )
        lanes = np.asarray(lanes)
        for r in range(2):
            for i in range(count[r]):
                e = start + i + 1
                if e % 4 == 0:
                    np.testing.assert_array_equal(lanes[r, i], lanes4[r, e // 4 - 1])
            e = start + int(count[r])
            if e % 4 == 0:
                want = K.chain_state(ph4, jnp.full((2,), e, jnp.int32))
                np.testing.assert_array_equal(np.asarray(state)[r], np.asarray(want)[r])
        start += chunk
    assert start == n


@pytest.mark.parametrize("unit", [4, 64, 128])
def test_extend_chain_at_a_unit_gives_the_lanes_of_those_ends(rng, unit):
    """``unit > 1`` returns only the lanes at multiples of ``unit`` (entry ``j``: the end
    ``(start // unit + 1 + j) * unit``): exactly the per-token lanes at those ends, for
    unaligned starts, chunks crossing chain blocks, short counts and one-token steps; the
    chain state is the same as with ``unit = 1``."""
    n = 700
    t = rng.integers(0, 50_000, size=(2, n)).astype(np.int32)
    ns = jnp.asarray([[1, 0], [5, 2]], jnp.uint32)
    ph = chain_lanes(jnp.asarray(t), jnp.full((2,), n, jnp.int32), ns, seed=SEED, unit=1)
    bulk = np.asarray(ph.lanes)
    checked = 0
    for start, width, counts in (
        (0, 256, (256, 200)),
        (61, 256, (250, 3)),
        (127, 300, (300, 129)),
        (255, 1, (1, 1)),
        (319, 1, (1, 0)),
        (130, 512, (512, 511)),
    ):
        state = K.chain_state(ph, jnp.full((2,), start, jnp.int32))
        toks = jnp.asarray(t[:, start : start + width])
        count = jnp.asarray(counts, jnp.int32)
        starts = jnp.full((2,), start, jnp.int32)
        lanes, s_u = extend_chain(state, toks, starts, count, ns, seed=SEED, unit=unit)
        _, s_1 = extend_chain(state, toks, starts, count, ns, seed=SEED)
        np.testing.assert_array_equal(np.asarray(s_u), np.asarray(s_1))
        lanes = np.asarray(lanes)
        assert lanes.shape == (2, width // unit + 1, K.LANES)
        for r in range(2):
            for j in range(lanes.shape[1]):
                e = (start // unit + 1 + j) * unit
                if e <= start + counts[r]:
                    np.testing.assert_array_equal(lanes[r, j], bulk[r, e - 1])
                    checked += 1
    assert checked > 0


def test_one_token_steps_across_chain_blocks_match_the_bulk_chain(rng):
    """Width-1 extension (a decode step: one finishing mix gives both the token's lanes and,
    when the token completes a chain block, the next chain key) walks positions 120 -> 264,
    across two chain-block ends, and agrees with ``chain_lanes`` at every position; a row
    with ``count = 0`` keeps its state."""
    n = 300
    t = rng.integers(0, 50_000, size=(2, n)).astype(np.int32)
    lengths = jnp.full((2,), n, jnp.int32)
    ns = jnp.asarray([[3, 0], [9, 1]], jnp.uint32)
    ph = chain_lanes(jnp.asarray(t), lengths, ns, seed=SEED, unit=1)
    bulk = np.asarray(ph.lanes)
    start = 120
    state = K.chain_state(ph, jnp.full((2,), start, jnp.int32))
    for p in range(start, 264):
        idle = p % 7 == 0  # row 1 skips some steps (count 0) and catches up with the next
        count = jnp.asarray([1, 0 if idle else 1], jnp.int32)
        starts = jnp.asarray([p, p], jnp.int32)
        toks = jnp.asarray(t[:, p : p + 1])
        before = np.asarray(state)
        lanes, state = extend_chain(state, toks, starts, count, ns, seed=SEED)
        np.testing.assert_array_equal(np.asarray(lanes)[0, 0], bulk[0, p])
        want = np.asarray(K.chain_state(ph, jnp.full((2,), p + 1, jnp.int32)))
        np.testing.assert_array_equal(np.asarray(state)[0], want[0])
        if idle:
            np.testing.assert_array_equal(np.asarray(state)[1], before[1])
            # Catch row 1 up with the skipped token (start p, count 1) in a second call.
            lanes1, s1 = extend_chain(
                state, toks, starts, jnp.asarray([0, 1], jnp.int32), ns, seed=SEED
            )
            state = jnp.asarray(np.stack([np.asarray(state)[0], np.asarray(s1)[1]]))
            np.testing.assert_array_equal(np.asarray(lanes1)[1, 0], bulk[1, p])
        else:
            np.testing.assert_array_equal(np.asarray(lanes)[1, 0], bulk[1, p])
        np.testing.assert_array_equal(np.asarray(state)[1], want[1])


def test_no_collisions_among_many_keys():
    # 256 prompts x 512 blocks = 131k keys of prompts sharing prefixes in a tree: no two
    # distinct prefixes share even the first 64 hash bits (the 128-bit keys never will).
    rng = np.random.default_rng(1)
    t = rng.integers(0, 8, (256, 512)).astype(np.int32)  # tiny vocabulary: many near-duplicates
    t[:, :8] = 3
    keys, _ = block_keys(
        jnp.asarray(t), jnp.full((256,), 512, jnp.int32), 0, seed=SEED, block_tokens=1
    )
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
    with pytest.raises(
        ValueError, match=r"seed=-1 is invalid: a seed int must lie in \[0, 2\*\*128\)"
    ):
        K.seed_words(-1)
    with pytest.raises(ValueError, match=r"a seed array holds 4 uint32 words"):
        K.seed_words([1, 2, 3])
    with pytest.raises(ValueError, match=r"seed words lie in \[0, 2\*\*32\)"):
        K.seed_words([1, 2, 3, 2**32])
    with pytest.raises(TypeError, match="a seed is an int or uint32\\[4\\] words"):
        K.seed_words("secret")
    t = jnp.zeros((2, 8), jnp.int32)
    n = jnp.array([8, 8], jnp.int32)
    with pytest.raises(TypeError, match=r"the key seed is uint32\[4\]"):
        K.block_keys(t, n, 0, seed=jnp.zeros((4,), jnp.int32), block_tokens=4)
    with pytest.raises(ValueError, match=r"the key seed is uint32\[4\]"):
        K.block_keys(t, n, 0, seed=jnp.zeros((2,), jnp.uint32), block_tokens=4)
    kb = functools.partial(K.block_keys, seed=0)
    with pytest.raises(TypeError, match="token ids are int32"):
        kb(t.astype(jnp.float32), n, 0, block_tokens=4)
    with pytest.raises(ValueError, match=r"token ids are a \[B, L\] batch"):
        kb(t[0], n, 0, block_tokens=4)
    with pytest.raises(ValueError, match="one int32 per prompt"):
        kb(t, n[:1], 0, block_tokens=4)
    with pytest.raises(TypeError, match="namespace words are uint32"):
        kb(t, n, jnp.zeros((2,), jnp.float32), block_tokens=4)
    with pytest.raises(TypeError, match="namespace words are uint32"):
        kb(t, n, jnp.zeros((2, 2), jnp.int32), block_tokens=4)
    with pytest.raises(ValueError, match=r"one namespace \(2,\) or one per prompt \(2, 2\)"):
        kb(t, n, jnp.zeros((3, 2), jnp.uint32), block_tokens=4)
    t3, n3 = jnp.zeros((3, 8), jnp.int32), jnp.array([8, 8, 8], jnp.int32)
    with pytest.raises(
        TypeError, match=r"namespace='uint32\[3\]' is invalid: uint32 namespaces are words"
    ):
        kb(t3, n3, jnp.zeros((3,), jnp.uint32), block_tokens=4)
    with pytest.raises(ValueError, match="block_tokens=0 is invalid: it must be positive"):
        kb(t, n, 0, block_tokens=0)
    with pytest.raises(ValueError, match=r"the chain state is uint32\[B, 8\]"):
        K.extend_chain(jnp.zeros((2, 4), jnp.uint32), t, n, n, 0, seed=0)


def _check_old_collision_is_gone(a, b):
    assert (a != b).all() and a.shape == b.shape == (additive_collision.POSITIONS,)
    np.testing.assert_array_equal(additive_collision.old_lanes(a), additive_collision.old_lanes(b))
    n = len(a)
    toks, lengths = _tok([a, b]), jnp.array([n, n], jnp.int32)
    for seed in (0, SEED):
        keys, valid = block_keys(toks, lengths, 0, seed=seed, block_tokens=n)
        keys = np.asarray(keys)
        assert np.asarray(valid).all() and (keys[0, 0, : K.LANES] != keys[1, 0, : K.LANES]).all()


def test_prompts_crafted_to_collide_under_the_additive_keys_do_not_collide():
    """A pair crafted with Wagner's algorithm against the old public additive keys
    (``additive_collision.craft_collision``, stored): equal old keys, different seeded keys."""
    a, b = np.load(Path(__file__).parent / "data" / "additive_collision.npy")
    _check_old_collision_is_gone(a, b)


@pytest.mark.slow
def test_crafting_a_collision_against_the_additive_keys():
    """Crafts the pair from scratch (~10-40 s) and checks it as above."""
    a, b = additive_collision.craft_collision(seed=1)
    _check_old_collision_is_gone(a, b)


def test_create_state_draws_a_secret_seed_unless_given(monkeypatch):
    from prefix_cases import tiny_plan

    from flatkv_jax.coordinator import create_state

    monkeypatch.undo()  # the suite's conftest fixes the drawn seed; check the real draw
    plan = tiny_plan(pages=40, max_context=64)
    seeds = {np.asarray(create_state(plan).key_seed).tobytes() for _ in range(3)}
    assert len(seeds) == 3  # 128 fresh bits each time
    a, b = create_state(plan, seed=5), create_state(plan, seed=5)
    np.testing.assert_array_equal(np.asarray(a.key_seed), K.seed_words(5))
    np.testing.assert_array_equal(np.asarray(a.key_seed), np.asarray(b.key_seed))
    with pytest.raises(
        ValueError, match=r"seed=-3 is invalid: a seed int must lie in \[0, 2\*\*128\)"
    ):
        create_state(plan, seed=-3)


def test_looped_rounds_give_the_unrolled_words(monkeypatch):
    # Large arrays run P's rounds in a fori_loop (XLA:CPU's unrolled 7+ rounds are slow): the
    # words must be those of the unrolled rounds, for every round count and either path.
    x = jnp.asarray(np.random.default_rng(7).integers(0, 2**32, (3, 700, 4), dtype=np.uint32))
    assert x.size >= K._LOOP_MIN_WORDS
    looped = [np.asarray(K._permute(x, r)) for r in (K.TERM_ROUNDS, 7, K.CHAIN_ROUNDS)]
    monkeypatch.setattr(K, "_LOOP_MIN_WORDS", x.size + 1)
    unrolled = [np.asarray(K._permute(x, r)) for r in (K.TERM_ROUNDS, 7, K.CHAIN_ROUNDS)]
    for a, b in zip(looped, unrolled, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(looped[1], looped[2])


def test_stored_subkeys_and_add_terms_continue_the_chain_as_extend_chain(rng):
    """The coordinator keeps each request's subkeys (``Subkeys.words``, derived once at
    admission): ``extend_chain(sub=...)`` gives the same lanes and chain state as deriving
    them from the seed. ``add_terms`` (the rows of a decode step that reach no block end) gives
    ``extend_chain``'s chain state for every row whose tokens end inside their chain block,
    for one-token steps and wider ones, aligned and unaligned starts."""
    n = 400
    t = rng.integers(0, 50_000, size=(3, n)).astype(np.int32)
    ns = jnp.asarray([[1, 0], [5, 2], [1, 0]], jnp.uint32)
    ph = chain_lanes(jnp.asarray(t), jnp.full((3,), n, jnp.int32), ns, seed=SEED, unit=1)
    sub = K.subkeys(SEED, ns, 3)
    words = sub.words()
    assert words.shape == (3, 3, K.LANES) and words.dtype == jnp.uint32
    back = K.Subkeys.from_words(words)
    for x, y in zip(
        (back.term, back.chain, back.final), (sub.term, sub.chain, sub.final), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    checked = 0
    for starts, width, counts in (
        ((5, 128, 200), 1, (1, 1, 1)),
        ((0, 129, 250), 4, (4, 3, 0)),
        ((64, 130, 300), 60, (60, 20, 1)),
        ((126, 255, 100), 1, (1, 1, 0)),
    ):
        start = jnp.asarray(starts, jnp.int32)
        count = jnp.asarray(counts, jnp.int32)
        state = K.chain_state(ph, start)
        toks = jnp.asarray(np.stack([t[r, s : s + width] for r, s in enumerate(starts)]))
        lanes_s, chain_s = extend_chain(state, toks, start, count, ns, seed=SEED, sub=back)
        lanes, chain = extend_chain(state, toks, start, count, ns, seed=SEED)
        np.testing.assert_array_equal(np.asarray(lanes_s), np.asarray(lanes))
        np.testing.assert_array_equal(np.asarray(chain_s), np.asarray(chain))
        added = np.asarray(K.add_terms(state, toks, start, count, back.term))
        for r in range(3):
            if (starts[r] + counts[r]) // K.CHAIN_TOKENS == starts[r] // K.CHAIN_TOKENS:
                np.testing.assert_array_equal(added[r], np.asarray(chain)[r])
                checked += 1
    assert checked >= 8


@pytest.mark.parametrize("rows", [2, 5, 10])
def test_extend_by_units_gives_the_per_token_lanes_and_state(rows):
    """``extend_chain`` with ``unit > 1`` and several tokens lays the tokens from their chain
    block's start and sums whole units (``_extend_by_units``); with ``unit = 1`` it sums
    token by token: the two must give the same lanes at every unit end the tokens reach and
    the same chain state, for random starts (unaligned, at block ends), counts (0, partial,
    full) and widths; 1,100 tokens span more than 8 chain blocks (a scan, not unrolled): its
    stacked (2 rows), per-row (5) and four-word (10) forms."""
    assert K._ROW_SCAN_ROWS <= 5 < K._PLANAR_CHAIN_ROWS <= 10
    rng = np.random.default_rng(rows)
    n = 2600
    t = rng.integers(0, 50_000, size=(rows, n)).astype(np.int32)
    ns = jnp.asarray(rng.integers(0, 9, size=(rows, 2)), jnp.uint32)
    ph = chain_lanes(jnp.asarray(t), jnp.full((rows,), n, jnp.int32), ns, seed=SEED, unit=1)
    checked = 0
    for unit, width in ((4, 130), (64, 256), (128, 700), (256, 300), (64, 2), (128, 1100)):
        starts = rng.integers(0, n - width, size=rows).astype(np.int32)
        starts[0] = 2 * K.CHAIN_TOKENS  # a chain-block start
        starts[-1] = 3 * K.CHAIN_TOKENS - 1  # one short of a block end
        counts = rng.integers(0, width + 1, size=rows).astype(np.int32)
        counts[0] = width
        counts[1] = 0
        start = jnp.asarray(starts)
        state = K.chain_state(ph, start)
        toks = jnp.asarray(np.stack([t[r, s : s + width] for r, s in enumerate(starts)]))
        args = (state, toks, start, jnp.asarray(counts), ns)
        lanes_u, s_u = extend_chain(*args, seed=SEED, unit=unit)
        lanes_1, s_1 = extend_chain(*args, seed=SEED)
        np.testing.assert_array_equal(np.asarray(s_u), np.asarray(s_1))
        lanes_u, lanes_1 = np.asarray(lanes_u), np.asarray(lanes_1)
        for r in range(rows):
            for j in range(lanes_u.shape[1]):
                e = (int(starts[r]) // unit + 1 + j) * unit
                if e <= starts[r] + counts[r]:
                    np.testing.assert_array_equal(lanes_u[r, j], lanes_1[r, e - starts[r] - 1])
                    checked += 1
    assert checked > 10 * rows


@pytest.mark.parametrize("rows", [K._ROW_SCAN_ROWS + 1, K._PLANAR_CHAIN_ROWS + 1])
def test_chain_lanes_of_a_batch_are_each_prompts_own(rows):
    """The chain scan runs one scan per row from ``_ROW_SCAN_ROWS`` rows up and on the four
    words as separate arrays from ``_PLANAR_CHAIN_ROWS`` up (stacked below both): a batch's
    lanes, block sums and chain keys are those of each prompt hashed alone (one row)."""
    rng = np.random.default_rng(3)
    t = rng.integers(0, 50_000, size=(rows, 1100)).astype(np.int32)
    lengths = jnp.asarray(rng.integers(1, 1100, size=rows), jnp.int32)
    ns = jnp.asarray(rng.integers(0, 9, size=(rows, 2)), jnp.uint32)
    batch = chain_lanes(jnp.asarray(t), lengths, ns, seed=SEED, unit=64)
    for r in range(rows):
        one = chain_lanes(
            jnp.asarray(t[r : r + 1]), lengths[r : r + 1], ns[r : r + 1], seed=SEED, unit=64
        )
        for a, b in ((batch.lanes, one.lanes), (batch.acc, one.acc), (batch.heads, one.heads)):
            np.testing.assert_array_equal(np.asarray(a)[r], np.asarray(b)[0])


@pytest.mark.parametrize("unit", [4, 64])
def test_chain_state_is_exact_at_the_prompt_length(rng, unit):
    """``chain_state`` at a prompt's own length (not a multiple of the hash's sub-unit) is the
    state ``extend_chain`` reaches over the same tokens: the hash masked every token past the
    length, so the sum at the next sub-unit end is the sum at the length. Elsewhere between
    sub-unit ends it is not (the docstring says junk): the test shows both."""
    n = 600
    t = rng.integers(0, 50_000, size=(2, n)).astype(np.int32)
    ns = jnp.asarray([[3, 0], [9, 1]], jnp.uint32)
    zero = jnp.zeros((2, K.CHAIN_WORDS), jnp.uint32)
    for length in (1, 130, 257, 383, 599):
        lens = jnp.full((2,), length, jnp.int32)
        ph = chain_lanes(jnp.asarray(t), lens, ns, seed=SEED, unit=unit)
        got = np.asarray(K.chain_state(ph, lens))
        _, want = extend_chain(
            zero, jnp.asarray(t), jnp.zeros((2,), jnp.int32), lens, ns, seed=SEED
        )
        np.testing.assert_array_equal(got, np.asarray(want))
        if (length - 1) % ph.sub_unit:
            inner = lens - 1  # inside the prompt, not a sub-unit end: the next end's sum
            _, want_in = extend_chain(
                zero, jnp.asarray(t), jnp.zeros((2,), jnp.int32), inner, ns, seed=SEED
            )
            assert not np.array_equal(np.asarray(K.chain_state(ph, inner)), np.asarray(want_in))


def test_a_namespace_pair_means_one_namespace_at_every_batch_size():
    """``uint32[2]`` (what ``namespace_words`` returns) is one namespace's (low, high) words for
    every batch size: at B = 2 it was read as two prompts' low words, which keyed one tenant's
    two equal prompts apart and two tenants sharing a low word alike. Per-prompt low words are
    ``int32[B]``."""
    toks = jnp.tile(jnp.arange(8, dtype=jnp.int32)[None, :], (2, 1))
    n = jnp.array([8, 8], jnp.int32)

    def keys(ns, rows=2):
        return np.asarray(K.block_keys(toks[:rows], n[:rows], ns, seed=3, block_tokens=4)[0])

    ours, theirs = K.namespace_words((11, 22)), K.namespace_words((11, 99))
    pair = keys(ours)
    np.testing.assert_array_equal(pair[0], pair[1])  # one namespace, equal prompts
    np.testing.assert_array_equal(pair[0], keys(ours, rows=1)[0])  # as at B = 1
    np.testing.assert_array_equal(pair[0], keys((11, 22))[0])  # as the Python pair
    assert not np.array_equal(pair[0], keys(theirs)[0])  # another tenant, other keys
    low = keys(jnp.array([11, 12], jnp.int32))  # int32[B]: one low word per prompt
    np.testing.assert_array_equal(low[0], keys(11)[0])
    assert not np.array_equal(low[0], low[1])
