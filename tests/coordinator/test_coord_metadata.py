"""Step metadata: token layout, write slots, window read slots, and zeroing of recycled pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from coordinator_cases import FINISH, PLAN, Driver

from flatkv_jax import create_pools
from flatkv_jax.coordinator.metadata import window_columns
from flatkv_jax.coordinator.state import table
from kernels_pallas import write_rows, zero_pages


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
    re = d.extend((a, 4))
    md = d.metadata(ra, re)
    tables = [np.asarray(table(PLAN, d.state, gi)) for gi in range(len(PLAN.groups))]
    assert int(md.num_tokens) == 16 and not bool(md.overflow)
    assert md.row_slot[:3].tolist() == [1, 2, -1] and md.row_offset[:2].tolist() == [0, 10]
    assert md.row_slot[4].tolist() == 0 and md.row_offset[4].tolist() == 12
    tok_slot, tok_pos = md.token_slot.tolist(), md.token_pos.tolist()
    assert tok_slot == [1] * 10 + [2] * 2 + [0] * 4  # the step fills step_tokens = 16
    assert tok_pos == list(range(10)) + list(range(2)) + list(range(16, 20))
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


def test_overflow_is_flagged():
    d = Driver()
    r1 = d.admit((16, 16))
    r2 = d.admit((16, 16))
    md = d.metadata(r1, r2)  # one step of 32 tokens > step_tokens = 16
    assert bool(md.overflow) and int(md.num_tokens) == PLAN.limits.step_tokens
    assert md.row_offset[PLAN.limits.max_requests].tolist() == -1


def _step(plan, pools, md, value):
    """A serving step's cache part: zero the handed-out pages, then write every new token."""
    arrays = pools.arrays
    for gi, g in enumerate(plan.groups):
        pools = pools.with_flat_group(gi, zero_pages(pools.flat_group(gi), md.zero[gi]))
        arrays = pools.arrays
        new_g = []
        for fi, f in enumerate(g.fields):
            shape = f.format.shape
            dtype = jnp.dtype(f.format.dtype)
            rows = jnp.full((plan.limits.step_tokens, *shape), value, dtype)
            new_g.append(tuple(write_rows(p, rows, md.write_slot[gi]) for p in arrays[gi][fi]))
        pools = type(pools)((*arrays[:gi], tuple(new_g), *arrays[gi + 1 :]))
    return pools


def test_recycled_page_reads_zeros_in_every_pool_draft_included():
    d = Driver()
    pools = create_pools(PLAN)
    # Step 1: request (0, 0) writes 16 tokens in every group, target and draft.
    md = d.metadata(d.admit((16, 16)))
    pools = _step(PLAN, pools, md, 7)
    held = d.pages_of((0, 0))
    for gi, g in enumerate(PLAN.groups):
        for arr in pools.flat_group(gi):
            assert float(jnp.abs(arr[jnp.asarray(held[g.name])]).sum()) > 0, g.name
    # It finishes; the next request gets the same, recycled pages in every pool.
    d.retire(((0, 0), 16))
    d.release(((0, 0), FINISH))
    md = d.metadata(d.admit((16, 16)))
    again = d.pages_of((0, 1))
    for g in PLAN.groups:
        assert set(again[g.name]) == set(held[g.name]), g.name
    # Control: before zeroing, the recycled pages still hold the old rows.
    draft = PLAN.group_index("mtp_swa_kv")
    assert float(jnp.abs(pools.flat_group(draft)[0][jnp.asarray(again["mtp_swa_kv"])]).sum()) > 0
    # The step zeroes the zero list, then writes (zeros here): what any reader sees first.
    pools = _step(PLAN, pools, md, 0)
    for gi, g in enumerate(PLAN.groups):
        for arr in pools.flat_group(gi):
            assert float(jnp.abs(arr[jnp.asarray(again[g.name])]).sum()) == 0, g.name
