"""The capacity planner: payload-exact pools, the 20M-token goal, explicit pages, errors."""

import json

import pytest

from flatkv_jax import (
    RESERVED_PAGES,
    ServingLimits,
    memory_report,
    parse_size,
    plan_for_budget,
    plan_with_pages,
)
from flatkv_jax.recipes import deepseek_v4_groups, tiny_v4, v4_flash

FLASH_LIMITS = ServingLimits(max_requests=64, max_context=80_000, chunk_tokens=8192, verify_width=4)


@pytest.fixture(scope="module")
def flash_plan():
    groups = deepseek_v4_groups(
        v4_flash(kv_format="fp8_ds_mla", indexer_format="mxfp4"), verify_width=4
    )
    return plan_for_budget(groups, FLASH_LIMITS, "80GiB", name="v4-flash")


def test_flash_80gib_pools_are_payload_exact(flash_plan):
    for g in flash_plan.groups:
        pool, payload = flash_plan.pool_bytes(g), flash_plan.payload_bytes(g)
        assert pool == flash_plan.pages(g) * g.page_bytes  # stride == payload, no padding
        assert (pool - payload) / payload < 0.01, g.name  # only the null + scratch pages on top


def test_flash_80gib_serves_20m_tokens(flash_plan):
    assert flash_plan.total_bytes <= 80 * 2**30
    assert flash_plan.total_bytes > 0.999 * 80 * 2**30  # the budget is used, not left idle
    assert flash_plan.token_capacity >= 20_000_000
    assert flash_plan.largest_request_tokens == 80_000


