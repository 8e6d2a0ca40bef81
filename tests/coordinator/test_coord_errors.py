"""Every error message of the coordinator's host-side API (outside jit, bad input raises)."""

from __future__ import annotations

import pytest
from coordinator_cases import PLAN, Driver

from flatkv_jax.coordinator import ReleaseMode, create_state, host, ops
from flatkv_jax.coordinator.metadata import step_metadata_fn


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: host.admit_batch(PLAN, [(1, 1)] * 5), ValueError, r"rows=5 is invalid: a batch of size 4 holds at most 4 rows"),
        (lambda: host.admit_batch(PLAN, [(1, 1)], size=0), ValueError, r"size=0 is invalid: the batch size must be an int >= 1"),
        (lambda: host.admit_batch(PLAN, [(1, 1)], size=2.0), TypeError, r"size=2.0 is invalid"),
        (lambda: host.admit_batch(PLAN, "ab"), TypeError, r"rows='str' is invalid: rows must be a list or tuple"),
        (lambda: host.admit_batch(PLAN, [(1, 1, 1)]), TypeError, r"rows\[0\]=\(1, 1, 1\) is invalid: an admit row is \(prompt_len, first_chunk\)"),
        (lambda: host.admit_batch(PLAN, [(1.5, 1)]), TypeError, r"rows\[0\].prompt_len=1.5 is invalid: it must be an int"),
        (lambda: host.admit_batch(PLAN, [(True, 1)]), TypeError, r"rows\[0\].prompt_len=True is invalid: it must be an int"),
        (lambda: host.admit_batch(PLAN, [(2**31, 1)]), ValueError, r"rows\[0\].prompt_len=2147483648 is invalid: it must fit int32"),
        (lambda: host.extend_batch(PLAN, [(0, 1)]), TypeError, r"rows\[0\].handle=0 is invalid: a handle is a \(slot, generation\) tuple"),
        (lambda: host.extend_batch(PLAN, [((0, 0),)]), TypeError, r"rows\[0\]=\(\(0, 0\),\) is invalid: a row is \(handle, count\)"),
        (lambda: host.extend_batch(PLAN, [((0, 0), 3)], tokens=[[7]]), ValueError, r"tokens\[0\]='1 tokens' is invalid: a row carries its count's tokens \(count 3\)"),
        (lambda: host.retire_batch(PLAN, [((0, "x"), 1)]), TypeError, r"rows\[0\].handle.generation='x' is invalid"),
        (lambda: host.release_batch(PLAN, [((0, 0), 0)]), TypeError, r"rows\[0\].mode=0 is invalid: it must be a ReleaseMode"),
        (lambda: host.handle_batch(PLAN, [(0, 0, 0)]), TypeError, r"handles\[0\]=\(0, 0, 0\) is invalid"),
        (lambda: create_state(PLAN, fifo_depth=0), ValueError, r"fifo_depth=0 is invalid: it must be positive"),
        (lambda: create_state(PLAN, prefix=1), TypeError, r"prefix=1 is invalid: prefix is a bool"),
        (lambda: ops.admit(PLAN, create_state(PLAN, prefix=False), host.admit_batch(PLAN, [(4, 4)], tokens=[[1, 2, 3, 4]])), ValueError, r"AdmitBatch.tokens=.* is invalid: tokens turn prefix reuse on, but this state was created without a prefix index"),
        (lambda: ops.extend(PLAN, create_state(PLAN, prefix=False), host.extend_batch(PLAN, [((0, 0), 1)], tokens=[[7]])), ValueError, r"ExtendBatch.tokens=.* is invalid: tokens turn prefix reuse on"),
        (lambda: ops.resolve_max_count(PLAN, 17), ValueError, r"max_count=17 is invalid: a step writes at most max\(chunk_tokens, 1 \+ verify_width\) = 16"),
        (lambda: ops.resolve_max_count(PLAN, 0), ValueError, r"max_count=0 is invalid: it must be positive"),
        (lambda: step_metadata_fn(PLAN, None, []), TypeError, r"steps='list' is invalid: a non-empty tuple of StepResult"),
    ],
)  # fmt: skip
def test_error_messages(call, exc, match):
    with pytest.raises(exc, match=match) as info:
        call()
    assert "Fix: " in str(info.value)


def test_release_batch_accepts_modes():
    b = host.release_batch(PLAN, [((1, 2), ReleaseMode.RETRACT)])
    assert (
        b.mode.tolist()[:1] == [2]
        and b.slot.tolist()[:1] == [1]
        and b.valid.tolist() == [True, False, False, False]
    )


def test_step_metadata_refuses_a_max_count_below_its_calls():
    """Window reads are sized by the metadata's ``max_count``: one below the bound a call
    ran with would cut a longer row's reads short without a sign, so it is refused at trace
    time; the call's own bound (or more) is accepted."""
    d = Driver()
    res = d.admit((16, 16))  # the plan's default max_count (chunk_tokens = 16)
    assert res.max_count == 16
    dec = PLAN.limits.decode_tokens
    with pytest.raises(ValueError, match=r"max_count=2 is invalid: step_metadata sizes every") as e:
        step_metadata_fn(PLAN, d.state, (res,), max_count=dec)
    assert "steps[0] came from a call made with max_count=16" in str(e.value)
    assert "Fix: pass max_count >= 16" in str(e.value)
    md = step_metadata_fn(PLAN, d.state, (res,), max_count=16)
    assert int(md.row_count[0]) == 16


def test_prefix_reuse_on_a_plan_that_can_never_hit_is_refused():
    """Block spans 7 and 9 hit in granules of 63 tokens: with max_context 60 no prompt could
    ever hit (a hit leaves at least one token to compute), so prefix reuse would hash and
    publish for 0 % hits. create_state says so; without the prefix index the plan serves."""
    from flatkv_jax import ServingLimits, formats, plan_with_pages
    from flatkv_jax.groups import FieldSpec, GroupSpec, Retention

    row = formats.plain(4, "float32")
    a = GroupSpec("a", Retention.HISTORY, 7, 1, (0,), (FieldSpec("kv", row),))
    b = GroupSpec("b", Retention.HISTORY, 9, 1, (1,), (FieldSpec("kv", row),))
    plan = plan_with_pages(
        (a, b), ServingLimits(max_requests=2, max_context=60, chunk_tokens=16), 40
    )
    assert plan.prefix_granularity == 63
    with pytest.raises(
        ValueError,
        match=r"prefix=True is invalid: the plan's prefix hit granularity \(the lcm of its block "
        r"spans\) is 63 tokens, not below max_context=60: no prompt could ever hit\. Fix: pass "
        r"prefix=False",
    ):
        create_state(plan)
    assert not create_state(plan, prefix=False).prefix
