"""Prefix matching across groups: history first miss, window trailing runs, granularity, the
last prompt token, the tiny V4 plan, V4 geometry at 128 tokens, and compile-once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cases import SEED, examples, publish, ref_match, ref_rows, tiny_plan

from flatkv_jax import FieldSpec, GroupSpec, Retention, ServingLimits, formats, plan_with_pages
from flatkv_jax.prefix import index as I
from flatkv_jax.prefix import keys as K
from flatkv_jax.prefix.match import MatchLayout, common_hit, history_run, match_prompts, window_ok
from flatkv_jax.recipes import (
    deepseek_v4_groups,
    full_attention_groups,
    hybrid_swa_groups,
    v4_flash,
)

match = jax.jit(functools.partial(match_prompts, seed=SEED), static_argnums=0)
L = 96  # prompt axis of the tiny tests: 6 granules of 16


def _setup(plan, blocks_by_group, tokens, length=None, ns=0):
    idx = I.create_indexes(plan)
    nxt = [1] * len(plan.groups)
    length = len(tokens) if length is None else length
    return publish(plan, idx, tokens, length, ns, blocks_by_group, nxt)


def _all_blocks(plan, n_tokens, skip=None):
    skip = skip or {}
    return {
        g.name: [i for i in range(n_tokens // g.block_tokens) if i not in skip.get(g.name, ())]
        for g in plan.groups
    }


def _query(plan, idx, prompts, lengths, ns=0):
    toks = np.zeros((len(prompts), L), np.int32)
    for r, p in enumerate(prompts):
        toks[r, : len(p)] = p
    layout = MatchLayout.for_plan(plan, L)
    return match(
        layout, idx, jnp.asarray(toks), jnp.asarray(np.array(lengths, np.int32)), ns
    ), layout


def _check_listed(m, layout):
    """``listed`` holds exactly each row's pages >= 1 of ``pages``, in ``slots`` (history) or
    ``need`` (window) columns, and -1 elsewhere."""
    for gm, pages, listed in zip(layout.groups, m.pages, m.listed, strict=True):
        pages, listed = np.asarray(pages), np.asarray(listed)
        assert listed.shape == (pages.shape[0], gm.need if gm.is_window else gm.slots)
        assert ((listed == -1) | (listed >= 1)).all()
        for r in range(pages.shape[0]):
            np.testing.assert_array_equal(
                np.sort(listed[r][listed[r] >= 1]), np.sort(pages[r][pages[r] >= 1])
            )


def test_unit_rules_on_lookup_rows():
    assert history_run(
        jnp.array([[3, 4, 0, 5], [0, 1, 1, 1], [1, 1, 1, 1]], jnp.int32)
    ).tolist() == [2, 0, 4]
    pages = jnp.array([[[1, 0], [1, 2]]], jnp.int32)  # one prompt, 2 candidates x 2 blocks
    needed = jnp.array([[False, True], [True, True]])
    assert window_ok(pages, needed).tolist() == [[False, True]]
    plan = plan_with_pages(
        full_attention_groups(1, 1, 8, rows_per_page=4), ServingLimits(2, 64, 8), 40
    )
    layout = MatchLayout.for_plan(plan, 20)
    assert layout.granularity == 4 and layout.candidates == 4
    hit = common_hit(
        layout, jnp.array([20, 9, 4], jnp.int32), (jnp.array([5, 5, 5], jnp.int32),), (None,)
    )
    assert hit.tolist() == [16, 8, 0]  # capped at length - 1, aligned down to 4


def test_history_groups_match_until_the_first_miss():
    plan = tiny_plan()
    rng = np.random.default_rng(0)
    p = rng.integers(0, 1000, 80).astype(np.int32)
    # c4_kv (16-token blocks) misses block 3: no hit can pass 48 even though later blocks hit.
    idx, pages, _ = _setup(plan, _all_blocks(plan, 80, skip={"c4_kv": [3]}), p)
    m, layout = _query(plan, idx, [p], [80])
    assert m.hit.tolist() == [48]
    rows = ref_rows(plan, 48, pages, [gm.slots for gm in layout.groups])
    for g, got, want in zip(plan.groups, m.pages, rows, strict=True):
        np.testing.assert_array_equal(np.asarray(got)[0], want, err_msg=g.name)


def test_window_trailing_run_decides_the_boundary():
    plan = tiny_plan()
    rng = np.random.default_rng(1)
    p = rng.integers(0, 1000, 90).astype(np.int32)
    # History everywhere; swa_kv (B=4, W=8, a sliding window) keeps only blocks 10..11
    # (positions 40..47): boundary 48 needs blocks (48-7)//4 = 10 .. 11 -> served; 64 would
    # need 14..15 -> not. The other window groups publish every block.
    blocks = _all_blocks(plan, 90)
    blocks["swa_kv"] = [10, 11]
    idx, pages, _ = _setup(plan, blocks, p)
    m, layout = _query(plan, idx, [p, p[:49], p[:48]], [90, 49, 48])
    # A 48-token prompt can hit at most 32, which needs blocks (32-7)//4 = 6 .. 7: missing.
    assert m.hit.tolist() == [48, 48, 0]
    rows = ref_rows(plan, 48, pages, [gm.slots for gm in layout.groups])
    gi = plan.group_index("swa_kv")
    np.testing.assert_array_equal(np.asarray(m.pages[gi])[0], rows[gi])
    assert np.asarray(m.pages[gi])[0, :12].tolist() == [0] * 10 + [
        pages[gi][i] for i in range(10, 12)
    ]
    # Block 10 holds positions 40..43; the window of position 48 reaches back to 41, so
    # without block 10 the boundary 48 is lost (and 32 and 16 were never served).
    blocks["swa_kv"] = [11]
    idx, _, _ = _setup(plan, blocks, p)
    m, _ = _query(plan, idx, [p], [90])
    assert m.hit.tolist() == [0]


def test_a_state_with_a_period_needs_only_its_carry_at_a_boundary():
    """Compressor states restart at every multiple of their ratio: a hit (a multiple of the
    granularity, hence of every period) needs only the carry behind it — the ratio-4 state's
    previous window (one 4-token block), and nothing of the ratio-16 state (no overlap),
    although their windows are 8 and 20 tokens."""
    plan = tiny_plan()
    c4s, c16s = plan.group("c4_state"), plan.group("c16_state")
    assert (c4s.period, c4s.carry, c4s.window, c4s.hit_reach) == (4, 4, 8, 4)
    assert (c16s.period, c16s.carry, c16s.window, c16s.hit_reach) == (16, 0, 20, 0)
    p = np.random.default_rng(7).integers(0, 1000, 90).astype(np.int32)
    blocks = _all_blocks(plan, 90)
    blocks["c16_state"] = []  # no ratio-16 state at all
    blocks["c4_state"] = [11]  # positions 44..47 only
    idx, pages, _ = _setup(plan, blocks, p)
    m, layout = _query(plan, idx, [p], [90])
    assert m.hit.tolist() == [48]  # 64 would need c4_state block 15
    rows = ref_rows(plan, 48, pages, [gm.slots for gm in layout.groups])
    for gi in (plan.group_index("c4_state"), plan.group_index("c16_state")):
        np.testing.assert_array_equal(np.asarray(m.pages[gi])[0], rows[gi])
    assert np.asarray(m.pages[plan.group_index("c16_state")])[0, :13].tolist() == [0] * 12 + [-1]
    _check_listed(m, layout)
    # Without block 11 (the carry: positions 44..47) the boundary 48 is lost.
    blocks["c4_state"] = [10]
    idx, _, _ = _setup(plan, blocks, p)
    m, _ = _query(plan, idx, [p], [90])
    assert m.hit.tolist() == [0]


def test_granularity_alignment_and_last_token():
    plan = tiny_plan()
    p = np.random.default_rng(2).integers(0, 1000, 96).astype(np.int32)
    idx, _, _ = _setup(plan, _all_blocks(plan, 96), p)
    lens = [96, 80, 81, 17, 16, 15, 1]
    m, _ = _query(plan, idx, [p[:n] for n in lens], lens)
    # Largest multiple of 16 that is <= len - 1: the last prompt token is always recomputed.
    assert m.hit.tolist() == [80, 64, 80, 16, 0, 0, 0]
    # A divergence inside granule 3 (position 50) caps the hit at 48.
    q = p.copy()
    q[50] += 1
    m, _ = _query(plan, idx, [q], [96])
    assert m.hit.tolist() == [48]
    # A different namespace never hits; invalid rows report 0.
    m, _ = _query(plan, idx, [p], [96], ns=jnp.asarray(K.namespace_words(1)))
    assert m.hit.tolist() == [0]
    layout = MatchLayout.for_plan(plan, L)
    toks = jnp.asarray(np.stack([p, p]))
    m = match(layout, idx, toks, jnp.array([96, 96], jnp.int32), 0, jnp.array([True, False]))
    assert m.hit.tolist() == [80, 0]
    assert all(np.asarray(r)[1].tolist() == [-1] * r.shape[1] for r in m.pages)


def test_state_at_hit_continues_the_chain():
    plan = tiny_plan()
    p = np.random.default_rng(3).integers(0, 1000, 96).astype(np.int32)
    idx, _, _ = _setup(plan, _all_blocks(plan, 96), p)
    m, _ = _query(plan, idx, [p, p[:10]], [96, 10])
    assert m.hit.tolist() == [80, 0]
    np.testing.assert_array_equal(np.asarray(m.state)[1], 0)
    # Continuing the hit's chain state over the rest of the prompt gives the bulk lanes.
    rest = jnp.asarray(p[None, 80:])
    lanes, _ = K.extend_chain(
        m.state[:1], rest, jnp.array([80], jnp.int32), jnp.array([16], jnp.int32), 0, seed=SEED
    )
    full = K.chain_lanes(jnp.asarray(p[None]), jnp.array([96], jnp.int32), 0, seed=SEED, unit=16)
    np.testing.assert_array_equal(np.asarray(lanes)[0, -1], np.asarray(full.lanes)[0, -1])


@settings(max_examples=examples(20), deadline=None)
@given(st.data())
def test_tiny_v4_matches_the_python_reference(data):
    """Random cached block subsets per group and random divergences vs ref_match/ref_rows."""
    plan = tiny_plan()
    base = np.asarray(data.draw(st.lists(st.integers(0, 50), min_size=L, max_size=L)), np.int32)
    blocks = {}
    for g in plan.groups:
        n = L // g.block_tokens
        drop = data.draw(st.sets(st.integers(0, n - 1), max_size=3))
        cut = data.draw(st.integers(0, n))
        blocks[g.name] = [i for i in range(cut) if i not in drop]
    idx, pages, _ = _setup(plan, blocks, base)
    prompts, lengths, cached = [], [], []
    for _ in range(3):
        n = data.draw(st.integers(1, L))
        q = base[:n].copy()
        div = data.draw(st.integers(0, L))  # first position that differs (>= n: none)
        if div < n:
            q[div] = (q[div] + 1) % 51
        prompts.append(q)
        lengths.append(n)
        hit_blocks = []
        for gi, g in enumerate(plan.groups):
            ok = {i for i in pages[gi] if (i + 1) * g.block_tokens <= min(n, div)}
            hit_blocks.append(ok)
        cached.append(hit_blocks)
    m, layout = _query(plan, idx, prompts, lengths)
    for r in range(3):
        want = ref_match(plan, plan.prefix_granularity, lengths[r], cached[r])
        assert int(m.hit[r]) == want
        rows = ref_rows(plan, want, pages, [gm.slots for gm in layout.groups])
        for g, got, exp in zip(plan.groups, m.pages, rows, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[r], exp, err_msg=g.name)
    _check_listed(m, layout)


def test_v4_geometry_matches_at_128_tokens():
    # V4-Flash groups with 128-token compressed pages: the granularity is 128, not an lcm blow-up.
    groups = deepseek_v4_groups(
        v4_flash(c4_rows=32, c128_rows=1, kv_format="bf16", indexer_format="bf16"), verify_width=2
    )
    plan = plan_with_pages(groups, ServingLimits(2, 1024, 256, 2), 600)
    assert plan.prefix_granularity == 128
    n = 700
    p = np.random.default_rng(4).integers(0, 100_000, n).astype(np.int32)
    idx, pages, _ = _setup(plan, _all_blocks(plan, n), p)
    layout = MatchLayout.for_plan(plan, 768)
    # Lanes are hashed only where a lookup reads: every 64 tokens (the sliding windows'
    # blocks; a 4-token state is read only at its boundary's block), not every 4.
    assert sorted({int(e) % 64 for ends in layout.lookup_ends().values() for e in ends.flat}) == [0]
    assert layout.unit == 64
    toks = np.zeros((3, 768), np.int32)
    toks[:, :n] = p
    toks[1, 300] += 1
    m = match(layout, idx, jnp.asarray(toks), jnp.array([n, n, 200], jnp.int32), 0)
    assert m.hit.tolist() == [640, 256, 128]
    rows = ref_rows(plan, 640, pages, [gm.slots for gm in layout.groups])
    for g, got, exp in zip(plan.groups, m.pages, rows, strict=True):
        np.testing.assert_array_equal(np.asarray(got)[0], exp, err_msg=g.name)
    _check_listed(m, layout)


def test_hybrid_recipe_and_lookup_all_blocks_path():
    # Window 24 with 4-token blocks at granularity 4: need 6 blocks per candidate > all blocks,
    # so the all-blocks lookup path is taken.
    groups = hybrid_swa_groups("SF", 1, 8, 24, rows_per_page=4)
    plan = plan_with_pages(groups, ServingLimits(2, 96, 8), 80)
    p = np.random.default_rng(5).integers(0, 100, 60).astype(np.int32)
    blocks = {"full_kv": list(range(15)), "swa_kv": [5, 6, 7, 8, 9, 10, 11, 12]}
    idx, pages, _ = _setup(plan, blocks, p)
    m, layout = _query(plan, idx, [p], [60])
    cached = [set(blocks["full_kv"]), set(blocks["swa_kv"])]
    assert int(m.hit[0]) == ref_match(plan, 4, 60, cached) == 52
    rows = ref_rows(plan, 52, pages, [gm.slots for gm in layout.groups])
    for got, exp in zip(m.pages, rows, strict=True):
        np.testing.assert_array_equal(np.asarray(got)[0], exp)
    _check_listed(m, layout)


def test_compiles_once():
    plan = tiny_plan()
    layout = MatchLayout.for_plan(plan, L)
    traces = []

    def f(idx, toks, lens):
        traces.append(1)
        return match_prompts(layout, idx, toks, lens, 0, seed=SEED)

    jf = jax.jit(f)
    rng = np.random.default_rng(6)
    idx = I.create_indexes(plan)
    for s in range(3):
        p = rng.integers(0, 50, L).astype(np.int32)
        idx, _, _ = publish(
            plan, idx, p, L, 0, _all_blocks(plan, 32 * (s + 1)), [1 + 40 * s] * len(plan.groups)
        )
        m = jf(idx, jnp.asarray(p[None]), jnp.array([L], jnp.int32))
        assert int(m.hit[0]) == 32 * (s + 1) - (16 if s == 2 else 0)
    assert len(traces) == 1


def test_prompts_shorter_than_a_granule():
    plan = tiny_plan()
    layout = MatchLayout.for_plan(plan, 16)
    assert layout.candidates == 0
    m = match(
        layout,
        I.create_indexes(plan),
        jnp.zeros((2, 16), jnp.int32),
        jnp.array([16, 0], jnp.int32),
        0,
    )
    assert m.hit.tolist() == [0, 0]
    assert all((np.asarray(r) == -1).all() for r in m.pages)


def test_errors():
    plan = tiny_plan()
    with pytest.raises(
        ValueError,
        match=r"granularity=8 is invalid: hits share whole pages.*groups \['c4_kv', 'c16_kv'\]",
    ):
        MatchLayout.for_plan(plan, L, granularity=8)
    # 4-token pages but a period of 8: a granularity of 4 would land hits between boundaries.
    field = (FieldSpec("x", formats.plain(8, "float32")),)
    st = GroupSpec("st", Retention.WINDOW, 4, 1, (0,), field, window=12, period=8, carry=4)
    st_plan = plan_with_pages((st,), ServingLimits(2, 64, 8), 40)
    assert MatchLayout.for_plan(st_plan, 32).granularity == 8
    with pytest.raises(
        ValueError,
        match=r"granularity=4 is invalid: hits must land on period boundaries, where a group "
        r"with a period needs only its carry \(groups \['st'\] have periods that do not "
        r"divide it\). Fix: use a multiple of 8",
    ):
        MatchLayout.for_plan(st_plan, 32, granularity=4)
    with pytest.raises(ValueError, match="max_len=0 is invalid"):
        MatchLayout.for_plan(plan, 0)
    with pytest.raises(TypeError, match="it must be a CachePlan"):
        MatchLayout.for_plan("plan", 8)
    layout = MatchLayout.for_plan(plan, L)
    idx = I.create_indexes(plan)
    with pytest.raises(ValueError, match=r"the layout serves \[B, 96\] prompts"):
        match_prompts(
            layout, idx, jnp.zeros((1, 64), jnp.int32), jnp.array([3], jnp.int32), 0, seed=SEED
        )
    with pytest.raises(ValueError, match=r"one index per group \(7\)"):
        match_prompts(
            layout, idx[:2], jnp.zeros((1, 96), jnp.int32), jnp.array([3], jnp.int32), 0, seed=SEED
        )
    with pytest.raises(ValueError, match="one int32 per prompt"):
        match_prompts(
            layout, idx, jnp.zeros((1, 96), jnp.int32), jnp.array([3, 4], jnp.int32), 0, seed=SEED
        )
    with pytest.raises(TypeError, match="it must be a MatchLayout"):
        match_prompts(
            plan, idx, jnp.zeros((1, 96), jnp.int32), jnp.array([3], jnp.int32), 0, seed=SEED
        )
