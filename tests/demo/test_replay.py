"""replay_ops: the engine's coordinator operations replayed on the radix oracle.

The "engine" here is a second RadixOracle driven by a scripted serving sequence (prefill in
chunks, speculative steps, a finished request whose prefix the next turn hits, a retraction
and readmission); its log is what an engine records. The replay must agree with it, and a
log whose hit or status was altered must be reported, naming the op and the request.
"""

import pytest

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.demo.replay import replay_ops
from flatkv_jax.model import tiny_model
from flatkv_jax.oracle import RadixOracle, ReleaseMode, admit_batch, extend_batch, handle_batch
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from flatkv_jax.status import Status

LIMITS = ServingLimits(max_requests=4, max_context=128, chunk_tokens=32, verify_width=2)
PLAN = plan_with_pages(deepseek_v4_groups(tiny_model().cache, verify_width=2), LIMITS, 48)


class ScriptedEngine:
    """Serves requests on an oracle and logs every op like an engine does."""

    def __init__(self):
        self.o = RadixOracle(PLAN)
        self.log, self.handles, self.seqs = [], {}, {}

    def admit(self, rid, ns, seq, plen, chunk):
        self.seqs[rid] = seq
        r = self.o.admit(admit_batch(PLAN, [(ns, seq[:plen], chunk)]))
        st, hit = int(r.status[0]), int(r.hit[0])
        self.log.append(("admit", ((rid, ns, plen, chunk, st, hit),)))
        if st == Status.OK:
            self.handles[rid] = (int(r.slot[0]), int(r.generation[0]))
        return hit

    def extend(self, rid, count):
        h = self.handles[rid]
        n = self.o.requests[h[0]].n
        toks = (list(self.seqs[rid][n : n + count]) + [0] * count)[:count]
        r = self.o.extend(extend_batch(PLAN, [(h, toks)]))
        self.log.append(("extend", ((rid, count, int(r.status[0])),)))

    def handle_op(self, kind, rid, arg=None):
        h = self.handles[rid]
        row = h if arg is None else (h, int(arg))
        r = getattr(self.o, kind)(handle_batch(PLAN, [row]))
        entry = (rid, int(r.status[0])) if arg is None else (rid, int(arg), int(r.status[0]))
        self.log.append((kind, (entry,)))
        return int(r.status[0])

    def serve(self, rid, ns, seq, plen, gen, mode=ReleaseMode.FINISH):
        """Prefill ``plen`` tokens in chunks of 32, then ``gen`` tokens by verify steps
        accepting one draft each (2 tokens per step)."""
        hit = self.admit(rid, ns, seq, plen, min(32, plen))
        n = min(plen, hit + 32)
        self.handle_op("retire", rid, n - hit)
        while n < plen:
            c = min(32, plen - n)
            self.extend(rid, c)
            self.handle_op("retire", rid, c)
            n += c
        while n < plen + gen:
            self.extend(rid, 3)
            self.handle_op("retire", rid, 2)
            self.handle_op("reclaim", rid)
            n += 2
        self.handle_op("release", rid, mode)
        return hit


def _scripted():
    eng = ScriptedEngine()
    system = list(range(1, 41))  # a 40-token system prompt shared by the tenant
    turn1 = [*system, *range(50, 60)]
    full1 = [*turn1, *range(60, 70)]  # prompt + 10 generated tokens
    assert eng.serve(0, 0, full1, len(turn1), 10) == 0
    turn2 = [*full1, 3, 4, 5]
    hit2 = eng.serve(1, 0, [*turn2, 9, 9, 9, 9], len(turn2), 4)
    other_tenant = eng.serve(2, 1, [*turn1, 1, 1], len(turn1), 2)
    # Retracted mid-decode, readmitted with prompt + generated so far: hits its own prefix.
    seq3 = [*system, *range(20, 60)]
    hit_sys = eng.admit(3, 0, seq3, 70, 32)  # the tenant's system prompt
    eng.handle_op("retire", 3, 32)
    eng.handle_op("release", 3, ReleaseMode.RETRACT)
    hit3 = eng.admit(3, 0, seq3, 76, 32)
    return eng, hit2, other_tenant, hit3, hit_sys


def test_replay_agrees_with_the_engine_log():
    eng, hit2, other_tenant, hit3, hit_sys = _scripted()
    # The script exercises hits: a later turn, the shared system prompt, a readmission; none
    # across tenants.
    assert hit2 >= 48 and other_tenant == 0 and hit_sys == 32 and hit3 >= hit_sys + 32
    res = replay_ops(PLAN, eng.log, eng.seqs)
    assert res.agrees, res.mismatches
    assert res.mismatch_count == 0 and not res.violations
    assert res.hit_tokens == res.engine_hit_tokens == hit2 + hit_sys + hit3
    assert res.prompt_tokens == res.engine_prompt_tokens == 50 + 63 + 50 + 70 + 76
    assert res.admissions == 5 and res.ops == len(eng.log)
    assert res.hit_rate == pytest.approx((hit2 + hit_sys + hit3) / 309)


def test_replay_without_prefix_reuse_reports_the_hits_as_mismatches():
    eng, hit2, *_ = _scripted()
    res = replay_ops(PLAN, eng.log, eng.seqs, prefix_reuse=False)
    assert res.hit_tokens == 0 and not res.agrees
    assert any(f"hit engine={hit2} oracle=0" in m for m in res.mismatches)


def test_an_altered_log_is_caught_naming_op_and_request():
    eng, *_ = _scripted()
    kind, ((rid, ns, plen, chunk, st, hit),) = eng.log[-1]
    eng.log[-1] = (kind, ((rid, ns, plen, chunk, st, hit + 16),))
    i = next(k for k, e in enumerate(eng.log) if e[0] == "extend")
    ((erid, count, _),) = eng.log[i][1]
    eng.log[i] = ("extend", ((erid, count, int(Status.OUT_OF_PAGES)),))
    res = replay_ops(PLAN, eng.log, eng.seqs)
    assert res.mismatch_count == 2 and not res.agrees
    assert (
        f"op {len(eng.log) - 1} admit request 3: hit engine={hit + 16} oracle={hit}"
        in res.mismatches
    )
    assert f"op {i} extend request {erid}: status engine=OUT_OF_PAGES oracle=OK" in res.mismatches


@pytest.mark.parametrize(
    ("log", "seqs", "needle"),
    [
        ("nope", {}, "op_log='str'"),
        ([("admit", ((0, 0, 4),))], {0: [1, 2, 3, 4]}, "admit row"),
        ([("frobnicate", ())], {}, "op_log[0]"),
        ([("admit", ((7, 0, 4, 4, 0, 0),))], {}, "request_id=7"),
    ],
)
def test_malformed_logs_are_rejected(log, seqs, needle):
    with pytest.raises((ValueError, TypeError), match="Fix") as e:
        replay_ops(PLAN, log, seqs)
    assert needle in str(e.value)
