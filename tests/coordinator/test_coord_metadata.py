"""Step metadata: token layout, write slots, window read slots, and zeroing of recycled pages."""

from __future__ import annotations

import dataclasses

import coordinator_cases
import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import FINISH, PLAN, Driver

from flatkv_jax import create_pools
from flatkv_jax.coordinator import host
from flatkv_jax.coordinator.metadata import window_columns
from flatkv_jax.coordinator.state import table
from flatkv_jax.pools import Pools
from flatkv_jax.status import Status
from kernels_pallas import write_rows


def _expected_write_slot(plan, tables, slot, pos):
    out = []
    for g, tab in zip(plan.groups, tables, strict=True):
        if slot < 0 or (pos + 1) % g.tokens_per_row:
            out.append(-1)
            continue
        page = int(tab[slot, pos // g.block_tokens])
        out.append(page * g.rows_per_page + (pos // g.tokens_per_row) % g.rows_per_page)
    return out


def test_token_layout_and_write_slots():
    d = Driver()
    a = d.new(20, 16)
    d.retire((a, 16))
    ra = d.admit((10, 10), (2, 2))
    re = d.extend((a, 4), same_step=(ra,))
    md = d.metadata(ra, re)
    tables = [np.asarray(table(PLAN, d.state, gi)) for gi in range(len(PLAN.groups))]
    assert int(md.num_tokens) == 16 and not bool(md.overflow)
    assert md.row_slot[:3].tolist() == [1, 2, -1] and md.row_offset[:2].tolist() == [0, 10]
    assert md.row_slot[4].tolist() == 0 and md.row_offset[4].tolist() == 12
    tok_slot, tok_pos = md.token_slot.tolist(), md.token_pos.tolist()
    pad = [-1] * (PLAN.limits.step_tokens - 16)
    assert tok_slot == [1] * 10 + [2] * 2 + [0] * 4 + pad
    assert tok_pos == list(range(10)) + list(range(2)) + list(range(16, 20)) + pad
    for t in range(PLAN.limits.step_tokens):
        want = _expected_write_slot(PLAN, tables, tok_slot[t], tok_pos[t])
        assert [int(w[t]) for w in md.write_slot] == want, t
    # Compressed chains write only where a ratio window completes: c4 at positions 3, 7, ...
    c4 = md.write_slot[PLAN.group_index("c4_kv")].tolist()
    assert [t for t in range(10) if c4[t] >= 0] == [3, 7]
    assert md.zero[0].shape == (2 * PLAN.limits.max_requests * 4,)


def test_window_read_index_covers_every_position_the_step_reads():
    d = Driver()
    a = d.new(12, 12)
    d.retire((a, 12))
    re = d.extend((a, 2))  # positions 12, 13 read back to 12 - 7 = 5
    md = d.metadata(re)
    g = PLAN.group("swa_kv")
    tab = np.asarray(table(PLAN, d.state, 0))
    off, span = window_columns(PLAN, None)[0]
    assert (off, span) == (0, 7)  # blocks_for_span(7 + 16, 4)
    pages = np.asarray(md.window_pages)[:, off : off + span]
    first = np.asarray(md.window_first_block[0])
    assert first[0] == (12 - 7) // 4 == 1
    for p in (12, 13):
        for q in range(p - g.window + 1, p + 1):
            j = q // 4 - first[0]
            assert pages[0, j] * 4 + q % 4 == tab[0, q // 4] * 4 + q % 4, (p, q)
    assert pages[0, :3].tolist() == tab[0, 1:4].tolist() and (pages[0, 3:] == -1).all()
    assert (pages[1:] == -1).all()
    assert window_columns(PLAN)[PLAN.group_index("c4_kv")][1] == 0
    c16 = window_columns(PLAN)[PLAN.group_index("c16_state")]
    assert c16[1] == 10 and np.asarray(md.window_pages).shape == (
        4,
        sum(n for _, n in window_columns(PLAN)),
    )
    # A request at the start of its prompt: blocks before position 0 are -1.
    md = d.metadata(d.admit((3, 3)))
    assert np.asarray(md.window_first_block[0])[0] == -2
    assert np.asarray(md.window_pages)[0, :3].tolist() == [
        -1,
        -1,
        int(table(PLAN, d.state, 0)[1, 0]),
    ]


def test_a_full_step_never_overflows():
    # The step budget is the ops' contract (STEP_FULL, test_coord_budget.py): results made
    # as step_metadata requires always fit the flat token axis.
    d = Driver()
    r1 = d.admit((40, 16), (40, 16), (40, 16))
    h = host.handles(r1, 3)
    r2 = d.extend((h[0], 16), (h[1], 16), same_step=(r1,))  # 48 + 16 fits 64, + 16 does not
    assert host.statuses(r2, 2) == [Status.OK, Status.STEP_FULL]
    md = d.metadata(r1, r2)
    assert not bool(md.overflow) and int(md.num_tokens) == PLAN.limits.step_tokens == 64
    r = PLAN.limits.max_requests
    assert md.row_offset[r : r + 2].tolist() == [48, -1]


def _step(plan, pools, md, value):
    """A serving step's cache part as the model runs it: zero the step's zero list with
    ``Pools.zero_group`` (what the model step calls for every group), then write every new
    token's row as ``value``."""
    for gi, g in enumerate(plan.groups):
        pools = pools.zero_group(gi, md.zero[gi])
        arrays = pools.arrays
        new_g = []
        for f in g.fields:
            rows = jnp.full((plan.limits.step_tokens, *f.format.shape), value, f.format.dtype)
            new_g.append(
                tuple(write_rows(p, rows, md.write_slot[gi]) for p in arrays[gi][len(new_g)])
            )
        pools = type(pools)((*arrays[:gi], tuple(new_g), *arrays[gi + 1 :]))
    return pools


def _sentinel(dtype):
    """What a previous tenant left in a page: NaN (or the largest integer), never zero."""
    dtype = jnp.dtype(dtype)
    return jnp.nan if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


def _recycled_pages_after_a_step():
    """Request A fills its pages in every pool (target and draft) with the sentinel, every row
    of them; it finishes and request B gets the recycled pages. B's first step schedules 5
    tokens, so most rows of its pages are ones the step does not write: only zeroing makes them
    read zeros. Returns the plan, the pools after B's step, its metadata and B's pages."""
    d = Driver()
    pools = create_pools(PLAN)
    md = d.metadata(d.admit((16, 16)))
    pools = _step(PLAN, pools, md, 7)
    held = d.pages_of((0, 0))
    for gi, g in enumerate(PLAN.groups):
        idx = jnp.asarray(held[g.name])
        flat = tuple(a.at[idx].set(_sentinel(a.dtype)) for a in pools.flat_group(gi))
        pools = pools.with_flat_group(gi, flat)
    d.retire(((0, 0), 16))
    d.release(((0, 0), FINISH))
    md = d.metadata(d.admit((16, 5)))
    again = d.pages_of((0, 1))
    for g in PLAN.groups:  # every page B got held A's sentinel rows
        assert again[g.name] and set(again[g.name]) <= set(held[g.name]), g.name
    return PLAN, _step(PLAN, pools, md, 3), md, again


def check_handed_out_pages_read_zeros(plan, pools, md, pages):
    """Every row of every page handed out by the step reads 3 where the step wrote it and 0
    everywhere else, in every array of every pool; and the step's zero list names exactly
    those pages. Raises AssertionError naming the pool that fails."""
    for gi, g in enumerate(plan.groups):
        zl = np.asarray(md.zero[gi])
        assert sorted(zl[zl >= 0].tolist()) == sorted(pages[g.name]), f"{g.name}: zero list"
        written = np.asarray(md.write_slot[gi])
        written = set(written[written >= 0].tolist())
        unwritten = 0
        arrays = [np.asarray(a, np.float64) for a in pools.flat_group(gi)]
        for page in pages[g.name]:
            for r in range(g.rows_per_page):
                slot = page * g.rows_per_page + r
                want = 3 if slot in written else 0
                unwritten += slot not in written
                for arr in arrays:
                    got = arr[page, r]
                    assert np.all(got == want), f"{g.name}: page {page} row {r} reads {got.flat[0]}"
        # The check cannot pass for lack of rows to check: the step leaves some unwritten.
        assert unwritten > 0, g.name


def test_recycled_page_reads_zeros_in_every_pool_draft_included():
    check_handed_out_pages_read_zeros(*_recycled_pages_after_a_step())


@pytest.mark.parametrize("where", ["step", "zero list"])
@pytest.mark.parametrize("group", [g.name for g in PLAN.groups])
def test_the_zeroing_check_fails_without_zeroing_in_any_pool(monkeypatch, group, where):
    """The check above is not vacuous: remove zeroing for one pool (the model step skips it,
    or the coordinator leaves the pool's pages off the zero list) and it fails on that pool."""
    gi = PLAN.group_index(group)
    if where == "step":
        zero_group = Pools.zero_group
        monkeypatch.setattr(
            Pools,
            "zero_group",
            lambda self, g, ids, **kw: self if g == gi else zero_group(self, g, ids, **kw),
        )
    else:
        metadata = coordinator_cases.step_metadata

        def no_zero_list(plan, state, results):
            md = metadata(plan, state, results)
            return dataclasses.replace(md, zero=md.zero.at[gi].set(-1))

        monkeypatch.setattr(coordinator_cases, "step_metadata", no_zero_list)
    case = _recycled_pages_after_a_step()
    with pytest.raises(AssertionError, match=f"^{group}: "):
        check_handed_out_pages_read_zeros(*case)
