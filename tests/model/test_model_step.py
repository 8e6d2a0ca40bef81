"""The jitted step: compiled once, pools aliased (no full-pool copies), V4-Flash shapes, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_harness import LIMITS, Engine, jitted, make_plan

from flatkv_jax import ServingLimits
from flatkv_jax.model import (
    DraftBatch,
    StepBatch,
    StepMeta,
    dense_forward,
    init_params,
    make_propose,
    make_step,
    param_shapes,
    tiny_model,
    v4_flash_model,
)
from flatkv_jax.pools import Pools, pool_specs


def _sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _abstract(cfg, plan, zero_len=8):
    s, r = plan.limits.step_tokens, plan.limits.max_requests
    meta = StepMeta(
        token_slot=_sds((s,)),
        token_pos=_sds((s,)),
        tables=tuple(_sds(plan.table_shape(g)) for g in plan.groups),
        zero_pages=tuple(_sds((zero_len,)) for _ in plan.groups),
    )
    batch = StepBatch(tokens=_sds((s,)), prev_hidden=_sds((r, cfg.hidden), jnp.float32))
    return Pools(pool_specs(plan)), batch, meta


def test_step_compiles_once_across_varied_batches(fp32_setup, rng):
    """After one warm-up call, prefill chunks, mixed batches, decode, verify and retract add no
    entry to the jitted step's (and propose's) compilation cache."""
    s = fp32_setup
    step_fn, propose_fn = jitted(s.cfg, s.plan)
    e = Engine(s.cfg, s.plan, s.params)
    a = e.admit(rng.integers(0, 64, 20).tolist())
    e.run([(a, 3)])  # one prefill chunk, the rest idle
    b = e.admit(rng.integers(0, 64, 9).tolist())
    e.run([(a, 12), (b, 4)])  # two chunks
    e.run([(a, 5), (b, 5)])
    e.run([(a, 1), (b, 1)])  # decode
    e.verify([a, b])  # verify blocks; draft pools zeroed by propose
    compiled = step_fn._cache_size(), propose_fn._cache_size()
    e.retract(b)
    c = e.admit(rng.integers(0, 64, 14).tolist())
    e.run([(a, 1), (c, 12)])
    e.verify([a])
    e.run([(c, 2), (a, 1)])
    e.verify([a, c])
    assert e.steps == 9
    assert (step_fn._cache_size(), propose_fn._cache_size()) == compiled


def test_step_aliases_every_pool_and_copies_none(fp32_setup):
    """memory_analysis(): alias size == all pool bytes, and temp memory is smaller than the
    smallest pool array, so no pool array is ever copied (a copy would need a temp buffer of
    its size). Pools are only described, never allocated."""
    s = fp32_setup
    plan = make_plan(s.cfg, pages=4096)
    stats = (
        make_step(s.cfg, plan).lower(s.params, *_abstract(s.cfg, plan)).compile().memory_analysis()
    )
    assert stats.alias_size_in_bytes == plan.total_pool_bytes
    smallest = min(
        int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(pool_specs(plan))
    )
    assert stats.temp_size_in_bytes < smallest, (stats.temp_size_in_bytes, smallest)


def test_propose_aliases_the_draft_pool(fp32_setup):
    s = fp32_setup
    plan = make_plan(s.cfg, pages=4096)
    r = plan.limits.max_requests
    pools, _, meta = _abstract(s.cfg, plan)
    batch = DraftBatch(
        tokens=_sds((r,)), start_pos=_sds((r,)), prev_hidden=_sds((r, s.cfg.hidden), jnp.float32)
    )
    fn = make_propose(s.cfg, plan)
    stats = (
        fn.lower(s.params, pools, batch, meta.tables, meta.zero_pages).compile().memory_analysis()
    )
    assert stats.alias_size_in_bytes == plan.total_pool_bytes
    assert stats.temp_size_in_bytes < plan.pool_bytes("mtp_swa_kv") / 4


def test_v4_flash_geometry_traces_with_shapes_only():
    cfg = v4_flash_model()
    limits = ServingLimits(max_requests=2, max_context=1024, chunk_tokens=256, verify_width=1)
    plan = make_plan(cfg, limits, pages=1024)
    params = param_shapes(cfg)
    assert params.embed.shape == (129280, 4096)
    assert len(params.layers) == 43
    pools, batch, meta = _abstract(cfg, plan)
    out, new_pools = jax.eval_shape(make_step(cfg, plan), params, pools, batch, meta)
    assert out.logits.shape == (limits.step_tokens, 129280)
    assert out.draft_logits.shape == (limits.step_tokens, 129280)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new_pools) == jax.tree.map(
        lambda a: (a.shape, a.dtype), pools
    )
    # The production row layouts are what the pools hold.
    assert plan.group("swa_kv").field("kv").format.nbytes == 584
    assert plan.group("c4_kv").field("index_key").format.nbytes == 68


def test_init_is_deterministic_and_seeded():
    cfg = tiny_model(num_layers=2)
    a, b, c = init_params(cfg, 3), init_params(cfg, 3), init_params(cfg, 4)
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    assert not np.array_equal(a.embed, c.embed)
    assert jax.tree.map(lambda x: x.shape, a) == jax.tree.map(lambda x: x.shape, param_shapes(cfg))


# --- errors ------------------------------------------------------------------------------------
def test_config_errors():
    with pytest.raises(TypeError, match=r"cache=1 is invalid: it must be a DeepSeekV4Config"):
        from flatkv_jax.model import ModelConfig

        ModelConfig(cache=1)
    with pytest.raises(
        ValueError, match=r"num_mtp_layers=2 is invalid: the reference model has at most one MTP"
    ):
        tiny_model(num_mtp_layers=2)
    with pytest.raises(ValueError, match=r"rope_dim=15 is invalid: RoPE rotates pairs"):
        tiny_model(rope_dim=15)
    with pytest.raises(TypeError, match=r"hidden=2.0 is invalid: it must be an int"):
        tiny_model(hidden=2.0)
    with pytest.raises(ValueError, match=r"seed=-1 is invalid: it must be >= 0"):
        init_params(tiny_model(num_layers=1), -1)
    with pytest.raises(ValueError, match=r"tokens=.*is invalid: one sequence of int32 token ids"):
        dense_forward(None, jnp.zeros((2, 3), jnp.int32), tiny_model(num_layers=1))


def test_plan_mismatch_errors(fp32_setup):
    s = fp32_setup
    other = make_plan(tiny_model(num_layers=2))
    with pytest.raises(
        ValueError, match=r"plan=\[.*\] is invalid: the plan's groups must be deepseek_v4_groups"
    ):
        make_step(s.cfg, other)
    with pytest.raises(TypeError, match=r"plan=None is invalid: it must be a CachePlan"):
        make_step(s.cfg, None)
    with pytest.raises(TypeError, match=r"cfg=None is invalid: it must be a ModelConfig"):
        make_step(None, s.plan)
    no_mtp = tiny_model(num_mtp_layers=0)
    with pytest.raises(
        ValueError, match=r"cfg='num_mtp_layers=0' is invalid: propose needs the MTP draft layer"
    ):
        make_propose(no_mtp, make_plan(no_mtp))(None, None, None, (), ())
    with pytest.raises(ValueError, match=r"num_draft=0 is invalid: it must be an int >= 1"):
        make_propose(s.cfg, s.plan, num_draft=0)(None, None, None, (), ())


def test_step_input_errors(fp32_setup):
    s = fp32_setup
    fn = make_step(s.cfg, s.plan)
    pools, batch, meta = _abstract(s.cfg, s.plan)
    bad_pos = StepMeta(_sds((3,)), meta.token_pos, meta.tables, meta.zero_pages)
    with pytest.raises(
        ValueError, match=r"token_slot=\(\(3,\), 'int32'\) is invalid: expected shape \(16,\)"
    ):
        jax.eval_shape(fn, s.params, pools, batch, bad_pos)
    bad_tok = StepBatch(_sds((16,), jnp.float32), batch.prev_hidden)
    with pytest.raises(
        ValueError,
        match=r"tokens=\(\(16,\), 'float32'\) is invalid: expected shape \(16,\) and dtype int32",
    ):
        jax.eval_shape(fn, s.params, pools, bad_tok, meta)
    short = StepMeta(meta.token_slot, meta.token_pos, meta.tables[:-1], meta.zero_pages)
    with pytest.raises(ValueError, match=r"tables='tuple' is invalid: one table per group"):
        jax.eval_shape(fn, s.params, pools, batch, short)
    wide = StepMeta(
        meta.token_slot, meta.token_pos, (_sds((4, 3)), *meta.tables[1:]), meta.zero_pages
    )
    with pytest.raises(ValueError, match=r"tables\[swa_kv\]=\(\(4, 3\), 'int32'\) is invalid"):
        jax.eval_shape(fn, s.params, pools, batch, wide)
    zl = StepMeta(
        meta.token_slot, meta.token_pos, meta.tables, (_sds((2, 2)), *meta.zero_pages[1:])
    )
    with pytest.raises(
        ValueError, match=r"zero_pages\[swa_kv\]=\(2, 2\) is invalid: a rank-1 int32 array"
    ):
        jax.eval_shape(fn, s.params, pools, batch, zl)
    assert LIMITS.step_tokens == 16