def test_history_pages_follow_token_capacity(flash_plan):
    T = flash_plan.token_capacity
    for g in flash_plan.groups:
        if not g.is_window:
            assert flash_plan.usable_pages(g) == -(-T // g.block_tokens) + 64


def test_window_pages_follow_concurrency():
    groups = deepseek_v4_groups(v4_flash(), verify_width=4)
    p64 = plan_for_budget(groups, FLASH_LIMITS, "80GiB", cached_window_requests=0)
    p128 = plan_for_budget(
        groups, ServingLimits(128, 80_000, 8192, 4), "80GiB", cached_window_requests=0
    )
    swa = groups[0]
    steady = swa.live_blocks(5)
    assert p128.usable_pages(swa) - p64.usable_pages(swa) == 64 * steady
    assert p128.token_capacity < p64.token_capacity


def test_fixed_cost_per_request(flash_plan):
    # steady decode holds live_blocks(1 + verify) pages in each window group
    expected = sum(g.live_blocks(5) * g.page_bytes for g in flash_plan.groups if g.is_window)
    assert flash_plan.fixed_bytes_per_request() == expected
    assert 15e6 < expected < 30e6  # ~21 MB, dominated by the ratio-128 state


def test_report_matches_plan(flash_plan):
    rep = memory_report(flash_plan)
    assert rep.total_pool_bytes == sum(r.pool_bytes for r in rep.groups)
    assert rep.total_table_bytes == sum(r.table_bytes for r in rep.groups)
    assert rep.token_capacity == flash_plan.token_capacity
    text = str(rep)
    assert "c4_kv" in text and "token capacity" in text
    d = json.loads(rep.to_json())
    assert d["groups"][0]["name"] == "swa_kv" and d["token_capacity"] == flash_plan.token_capacity


def test_explicit_pages():
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    lim = ServingLimits(4, 64, 16, 2)
    plan = plan_with_pages(groups, lim, {g.name: 40 + i for i, g in enumerate(groups)})
    assert plan.num_pages == tuple(40 + i + RESERVED_PAGES for i in range(len(groups)))
    assert plan.scratch_page("swa_kv") == plan.pages("swa_kv") - 1
    assert plan_with_pages(groups, lim, 40).num_pages == (42,) * len(groups)


def test_plan_is_hashable_and_static():
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    a = plan_with_pages(groups, ServingLimits(4, 64, 16, 2), 40)
    b = plan_with_pages(
        deepseek_v4_groups(tiny_v4(), verify_width=2), ServingLimits(4, 64, 16, 2), 40
    )
    assert a == b and hash(a) == hash(b)


def test_evict_ahead_pages_follow_the_block_span_and_are_checked():
    """``evict_ahead_tokens``: pages per pool for that many more tokens of every request
    slot (ceil), capped at the pool's usable pages; part of the plan's identity (a static
    jit argument); both builders pass it; a bad value is refused with the fix."""
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    lim = ServingLimits(4, 64, 16, 2)
    plan = plan_with_pages(groups, lim, 40, evict_ahead_tokens=6)
    for g in plan.groups:
        assert plan.evict_ahead_pages(g) == min(-(-4 * 6 // g.block_tokens), 40)
    assert plan_with_pages(groups, lim, 40, evict_ahead_tokens=10_000).evict_ahead_pages(0) == 40
    exact = plan_with_pages(groups, lim, 40)
    assert exact.evict_ahead_tokens == 0 and exact.evict_ahead_pages(0) == 0
    assert plan != exact and hash(plan) != hash(exact)
    budget = plan_for_budget(groups, lim, "64MiB", evict_ahead_tokens=3)
    assert budget.evict_ahead_tokens == 3
    with pytest.raises(ValueError, match=r"evict_ahead_tokens=-1 is invalid: .*>= 0"):
        plan_with_pages(groups, lim, 40, evict_ahead_tokens=-1)
    with pytest.raises(TypeError, match=r"evict_ahead_tokens=1.5 is invalid"):
        plan_with_pages(groups, lim, 40, evict_ahead_tokens=1.5)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80GiB", 80 * 2**30),
        ("80k", 80_000),
        ("1.5GB", 1_500_000_000),
        (4096, 4096),
        ("512 MiB", 512 * 2**20),
    ],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_budget_too_small_for_one_request():
    groups = deepseek_v4_groups(v4_flash(), verify_width=4)
    with pytest.raises(
        ValueError,
        match=r"hbm_bytes=1073741824 is invalid: the budget is too small .* Fix: raise the budget",
    ):
        plan_for_budget(groups, FLASH_LIMITS, "1GiB")


@pytest.mark.parametrize(
    ("pages", "exc", "match"),
    [
        ({"swa_kv": 10}, ValueError, r"pages=\[.*\] is invalid: every group needs a page count"),
        (
            {"nope": 10},
            ValueError,
            r"pages=\['nope'\] is invalid: these are not groups of the plan",
        ),
        ("many", TypeError, r"pages='many' is invalid: expected a mapping"),
        (
            1,
            ValueError,
            r"num_pages\[swa_kv\]=3 is invalid: one request at max_context=64 .* needs \d+ pages in group 'swa_kv'",
        ),
    ],
)
def test_explicit_pages_errors(pages, exc, match):
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    with pytest.raises(exc, match=match):
        plan_with_pages(groups, ServingLimits(4, 64, 16, 2), pages)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            dict(max_requests=0, max_context=64, chunk_tokens=16),
            ValueError,
            r"max_requests=0 is invalid: it must be positive",
        ),
        (
            dict(max_requests=4, max_context=-1, chunk_tokens=16),
            ValueError,
            r"max_context=-1 is invalid",
        ),
        (
            dict(max_requests=4, max_context=64, chunk_tokens=16, verify_width=-1),
            ValueError,
            r"verify_width=-1 is invalid: it must be >= 0",
        ),
        (
            dict(max_requests=4, max_context=64, chunk_tokens=16, step_tokens=8),
            ValueError,
            r"step_tokens=8 is invalid: a step must fit one whole chunk",
        ),
        (
            dict(max_requests=4.0, max_context=64, chunk_tokens=16),
            TypeError,
            r"max_requests=4.0 is invalid: it must be an int",
        ),
    ],
)
def test_limits_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ServingLimits(**kwargs)


def test_unknown_budget_unit():
    with pytest.raises(
        ValueError,
        match=r"hbm_bytes='80 parsecs' is invalid: expected a number with an optional unit",
    ):
        plan_for_budget(deepseek_v4_groups(tiny_v4()), ServingLimits(4, 64, 16), "80 parsecs")
