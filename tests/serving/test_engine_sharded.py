"""The serving engine on several data-parallel ranks (the tests run on 8 host CPU devices).

Two step compilations in all: the 1-device engine and the 2-rank sharded engine (prefix
cache on, MTP off, one step kind); every other engine here reuses one of them (the step
function is cached per model graph, plan, kind and mesh), which the compile counters check.
(The 2-rank engine with split step kinds is tested in tests/serving_kinds.)

The workload has two phases so that prefixes are cached before they are asked for: phase 1
serves one request per tenant; phase 2 sends two more requests of tenant 0, one of tenant 1,
a short prompt (too short to have a prefix key) and an unrelated one.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator.audit import check_state, page_counts
from flatkv_jax.model import DeepSeekV4, init_params, tiny_model
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from flatkv_jax.serving import Engine, EngineOptions, Router
from flatkv_jax.sharding import collectives_in, rank_mesh

LIMITS = ServingLimits(
    max_requests=4, max_context=64, chunk_tokens=12, verify_width=2, step_tokens=16
)
OPTS = dict(overlap=True, prefix_cache=True, mtp=False, split_steps=False)


@functools.cache
def setup():
    cfg = tiny_model()
    plan = plan_with_pages(deepseek_v4_groups(cfg.cache, verify_width=2), LIMITS, 16)
    return plan, DeepSeekV4.from_params(cfg, init_params(cfg, 0))


def phases():
    """(namespace, prompt, max_new) per request of phase 1 and phase 2."""
    rng = np.random.default_rng(3)
    g = setup()[0].prefix_granularity  # 16 on the tiny plan
    sys0, sys1 = (rng.integers(1, 64, 2 * g).tolist() for _ in range(2))

    def user(n):
        return rng.integers(1, 64, n).tolist()

    one = [(0, sys0 + user(5), 6), (1, sys1 + user(3), 5)]
    two = [
        (0, sys0 + user(4), 5),
        (0, sys0 + user(6), 4),
        (1, sys1 + user(2), 6),
        (2, user(5), 5),  # shorter than a key: plain least-loaded
        (3, user(20), 4),
    ]
    return one, two


def serve(engine: Engine):
    """Both phases; returns (ids of phase 1, ids of phase 2)."""
    one, two = phases()
    ids1 = [engine.submit(p, m, namespace=ns) for ns, p, m in one]
    engine.run()
    ids2 = [engine.submit(p, m, namespace=ns) for ns, p, m in two]
    engine.run()
    return ids1, ids2


def tokens(engine: Engine) -> list[tuple[int, ...]]:
    return [engine.outputs[i].tokens for i in sorted(engine.outputs)]


@functools.cache
def single():
    plan, model = setup()
    engine = Engine(model, plan, EngineOptions(**OPTS))
    serve(engine)
    return engine


@functools.cache
def sharded(routing: str = "affinity"):
    plan, model = setup()
    engine = Engine(model, plan, EngineOptions(devices=2, routing=routing, **OPTS))
    ids = serve(engine)
    return engine, ids


def test_two_ranks_equal_the_single_device_engine():
    engine, _ = sharded()
    want = tokens(single())
    assert tokens(engine) == want
    assert tokens(sharded("least_loaded")[0]) == want
    assert all(o.finished for o in engine.outputs.values())
    assert engine.ranks == 2 and len(engine.rank_stats) == 2
    # Totals are the sums of the ranks'.
    st = engine.stats
    for name in ("prefill_tokens", "decode_tokens", "emitted_tokens", "hit_tokens"):
        assert getattr(st, name) == sum(getattr(r, name) for r in engine.rank_stats), name
    assert st.emitted_tokens == single().stats.emitted_tokens
    assert st.usable_pages == tuple(2 * u for u in engine.rank_stats[0].usable_pages)
    # Every record carries each rank's record; occupancy sums over ranks.
    rec = engine.records[0]
    assert len(rec.ranks) == 2
    assert rec.in_use == tuple(a + b for a, b in zip(*(x.in_use for x in rec.ranks), strict=True))


def test_affinity_keeps_a_tenant_on_one_rank_and_it_hits():
    engine, (ids1, ids2) = sharded()
    ranks = [engine.rank_of(i) for i in ids1 + ids2]
    # Tenant 0 (ids1[0], ids2[0], ids2[1]) on rank 0, tenant 1 on rank 1.
    assert ranks[0] == ranks[2] == ranks[3]
    assert ranks[1] == ranks[4] != ranks[0]
    g = setup()[0].prefix_granularity
    for rid in (ids2[0], ids2[1], ids2[2]):
        assert engine.outputs[rid].hit_tokens == 2 * g  # the whole system prompt
    rt = engine.routing
    assert rt.routing_misses == 0 and rt.keyed == 6 and sum(rt.routed) == 7
    hits = [r.hit_tokens for r in engine.rank_stats]
    assert hits[ranks[0]] == 4 * g and hits[ranks[1]] == 2 * g
    assert engine.stats.hit_tokens == sum(hits)


def test_least_loaded_routing_misses_are_counted_and_recompute():
    engine, (ids1, ids2) = sharded("least_loaded")
    holder = {0: engine.rank_of(ids1[0]), 1: engine.rank_of(ids1[1])}
    tenants = [0, 0, 1]
    away = [rid for rid, t in zip(ids2, tenants, strict=False) if engine.rank_of(rid) != holder[t]]
    assert away, "least-loaded routing should send some tenant request away from its prefix"
    assert engine.routing.routing_misses == len(away)
    # Each missed the whole 2-block system prompt its tenant's rank had cached.
    assert engine.routing.miss_tokens == len(away) * 2 * setup()[0].prefix_granularity
    # A prefix is only served by the rank holding its pages: the others recompute.
    for rid in away:
        assert engine.outputs[rid].hit_tokens == 0
    assert engine.stats.hit_tokens < sharded()[0].stats.hit_tokens


def test_router_follows_the_deepest_prefix_within_the_slack():
    g = 16
    sys0, sys1 = list(range(1, 2 * g + 1)), list(range(2 * g + 1, 4 * g + 1))
    turn1 = sys0 + [7] * g  # a session's first turn: 3 whole blocks (49 tokens)
    r = Router(2, "affinity", key_tokens=g, slack=2)
    assert r.route([*turn1, 1], 0, [0, 0]) == (0, 3, 0)
    assert r.route([*sys1, 1], 0, [1, 0]) == (1, 2, 0)  # a new prefix: least loaded
    # Another session of tenant 0 on rank 1 (least loaded within the slack? no: it follows
    # its system prompt to rank 0).
    assert r.route([*sys0, 9, 9], 0, [1, 0]) == (0, 2, 0)
    # Past the slack it goes to the least-loaded rank: a miss of 2 blocks.
    assert r.route([*sys0, 8, 8], 0, [3, 0]) == (1, 2, 2)
    # Now both ranks hold sys0, but only rank 0 holds turn 1: the next turn follows it.
    assert r.route([*turn1, 1, 2, 3], 0, [1, 1]) == (0, 3, 0)
    # The namespace is part of the key: the same tokens in another tenant are new.
    assert r.route([*turn1, 1], 5, [1, 0]) == (1, 3, 0)
    assert r.route([1, 2, 3], 0, [1, 0]) == (1, 0, 0)  # too short to hit: least loaded
    plain = Router(2, "least_loaded", key_tokens=g, slack=2)
    assert plain.route([*turn1, 1], 0, [0, 0]) == (0, 3, 0)
    assert plain.route([*turn1, 1, 2], 0, [1, 0]) == (1, 3, 3)


def test_one_compilation_and_no_collective_in_the_sharded_step():
    engine, _ = sharded()
    assert engine.stats.compilations == 1
    assert engine.stats.compilations_after_warmup == 0
    other, _ = sharded("least_loaded")  # same plan, kind and mesh: the same compiled step
    assert other.stats.compilations == 0 and other.stats.compilations_after_warmup == 0
    text = engine.step_hlo()
    assert "num_partitions=2" in text  # the partitioned program of both ranks
    found = collectives_in(text)
    assert not found, found
    # Control: the same check sees a collective where there is one.
    mesh = rank_mesh(2)
    psum = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    )
    control = psum.lower(np.ones((2, 4), np.float32)).compile().as_text()
    assert collectives_in(control)


def test_every_rank_whole_after_the_run():
    plan, _ = setup()
    for engine in (sharded()[0], sharded("least_loaded")[0]):
        assert not engine.has_work()
        for r in range(engine.ranks):
            state = engine.rank_state(r)
            check_state(plan, state, shared_ok=True)
            counts = page_counts(plan, state)
            assert all(c.in_use == 0 for c in counts.values()), (r, counts)
            assert not np.asarray(state.live).any()
        # The state really is per rank on its own device.
        leaf = jax.tree.leaves(engine.state)[0]
        assert leaf.shape[0] == 2 and len(leaf.sharding.device_set) == 2


def test_abort_on_a_rank():
    plan, model = setup()
    engine = Engine(model, plan, EngineOptions(devices=2, **OPTS))  # compiled already
    one, _ = phases()
    a = engine.submit(one[0][1], 6, namespace=0)
    b = engine.submit(one[1][1], 5, namespace=1)
    engine.step()
    engine.abort(b)
    out = engine.run()
    assert out[b].aborted and out[a].finished
    assert out[a].tokens == single().outputs[0].tokens
    assert engine.stats.compilations_after_warmup == 0


def test_bad_options_name_the_fix():
    plan, model = setup()
    with pytest.raises(ValueError, match=r"devices=0 .*at least one rank"):
        EngineOptions(devices=0)
    with pytest.raises(TypeError, match=r"devices=True .*int"):
        EngineOptions(devices=True)
    with pytest.raises(ValueError, match=r"routing='nearest' .*affinity"):
        EngineOptions(routing="nearest")
    with pytest.raises(ValueError, match=r"affinity_slack=-1"):
        EngineOptions(affinity_slack=-1)
    n = jax.device_count()
    with pytest.raises(
        ValueError,
        match=rf"EngineOptions.devices={n + 1} .*jax.device_count.*"
        rf"XLA_FLAGS=--xla_force_host_platform_device_count={n + 1}",
    ):
        Engine(model, plan, EngineOptions(devices=n + 1))
    with pytest.raises(TypeError, match=r"mesh='list' .*jax.sharding.Mesh"):
        Engine(model, plan, EngineOptions(), mesh=[0, 1])
    with pytest.raises(ValueError, match=r"devices=3 .*disagrees with the mesh's 2"):
        Engine(model, plan, EngineOptions(devices=3), mesh=rank_mesh(2))
    engine = sharded()[0]
    with pytest.raises(ValueError, match=r"2 ranks.*single-device engine only"):
        engine.sleep()
    with pytest.raises(ValueError, match=r"rank=2 .*ranks 0..1"):
        engine.rank_state(2)
    with pytest.raises(ValueError, match=r"request_id=99 "):
        engine.rank_of(99)
