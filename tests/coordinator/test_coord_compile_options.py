"""The jitted coordinator operations compile with COORDINATOR_COMPILER_OPTIONS: XLA:CPU does
not split their fusions across threads (a thread hand-off for ~1 us of work; decode x0.96 on
the vs_vllm trace, docs/benchmarks.md)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS, DISABLED_PASSES
from flatkv_jax.coordinator import (
    AdmitBatch,
    ExtendBatch,
    HandleBatch,
    ReleaseBatch,
    RetireBatch,
    create_state,
    ops,
)
from flatkv_jax.recipes import deepseek_v4_groups, v4_flash

B = 64
SPLIT = "outer_dimension_partitions"


def _lowered(name: str):
    """``ops.<name>`` lowered for a V4-Flash plan at B = 64 with prefix reuse (the decode
    shapes; admission of 1,024-token prompts)."""
    groups = deepseek_v4_groups(
        v4_flash(c4_rows=32, c128_rows=1, kv_format="bf16", indexer_format="bf16"), verify_width=2
    )
    plan = plan_with_pages(groups, ServingLimits(B, 1024, 32, 2), 4800)
    state = jax.eval_shape(lambda: create_state(plan, seed=0))
    i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
    on = jax.ShapeDtypeStruct((B,), jnp.bool_)
    if name == "admit":
        tokens = jax.ShapeDtypeStruct((B, 1024), jnp.int32)
        return ops.admit.lower(plan, state, AdmitBatch(on, i32, i32, tokens, i32), max_count=32)
    if name == "extend":
        tokens = jax.ShapeDtypeStruct((B, 1), jnp.int32)
        batch = ExtendBatch(on, i32, i32, i32, tokens)
        return ops.extend.lower(plan, state, batch, max_count=1)
    if name == "retire":
        return ops.retire.lower(plan, state, RetireBatch(on, i32, i32, i32), max_count=1)
    if name == "retire_reclaim":
        batch = RetireBatch(on, i32, i32, i32)
        return ops.retire_reclaim.lower(plan, state, batch, max_count=1)
    if name == "reclaim":
        return ops.reclaim.lower(plan, state, HandleBatch(on, i32, i32))
    return ops.release.lower(plan, state, ReleaseBatch(on, i32, i32, i32))


@pytest.mark.parametrize(
    "name", ["admit", "extend", "retire", "retire_reclaim", "reclaim", "release"]
)
def test_jitted_ops_compile_without_cpu_task_splits(name):
    lowered = _lowered(name)
    assert lowered.compile().as_text().count(SPLIT) == 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if jax.default_backend() != "cpu" or (cpus or 1) < 2 or name == "release":
        return  # nothing to split into (release: too small to split on any machine)
    # The same program with XLA's defaults is split (so the check above can fail).
    defaults = lowered.compile({"xla_disable_hlo_passes": ""}).as_text()
    assert defaults.count(SPLIT) > 0, name


def test_options_name_the_pass_and_are_read_only():
    assert dict(COORDINATOR_COMPILER_OPTIONS) == {
        "xla_disable_hlo_passes": ",".join(DISABLED_PASSES)
    }
    with pytest.raises(TypeError):
        COORDINATOR_COMPILER_OPTIONS["xla_disable_hlo_passes"] = ""  # type: ignore[index]
