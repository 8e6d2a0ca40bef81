"""The flax.nnx model: the interface a serving engine drives.

``DeepSeekV4`` jitted the flax way (``nnx.split`` once, ``nnx.merge`` inside the jitted function,
pools donated) must give what the functional step gives on the same schedule, equal dense
recompute through its own ``dense``, compile once, and keep every pool aliased.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_harness import TOL, Engine, make_plan, nnx_jitted
from test_model_step import _abstract

from flatkv_jax.model import (
    DeepSeekV4,
    init_params,
    param_shapes,
    random_params,
    tiny_model,
)
from flatkv_jax.pools import pool_specs


def _schedule(e: Engine, rng) -> None:
    """Prefill chunks (one inside a compression window), mixed prefill + decode, MTP verify
    rounds with rewinds, a retract and a readmission."""
    a = e.admit(rng.integers(0, 64, 21).tolist())
    b = e.admit(rng.integers(0, 64, 7).tolist())
    e.run([(a, 9), (b, 7)])
    e.run([(a, 11), (b, 1)])
    e.verify([a, b])
    tokens = e.retract(b)
    c = e.admit(tokens)
    e.run([(c, len(tokens) - 1), (a, 1)])
    e.verify([a, c])


def test_nnx_model_jitted_the_engine_way_equals_dense(fp32_setup):
    """Prefill, verify rounds, retract and readmission through ``nnx.merge(graphdef,
    weights).step`` / ``.propose`` (pools donated): every accepted position equals the
    module's own dense recompute, and each step kind compiled once."""
    s = fp32_setup
    model = DeepSeekV4.from_params(s.cfg, s.params)
    e = Engine(s.cfg, s.plan, model, rng=np.random.default_rng(5))
    _schedule(e, np.random.default_rng(1))
    for rid in e.live():
        assert e.check_parity(rid) <= TOL
    e.check_state()
    assert (e.step_fn._cache_size(), e.propose_fn._cache_size()) == (1, 1)


def test_nnx_step_aliases_every_pool_and_copies_none(fp32_setup):
    """The engine-side jit (split/merge, pools donated) keeps every pool aliased and needs no
    temporary of a pool's size (a copy of any pool array would)."""
    s = fp32_setup
    plan = make_plan(s.cfg, pages=4096)
    graphdef, weights = nnx.split(DeepSeekV4.from_params(s.cfg, s.params))
    step_fn, _ = nnx_jitted(graphdef, plan)
    stats = step_fn.lower(weights, *_abstract(s.cfg, plan)).compile().memory_analysis()
    assert stats.alias_size_in_bytes == plan.total_pool_bytes
    smallest = min(
        int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(pool_specs(plan))
    )
    assert stats.temp_size_in_bytes < smallest, (stats.temp_size_in_bytes, smallest)


def test_from_params_holds_exactly_the_given_weights():
    cfg = tiny_model(num_layers=3)
    params = init_params(cfg, 3)
    model = DeepSeekV4.from_params(cfg, params)
    back = model.to_params()
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        assert np.array_equal(x, y)
    # Every weight is an nnx.Param of the module tree (the engine splits them out).
    n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == len(jax.tree.leaves(params))
    assert isinstance(model.layers[1].attn.compressor.wkv, nnx.Param)
    assert model.layers[0].attn.compressor is None  # window-only layer
    assert model.layers[1].attn.indexer is not None  # CSA
    assert model.layers[2].attn.indexer is None  # HCA
    # Same config, same graph: dense_forward and every model share one compilation.
    graphdef, _ = nnx.split(model)
    assert graphdef == nnx.split(DeepSeekV4(cfg, rngs=nnx.Rngs(1)))[0]


def test_rngs_init_is_deterministic_and_shaped():
    cfg = tiny_model(num_layers=2)
    a = DeepSeekV4(cfg, rngs=nnx.Rngs(0)).to_params()
    b = DeepSeekV4(cfg, rngs=nnx.Rngs(0)).to_params()
    c = DeepSeekV4(cfg, rngs=nnx.Rngs(1)).to_params()
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    assert not np.array_equal(a.embed, c.embed)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), param_shapes(cfg))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), a) == shapes
    # Norm weights are drawn around 1 (scale 0.1), matrices around 0 (1/sqrt(fan_in)).
    assert abs(float(a.final_norm.mean()) - 1.0) < 0.1
    assert abs(float(a.head.std()) - 1 / np.sqrt(cfg.hidden)) < 0.02
    # Under a trace nothing is materialised: the V4-Flash geometry is described, not allocated.
    big = jax.eval_shape(lambda k: random_params(tiny_model(hidden=4096), k), jax.random.key(0))
    assert big.embed.shape == (64, 4096)


def test_constructor_errors():
    cfg = tiny_model(num_layers=1)
    with pytest.raises(TypeError, match=r"rngs=None is invalid: give exactly one of rngs"):
        DeepSeekV4(cfg)
    with pytest.raises(
        TypeError, match=r"rngs='given with params' is invalid: give exactly one of rngs"
    ):
        DeepSeekV4(cfg, rngs=nnx.Rngs(0), params=init_params(cfg, 0))
    with pytest.raises(TypeError, match=r"rngs='int' is invalid: it must be a flax.nnx.Rngs"):
        DeepSeekV4(cfg, rngs=0)
    with pytest.raises(TypeError, match=r"cfg=None is invalid: it must be a ModelConfig"):
        DeepSeekV4(None, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"params='dict' is invalid: it must be a Params pytree"):
        DeepSeekV4.from_params(cfg, {})
    with pytest.raises(ValueError, match=r"params=.* is invalid: the layer structure of cfg needs"):
        DeepSeekV4.from_params(cfg, init_params(tiny_model(num_layers=2), 0))
    with pytest.raises(
        ValueError,
        match=r"params\.embed=\(\(64, 32\), 'float32'\) is invalid: cfg wants shape \(64, 64\)",
    ):
        DeepSeekV4.from_params(cfg, init_params(tiny_model(num_layers=1, hidden=32), 0))
    with pytest.raises(ValueError, match=r"tokens=.*is invalid: one sequence of int32 token ids"):
        DeepSeekV4.from_params(cfg, init_params(cfg, 0)).dense(jnp.zeros((2, 3), jnp.int32))


def test_step_checks_run_through_the_module(fp32_setup):
    """The module's step checks its inputs at trace time like the functional one: pools of
    another plan and an unknown kernel implementation."""
    s = fp32_setup
    model = DeepSeekV4.from_params(s.cfg, s.params)
    pools, batch, meta, tables = _abstract(s.cfg, s.plan)

    def trace(pools=pools, **kw):
        def f(*args):
            return model.step(*args, plan=s.plan, **kw)

        return jax.eval_shape(f, pools, batch, meta, tables)

    with pytest.raises(ValueError, match=r"pools\[swa_kv\.kv, layer 0\]=\(\(66, 4, 64\)"):
        trace(pools=_abstract(s.cfg, make_plan(s.cfg, pages=64))[0])
    with pytest.raises(ValueError, match=r"impl='cuda' is invalid: it must be one of"):
        trace(impl="cuda")
    out, _ = trace(impl="reference")
    assert out.logits.shape == (s.plan.limits.step_tokens, s.cfg.vocab)
