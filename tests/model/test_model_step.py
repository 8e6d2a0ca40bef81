"""The jitted step: compiled once, pools aliased (no full-pool copies), V4-Flash shapes, errors."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_harness import LIMITS, Engine, jitted, make_plan

from flatkv_jax import ServingLimits
from flatkv_jax.coordinator import StepMetadata, window_columns
from flatkv_jax.coordinator.state import table_size
from flatkv_jax.model import (
    DraftBatch,
    StepBatch,
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


def _metadata(plan, rows=None, zero_len=8) -> StepMetadata:
    """Abstract coordinator metadata of one step with ``rows`` step rows (default: an extend
    and an admit batch, as the engine passes)."""
    t, g = plan.limits.step_tokens, len(plan.groups)
    s = 2 * plan.limits.max_requests if rows is None else rows
    cols = sum(n for _, n in window_columns(plan))
    return StepMetadata(
        token_slot=_sds((t,)),
        token_pos=_sds((t,)),
        token_row=_sds((t,)),
        row_slot=_sds((s,)),
        row_start=_sds((s,)),
        row_count=_sds((s,)),
        row_offset=_sds((s,)),
        seq_len=_sds((s,)),
        write_slot=_sds((g, t)),
        window_pages=_sds((s, cols)),
        window_first_block=_sds((g, s)),
        zero=_sds((g, zero_len)),
        num_tokens=_sds(()),
        overflow=_sds((), jnp.bool_),
    )


def _abstract(cfg, plan):
    s, r = plan.limits.step_tokens, plan.limits.max_requests
    batch = StepBatch(tokens=_sds((s,)), prev_hidden=_sds((r, cfg.hidden), jnp.float32))
    return Pools(pool_specs(plan)), batch, _metadata(plan), _sds((table_size(plan),))


def test_step_compiles_once_across_varied_batches(fp32_setup, rng):
    """After one warm-up call, prefill chunks, mixed batches, decode, verify and retract add no
    entry to the jitted step's (and propose's) compilation cache."""
    s = fp32_setup
    step_fn, propose_fn = jitted(s.cfg, s.plan)
    e = Engine(s.cfg, s.plan, s.params)
    a = e.admit(rng.integers(0, 64, 20).tolist())
    e.run([(a, 3)])  # one prefill chunk (admit), the rest idle
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
    pools, _, meta, tables = _abstract(s.cfg, plan)
    batch = DraftBatch(
        tokens=_sds((r,)),
        prev_hidden=_sds((r, s.cfg.hidden), jnp.float32),
        active=_sds((r,), jnp.bool_),
    )
    fn = make_propose(s.cfg, plan)
    stats = fn.lower(s.params, pools, batch, meta, tables).compile().memory_analysis()
    assert stats.alias_size_in_bytes == plan.total_pool_bytes
    assert stats.temp_size_in_bytes < plan.pool_bytes("mtp_swa_kv") / 4


def test_v4_flash_geometry_traces_with_shapes_only():
    cfg = v4_flash_model()
    limits = ServingLimits(max_requests=2, max_context=1024, chunk_tokens=256, verify_width=1)
    plan = make_plan(cfg, limits, pages=1024)
    params = param_shapes(cfg)
    assert params.embed.shape == (129280, 4096)
    assert len(params.layers) == 43
    pools, batch, meta, tables = _abstract(cfg, plan)
    out, new_pools = jax.eval_shape(make_step(cfg, plan), params, pools, batch, meta, tables)
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
    with pytest.raises(TypeError, match=r"plan='NoneType' is invalid: it must be a CachePlan"):
        make_step(s.cfg, None)
    with pytest.raises(TypeError, match=r"cfg=None is invalid: it must be a ModelConfig"):
        make_step(None, s.plan)
    no_mtp = tiny_model(num_mtp_layers=0)
    with pytest.raises(
        ValueError, match=r"cfg='num_mtp_layers=0' is invalid: propose needs the MTP draft layer"
    ):
        make_propose(no_mtp, make_plan(no_mtp))(None, None, None, None, None)
    with pytest.raises(ValueError, match=r"num_draft=0 is invalid: it must be an int >= 1"):
        make_propose(s.cfg, s.plan, num_draft=0)(None, None, None, None, None)


def test_step_input_errors(fp32_setup):
    s = fp32_setup
    fn = make_step(s.cfg, s.plan)
    pools, batch, meta, tables = _abstract(s.cfg, s.plan)

    def call(batch=batch, meta=meta, tables=tables):
        return jax.eval_shape(fn, s.params, pools, batch, meta, tables)

    with pytest.raises(
        TypeError, match=r"meta='dict' is invalid: it must be the coordinator's StepMetadata"
    ):
        call(meta={})
    with pytest.raises(
        ValueError, match=r"meta.token_slot=\(\(3,\), 'int32'\) is invalid: expected shape \(16,\)"
    ):
        call(meta=dataclasses.replace(meta, token_slot=_sds((3,))))
    bad_tok = StepBatch(_sds((16,), jnp.float32), batch.prev_hidden)
    with pytest.raises(
        ValueError,
        match=r"tokens=\(\(16,\), 'float32'\) is invalid: expected shape \(16,\) and dtype int32",
    ):
        call(batch=bad_tok)
    with pytest.raises(ValueError, match=r"meta.write_slot=\(\(7, 3\), 'int32'\) is invalid"):
        call(meta=dataclasses.replace(meta, write_slot=_sds((7, 3))))
    with pytest.raises(ValueError, match=r"meta.row_slot=\(\) is invalid: a rank-1 int32 array"):
        call(meta=dataclasses.replace(meta, row_slot=_sds(())))
    # Window columns sized for another max_count than the step's.
    with pytest.raises(ValueError, match=r"meta.window_pages=\(\(8, 3\), 'int32'\) is invalid"):
        call(meta=dataclasses.replace(meta, window_pages=_sds((8, 3))))
    with pytest.raises(
        ValueError, match=r"meta.zero=\(8,\) is invalid: an int32 array \[7, K\] \(one zero list"
    ):
        call(meta=dataclasses.replace(meta, zero=_sds((8,))))
    with pytest.raises(
        ValueError, match=r"table_buffer=\(\(3,\), 'int32'\) is invalid: expected shape"
    ):
        call(tables=_sds((3,)))
    assert LIMITS.step_tokens == 16
    # propose checks its own batch, then the same metadata.
    r = s.plan.limits.max_requests
    draft = DraftBatch(_sds((r,)), _sds((r, s.cfg.hidden), jnp.float32), _sds((r,)))
    with pytest.raises(ValueError, match=r"active=\(\(4,\), 'int32'\) is invalid: expected shape"):
        jax.eval_shape(make_propose(s.cfg, s.plan), s.params, pools, draft, meta, tables)


def test_step_rejects_pools_and_tables_of_another_plan(fp32_setup):
    """Pools, table buffer or metadata of another plan raise at trace time, naming the array
    and the fix, instead of retracing the step for the new shapes."""
    s = fp32_setup
    fn = make_step(s.cfg, s.plan)
    pools, batch, meta, tables = _abstract(s.cfg, s.plan)
    bigger = make_plan(s.cfg, pages=64)

    def call(pools=pools, meta=meta, tables=tables):
        return jax.eval_shape(fn, s.params, pools, batch, meta, tables)

    with pytest.raises(
        ValueError,
        match=r"pools\[swa_kv\.kv, layer 0\]=\(\(66, 4, 64\), 'float32'\) is invalid: the "
        r"plan's array is shape \(42, 4, 64\) of float32 \(42 pages\); these pools were built "
        r"for another plan\. Fix: create the pools with create_pools\(plan\)",
    ):
        call(pools=Pools(pool_specs(bigger)))
    # Another row format: same page counts, other dtype.
    bf16 = make_plan(tiny_model(kv_format="bf16"))
    with pytest.raises(
        ValueError, match=r"pools\[swa_kv\.kv, layer 0\]=\(\(42, 4, 64\), 'bfloat16'\) is invalid"
    ):
        call(pools=Pools(pool_specs(bf16)))
    no_mtp = make_plan(tiny_model(num_mtp_layers=0))
    with pytest.raises(ValueError, match=r"pools='6 groups' is invalid: the plan has 7 groups"):
        call(pools=Pools(pool_specs(no_mtp)))
    with pytest.raises(TypeError, match=r"pools='tuple' is invalid: it must be the Pools of"):
        call(pools=pool_specs(s.plan))
    more_requests = make_plan(s.cfg, dataclasses.replace(LIMITS, max_requests=8))
    with pytest.raises(
        ValueError,
        match=r"table_buffer=\(\(\d+,\), 'int32'\) is invalid: expected shape \(\d+,\) and "
        r"dtype int32: the state's table buffer of this plan\. Fix: pass CacheState",
    ):
        call(tables=_abstract(s.cfg, more_requests)[3])
    # The metadata of a plan with a longer step.
    longer = make_plan(s.cfg, dataclasses.replace(LIMITS, step_tokens=24))
    with pytest.raises(
        ValueError, match=r"meta\.token_slot=\(\(24,\), 'int32'\) is invalid: expected shape"
    ):
        call(meta=_metadata(longer))
    # propose checks the pools the same way.
    r = s.plan.limits.max_requests
    draft = DraftBatch(_sds((r,)), _sds((r, s.cfg.hidden), jnp.float32), _sds((r,), jnp.bool_))
    with pytest.raises(ValueError, match=r"pools\[swa_kv\.kv, layer 0\]=\(\(66, 4, 64\)"):
        jax.eval_shape(
            make_propose(s.cfg, s.plan), s.params, Pools(pool_specs(bigger)), draft, meta, tables
        )
    with pytest.raises(
        ValueError, match=r"matmul_precision='fast' is invalid: it must be one of highest, float32"
    ):
        dataclasses.replace(tiny_model(), matmul_precision="fast")


# --- matmul precision --------------------------------------------------------------------------
def _dot_precisions(lowered) -> set[str]:
    """The operand precisions of every dot_general in a lowered program."""
    found = re.findall(
        r"stablehlo\.dot_general[^\n]*?precision = \[(\w+), (\w+)\]", lowered.as_text()
    )
    dots = lowered.as_text().count("stablehlo.dot_general")
    # A dot without a precision attribute would be DEFAULT: count it as such.
    return {p for pair in found for p in pair} | ({"DEFAULT"} if dots > len(found) else set())


def _lower_all(cfg, plan, params):
    """The step, the draft proposer and the dense reference, lowered (shapes only)."""
    r = plan.limits.max_requests
    pools, batch, meta, tables = _abstract(cfg, plan)
    draft = DraftBatch(
        tokens=_sds((r,)),
        prev_hidden=_sds((r, cfg.hidden), jnp.float32),
        active=_sds((r,), jnp.bool_),
    )
    dense = jax.jit(lambda p, t: dense_forward(p, t, cfg))
    return (
        make_step(cfg, plan).lower(params, pools, batch, meta, tables),
        make_propose(cfg, plan).lower(params, pools, draft, meta, tables),
        dense.lower(params, _sds((16,))),
    )


def test_every_matrix_product_runs_at_the_configured_precision(fp32_setup):
    """The default ``matmul_precision="highest"`` pins every dot of the step, the proposer and
    the dense reference to HIGHEST, whatever the caller's context (on an H200 the backend
    default, TF32, put the demo's cached vs dense logits 1.3e-1 apart). A config that asks
    for the backend default gets DEFAULT dots."""
    s = fp32_setup
    plan = make_plan(s.cfg, pages=64)
    with jax.default_matmul_precision("bfloat16"):  # the caller's context must not leak in
        lowered = _lower_all(s.cfg, plan, s.params)
    for low in lowered:
        assert "stablehlo.dot_general" in low.as_text()
        assert _dot_precisions(low) == {"HIGHEST"}
    cfg = dataclasses.replace(s.cfg, matmul_precision="default")
    for low in _lower_all(cfg, plan, s.params):
        assert _dot_precisions(low) == {"DEFAULT"}
