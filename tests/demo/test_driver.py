"""WorkloadDriver on a fake engine: turns are submitted in order, each after the previous one
finished, with the prompt extended by the previous answer."""

import dataclasses

import pytest

from flatkv_jax.demo.runner import WorkloadDriver
from flatkv_jax.demo.workload import WorkloadConfig, make_workload


@dataclasses.dataclass
class _Out:
    prompt: tuple
    tokens: tuple = ()
    finished: bool = False
    aborted: bool = False


@dataclasses.dataclass
class _Rec:
    index: int
    prefill_tokens: int = 0
    decode_tokens: int = 0


class FakeEngine:
    """Generates one token per step per request (a function of the prompt), two slots."""

    def __init__(self, slots=2, abort=()):
        self.slots, self.abort = slots, set(abort)
        self.outputs, self.queue, self.running = {}, [], []
        self.steps = 0
        self.finished_at = {}
        self.submitted_at = {}

    def submit(self, prompt, max_new_tokens, namespace=0):
        rid = len(self.outputs)
        self.outputs[rid] = _Out(tuple(prompt))
        self.queue.append((rid, max_new_tokens))
        self.submitted_at[rid] = self.steps
        return rid

    def has_work(self):
        return bool(self.queue or self.running)

    def step(self):
        while self.queue and len(self.running) < self.slots:
            self.running.append(self.queue.pop(0))
        for rid, n in list(self.running):
            out = self.outputs[rid]
            out.tokens += ((sum(out.prompt) + len(out.tokens)) % 50 + 1,)
            if rid in self.abort:
                out.aborted = True
            elif len(out.tokens) == n:
                out.finished = True
            if out.finished or out.aborted:
                self.running.remove((rid, n))
                self.finished_at[rid] = self.steps
        self.steps += 1
        return _Rec(self.steps - 1, decode_tokens=len(self.running))


def test_every_turn_extends_the_previous_turn():
    wl = make_workload(5, WorkloadConfig(requests=12, arrival_gap=3.0))
    eng = FakeEngine()
    calls = []
    subs = WorkloadDriver(wl, eng).run(lambda rec, done: calls.append(done))
    assert len(subs) == wl.requests == 12
    assert all(eng.outputs[s.request_id].finished for s in subs)
    assert calls == sorted(calls) and calls[-1] == 12
    by_turn = {(s.session, s.turn): s for s in subs}
    for sess in wl.sessions:
        assert by_turn[(sess.index, 0)].prompt == wl.first_prompt(sess)
        assert by_turn[(sess.index, 0)].step >= sess.arrival_step
        for k in range(1, len(sess.turns)):
            prev, cur = by_turn[(sess.index, k - 1)], by_turn[(sess.index, k)]
            answer = eng.outputs[prev.request_id].tokens
            assert cur.prompt == prev.prompt + answer + sess.turns[k].user
            # Submitted only after the previous turn finished (+ its think steps).
            assert cur.step >= eng.finished_at[prev.request_id] + 1 + sess.turns[k].think_steps
            assert cur.namespace == prev.namespace == sess.namespace


def test_an_aborted_turn_ends_its_session():
    wl = make_workload(5, WorkloadConfig(requests=12))
    multi = next(s for s in wl.sessions if len(s.turns) > 1)
    # Request ids follow submission order; find the id the multi-turn session's first turn
    # gets by a dry run, then abort it.
    dry = FakeEngine()
    rid = next(
        s.request_id
        for s in WorkloadDriver(wl, dry).run()
        if s.session == multi.index and s.turn == 0
    )
    subs = WorkloadDriver(wl, FakeEngine(abort={rid})).run()
    assert [s.turn for s in subs if s.session == multi.index] == [0]
    assert len(subs) == 12 - (len(multi.turns) - 1)


def test_an_engine_that_drops_a_request_is_reported():
    class Dropping(FakeEngine):
        def step(self):
            rec = super().step()
            self.running.clear()  # forgets its requests without finishing them
            return rec

    wl = make_workload(0, WorkloadConfig(requests=3))
    with pytest.raises(RuntimeError, match="never finished"):
        WorkloadDriver(wl, Dropping()).run()


def test_compile_clock_counts_compilations_only_while_active():
    import jax
    import jax.numpy as jnp

    from flatkv_jax.demo.runner import CompileClock

    with CompileClock() as clock:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5))
    inside = clock.seconds
    assert inside > 0
    jax.jit(lambda x: x * 5 - 2)(jnp.arange(7))  # compiled after the clock stopped
    assert clock.seconds == inside
