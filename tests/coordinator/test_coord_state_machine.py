"""Hypothesis state machines: random operation sequences against a model.

``CoordinatorMachine`` (no prompts, so no prefix reuse) checks the coordinator against a small
Python model of docs/semantics.md. After every operation: the full invariant audit (per pool
free + held == total, refcount == references, no live table entry at a free page, no sharing,
row shapes), and the model's statuses, extents, committed lengths, FIFO depths, lo/hi and
free-page counts must match.

``PrefixMachine`` draws prompts from a few shared prefixes and passes every token id to admit
and extend, so the coordinator matches, pins, evicts and publishes. Its model is the radix
oracle, compared by the differential harness after every operation (results, hits, page
counts, tables up to relabelling, every row's content, fresh pages reading zeros, the oracle's
invariants), plus the coordinator's audit with shared pages allowed. The run counts hits,
publishes, evictions and evictions under pins, and fails if any never happened.

CI runs a bounded number of examples (derandomized, so the counts are reproducible). Long
local run::

    FLATKV_COORD_EXAMPLES=2000 FLATKV_COORD_STEPS=80 pytest tests/coordinator/test_coord_state_machine.py
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
from collections import Counter
from typing import ClassVar

import numpy as np
from coordinator_cases import LIMITS, make_plan
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as stg
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from flatkv_jax.coordinator import ReleaseMode, audit, create_state, host, ops
from flatkv_jax.oracle import Op, OpKind, RadixOracle, Trace
from flatkv_jax.oracle.device_adapter import DeviceBackend
from flatkv_jax.oracle.differential import _Found, _Harness
from flatkv_jax.status import Status

PLAN = make_plan(14, c16_state=12)  # tight pools: OUT_OF_PAGES happens often
R, D = LIMITS.max_requests, 2
MAX_COUNT = LIMITS.max_count
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

    def retire_reclaim(self, rows):
        """retire, then reclaim of the rows it committed and did not free."""
        out = self.retire(rows)
        keep = [
            h
            for (h, _), st in zip(rows, out, strict=True)
            if st == Status.OK and self.lookup(h, True) is not None
        ]
        assert self.reclaim(keep) == [Status.OK] * len(keep)
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
                        max(max(0, g.first_read(r.c)) // g.block_tokens, r.lo[gi]), r.hi[gi]
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

    def retire_rows(self, rows):
        """(handle, accepted) rows: mostly all accepted, often some rejected, rarely out of
        range."""
        out = []
        for i, x in rows:
            h = self.pick(i)
            cnt = self.head_count(h)
            acc = cnt if x < 55 else x % (cnt + 1) if x < 92 else (-1 if x % 2 else cnt + 1)
            out.append((h, acc))
        return out

    @rule(rows=stg.lists(stg.tuples(handle_idx, stg.integers(0, 99)), min_size=1, max_size=3))
    def retire(self, rows):
        rows = self.retire_rows(rows)
        self.run(ops.retire, host.retire_batch(PLAN, rows), self.model.retire(rows))

    @rule(rows=stg.lists(stg.tuples(handle_idx, stg.integers(0, 99)), min_size=1, max_size=3))
    def retire_reclaim(self, rows):
        """The decode step's form: retire, then reclaim of what it committed, one sweep."""
        rows = self.retire_rows(rows)
        batch = host.retire_batch(PLAN, rows)
        self.run(ops.retire_reclaim, batch, self.model.retire_reclaim(rows))

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


# --- shared prompts: prefix hits, pinning, eviction and publishing ------------------------------
#: Shared prefixes (granularity 16 on this plan): the second shares one block with the first.
PREFIXES = (
    tuple(range(100, 148)),
    tuple(range(100, 116)) + tuple(range(200, 232)),
    tuple(range(300, 340)),
)


#: History and SWA pools at their minimum: cached blocks are evicted while others are pinned
#: by hits (the compressor states cache little: a hit needs only their carry).
PPLAN = make_plan(10, c4_kv=5, c16_kv=5, swa_kv=7, mtp_swa_kv=7)


def decode_token(pos: int) -> int:
    """The token a request "generates" at ``pos``: a function of the position only, so two
    requests that decode over the same prefix write the same tokens (and may share)."""
    return 1 + pos * 7 % 5


