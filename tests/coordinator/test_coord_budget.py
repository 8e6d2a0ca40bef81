"""The step token budget is part of admit/extend's contract (STEP_FULL), step_metadata takes
one step's results only in call order, and every op refuses a state of another plan or a batch
field of the wrong dtype or shape at trace time.

One small plan (one history group, 4 requests, chunk 8, verify 1: step_tokens = 8 + 3 * 2 =
14) keeps the compilations few.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import assert_same, snapshot

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator import (
    AdmitBatch,
    ExtendBatch,
    ReleaseMode,
    audit,
    create_state,
    host,
    ops,
    step_metadata,
)
from flatkv_jax.coordinator.metadata import step_metadata_fn
from flatkv_jax.prefix.index import create_index_set
from flatkv_jax.recipes import full_attention_groups
from flatkv_jax.status import Status

GROUPS = full_attention_groups(1, 1, 4, dtype="float32", rows_per_page=4)
LIMITS = ServingLimits(max_requests=4, max_context=32, chunk_tokens=8, verify_width=1)
PLAN = plan_with_pages(GROUPS, LIMITS, 32)
OTHER = plan_with_pages(GROUPS, LIMITS, 64)  # same groups and limits, twice the pages


def test_default_budget_holds_one_chunk_and_every_other_decode():
    assert PLAN.limits.step_tokens == 8 + 3 * 2


def _admit(state, rows, **kw):
    return ops.admit(PLAN, state, host.admit_batch(PLAN, rows), **kw)


def test_one_call_past_the_budget_fails_with_step_full_and_changes_nothing():
    # Two whole chunks (16 tokens) do not fit a step of 14: before the budget was the ops'
    # contract both were OK and the step silently dropped two tokens that retire committed.
    state, res = _admit(create_state(PLAN, prefix=False), [(8, 8), (8, 8), (3, 3), (2, 0)])
    st = host.statuses(res)
    assert st == [Status.OK, Status.STEP_FULL, Status.STEP_FULL, Status.STEP_FULL]
    assert res.count.tolist() == [8, 0, 0, 0] and res.slot.tolist() == [0, -1, -1, -1]
    # Bit-identical to the same call with the refused rows masked off.
    ref, _ = _admit(create_state(PLAN, prefix=False), [(8, 8)])
    assert_same(snapshot(state), snapshot(ref))
    audit.check_state(PLAN, state)
    md = step_metadata(PLAN, state, (res,))
    assert int(md.num_tokens) == 8 and not bool(md.overflow)


def test_same_step_carries_the_budget_across_calls():
    state, ra = _admit(create_state(PLAN, prefix=False), [(8, 8), (4, 4)])
    h = host.handles(ra, 2)
    state, _ = ops.retire(PLAN, state, host.retire_batch(PLAN, [(h[0], 8), (h[1], 4)]))
    # A new step: one chunk (8) plus decodes of 2: 8 + 2 + 2 = 12 fit, the next 2 does not.
    state, ra2 = _admit(state, [(20, 8)])
    eb = host.extend_batch(PLAN, [(h[0], 2), (h[1], 2)])
    state, re = ops.extend(PLAN, state, eb, same_step=(ra2,))
    assert host.statuses(re, 2) == [Status.OK, Status.OK]
    md = step_metadata(PLAN, state, (ra2, re))
    assert int(md.num_tokens) == 12 and not bool(md.overflow)
    # A third call of the same step: 12 + 3 > 14 -> STEP_FULL, and the 1 after it too (FIFO,
    # although 12 + 1 would fit). h2 has a step in flight; FIFO depth 2 allows a second.
    h2 = host.handles(ra2, 1)[0]
    before = snapshot(state)
    state, re2 = ops.extend(
        PLAN, state, host.extend_batch(PLAN, [(h2, 3), (h[0], 1)]), same_step=(ra2, re)
    )
    assert host.statuses(re2, 2) == [Status.STEP_FULL, Status.STEP_FULL]
    assert_same(snapshot(state), before)
    # Without same_step the same rows open a step of their own and fit.
    state, re3 = ops.extend(PLAN, state, host.extend_batch(PLAN, [(h2, 3), (h[0], 1)]))
    assert host.statuses(re3, 2) == [Status.OK, Status.OK]
    audit.check_state(PLAN, state)


def test_step_metadata_refuses_a_step_not_scheduled_as_one():
    state, ra = _admit(create_state(PLAN, prefix=False), [(8, 8)])
    h = host.handles(ra, 1)[0]
    state, _ = ops.retire(PLAN, state, host.retire_batch(PLAN, [(h, 8)]))
    state, ra2 = _admit(state, [(8, 8)])
    state, re = ops.extend(PLAN, state, host.extend_batch(PLAN, [(h, 2)]))  # no same_step
    with pytest.raises(
        ValueError,
        match=r"steps\[1\]='a result with step_index=0' is invalid: step_metadata takes the results of one step in call order.*step_tokens=14.*Fix: pass the step's earlier results",
    ):
        step_metadata(PLAN, state, (ra2, re))
    state, re2 = ops.extend(PLAN, state, host.extend_batch(PLAN, [(h, 1)]), same_step=(ra2,))
    with pytest.raises(ValueError, match=r"steps\[0\]='a result with step_index=1' is invalid"):
        step_metadata(PLAN, state, (re2,))  # the admit's tokens would be missing
    with pytest.raises(ValueError, match=r"same_step\[0\]='a result with step_index=1' is invalid"):
        ops.extend_fn(PLAN, state, host.extend_batch(PLAN, [(h, 1)]), same_step=(re2,))
    with pytest.raises(TypeError, match=r"same_step='list' is invalid: a tuple of StepResult"):
        ops.extend_fn(PLAN, state, host.extend_batch(PLAN, [(h, 1)]), same_step=[ra2])


# --- a state of another plan --------------------------------------------------------------
_BATCHES = {
    "admit": lambda p: host.admit_batch(p, [(4, 4)]),
    "extend": lambda p: host.extend_batch(p, [((0, 0), 1)]),
    "retire": lambda p: host.retire_batch(p, [((0, 0), 1)]),
    "rewind": lambda p: host.rewind_batch(p, [((0, 0), 1)]),
    "reclaim": lambda p: host.handle_batch(p, [(0, 0)]),
    "release": lambda p: host.release_batch(p, [((0, 0), ReleaseMode.FINISH)]),
}


@pytest.mark.parametrize("op", list(_BATCHES))
def test_every_op_refuses_a_state_of_another_plan(op):
    # A state built for 32 pages used with a 64-page plan would hand out pages 34..63 of a
    # pool of 34 pages. Caught while tracing: nothing runs.
    state = create_state(PLAN, prefix=False)
    fn = getattr(ops, op)
    with pytest.raises(
        ValueError,
        match=r"state='a state built for a plan with max_requests=4, num_pages=\(34,\), table widths=\(9,\)' is invalid: "
        + op
        + r" was given a plan with max_requests=4, num_pages=\(66,\), table widths=\(9,\); a state only works with the plan it was created for. Fix: pass the plan the state was created with, or create a state for this plan with create_state\(plan\)",
    ):
        fn(OTHER, state, _BATCHES[op](OTHER))


def test_step_metadata_refuses_a_state_of_another_plan():
    state, ra = _admit(create_state(PLAN, prefix=False), [(4, 4)])
    with pytest.raises(
        ValueError,
        match=r"state='a state built for a plan with .*num_pages=\(34,\).*step_metadata was given a plan with .*num_pages=\(66,\)",
    ):
        step_metadata_fn(OTHER, state, (ra,))
    other = plan_with_pages(
        full_attention_groups(1, 2, 4, dtype="float32", rows_per_page=4), LIMITS, 32
    )
    with pytest.raises(ValueError, match=r"\(other groups or limits\)"):
        step_metadata_fn(other, state, (ra,))
    with pytest.raises(TypeError, match=r"state='NoneType' is invalid: admit takes a CacheState"):
        ops.admit_fn(PLAN, None, host.admit_batch(PLAN, [(4, 4)]))


def test_a_reshaped_state_array_is_refused():
    state = dataclasses.replace(create_state(PLAN, prefix=False), extent=jnp.zeros((3,), jnp.int32))
    with pytest.raises(
        ValueError,
        match=r"state.extent='int32\[3\]' is invalid: extend was given a plan whose state has int32\[4\] there. Fix: pass the state create_state\(plan\) built",
    ):
        ops.extend_fn(PLAN, state, host.extend_batch(PLAN, [((0, 0), 1)]))


def test_a_prefix_index_or_pin_mask_of_other_pools_is_refused():
    """The prefix state is flat across groups (one index set, one pin mask): one sized for
    other pools would address the wrong pages; caught while tracing."""
    state = dataclasses.replace(create_state(PLAN), index=create_index_set(OTHER))
    with pytest.raises(
        ValueError,
        match=r"state='a state whose prefix index has pools of \(66,\) pages' is invalid: the plan has 1 groups of \(34,\) pages \(an index and an LRU per group\). Fix: create the state with create_state\(plan\)",
    ):
        ops.extend_fn(PLAN, state, host.extend_batch(PLAN, [((0, 0), 1)]))
    state = dataclasses.replace(create_state(PLAN), pinned=jnp.zeros((3,), bool))
    with pytest.raises(
        ValueError,
        match=r"state.pinned='bool\[3\]' is invalid: extend was given a plan whose state has bool\[34\] there",
    ):
        ops.extend_fn(PLAN, state, host.extend_batch(PLAN, [((0, 0), 1)]))


# --- batch fields ---------------------------------------------------------------------------
def _admit_fields(**kw):
    b = host.admit_batch(PLAN, [(4, 4)])
    return dataclasses.replace(b, **kw)


_I = jnp.ones((4,), jnp.int32)


@pytest.mark.parametrize(
    ("batch", "exc", "match"),
    [
        # An int mask was read as a mask of other rows: admitted, reported IDLE, leaked.
        (_admit_fields(valid=jnp.asarray([1, 0, 0, 0], jnp.int32)), TypeError, r"AdmitBatch.valid='an array of dtype int32' is invalid: it must be bool\[B\]. Fix: pass valid as a bool array \(e.g. jnp.asarray\(mask, jnp.bool_\)\); an int array is not a mask"),
        (_admit_fields(prompt_len=jnp.ones((4,), jnp.float32)), TypeError, r"AdmitBatch.prompt_len='an array of dtype float32' is invalid: it must be int32\[B\]. Fix: cast it with jnp.asarray\(prompt_len, jnp.int32\)"),
        (_admit_fields(first_chunk=jnp.ones((4, 1), jnp.int32)), ValueError, r"AdmitBatch.first_chunk='an array of shape \(4, 1\)' is invalid: it must be int32\[B\] \(rank 1\)"),
        (_admit_fields(first_chunk=jnp.ones((3,), jnp.int32)), ValueError, r"AdmitBatch.first_chunk='an array of shape \(3,\)' is invalid: every field of one batch has the same batch size B = 4"),
        (_admit_fields(tokens=jnp.ones((4,), jnp.int32)), ValueError, r"AdmitBatch.tokens='an array of shape \(4,\)' is invalid: it must be int32\[B, L\] \(rank 2\)"),
        (_admit_fields(namespace=[0, 0, 0, 0], tokens=jnp.ones((4, 4), jnp.int32)), TypeError, r"AdmitBatch.namespace='list' is invalid: it must be an array of int32\[B\]"),
        (_admit_fields(valid=jnp.zeros((0,), jnp.bool_), prompt_len=jnp.zeros((0,), jnp.int32), first_chunk=jnp.zeros((0,), jnp.int32)), ValueError, r"AdmitBatch.valid='an array of shape \(0,\)' is invalid: a batch needs at least one row"),
        (ExtendBatch(jnp.ones((4,), bool), _I, _I, _I), TypeError, r"batch='ExtendBatch' is invalid: admit takes an AdmitBatch. Fix: build it with host.admit_batch"),
    ],
)  # fmt: skip
def test_admit_checks_every_batch_field(batch, exc, match):
    state = create_state(PLAN, prefix=False)
    with pytest.raises(exc, match=match) as info:
        ops.admit(PLAN, state, batch)
    assert "Fix: " in str(info.value)


@pytest.mark.parametrize(
    ("op", "field", "value", "exc", "match"),
    [
        ("extend", "count", jnp.ones((4,), jnp.float32), TypeError, r"ExtendBatch.count='an array of dtype float32' is invalid: it must be int32\[B\]"),
        ("extend", "tokens", jnp.ones((4, 2), jnp.uint32), TypeError, r"ExtendBatch.tokens='an array of dtype uint32' is invalid: it must be int32\[B, L\]"),
        ("retire", "accepted", jnp.ones((4,), jnp.int16), TypeError, r"RetireBatch.accepted='an array of dtype int16' is invalid"),
        ("rewind", "extent", jnp.ones((2, 2), jnp.int32), ValueError, r"RewindBatch.extent='an array of shape \(2, 2\)' is invalid: it must be int32\[B\] \(rank 1\)"),
        ("reclaim", "valid", jnp.ones((4,), jnp.int32), TypeError, r"HandleBatch.valid='an array of dtype int32' is invalid: it must be bool\[B\]"),
        ("release", "mode", jnp.ones((4,), jnp.float32), TypeError, r"ReleaseBatch.mode='an array of dtype float32' is invalid"),
        ("release", "slot", jnp.ones((5,), jnp.int32), ValueError, r"ReleaseBatch.slot='an array of shape \(5,\)' is invalid: every field of one batch has the same batch size B = 4"),
    ],
)  # fmt: skip
def test_every_op_checks_its_batch_fields(op, field, value, exc, match):
    batch = dataclasses.replace(_BATCHES[op](PLAN), **{field: value})
    with pytest.raises(exc, match=match):
        getattr(ops, f"{op}_fn")(PLAN, create_state(PLAN, prefix=False), batch)


def test_numpy_batches_of_the_right_dtypes_are_accepted():
    # The checks accept any array with the right dtype and shape (NumPy included).
    b = AdmitBatch(
        np.array([True, False, False, False]),
        np.array([4, 0, 0, 0], np.int64),  # int32 once jit has it (64-bit types off)
        np.array([4, 0, 0, 0], np.int32),
    )
    _, res = ops.admit(PLAN, create_state(PLAN, prefix=False), b)
    assert host.statuses(res, 1) == [Status.OK]
    assert jax.tree.structure(res).num_leaves == 9
