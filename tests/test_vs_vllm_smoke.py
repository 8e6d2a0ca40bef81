"""benchmarks/vs_vllm.py's host helpers: admission row buckets and the oracle's plan (same page
geometry as the V4-Flash plan the benchmark drives). The benchmark itself compiles V4-Flash
shapes for minutes and is run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from flatkv_jax import ServingLimits, plan_with_pages

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "vs_vllm.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_vllm", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_row_buckets_are_powers_of_two_up_to_the_cap(vs):
    assert [vs.row_bucket(n, 16) for n in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert [vs.row_bucket(n, 6) for n in (1, 3, 5, 6)] == [1, 4, 6, 6]


def test_oracle_plan_keeps_the_page_geometry(vs):
    gs = vs.groups()
    batch, max_len, budget = 4, 4096 + 256, 16384
    limits = ServingLimits(
        max_requests=batch,
        max_context=max_len,
        chunk_tokens=4096,
        verify_width=0,
        step_tokens=budget + batch,
    )
    plan = plan_with_pages(gs, limits, vs.pool_pages(gs, batch, max_len, budget, 1.25))
    small = vs.oracle_plan(plan)
    assert small.limits == plan.limits
    assert small.prefix_granularity == plan.prefix_granularity == 128
    for a, b in zip(plan.groups, small.groups, strict=True):
        assert (a.name, a.block_tokens, a.window, a.retention) == (
            b.name,
            b.block_tokens,
            b.window,
            b.retention,
        )
        assert plan.pages(a) == small.pages(b)
        assert len(b.layers) == 1 and b.fields[0].format.shape == (1,)


def test_hit_ceilings_count_whole_granules_shared_with_an_earlier_prompt(vs):
    a = [1, 2, 3, 4, 5, 6, 7]
    prompts = [
        a,  # first: nothing earlier
        [*a[:4], 9, 9, 9],  # shares 2 granules of 2 with a
        [*a[:2], 8, 8],  # shares 1; its second granule differs
        a[:5],  # shares 2 whole granules: its 5th token stays to compute
        a[:4],  # shares 2, but at least its last token is computed: 1 granule
        [0, *a[1:]],  # differs in the first token: nothing
    ]
    assert vs.hit_ceilings(prompts, 2) == [0, 4, 2, 4, 2, 0]
    assert vs.hit_ceilings(prompts, 4) == [0, 4, 0, 4, 0, 0]
