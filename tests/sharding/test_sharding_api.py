"""Sharded creation (directly on device, one rank per device), per_rank checks, unstack_rank,
rank_report / ``flatkv plan --ranks``, and every error message."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator import create_state
from flatkv_jax.pools import create_pools
from flatkv_jax.recipes import mla_groups
from flatkv_jax.sharding import (
    RANK_AXIS,
    create_pools_sharded,
    create_state_sharded,
    per_rank,
    rank_capacity,
    rank_mesh,
    rank_report,
    rank_seeds,
    rank_sharding,
    unstack_rank,
)

LIMITS = ServingLimits(max_requests=2, max_context=32, chunk_tokens=8, verify_width=1)
#: MLA: one shared K=V latent row per token (8 + 4 floats), two layers.
PLAN = plan_with_pages(
    mla_groups(2, kv_lora_rank=8, rope_dim=4, dtype="float32", rows_per_page=4), LIMITS, 12
)
OTHER = plan_with_pages(
    mla_groups(2, kv_lora_rank=8, rope_dim=4, dtype="float32", rows_per_page=4), LIMITS, 16
)


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
        for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.parametrize("n", [1, 8])
def test_created_sharded_rank_r_equals_create_state_and_create_pools(n):
    mesh = rank_mesh(n)
    state = create_state_sharded(PLAN, mesh, 2, prefix=True, seed=11)
    pools = create_pools_sharded(PLAN, mesh)
    seeds = rank_seeds(11, n)
    want = NamedSharding(mesh, P(RANK_AXIS))
    for tree, one in ((state, create_state(PLAN, seed=11)), (pools, create_pools(PLAN))):
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(one), strict=True):
            assert x.sharding == want
            assert x.shape == (n, *y.shape)
            # Device r holds exactly rank r's block.
            assert [s.data.shape for s in x.addressable_shards] == [(1, *y.shape)] * n
            assert [s.device for s in x.addressable_shards] == list(mesh.devices.flat)
    for r in range(n):
        assert _leaves_equal(unstack_rank(state, r), create_state(PLAN, seed=seeds[r]))
        assert _leaves_equal(unstack_rank(pools, r), create_pools(PLAN))
    assert pools.nbytes == n * PLAN.total_pool_bytes
    if n > 1:  # ranks never share prefix keys
        assert len({s.tobytes() for s in seeds}) == n


def test_rank_seeds():
    assert np.array_equal(rank_seeds(5, 3)[0], rank_seeds(5, 1)[0])  # a mesh of one: seed=5
    assert all(
        np.array_equal(a, b) for a, b in zip(rank_seeds(5, 4), rank_seeds(5, 4), strict=True)
    )
    assert not np.array_equal(rank_seeds(5, 2)[1], rank_seeds(6, 2)[1])
    assert all(s.dtype == np.uint32 and s.shape == (4,) for s in rank_seeds(None, 3))
    with pytest.raises(ValueError, match=r"seed=-1 is invalid: .*Fix"):
        rank_seeds(-1, 2)


def test_creation_stages_nothing_on_the_host(monkeypatch):
    """Only the per-rank seeds (16 bytes each) travel from the host: every explicit transfer
    is recorded, and implicit transfers (a host array passed to a jitted function) raise."""
    mesh = rank_mesh(8)
    create_state_sharded(PLAN, mesh, seed=1)  # compile outside the guard
    create_pools_sharded(PLAN, mesh)
    moved = []
    real_put = jax.device_put

    def spy(x, *args, **kw):
        moved.append(sum(np.asarray(a).nbytes for a in jax.tree.leaves(x)))
        return real_put(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", spy)
    with jax.transfer_guard_host_to_device("disallow"):
        state = create_state_sharded(PLAN, mesh, seed=1)
        pools = create_pools_sharded(PLAN, mesh)
    assert sum(moved) == 8 * 16, moved
    assert sum(x.nbytes for x in jax.tree.leaves(state)) > 100 * sum(moved)
    assert pools.nbytes == 8 * PLAN.total_pool_bytes
    # The spy sees a naive stacked creation (so the check above can fail).
    moved.clear()
    jax.device_put(np.zeros((8, *create_pools(PLAN).arrays[0][0][0].shape), np.float32))
    assert moved and moved[0] >= 8 * PLAN.total_pool_bytes // 4


def test_per_rank_runs_a_single_rank_function_on_each_rank():
    mesh = rank_mesh(8)

    def add(x, w, k):  # single-rank code: x[4], w[4] (replicated), k static
        return x * k + w, x.sum()

    step = per_rank(mesh, add, replicated=(1,), static=(2,))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4), rank_sharding(mesh))
    w = np.ones(4, np.float32)
    y, s = step(x, w, 3.0)
    assert y.sharding == rank_sharding(mesh) and y.shape == (8, 4) and s.shape == (8,)
    np.testing.assert_array_equal(np.asarray(y), np.arange(32).reshape(8, 4) * 3 + 1)
    np.testing.assert_array_equal(np.asarray(s), np.arange(32).reshape(8, 4).sum(1))
    np.testing.assert_array_equal(unstack_rank((y, s), 2)[0], np.arange(8, 12) * 3 + 1)
    assert step.cache_size() == 1


def test_rank_report_and_capacity():
    cap = rank_capacity(PLAN, 4)
    assert cap.total_requests == 4 * LIMITS.max_requests
    assert cap.total_token_capacity == 4 * PLAN.token_capacity
    assert cap.pool_bytes == PLAN.total_pool_bytes
    assert cap.total_pages == {g.name: 4 * PLAN.pages(g) for g in PLAN.groups}
    # The state bytes are those create_state really allocates (tables counted apart).
    st = create_state(PLAN)
    real = sum(x.nbytes for x in jax.tree.leaves(st)) - st.table_buffer.nbytes
    assert cap.state_bytes == real
    assert cap.total_bytes == 4 * (PLAN.total_pool_bytes + PLAN.total_table_bytes + real)
    text = rank_report(PLAN, 4)
    assert "data-parallel ranks: 4" in text and f"{cap.total_token_capacity:,}" in text
    assert f"{4 * PLAN.pages(PLAN.groups[0]):,} pages" in text


def test_flatkv_plan_ranks(capsys):
    from flatkv_jax.cli import main

    args = ["plan", "--model", "tiny-v4", "--pages", "64", "--max-requests", "4"]
    args += ["--max-context", "256", "--chunk", "64", "--verify", "1"]
    assert main([*args, "--ranks", "8"]) == 0
    out = capsys.readouterr().out
    assert "data-parallel ranks: 8" in out and "per rank" in out and "total" in out
    assert main([*args, "--ranks", "2", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["ranks"]["n_ranks"] == 2
    assert data["ranks"]["total_requests"] == 8
    with pytest.raises(SystemExit) as e:
        main([*args, "--ranks", "0"])
    assert e.value.code == 2
    assert "--ranks" in capsys.readouterr().err


# --- error messages -------------------------------------------------------------------------


def test_more_ranks_than_devices():
    with pytest.raises(ValueError) as e:
        rank_mesh(9)
    msg = str(e.value)
    assert "n_ranks=9 is invalid" in msg and "jax.device_count() = 8" in msg
    assert "xla_force_host_platform_device_count=9" in msg and "Fix" in msg
    with pytest.raises(TypeError, match=r"n_ranks=2.0 is invalid: it must be an int"):
        rank_mesh(2.0)
    with pytest.raises(ValueError, match=r"n_ranks=0 is invalid: it must be positive"):
        rank_mesh(0)


def test_not_a_rank_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    with pytest.raises(
        TypeError, match=r"mesh=.* is invalid: the cache mesh has one axis named 'dp'.*rank_mesh"
    ):
        create_pools_sharded(PLAN, mesh)


def test_unstack_rank_out_of_range():
    pools = create_pools_sharded(PLAN, rank_mesh(2))
    with pytest.raises(
        ValueError,
        match=r"r=2 is invalid: the tree has 2 ranks, so r lies in \[0, 2\)\. Fix: pass 0 <= r <= 1",
    ):
        unstack_rank(pools, 2)
    with pytest.raises(ValueError, match=r"r=-1 is invalid"):
        unstack_rank(pools, -1)
    with pytest.raises(TypeError, match=r"r='0' is invalid: a rank is an int"):
        unstack_rank(pools, "0")


def _copy(state, pools):
    return state, pools


def test_per_rank_rejects_state_or_pools_of_another_plan_or_rank_count():
    mesh = rank_mesh(2)
    step = per_rank(mesh, lambda plan, state, pools: _copy(state, pools), static=(0,))
    state, pools = create_state_sharded(PLAN, mesh, seed=0), create_pools_sharded(PLAN, mesh)
    other_state = create_state_sharded(OTHER, mesh, seed=0)
    other_pools = create_pools_sharded(OTHER, mesh)
    with pytest.raises(
        ValueError,
        match=r"args\[1\]=.*CacheState of plan key .* the state must belong to the step's plan .*create_state_sharded\(plan, mesh\)",
    ):
        step(PLAN, other_state, pools)
    with pytest.raises(
        ValueError,
        match=r"args\[2\]=.*Pools of 2 arrays.* the pools must have the shapes of the step's plan .* over 2 ranks.*create_pools_sharded",
    ):
        step(PLAN, state, other_pools)
    four = rank_mesh(4)
    with pytest.raises(ValueError, match=r"args\[1\]=.*leading rank axis of 2.*rank_mesh\(2\)"):
        step(PLAN, create_state_sharded(PLAN, four, seed=0), pools)
    # Right shapes, wrong placement: would be moved between devices on every call.
    moved = jax.device_put(pools, rank_sharding(rank_mesh(8)).mesh.devices.flat[0])
    with pytest.raises(
        ValueError, match=r"args\[2\]=.*sharded as .* the step's arrays are split over its mesh"
    ):
        step(PLAN, state, moved)


def test_per_rank_argument_errors():
    mesh = rank_mesh(2)
    with pytest.raises(TypeError, match=r"f=3 is invalid: per_rank wraps a function"):
        per_rank(mesh, 3)
    with pytest.raises(
        TypeError, match=r"donate='a' is invalid: argument positions are a tuple of ints"
    ):
        per_rank(mesh, abs, donate="a")
    with pytest.raises(
        ValueError,
        match=r"static=\[0\] is invalid: a static argument is neither replicated nor donated",
    ):
        per_rank(mesh, abs, static=(0,), donate=(0,))
