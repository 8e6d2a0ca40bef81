"""Planner limits: chunk vs context, whole-number sizes, int32 ranges of every derived id,
the recipe's verify width, NumPy integers, and the default step budget."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from flatkv_jax import ServingLimits, plan_for_budget, plan_with_pages
from flatkv_jax.capacity import parse_size
from flatkv_jax.plan import MAX_POOL_ROWS, CachePlan
from flatkv_jax.recipes import deepseek_v4_groups, full_attention_groups, tiny_v4, v4_flash
from kernels_pallas._common import check_pool_array

FULL = full_attention_groups(1, 1, 4, dtype="float32", rows_per_page=16)


def test_default_step_budget_holds_a_chunk_plus_every_other_decode():
    # The README's plan: 64 requests, 80k context, chunk 8192, verify 4.
    lim = ServingLimits(max_requests=64, max_context=80_000, chunk_tokens=8192, verify_width=4)
    assert lim.step_tokens == 8192 + 63 * 5
    # Chunks shorter than a decode step still leave room for every request's decode.
    lim = ServingLimits(max_requests=8, max_context=64, chunk_tokens=2, verify_width=3)
    assert lim.step_tokens == 4 + 7 * 4 == 8 * lim.decode_tokens


def test_numpy_integers_are_accepted_and_stored_as_ints():
    lim = ServingLimits(np.int64(4), np.int32(64), np.int64(16), np.int64(2))
    assert lim == ServingLimits(4, 64, 16, 2) and hash(lim) == hash(ServingLimits(4, 64, 16, 2))
    assert all(type(getattr(lim, f)) is int for f in ("max_requests", "max_context", "step_tokens"))
    plan = plan_with_pages(FULL, lim, np.int64(8))
    assert plan == plan_with_pages(FULL, ServingLimits(4, 64, 16, 2), 8)
    assert type(plan.num_pages[0]) is int
    assert plan_with_pages(FULL, lim, {"kv": np.int32(8)}) == plan
    assert CachePlan(FULL, lim, (np.int64(10),)) == plan


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(max_requests=np.bool_(True), max_context=64, chunk_tokens=16), TypeError, r"max_requests=np.True_ is invalid: it must be an int"),
        (dict(max_requests=4, max_context=np.float64(64.0), chunk_tokens=16), TypeError, r"max_context=np.float64\(64.0\) is invalid: it must be an int"),
        (dict(max_requests=4, max_context=64, chunk_tokens=16, verify_width=True), TypeError, r"verify_width=True is invalid: it must be an int"),
        # A chunk is part of one request.
        (dict(max_requests=4, max_context=64, chunk_tokens=65), ValueError, r"chunk_tokens=65 is invalid: a chunk is part of one request, at most max_context=64 tokens. Fix: lower chunk_tokens to <= 64"),
        # Positions are int32.
        (dict(max_requests=4, max_context=2**31 - 1, chunk_tokens=16), ValueError, r"max_context=2147483647 is invalid: positions are int32: max_context \+ verify_width \+ one step's tokens = 2,147,483,663 must stay <= 2\*\*31 - 1.*Fix: lower max_context"),
        (dict(max_requests=4, max_context=64, chunk_tokens=16, step_tokens=2**31), ValueError, r"step_tokens=2147483648 is invalid: a step's token indices are int32"),
        (dict(max_requests=4, max_context=64, chunk_tokens=16, step_tokens=np.float32(16)), TypeError, r"step_tokens=np.float32\(16.0\) is invalid: it must be an int"),
    ],
)  # fmt: skip
def test_limits_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match) as info:
        ServingLimits(**kwargs)
    assert "Fix: " in str(info.value)


def test_parse_size_never_truncates():
    assert parse_size("1.5k", "max_context") == 1500
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("80GiB") == 80 * 2**30
    assert parse_size(np.int64(7)) == 7 and type(parse_size(np.int64(7))) is int
    with pytest.raises(
        ValueError,
        match=r"max_context='1.5' is invalid: it must be a whole number of bytes or tokens \(it is never truncated\). Fix: write a whole number",
    ):
        parse_size("1.5", "max_context")
    with pytest.raises(
        ValueError, match=r"hbm_bytes='0.3KiB' is invalid: it must be a whole number"
    ):
        parse_size("0.3KiB", "hbm_bytes")
    for bad in (True, 1.5, None):
        with pytest.raises(
            TypeError, match=r"is invalid: a size is an int or a string such as '80GiB'"
        ):
            parse_size(bad, "size")


def test_slot_ids_must_fit_int32():
    # 2**26 pages of 16 rows: 2**30 row addresses, past what the page kernels take (half the
    # int32 range); the plan refuses it rather than build pools no write could reach.
    with pytest.raises(
        ValueError,
        match=r"num_pages\[kv\]=67108866 is invalid: slot ids page \* rows_per_page \+ row are int32 and the page kernels take at most 1,073,741,823 row addresses a pool: 67,108,866 pages x 16 rows = 1,073,741,856. Fix: lower the page count \(a smaller HBM budget\)",
    ):
        plan_with_pages(FULL, ServingLimits(4, 64, 16), 2**26)
    # Just under it: built, and the kernels' own check (the same limit) takes its pools.
    usable = MAX_POOL_ROWS // 16 - 2  # the plan adds the null and scratch pages
    plan = plan_with_pages(FULL, ServingLimits(4, 64, 16), usable)
    shape = (plan.num_pages[0], 16, 1)
    check_pool_array(jax.ShapeDtypeStruct(shape, np.float32), name="pool", op="write_rows")
    with pytest.raises(ValueError, match=r"too many for int32 slot ids \(limit 1073741823\)"):
        check_pool_array(
            jax.ShapeDtypeStruct((shape[0] + 1, 16, 1), np.float32), name="pool", op="write_rows"
        )
    # The budget planner turns an absurd budget into the same refusal, not an OverflowError
    # later (V4-Flash at 80 TiB: slots up to ~6e9).
    groups = deepseek_v4_groups(v4_flash(), verify_width=4)
    lim = ServingLimits(max_requests=64, max_context=80_000, chunk_tokens=8192, verify_width=4)
    with pytest.raises(
        ValueError,
        match=r"num_pages\[\w+\]=\d+ is invalid: slot ids page \* rows_per_page \+ row are int32",
    ):
        plan_for_budget(groups, lim, "80TiB")


def test_tables_and_allocator_must_fit_int32():
    one_row = full_attention_groups(1, 1, 4, dtype="float32", rows_per_page=1)
    lim = ServingLimits(max_requests=4096, max_context=2**20, chunk_tokens=16)
    with pytest.raises(
        ValueError,
        match=r"max_context=1048576 is invalid: the tables of 4096 requests hold 4,294,967,296 int32 entries, indexed by int32 \(> 2\*\*31 - 1\). Fix: lower max_context or max_requests",
    ):
        plan_with_pages(one_row, lim, 2**20)
    # Each pool within its own limit (half the int32 range), three together past int32.
    three = (one_row[0], *(dataclasses.replace(one_row[0], name=f"kv{i}") for i in (2, 3)))
    with pytest.raises(
        ValueError,
        match=r"num_pages=\(800000002, 800000002, 800000002\) is invalid: the allocator indexes every pool's pages in one int32 array",
    ):
        plan_with_pages(three, ServingLimits(4, 64, 16), 800_000_000)


def test_recipe_and_limits_must_agree_on_verify_width():
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    with pytest.raises(
        ValueError,
        match=r"verify_width=100 is invalid: group 'c4_state' was sized by its recipe for verify_width=2, and the serving limits must verify the same number of draft tokens. Fix: pass the same verify_width to the recipe",
    ):
        plan_with_pages(groups, ServingLimits(4, 256, 128, 100), 400)
    with pytest.raises(ValueError, match=r"verify_width=0 is invalid: group 'c4_state' was sized"):
        plan_for_budget(groups, ServingLimits(4, 64, 16), "1GiB")
    assert plan_with_pages(groups, ServingLimits(4, 64, 16, 2), 40).limits.verify_width == 2
    assert groups[0].verify_width is None  # the SWA window does not depend on it
