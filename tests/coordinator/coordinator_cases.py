"""Shared plans and a small test driver for the coordinator tests.

Every test uses plans built here with the same limits and batch size, so the jitted operations
compile once per plan for the whole test session.
"""

from __future__ import annotations

import jax
import numpy as np

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator import ReleaseMode, audit, create_state, host, ops
from flatkv_jax.coordinator.metadata import step_metadata
from flatkv_jax.recipes import deepseek_v4_groups, tiny_v4
from flatkv_jax.status import Status

#: tiny V4 with MTP: swa_kv, mtp_swa_kv (draft), c4_kv, c4_state, c4_index_state, c16_kv,
#: c16_state. Blocks: 4 tokens (window/state groups), 16 tokens (c4_kv, c16_kv).
GROUPS = deepseek_v4_groups(tiny_v4(), verify_width=1)
#: step_tokens = max_requests * chunk_tokens: any one call of the driver fits a step (the
#: step budget itself is tested with its own plans in test_coord_budget.py).
LIMITS = ServingLimits(
    max_requests=4, max_context=64, chunk_tokens=16, verify_width=1, step_tokens=64
)


def make_plan(pages: int = 40, **per_group: int):
    """A tiny-V4 plan with ``pages`` usable pages per group, overridden per group name."""
    return plan_with_pages(GROUPS, LIMITS, {g.name: per_group.get(g.name, pages) for g in GROUPS})


PLAN = make_plan()


def snapshot(state):
    """A host copy of a state (the jitted ops donate their input)."""
    return jax.tree.map(np.array, state)


def assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class Driver:
    """Holds a plan and a state, runs one op per call and audits the state after each."""

    def __init__(self, plan=PLAN, fifo_depth: int = 2, prefix: bool = True):
        self.plan = plan
        self.state = create_state(plan, fifo_depth=fifo_depth, prefix=prefix)

    def _run(self, op, batch, **kw):
        self.state, res = op(self.plan, self.state, batch, **kw)
        audit.check_state(self.plan, self.state)
        return res

    def admit(self, *rows, same_step=()):
        return self._run(ops.admit, host.admit_batch(self.plan, list(rows)), same_step=same_step)

    def extend(self, *rows, same_step=()):
        return self._run(ops.extend, host.extend_batch(self.plan, list(rows)), same_step=same_step)

    def retire(self, *rows):
        return self._run(ops.retire, host.retire_batch(self.plan, list(rows)))

    def retire_reclaim(self, *rows):
        return self._run(ops.retire_reclaim, host.retire_batch(self.plan, list(rows)))

    def rewind(self, *rows):
        return self._run(ops.rewind, host.rewind_batch(self.plan, list(rows)))

    def reclaim(self, *handles):
        return self._run(ops.reclaim, host.handle_batch(self.plan, list(handles)))

    def release(self, *rows):
        return self._run(ops.release, host.release_batch(self.plan, list(rows)))

    def metadata(self, *results):
        return step_metadata(self.plan, self.state, tuple(results))

    # --- conveniences ---
    def new(self, prompt_len: int, first_chunk: int | None = None):
        res = self.admit((prompt_len, prompt_len if first_chunk is None else first_chunk))
        assert host.statuses(res, 1) == [Status.OK], host.statuses(res, 1)
        return host.handles(res, 1)[0]

    def counts(self):
        return audit.page_counts(self.plan, self.state)

    def held(self, group: str) -> int:
        return self.counts()[group].in_use

    def pages_of(self, handle) -> dict[str, list[int]]:
        return audit.request_pages(self.plan, self.state, handle[0])

    def n_c(self, handle) -> tuple[int, int]:
        s = handle[0]
        return int(self.state.extent[s]), int(self.state.committed[s])

    def all_free(self) -> bool:
        return all(c.free == c.total for c in self.counts().values())


FINISH, ABORT, RETRACT = ReleaseMode.FINISH, ReleaseMode.ABORT, ReleaseMode.RETRACT
