"""Hypothesis state machine: random operation sequences against a small Python model.

After every operation: the full invariant audit (per pool free + held == total, refcount ==
references, no live table entry at a free page, no sharing, row shapes), and the model's
statuses, extents, committed lengths, FIFO depths, lo/hi and free-page counts must match.

CI runs a bounded number of examples. Long local run::

    FLATKV_COORD_EXAMPLES=2000 FLATKV_COORD_STEPS=80 pytest tests/coordinator/test_coord_state_machine.py
"""

from __future__ import annotations

import os

import numpy as np
from coordinator_cases import LIMITS, make_plan
from hypothesis import HealthCheck, settings
from hypothesis import strategies as stg
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flatkv_jax.coordinator import ReleaseMode, audit, create_state, host, ops
from flatkv_jax.status import Status

PLAN = make_plan(14, c16_state=12)  # tight pools: OUT_OF_PAGES happens often
R, D = LIMITS.max_requests, 2
MAX_COUNT = max(LIMITS.chunk_tokens, LIMITS.decode_tokens)
MAX_EXTENT = LIMITS.max_context + LIMITS.verify_width


def cdiv(a, b):
    return -(-a // b)


class Req:
    def __init__(self, count):
        self.n, self.c = count, 0
        self.fifo = [[0, count, count]] if count else []
        self.pending = None
        self.lo = [0] * len(PLAN.groups)
        self.hi = [cdiv(count, g.block_tokens) for g in PLAN.groups]


class Model:
    """The contract of docs/semantics.md plus docs/coordinator.md's decisions, row by row."""

    def __init__(self):
        self.free = [PLAN.usable_pages(g) for g in PLAN.groups]
        self.req: list[Req | None] = [None] * R
        self.gen = [0] * R

    def lookup(self, h, pending_ok):
        s, gen = h
        if not 0 <= s < R or self.req[s] is None or self.gen[s] != gen:
            return None
        if self.req[s].pending is not None and not pending_ok:
            return None
        return s

    def _allocate(self, needs, blocked):
        if blocked or any(k > f for k, f in zip(needs, self.free, strict=True)):
            return False
        self.free = [f - k for f, k in zip(self.free, needs, strict=True)]
        return True

    def admit(self, rows):
        out, blocked, rank = [], False, 0
        free_slots = [s for s in range(R) if self.req[s] is None]
        for pl, fc in rows:
            if pl < 1 or fc < 0 or fc > pl or fc > MAX_COUNT:
                out.append(Status.BAD_ARG)
            elif pl > LIMITS.max_context:
                out.append(Status.TOO_LONG)
            else:
                rank += 1
                if rank > len(free_slots):
                    out.append(Status.NO_SLOT)
                    continue
                needs = [cdiv(fc, g.block_tokens) for g in PLAN.groups]
                if self._allocate(needs, blocked):
                    self.req[free_slots[rank - 1]] = Req(fc)
                    out.append(Status.OK)
                else:
                    blocked = True
                    out.append(Status.OUT_OF_PAGES)
        return out

    def _rows(self, rows, pending_ok):
        """Every row's handle is checked against the state before the call."""
        seen, out = set(), []
        for h, v in rows:
            s = self.lookup(h, pending_ok)
            out.append((s, s is not None and s in seen, v))
            if s is not None:
                seen.add(s)
        return out

    def extend(self, rows):
        out, blocked = [], False
        for s, dup, cnt in self._rows(rows, False):
            if s is None:
                out.append(Status.STALE)
                continue
            r = self.req[s]
            if dup or cnt < 1 or cnt > MAX_COUNT:
                out.append(Status.BAD_ARG)
            elif len(r.fifo) >= D:
                out.append(Status.FIFO_FULL)
            elif r.n + cnt > MAX_EXTENT:
                out.append(Status.TOO_LONG)
            else:
                needs = [
                    max(0, cdiv(r.n + cnt, g.block_tokens) - hi)
                    for g, hi in zip(PLAN.groups, r.hi, strict=True)
                ]
                if self._allocate(needs, blocked):
                    r.hi = [h + k for h, k in zip(r.hi, needs, strict=True)]
                    r.fifo.append([r.n, cnt, cnt])
                    r.n += cnt
                    out.append(Status.OK)
                else:
                    blocked = True
                    out.append(Status.OUT_OF_PAGES)
        return out

    def _free_req(self, s):
        r = self.req[s]
        self.free = [f + h - lo for f, h, lo in zip(self.free, r.hi, r.lo, strict=True)]
        self.req[s] = None
        self.gen[s] += 1

    def retire(self, rows):
        out = []
        for s, dup, acc in self._rows(rows, True):
            if s is None:
                out.append(Status.STALE)
                continue
            r = self.req[s]
            if dup:
                out.append(Status.BAD_ARG)
                continue
            if not r.fifo:
                out.append(Status.NO_STEP)
                continue
            start, cnt, cap = r.fifo[0]
            if acc < 0 or acc > cnt:
                out.append(Status.BAD_ARG)
                continue
            r.fifo.pop(0)
            if start != r.c or cap == 0:
                out.append(Status.DISCARDED)
            else:
                a = min(acc, cap)
                r.c = start + a
                if a < cap:
                    r.n = r.c
                out.append(Status.OK)
            if r.pending is not None and not r.fifo:
                self._free_req(s)
        return out

    def rewind(self, rows):
        out = []
        for s, dup, e in self._rows(rows, False):
            if s is None:
                out.append(Status.STALE)
                continue
            r = self.req[s]
            if dup or e < r.c or e > r.n:
                out.append(Status.BAD_ARG)
                continue
            r.n = e
            for rec in r.fifo:
                rec[2] = min(max(e - rec[0], 0), rec[2])
            out.append(Status.OK)
        return out

    def reclaim(self, handles):
        out = []
        for s, dup, _ in self._rows([(h, 0) for h in handles], True):
            if s is None or dup:
                out.append(Status.STALE if s is None else Status.BAD_ARG)
                continue
            r = self.req[s]
            for gi, g in enumerate(PLAN.groups):
                if g.is_window:
                    new_lo = min(
                        max(max(0, (r.c - g.window + 1) // g.block_tokens), r.lo[gi]), r.hi[gi]
                    )
                    self.free[gi] += new_lo - r.lo[gi]
                    r.lo[gi] = new_lo
            out.append(Status.OK)
        return out

    def release(self, rows):
        out = []
        for s, dup, mode in self._rows(rows, False):
            if s is None:
                out.append(Status.STALE)
            elif dup:
                out.append(Status.BAD_ARG)
            elif self.req[s].fifo:
                self.req[s].pending = mode
                out.append(Status.DEFERRED)
            else:
                self._free_req(s)
                out.append(Status.OK)
        return out


handle_idx = stg.integers(0, 10_000)


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = create_state(PLAN, fifo_depth=D)
        self.model = Model()
        self.handles = [(0, 0), (R, 0), (1, 3)]  # plus garbage handles

    def pick(self, i):
        """Mostly a live handle; one pick in five from every handle ever seen (mostly stale)."""
        live = [h for h in self.handles[3:] if self.model.lookup(h, True) is not None]
        if live and i % 5:
            return live[(i // 5) % len(live)]
        return self.handles[i % len(self.handles)]

    def head_count(self, h):
        s = self.model.lookup(h, True)
        return self.model.req[s].fifo[0][1] if s is not None and self.model.req[s].fifo else 2

    def run(self, op, batch, expect):
        self.state, res = op(PLAN, self.state, batch)
        got = host.statuses(res, len(expect))
        assert got == expect, (op.__name__, got, expect)
        assert host.statuses(res)[len(expect) :] == [Status.IDLE] * (R - len(expect))
        return res

    @rule(
        rows=stg.lists(
            stg.tuples(stg.sampled_from([0, 1, 3, 5, 8, 16, 17, 30, 64, 65]), stg.integers(0, 17)),
            min_size=1,
            max_size=2,
        )
    )
    def admit(self, rows):
        rows = [(pl, min(fc, pl) if fc < 17 else fc) for pl, fc in rows]
        expect = self.model.admit(rows)
        res = self.run(ops.admit, host.admit_batch(PLAN, rows), expect)
        self.handles += [h for h in host.handles(res) if h is not None]

    @rule(
        rows=stg.lists(
            stg.tuples(handle_idx, stg.sampled_from([0, 1, 2, 2, 3, 5, 16, 17])),
            min_size=1,
            max_size=3,
        )
    )
    def extend(self, rows):
        rows = [(self.pick(i), cnt) for i, cnt in rows]
        self.run(ops.extend, host.extend_batch(PLAN, rows), self.model.extend(rows))

    @rule(rows=stg.lists(stg.tuples(handle_idx, stg.integers(0, 99)), min_size=1, max_size=3))
    def retire(self, rows):
        out = []
        for i, x in rows:
            h = self.pick(i)
            cnt = self.head_count(h)
            # Mostly all accepted, often some rejected, rarely out of range.
            acc = cnt if x < 55 else x % (cnt + 1) if x < 92 else (-1 if x % 2 else cnt + 1)
            out.append((h, acc))
        rows = out
        self.run(ops.retire, host.retire_batch(PLAN, rows), self.model.retire(rows))

    @rule(rows=stg.lists(stg.tuples(handle_idx, stg.integers(-2, 2)), min_size=1, max_size=2))
    def rewind(self, rows):
        out = []
        for i, delta in rows:
            h = self.pick(i)
            s = self.model.lookup(h, True)
            # Around the committed length: below it (BAD_ARG), at it, or one past it if possible.
            c, n = (self.model.req[s].c, self.model.req[s].n) if s is not None else (0, 0)
            bump = 1 if delta >= 0 and n > c else 0
            out.append((h, c + delta + bump))
        self.run(ops.rewind, host.rewind_batch(PLAN, out), self.model.rewind(out))

    @rule(idx=stg.lists(handle_idx, min_size=1, max_size=4))
    def reclaim(self, idx):
        hs = [self.pick(i) for i in idx]
        self.run(ops.reclaim, host.handle_batch(PLAN, hs), self.model.reclaim(hs))

    @rule(
        rows=stg.lists(
            stg.tuples(handle_idx, stg.sampled_from(list(ReleaseMode))), min_size=1, max_size=2
        )
    )
    def release(self, rows):
        rows = [(self.pick(i), m) for i, m in rows]
        self.run(ops.release, host.release_batch(PLAN, rows), self.model.release(rows))

    @invariant()
    def matches_model(self):
        audit.check_state(PLAN, self.state)
        counts = audit.page_counts(PLAN, self.state)
        assert [counts[g.name].free for g in PLAN.groups] == self.model.free
        live = np.asarray(self.state.live)
        assert np.asarray(self.state.generation).tolist() == self.model.gen
        n, c = np.asarray(self.state.extent), np.asarray(self.state.committed)
        flen, pend = np.asarray(self.state.fifo_len), np.asarray(self.state.pending)
        for s, r in enumerate(self.model.req):
            assert bool(live[s]) == (r is not None)
            if r is None:
                continue
            assert (n[s], c[s], flen[s]) == (r.n, r.c, len(r.fifo)), s
            assert pend[s] == (0 if r.pending is None else 1 + int(r.pending))
            assert [int(h[s]) for h in self.state.hi] == r.hi
            assert [int(lo[s]) for lo in self.state.lo] == r.lo


CoordinatorMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("FLATKV_COORD_EXAMPLES", "25")),
    stateful_step_count=int(os.environ.get("FLATKV_COORD_STEPS", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoordinatorMachine = CoordinatorMachine.TestCase
