"""The cached step as functions of a :class:`~flatkv_jax.model.params.Params` pytree.

Thin functions over :meth:`flatkv_jax.model.DeepSeekV4.step` and
:meth:`~flatkv_jax.model.DeepSeekV4.propose` (the model's math lives once, in
:mod:`flatkv_jax.model.modules`; the step's inputs, outputs and checks in
:mod:`flatkv_jax.model.cache_io`), for callers that keep weights as a plain pytree:
``make_step(cfg, plan)(params, pools, batch, meta, table_buffer)``.

Order per pool array inside one step (XLA copies a donated pool that is read before it is
mutated, see docs/model.md): every zero-listed page of every pool is zeroed first; then layer by
layer each (group, field, layer) array is written, then read. The draft proposer repeats
write/read rounds inside a ``lax.fori_loop`` that carries the draft pool.
"""

from __future__ import annotations

import functools

import jax

from flatkv_jax.coordinator.metadata import StepMetadata
from flatkv_jax.coordinator.ops import resolve_max_count
from flatkv_jax.model.cache_io import (
    DraftBatch,
    DraftOutput,
    StepBatch,
    StepOutput,
    check_draft_config,
    check_metadata,
    check_model_plan,
    check_plan,
    check_pools,
    check_step_inputs,
    resolve_kernels,
)
from flatkv_jax.model.config import ModelConfig
from flatkv_jax.model.modules import DeepSeekV4
from flatkv_jax.model.params import Params
from flatkv_jax.plan import CachePlan
from flatkv_jax.pools import Pools
from kernels_pallas import Impl

__all__ = [
    "DraftBatch",
    "DraftOutput",
    "StepBatch",
    "StepOutput",
    "check_metadata",
    "check_model_plan",
    "check_plan",
    "check_pools",
    "check_step_inputs",
    "make_propose",
    "make_step",
    "propose",
    "step",
]


def step(
    params: Params,
    pools: Pools,
    batch: StepBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    *,
    cfg: ModelConfig,
    plan: CachePlan,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
    interpret: object = None,
) -> tuple[StepOutput, Pools]:
    """:meth:`DeepSeekV4.step <flatkv_jax.model.DeepSeekV4.step>` of the model holding
    ``params``. Use :func:`make_step` for the jitted version with ``pools`` donated.

    Args:
      params: model parameters.
      pools, batch, meta, table_buffer, plan, max_count, impl, interpret: as in
        ``DeepSeekV4.step``.
      cfg: the static model config.

    Returns:
      ``(StepOutput, pools)``.
    """
    check_model_plan(cfg, plan)
    model = DeepSeekV4.from_params(cfg, params)
    return model.step(pools, batch, meta, table_buffer, plan=plan, max_count=max_count, impl=impl)


def propose(
    params: Params,
    pools: Pools,
    batch: DraftBatch,
    meta: StepMetadata,
    table_buffer: jax.Array,
    *,
    cfg: ModelConfig,
    plan: CachePlan,
    num_draft: int,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
    interpret: object = None,
) -> tuple[DraftOutput, Pools]:
    """:meth:`DeepSeekV4.propose <flatkv_jax.model.DeepSeekV4.propose>` of the model holding
    ``params`` (``num_draft`` required here)."""
    check_model_plan(cfg, plan)
    check_draft_config(cfg, num_draft)
    model = DeepSeekV4.from_params(cfg, params)
    return model.propose(
        pools,
        batch,
        meta,
        table_buffer,
        plan=plan,
        num_draft=num_draft,
        max_count=max_count,
        impl=impl,
        interpret=interpret,
    )


def make_step(
    cfg: ModelConfig,
    plan: CachePlan,
    *,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
    interpret: object = None,
):
    """``jax.jit`` of :func:`step` for one (cfg, plan): ``fn(params, pools, batch, meta,
    table_buffer)``.

    ``pools`` (argument 1) is donated: the step updates the pools in place and the caller must
    use the returned pools. Every batch composition of the plan's fixed shapes reuses one
    compilation (per metadata row count, i.e. per tuple of results given to ``step_metadata``).
    """
    check_model_plan(cfg, plan)
    impl, interpret = resolve_kernels(impl, interpret)
    mc = resolve_max_count(plan, max_count)
    return jax.jit(
        functools.partial(step, cfg=cfg, plan=plan, max_count=mc, impl=impl, interpret=interpret),
        donate_argnums=1,
    )


def make_propose(
    cfg: ModelConfig,
    plan: CachePlan,
    *,
    num_draft: int | None = None,
    max_count: int | None = None,
    impl: Impl | str = Impl.REFERENCE,
    interpret: object = None,
):
    """``jax.jit`` of :func:`propose`: ``fn(params, pools, batch, meta, table_buffer)``, pools
    donated.

    ``num_draft`` defaults to ``plan.limits.verify_width``.
    """
    check_model_plan(cfg, plan)
    k = plan.limits.verify_width if num_draft is None else num_draft
    impl, interpret = resolve_kernels(impl, interpret)
    mc = resolve_max_count(plan, max_count)
    return jax.jit(
        functools.partial(
            propose,
            cfg=cfg,
            plan=plan,
            num_draft=k,
            max_count=mc,
            impl=impl,
            interpret=interpret,
        ),
        donate_argnums=1,
    )
