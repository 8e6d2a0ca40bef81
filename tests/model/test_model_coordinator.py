"""Parity with the real coordinator producing the tables, write layout and zero lists.

The coordinator (flatkv_jax.coordinator) was still being written when this test was added; it
drives prefill chunks (boundaries inside compression windows), decode past several windows
(reclaim) and a mixed prefill/decode batch through admit / extend / step_metadata / retire /
reclaim / release, and compares the logits with ``dense_forward``. MTP rounds and prefix hits
through the coordinator are not covered here yet (see docs/model.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from model_harness import TOL, dense, jitted

coordinator = pytest.importorskip("flatkv_jax.coordinator")
host = pytest.importorskip("flatkv_jax.coordinator.host")

from flatkv_jax.model import StepBatch, StepMeta  # noqa: E402
from flatkv_jax.pools import create_pools  # noqa: E402
from flatkv_jax.status import Status  # noqa: E402


def _meta(md, state) -> StepMeta:
    """The model's step inputs from the coordinator's metadata and state (tables by reference)."""
    return StepMeta(
        token_slot=md.token_slot,
        token_pos=md.token_pos,
        tables=tuple(state.tables),
        zero_pages=tuple(md.zero),
    )


def test_parity_through_the_coordinator(fp32_setup, rng):
    s = fp32_setup
    plan, cfg = s.plan, s.cfg
    step_fn, _ = jitted(cfg, plan)
    state = coordinator.create_state(plan)
    pools = create_pools(plan)
    seqs = {0: rng.integers(0, 64, 27).tolist(), 1: rng.integers(0, 64, 6).tolist()}
    got = {0: {}, 1: {}}
    hidden = {0: {}, 1: {}}

    def run(state, pools, results, rows):
        """rows: [(slot, start, count)] in the order of the results' rows."""
        md = coordinator.step_metadata(plan, state, tuple(results))
        tok = np.zeros(plan.limits.step_tokens, np.int32)
        tslot, tpos = np.asarray(md.token_slot), np.asarray(md.token_pos)
        for i in np.flatnonzero(tpos >= 0):
            tok[i] = seqs[int(tslot[i])][int(tpos[i])]
        prev = np.zeros((plan.limits.max_requests, cfg.hidden), np.float32)
        for slot, start, _ in rows:
            if start > 0:
                prev[slot] = hidden[slot][start - 1]
        out, pools = step_fn(
            s.params, pools, StepBatch(jnp.asarray(tok), jnp.asarray(prev)), _meta(md, state)
        )
        logits, hid = np.asarray(out.logits), np.asarray(out.hidden)
        for i in np.flatnonzero(tpos >= 0):
            got[int(tslot[i])][int(tpos[i])] = logits[i]
            hidden[int(tslot[i])][int(tpos[i])] = hid[i]
        return pools

    def finish(state, handles_counts):
        state, res = coordinator.retire(plan, state, host.retire_batch(plan, handles_counts))
        assert host.statuses(res, len(handles_counts)) == [Status.OK] * len(handles_counts)
        state, _ = coordinator.reclaim(
            plan, state, host.handle_batch(plan, [h for h, _ in handles_counts])
        )
        return state

    # Admit request 0 with a first chunk of 5 (ends inside a ratio-4 window).
    state, res = coordinator.admit(plan, state, host.admit_batch(plan, [(27, 5)]))
    (h0,) = host.handles(res, 1)
    assert h0[0] == 0
    pools = run(state, pools, [res], [(0, 0, 5)])
    state = finish(state, [(h0, 5)])
    pos = {0: 5}
    for count in (11, 11):  # ends at 16, 27
        state, res = coordinator.extend(plan, state, host.extend_batch(plan, [(h0, count)]))
        pools = run(state, pools, [res], [(0, pos[0], count)])
        state = finish(state, [(h0, count)])
        pos[0] += count
    seqs[0].append(int(np.argmax(got[0][26])))
    # Admit request 1 (prefill 6) while request 0 decodes: one mixed step.
    state, r_ext = coordinator.extend(plan, state, host.extend_batch(plan, [(h0, 1)]))
    state, r_adm = coordinator.admit(plan, state, host.admit_batch(plan, [(6, 6)]))
    (h1,) = host.handles(r_adm, 1)
    pools = run(state, pools, [r_ext, r_adm], [(0, 27, 1), (h1[0], 0, 6)])
    state = finish(state, [(h0, 1), (h1, 6)])
    pos = {0: 28, 1: 6}
    seqs[0].append(int(np.argmax(got[0][27])))
    seqs[1].append(int(np.argmax(got[1][5])))
    # Decode both past several windows.
    for _ in range(24):
        state, res = coordinator.extend(plan, state, host.extend_batch(plan, [(h0, 1), (h1, 1)]))
        pools = run(state, pools, [res], [(0, pos[0], 1), (1, pos[1], 1)])
        state = finish(state, [(h0, 1), (h1, 1)])
        for x in (0, 1):
            seqs[x].append(int(np.argmax(got[x][pos[x]])))
            pos[x] += 1
    for x in (0, 1):
        ref, _, _ = dense(s.params, cfg, plan, seqs[x][: pos[x]])
        err = float(np.abs(np.stack([got[x][p] for p in range(pos[x])]) - ref).max())
        assert err <= TOL, (x, err)
