"""One compilation per operation for a given plan, batch size and max_count."""

from __future__ import annotations

from coordinator_cases import ABORT, FINISH, RETRACT, Driver, make_plan

from flatkv_jax.coordinator import ops
from flatkv_jax.coordinator.metadata import step_metadata

JITTED = (
    *(ops.admit, ops.extend, ops.retire, ops.rewind, ops.reclaim, ops.release),
    *(ops.retire_reclaim, step_metadata),
)


def test_a_varied_trace_compiles_each_operation_once():
    plan = make_plan(33)  # used by no other test, so every compilation below is ours
    before = [f._cache_size() for f in JITTED]
    d = Driver(plan)
    a, b = d.new(16, 16), d.new(5, 3)
    d.metadata(d.admit((9, 9)))
    d.retire((a, 16), (b, 3))
    for step in range(6):
        res = d.extend((a, 2), (b, 1 + step % 2))
        d.metadata(res)
        if step % 3:
            d.retire((a, 1 + step % 2), (b, 1))
            d.reclaim(a, b)
        else:  # the decode step's form: one call
            d.retire_reclaim((a, 1 + step % 2), (b, 1))
    d.extend((a, 2))
    d.rewind((a, d.n_c(a)[1] + 1))
    d.retire((a, 2))
    d.release((a, RETRACT), (b, ABORT), ((2, 0), FINISH))
    d.new(40, 16)
    d.release(((0, 1), ABORT))
    after = [f._cache_size() for f in JITTED]
    assert [x - y for x, y in zip(after, before, strict=True)] == [1] * len(JITTED)