class _CountingOracle(RadixOracle):
    """The oracle, counting the evictions it makes and the pages it hands out while the call
    pins hit pages (eviction must pass them by)."""

    def __init__(self, plan, stats: Counter, **kw):
        self.stats = stats
        super().__init__(plan, **kw)

    def _take(self, gi, pinned):
        self.stats["allocate while pinned"] += bool(pinned)
        if not self.pools[gi].free:
            self.stats["evict"] += 1
            self.stats["evict while pinned"] += bool(pinned)
        return super()._take(gi, pinned)


@functools.cache
def _device() -> DeviceBackend:
    """One device backend for every example (reset per example: compiled once)."""
    return DeviceBackend(PPLAN, fifo_depth=D, prefix_reuse=True)


class PrefixMachine(RuleBasedStateMachine):
    #: What happened over the run (every example), checked by the test below.
    stats: ClassVar[Counter] = Counter()

    def __init__(self):
        super().__init__()
        self.device = _device()
        self.device.reset()
        self.oracle = _CountingOracle(PPLAN, self.stats, fifo_depth=D)
        self.h = _Harness(Trace(PPLAN, 0, ()), (self.oracle, self.device), ("oracle", "device"))
        self.tokens: dict[int, list[int]] = {}  # rid -> its prompt
        self.done: list[list[int]] = []  # committed tokens of ended requests (next turns)
        self.next_rid = 0

    def req(self, rid):
        """The oracle's request ``rid`` names, or None (never admitted or ended)."""
        if rid not in self.h.handles:
            return None
        return self.oracle._req(*self.h.handles[rid], allow_pending=True)

    def pick(self, i):
        """Mostly a live rid; one pick in five any rid so far (mostly stale)."""
        live = [r for r in range(self.next_rid) if self.req(r) is not None]
        if live and i % 5:
            return live[(i // 5) % len(live)]
        return i % (self.next_rid + 1)

    def apply(self, kind, rows):
        if kind is not OpKind.ADMIT:
            # One row per request: a request named twice in one batch is CoordinatorMachine's
            # case (the oracle checks each row's handle after the earlier rows ran, so a
            # deferred release makes its duplicate STALE where the device says BAD_ARG).
            seen = set()
            rows = [r for r in rows if not (r[0] in seen or seen.add(r[0]))]
        published = sum(int(ix.count) for ix in self.device.state.indexes)
        hits = self.h.stats["hit_tokens"]
        op = Op(kind, tuple(rows) + (None,) * (R - len(rows)))
        try:
            self.h.step(op)
        except _Found as e:
            raise AssertionError(f"{op}: {e.what}") from None
        audit.check_state(PPLAN, self.device.state, shared_ok=True)
        if self.h.stats["hit_tokens"] > hits:
            self.stats["hit"] += 1
            event("prefix hit")
        if sum(int(ix.count) for ix in self.device.state.indexes) > published:
            self.stats["publish"] += 1
            event("publish")

    @rule(
        rows=stg.lists(
            stg.tuples(
                stg.integers(0, len(PREFIXES)),  # a shared prefix, or an earlier history
                # Mostly past a block edge (granularity 16), so a published prefix can hit.
                stg.sampled_from([17, 17, 20, 33, 33, 40, 48, 0, 15, 64]),  # cut
                stg.sampled_from([0, 1, 3, 8]),  # new tokens after the cut
                stg.sampled_from([16, 16, 16, 5, 1, 0, 17]),  # first chunk (17: BAD_ARG)
                stg.sampled_from([0, 0, 0, 1]),  # namespace
            ),
            min_size=1,
            max_size=2,
        )
    )
    def admit(self, rows):
        out = []
        for src, cut, new, chunk, ns in rows:
            if src < len(PREFIXES):
                base = list(PREFIXES[src])
            else:
                base = self.done[cut % len(self.done)] if self.done else list(PREFIXES[0])
            prompt = base[:cut] + [900 + k for k in range(new)] or [900]
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            self.tokens[rid] = prompt
            out.append((rid, ns, tuple(prompt), min(chunk, len(prompt)) if chunk < 17 else chunk))
        self.apply(OpKind.ADMIT, out)

    @initialize()
    def system_prompt(self):
        """Each run starts as a server does: a request of a system prompt has committed (and
        published) its first block, so later prompts drawn from ``PREFIXES`` can hit."""
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.tokens[rid] = list(PREFIXES[0][:33])
        self.apply(OpKind.ADMIT, [(rid, 0, tuple(self.tokens[rid]), 16)])
        self.apply(OpKind.RETIRE, [(rid, 16)])

    @rule(i=handle_idx, new=stg.sampled_from([1, 3, 8]), chunk=stg.sampled_from([16, 5, 0]))
    def share(self, i, new, chunk):
        """A prompt that continues what a running request committed (another turn of it, or
        a request sharing its system prompt): a hit once its blocks are published."""
        live = [r for r in range(self.next_rid) if self.req(r) is not None]
        if not live:
            return
        r = self.req(live[i % len(live)])
        prompt = [int(t) for t in r.tokens[: r.c]][:48] + [950 + k for k in range(new)]
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.tokens[rid] = prompt
        self.apply(OpKind.ADMIT, [(rid, r.namespace, tuple(prompt), min(chunk, len(prompt)))])

    @rule(
        rows=stg.lists(
            stg.tuples(handle_idx, stg.sampled_from([16, 16, 1, 2, 3, 5])), min_size=1, max_size=3
        )
    )
    def extend(self, rows):
        out = []
        for i, count in rows:
            rid = self.pick(i)
            r, prompt = self.req(rid), self.tokens.get(rid, [])
            n = r.n if r is not None else 0
            toks = [prompt[p] if p < len(prompt) else decode_token(p) for p in range(n, n + count)]
            out.append((rid, tuple(toks)))
        self.apply(OpKind.EXTEND, out)

    @rule(rows=stg.lists(stg.tuples(handle_idx, stg.integers(0, 99)), min_size=1, max_size=3))
    def retire(self, rows):
        out = []
        for i, x in rows:
            rid = self.pick(i)
            r = self.req(rid)
            cnt = r.fifo[0][1] if r is not None and r.fifo else 2
            acc = cnt if x < 60 else x % (cnt + 1) if x < 95 else cnt + 1
            out.append((rid, acc))
        self.apply(OpKind.RETIRE, out)

    @rule(rows=stg.lists(stg.tuples(handle_idx, stg.integers(0, 3)), min_size=1, max_size=2))
    def rewind(self, rows):
        out = []
        for i, back in rows:
            rid = self.pick(i)
            r = self.req(rid)
            out.append((rid, max(r.c, r.n - back) if r is not None else 0))
        self.apply(OpKind.REWIND, out)

    @rule(idx=stg.lists(handle_idx, min_size=1, max_size=4))
    def reclaim(self, idx):
        self.apply(OpKind.RECLAIM, [(self.pick(i),) for i in idx])

    @rule(
        rows=stg.lists(
            stg.tuples(handle_idx, stg.sampled_from(list(ReleaseMode))), min_size=1, max_size=2
        )
    )
    def release(self, rows):
        out = []
        for i, mode in rows:
            rid = self.pick(i)
            r = self.req(rid)
            if r is not None and mode != ReleaseMode.ABORT and r.c:
                self.done.append(list(r.tokens[: r.c]))  # a later turn continues it
            out.append((rid, int(mode)))
        self.apply(OpKind.RELEASE, out)

    def teardown(self):
        try:
            self.h.final()
        except _Found as e:
            raise AssertionError(e.what) from None


PREFIX_SETTINGS = settings(
    max_examples=int(os.environ.get("FLATKV_COORD_EXAMPLES", "12")),
    stateful_step_count=int(os.environ.get("FLATKV_COORD_STEPS", "30")),
    deadline=None,
    derandomize="FLATKV_COORD_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_prefix_machine_hits_pins_evicts_and_publishes():
    """The prefix machine, with every invariant after every step; and over the run the
    coordinator served hits, published blocks, evicted cached pages and allocated pages while a
    batched admit pinned its hits (a generator that never gets there is a defect, not a pass).

    It runs in a fresh pytest process: once a CI worker had run other test files first, the
    same derandomized run saw no eviction, so process-wide state left by another file reaches
    it; isolated, the derandomized run is reproducible (the cause is not yet found)."""
    if os.environ.get("FLATKV_PREFIX_MACHINE_INNER") != "1":
        node = f"{__file__}::test_prefix_machine_hits_pins_evicts_and_publishes"
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", node],
            cwd=pathlib.Path(__file__).parents[2],
            env=os.environ | {"FLATKV_PREFIX_MACHINE_INNER": "1"},
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
        return
    PrefixMachine.stats = stats = Counter()
    run_state_machine_as_test(PrefixMachine, settings=PREFIX_SETTINGS)
    # ("evict while pinned" is counted too; CI's few examples seldom reach it.)
    for what in ("hit", "publish", "evict", "allocate while pinned"):
        assert stats[what] > 0, (what, dict(stats))
