"""The model with the coordinator's prefix reuse (issue 5) and the coordinator's bookkeeping.

Every parity scenario already runs through the coordinator (``model_harness.Engine``); this
module adds what needs the coordinator's own prefix index: a request admitted with a hit on
another request's published prefix (``Engine(publish=True)`` passes token ids to admit/extend),
and a retracted request readmitted onto its own prefix.
"""

from __future__ import annotations

from model_harness import TOL, Engine


def test_prefix_hit_from_another_request_through_the_coordinator(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params, publish=True)
    shared = rng.integers(0, 64, 16).tolist()
    donor = e.admit([*shared, *rng.integers(0, 64, 10).tolist()])
    e.run([(donor, 12)])
    e.run([(donor, 12)])  # commits 24 >= 16: the shared blocks are published
    other = e.admit([*shared, *rng.integers(0, 64, 7).tolist()])
    e.run([(donor, 1), (other, 7)])
    hit = e.first[other]
    assert hit > 0
    assert hit % s.plan.prefix_granularity == 0
    for _ in range(4):
        e.run([(donor, 1), (other, 1)])
    assert e.check_parity(donor) <= TOL
    assert e.check_parity(other) <= TOL
    e.check_state()


def test_retract_and_readmit_hits_its_own_prefix(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params, publish=True)
    a = e.admit(rng.integers(0, 64, 20).tolist())
    e.run([(a, 12)])
    e.run([(a, 7)])
    for _ in range(3):
        e.run([(a, 1)])
    tokens = e.retract(a)
    a2 = e.admit(tokens)
    e.run([(a2, min(12, len(tokens) - 1))])
    assert e.first[a2] > 0
    while e.n(a2) < len(tokens) - 1:
        e.run([(a2, min(12, len(tokens) - 1 - e.n(a2)))])
    e.run([(a2, 1)])
    assert e.seq[a2][: len(tokens)] == tokens
    assert e.check_parity(a2) <= TOL
    e.check_state()
