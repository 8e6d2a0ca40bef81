"""Pools as pre-sized device arrays built from the plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatkv_jax import ServingLimits, create_pools, plan_with_pages, pool_specs
from flatkv_jax.recipes import deepseek_v4_groups, tiny_v4


@pytest.fixture(scope="module")
def plan():
    cfg = tiny_v4(
        kv_format="fp8_ds_mla",
        indexer_format="mxfp4",
        head_dim=128,
        rope_dim=64,
        index_head_dim=128,
    )
    return plan_with_pages(deepseek_v4_groups(cfg, verify_width=2), ServingLimits(4, 64, 16, 2), 24)


def test_pools_match_the_plan(plan):
    pools = create_pools(plan)
    assert pools.nbytes == plan.total_pool_bytes
    for g, per_group in zip(plan.groups, pools.arrays, strict=True):
        assert len(per_group) == len(g.fields)
        for f, per_field in zip(g.fields, per_group, strict=True):
            assert len(per_field) == g.num_layers
            for a in per_field:
                assert a.shape == plan.pool_shape(g, f.name) and a.dtype == jnp.dtype(
                    f.format.dtype
                )
    c4 = plan.group("c4_kv")
    assert pools.get(plan, "c4_kv", "index_key", c4.layers[-1]).shape == (26, 4, 68)
    assert all(
        not np.asarray(a).any() for a in jax.tree_util.tree_leaves(pools)
    )  # null page (and all) zero


def test_pools_are_a_pytree_of_arrays_only(plan):
    pools = create_pools(plan)
    leaves, treedef = jax.tree_util.tree_flatten(pools)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves).arrays[0][0][0] is leaves[0]
    specs = jax.tree_util.tree_leaves(pool_specs(plan))
    assert [s.shape for s in specs] == [x.shape for x in leaves]


def test_flat_group_roundtrip(plan):
    pools = create_pools(plan)
    gi = plan.group_index("c4_kv")
    flat = pools.flat_group(gi)
    assert len(flat) == 2 * plan.group("c4_kv").num_layers
    ones = tuple(jnp.ones_like(a) for a in flat)
    back = pools.with_flat_group(gi, ones)
    assert all(np.asarray(a).all() for a in back.flat_group(gi))
    assert not np.asarray(back.flat_group(0)[0]).any()


def test_sharded_creation_places_arrays_directly(plan):
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    pools = create_pools(plan, sharding={"swa_kv": rep})
    assert pools.group(plan, "swa_kv")[0][0].sharding == rep


def test_pool_errors(plan):
    with pytest.raises(
        ValueError, match=r"sharding=\['nope'\] is invalid: keys must be group names of the plan"
    ):
        create_pools(plan, sharding={"nope": None})
    pools = create_pools(plan)
    with pytest.raises(
        ValueError, match=r"layer=0 is invalid: group 'c4_kv' is used by layers \(1, 3\)"
    ):
        pools.get(plan, "c4_kv", "kv", 0)


def test_zero_group_zeroes_listed_pages_in_every_array(plan):
    pools = create_pools(plan)
    gi = plan.group_index("c4_kv")
    ones = pools.with_flat_group(gi, tuple(jnp.ones_like(a) for a in pools.flat_group(gi)))
    out = ones.zero_group(gi, jnp.asarray([2, 5, -1], jnp.int32))
    for a in out.flat_group(gi):
        a = np.asarray(a)
        assert not a[[2, 5]].any() and a[[1, 3, 4, 6]].all()
