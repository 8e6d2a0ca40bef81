"""A sharded run over 8 ranks equals 8 independent single-device runs, bit for bit.

One random serving trace per rank (tests/sharding/sharding_trace.py) drives the fused per-rank
step (retire, release, reclaim, admit with prefix reuse, extend, step metadata, reference
write kernels) twice: once through ``per_rank`` on the 8-device mesh, once per rank through a
plain ``jax.jit`` on one device with its own state and pools. Every step's results, and the
final states and pools, must be identical per rank. The same run then checks the compiled
step: one compilation for the whole trace, no collectives in its HLO, pools and state aliased.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import monitoring
from sharding_trace import PLAN, RankDriver, rank_step

from flatkv_jax.coordinator import create_state
from flatkv_jax.coordinator.state import state_bytes
from flatkv_jax.pools import create_pools, pool_specs
from flatkv_jax.sharding import (
    collectives_in,
    create_pools_sharded,
    create_state_sharded,
    per_rank,
    rank_mesh,
    rank_seeds,
    rank_sharding,
    unstack_rank,
)

RANKS, STEPS, SEED = 8, 14, 3


def stack(trees, mesh):
    """Per-rank host trees -> one stacked tree on the mesh (only the small batches travel)."""
    host = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
    return jax.device_put(host, rank_sharding(mesh))


def assert_trees_equal(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{what}: leaf {i} differs"


@pytest.fixture(scope="module")
def run():
    mesh = rank_mesh(RANKS)
    seeds = rank_seeds(SEED, RANKS)
    sharded_step = per_rank(mesh, rank_step, static=(0,), donate=(1, 2))
    state = create_state_sharded(PLAN, mesh, seed=SEED)
    pools = create_pools_sharded(PLAN, mesh)
    ref_step = jax.jit(rank_step, static_argnums=0, donate_argnums=(1, 2))
    refs = [[create_state(PLAN, seed=seeds[r]), create_pools(PLAN)] for r in range(RANKS)]
    drivers = [RankDriver(PLAN, r, SEED) for r in range(RANKS)]

    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        late_compiles = 0
        for step in range(STEPS):
            per_rank_batches = [d.batches() for d in drivers]
            before = len(compiles)
            batches = stack(per_rank_batches, mesh)
            state, pools, results = sharded_step(PLAN, state, pools, *batches)
            for r in range(RANKS):
                refs[r][0], refs[r][1], ref_results = ref_step(PLAN, *refs[r], *per_rank_batches[r])
                mine = unstack_rank(results, r)
                assert_trees_equal(mine, ref_results, f"step {step} rank {r} results")
                drivers[r].update(mine)
            if step > 0:
                late_compiles += len(compiles) - before
    finally:
        monitoring.unregister_event_duration_listener(listener)
    return dict(
        mesh=mesh,
        step=sharded_step,
        ref_step=ref_step,
        state=state,
        pools=pools,
        batches=batches,
        rank0_batches=per_rank_batches[0],
        refs=refs,
        drivers=drivers,
        late_compiles=late_compiles,
    )


def test_sharded_run_equals_independent_single_device_runs(run):
    for r in range(RANKS):
        state_r, pools_r = unstack_rank(run["state"], r), unstack_rank(run["pools"], r)
        assert_trees_equal(state_r, run["refs"][r][0], f"rank {r} state")
        assert_trees_equal(pools_r, run["refs"][r][1], f"rank {r} pools")
    # The trace did what it is for: prefix hits, finished and aborted requests, and the
    # ranks' workloads differ (their pools are not all equal).
    totals = {k: sum(d.stats[k] for d in run["drivers"]) for k in run["drivers"][0].stats}
    assert totals["hits"] > 0 and totals["finished"] > 0 and totals["admitted"] >= 2 * RANKS
    assert totals["aborted"] > 0 or totals["not_ok"] > 0, totals
    hits = [d.stats["hits"] for d in run["drivers"]]
    assert sum(h > 0 for h in hits) >= RANKS // 2, hits
    p0 = jax.tree.leaves(unstack_rank(run["pools"], 0))
    p1 = jax.tree.leaves(unstack_rank(run["pools"], 1))
    assert any(not np.array_equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_the_whole_trace_compiles_once(run):
    assert run["step"].cache_size() == 1
    assert run["ref_step"]._cache_size() == 1
    assert run["late_compiles"] == 0  # nothing compiled after the first step


def _compiled(run):
    # Same arguments' shapes and shardings as the trace: the jit cache answers, no compile.
    return run["step"].lower(PLAN, run["state"], run["pools"], *run["batches"]).compile()


def test_compiled_step_has_no_collectives(run):
    text = _compiled(run).as_text()
    assert "scatter" in text  # the body is there (the write kernels' scatters)
    assert collectives_in(text) == []


def test_collective_check_detects_a_collective():
    # The check above could not pass vacuously: a psum over the rank axis is caught.
    mesh = rank_mesh(RANKS)
    step = per_rank(mesh, lambda x: jax.lax.psum(x, "dp"))
    x = jax.device_put(np.ones((RANKS, 4), np.float32), rank_sharding(mesh))
    assert "all-reduce" in collectives_in(step.lower(x).compile().as_text())


def test_pools_and_state_stay_aliased_per_device(run):
    """Per device, the sharded step's memory is the single-device step's: every pool and
    state buffer aliased (updated in place), and no more temporary memory than one rank alone
    needs (a copy of a pool would add its size)."""
    mem = _compiled(run).memory_analysis()
    ref = run["ref_step"].lower(PLAN, *run["refs"][0], *run["rank0_batches"]).compile()
    ref_mem = ref.memory_analysis()
    per_device = PLAN.total_pool_bytes + state_bytes(run["refs"][0][0])
    assert mem.alias_size_in_bytes == ref_mem.alias_size_in_bytes == per_device
    smallest = min(
        int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(pool_specs(PLAN))
    )
    assert mem.temp_size_in_bytes < ref_mem.temp_size_in_bytes + smallest, (
        mem.temp_size_in_bytes,
        ref_mem.temp_size_in_bytes,
    )
