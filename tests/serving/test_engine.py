"""End-to-end tests of the serving engine on the tiny model.

Two engines are compiled once per module and reused: ``base`` (no overlap, no prefix cache, no
MTP; split step kinds) and ``full`` (overlap, prefix cache, MTP; one step kind). The plan has
only 16 pages per pool, so a handful of concurrent requests runs out of pages and the engine
must preempt. Every step runs with ``step_metadata``'s ``overflow`` checked by the engine
(a step over ``step_tokens`` raises).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator import ReleaseMode
from flatkv_jax.coordinator.audit import check_state, page_counts
from flatkv_jax.model import DeepSeekV4, init_params, tiny_model
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from flatkv_jax.serving import Engine, EngineOptions

LIMITS = ServingLimits(
    max_requests=4, max_context=64, chunk_tokens=12, verify_width=2, step_tokens=16
)
PAGES = 16
#: cached vs dense logits (fp32 rows; docs/model.md measures ~2.5e-6).
TOL = 1e-4

BASE = EngineOptions(overlap=False, prefix_cache=False, mtp=False)
FULL = EngineOptions(overlap=True, prefix_cache=True, mtp=True, split_steps=False,
                     keep_logits=True, record_ops=True)  # fmt: skip


@functools.cache
def setup(limits: ServingLimits = LIMITS, pages: int = PAGES):
    """(tiny model config, a plan of ``limits`` with ``pages`` pages a pool, the model)."""
    cfg = tiny_model()
    plan = plan_with_pages(deepseek_v4_groups(cfg.cache, verify_width=2), limits, pages)
    return cfg, plan, DeepSeekV4.from_params(cfg, init_params(cfg, 0))


def workload():
    rng = np.random.default_rng(7)
    lens = (5, 20, 9, 30, 14, 3, 26)
    new = (10, 8, 12, 6, 9, 5, 7)
    return [(rng.integers(0, 64, n).tolist(), m) for n, m in zip(lens, new, strict=True)]


def serve(engine: Engine, requests) -> list[tuple[int, ...]]:
    ids = [engine.submit(p, m) for p, m in requests]
    out = engine.run()
    return [out[i].tokens for i in ids]


@functools.cache
def base():
    _, plan, model = setup()
    engine = Engine(model, plan, BASE)
    return engine, serve(engine, workload())


@functools.cache
def full():
    _, plan, model = setup()
    engine = Engine(model, plan, FULL)
    return engine, serve(engine, workload())


def assert_whole(engine: Engine) -> None:
    """Every page free or cached-only, every slot free, every invariant."""
    _, plan, _ = setup()
    check_state(plan, engine.state, shared_ok=True)
    counts = page_counts(plan, engine.state)
    assert all(c.in_use == 0 for c in counts.values()), counts
    assert not np.asarray(engine.state.live).any()
    assert not engine.has_work()


def dense_logits(tokens) -> np.ndarray:
    """Dense recompute of ``tokens`` (padded to one length: the model is causal)."""
    _, plan, model = setup()
    padded = np.zeros(plan.limits.max_context + 1, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(model.dense(jnp.asarray(padded))[0])[: len(tokens)]


def test_every_request_completes_with_the_baseline_outputs():
    engine, got = full()
    _, want = base()
    assert got == want
    for (_, m), toks in zip(workload(), got, strict=True):
        assert len(toks) == m
    assert all(o.finished and not o.aborted for o in engine.outputs.values())
    assert engine.stats.emitted_tokens == sum(m for _, m in workload())


def test_outputs_equal_dense_recompute():
    engine, got = full()
    worst = 0.0
    for (prompt, _), toks, out in zip(workload(), got, engine.outputs.values(), strict=True):
        seq = list(prompt) + list(toks)
        ref = dense_logits(seq[:-1])[len(prompt) - 1 :]
        assert np.argmax(ref, axis=-1).tolist() == list(toks)
        worst = max(worst, float(np.abs(out.logits - ref).max()))
    assert worst <= TOL, worst


def test_pools_whole_after_the_run():
    assert_whole(full()[0])
    assert_whole(base()[0])


def test_mtp_reports_drafts_and_the_budget_holds():
    engine, _ = full()
    st = engine.stats
    assert st.draft_proposed > 0 and 0 <= st.draft_accepted <= st.draft_proposed
    assert 0.0 <= st.accept_rate <= 1.0
    assert base()[0].stats.draft_proposed == 0
    for rec in engine.records + base()[0].records:
        assert rec.prefill_tokens + rec.decode_tokens <= LIMITS.step_tokens
        assert all(0 <= u <= PAGES for u in rec.in_use)


def test_preemption_retracts_and_readmission_hits_its_own_prefix():
    """The main workload outgrows the 16-page pools, so the engine retracts a request; it comes
    back before its published blocks are evicted and hits its own prefix (no other prompt
    shares it), and every output equals the engine's without prefix cache or preemption
    state. (A three-request scenario with windows that could not all fit used to show this;
    since reclaim drops a period group's state before its last boundary, three requests fit.)
    """
    engine, got = full()
    assert engine.stats.retractions > 0
    ops = [name for name, _ in engine.op_log]
    assert {"admit", "extend", "retire", "reclaim", "release"} <= set(ops)
    prompts = [p for p, _ in workload()]
    back = [i for i in range(len(prompts)) if engine.outputs[i].retractions > 0]
    assert back, [engine.outputs[i] for i in range(len(prompts))]
    for i in back:
        h = engine.outputs[i].hit_tokens
        assert h >= 16, (i, engine.outputs[i])
        assert all(p[:h] != prompts[i][:h] for j, p in enumerate(prompts) if j != i)
    assert got == base()[1]
    assert_whole(engine)


def test_abort_of_a_request_whose_retraction_is_queued_releases_it_as_an_abort():
    """A preemption queues a RETRACT (dispatched with the next step); an abort before that
    turns it into an ABORT, so the request's in-flight step publishes nothing (a
    retraction's would). The others give the baseline's tokens and the pools end whole."""
    _, plan, model = setup()
    engine = Engine(model, plan, FULL)
    ids = [engine.submit(p, m) for p, m in workload()]
    victim = None
    while victim is None and engine.has_work():
        before = {i: engine.outputs[i].retractions for i in ids}
        engine.step()
        victim = next((i for i in ids if engine.outputs[i].retractions > before[i]), None)
    assert victim is not None, "the workload no longer preempts"
    engine.abort(victim)
    engine.run()
    modes = [
        m for name, rel in engine.op_log if name == "release" for r, m, _ in rel if r == victim
    ]
    assert modes == [int(ReleaseMode.ABORT)], modes
    assert engine.outputs[victim].aborted
    others = [engine.outputs[i].tokens for i in ids if i != victim]
    assert others == [t for i, t in zip(ids, base()[1], strict=True) if i != victim]
    assert_whole(engine)


def test_prefix_hit_gives_the_same_tokens():
    engine, _ = full()
    rng = np.random.default_rng(3)
    first = rng.integers(0, 64, 40).tolist()
    second = first[:34] + rng.integers(0, 64, 6).tolist()
    (a,) = serve(engine, [(first, 4)])
    (b,) = serve(engine, [(second, 4)])
    out = engine.outputs[max(engine.outputs)]
    assert out.hit_tokens >= 16
    assert [a, b] == serve(base()[0], [(first, 4), (second, 4)])
    assert_whole(engine)


@functools.cache
def aborted():
    """Aborts on the full engine: one waiting, one mid-prefill, one mid-decode."""
    engine, _ = full()
    rng = np.random.default_rng(5)
    waiting = engine.submit(rng.integers(0, 64, 8).tolist(), 5)
    engine.abort(waiting)
    decoding = engine.submit(rng.integers(0, 64, 4).tolist(), 30)
    prefilling = engine.submit(rng.integers(0, 64, 50).tolist(), 5)
    other = engine.submit(rng.integers(0, 64, 6).tolist(), 6)
    while len(engine.outputs[decoding].tokens) < 3:
        engine.step()
    assert engine.outputs[prefilling].tokens == ()
    engine.abort(decoding)
    engine.abort(prefilling)
    engine.run()
    return engine, waiting, decoding, prefilling, other


def test_abort_leaves_nothing_behind():
    engine, waiting, decoding, prefilling, other = aborted()
    out = engine.outputs
    assert out[waiting].aborted and out[waiting].tokens == ()
    assert out[prefilling].aborted and out[prefilling].tokens == ()
    assert out[decoding].aborted and 3 <= len(out[decoding].tokens) < 30
    assert out[other].finished and len(out[other].tokens) == 6
    # keep_logits: an aborted request's logits are set as a finished one's (one row per
    # token, greedy: each row's argmax is its token), empty where it made no token.
    vocab = setup()[0].vocab
    dec = out[decoding]
    assert dec.logits.shape == (len(dec.tokens), vocab)
    np.testing.assert_array_equal(dec.logits.argmax(axis=1), dec.tokens)
    assert out[waiting].logits.shape == out[prefilling].logits.shape == (0, vocab)
    assert_whole(engine)
    engine.abort(decoding)  # aborting twice does nothing


def test_no_compilation_after_warmup():
    aborted()  # prefill, decode, MTP, preemption, prefix hits and aborts have all run
    for engine in (full()[0], base()[0]):
        assert engine.stats.compilations_after_warmup == 0
    # split steps: with admission, without, and decode-only (narrow)
    assert base()[0].stats.compilations == 3
    assert base()[0].stats.narrow_steps > 0
    assert full()[0].stats.compilations == 1


def test_submit_rejects_requests_that_cannot_fit():
    cfg, plan, model = setup()
    engine = Engine(model, plan, BASE)
    with pytest.raises(ValueError, match=r"exceeds ServingLimits\.max_context = 64"):
        engine.submit([1] * 60, 5)
    engine.submit([1] * 59, 5)  # exactly max_context: accepted (the plan fits it in pages)
    # A pool too small for one max_context request is refused by the plan itself.
    with pytest.raises(ValueError, match=r"one request at max_context=64"):
        plan_with_pages(deepseek_v4_groups(cfg.cache, verify_width=2), LIMITS, 4)
    with pytest.raises(ValueError, match="at least one token"):
        engine.submit([], 3)
    with pytest.raises(TypeError, match="sequence of ints"):
        engine.submit("abc", 3)
    with pytest.raises(TypeError, match="token ids are ints"):
        engine.submit([1, 2.0], 3)
    with pytest.raises(ValueError, match=r"token ids lie in \[0, 64\)"):
        engine.submit([1, 64], 3)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        engine.submit([1], 0)
    with pytest.raises(TypeError, match="max_new_tokens"):
        engine.submit([1], 2.5)
    with pytest.raises(ValueError, match="no request has this id"):
        engine.abort(12345)
    with pytest.raises(ValueError, match='impl="reference" or impl="pallas"'):
        EngineOptions(impl="cuda")
    with pytest.raises(ValueError, match="fifo_depth >= 2"):
        EngineOptions(fifo_depth=1)
    with pytest.raises(TypeError, match=r"fifo_depth=2.0 is invalid: it must be an int"):
        EngineOptions(fifo_depth=2.0)
    with pytest.raises(TypeError, match=r"interpret='no' is invalid: it must be a bool or None"):
        EngineOptions(interpret="no")
    # NumPy integers are ints (as everywhere in the library), kept as Python ints.
    opts = EngineOptions(
        fifo_depth=np.int64(3), admit_rows=np.int32(2), admit_widths=(np.int64(8),)
    )
    assert type(opts.fifo_depth) is int and opts.fifo_depth == 3 and type(opts.admit_rows) is int
    assert type(opts.admit_widths[0]) is int
    flat = plan_with_pages(
        deepseek_v4_groups(cfg.cache, verify_width=0),
        ServingLimits(max_requests=2, max_context=32, chunk_tokens=8),
        8,
    )
    with pytest.raises(ValueError, match="EngineOptions\\(mtp=False\\)"):
        Engine(model, flat, EngineOptions())
    with pytest.raises(TypeError, match=r"flax\.nnx\.Module"):
        Engine(object(), plan, BASE)
    engine.abort(np.int64(0))  # a NumPy id names the same request (submit takes them too)
    engine.run()
    assert engine.outputs[0].aborted and not engine.has_work()
    assert engine.rank_of(np.int32(0)) == 0


def test_pallas_kernels_give_the_same_tokens():
    """The engine with ``impl="pallas"`` (Pallas TPU kernels in interpret mode on CPU)."""
    _, plan, model = setup()
    engine = Engine(
        model,
        plan,
        EngineOptions(
            impl="pallas", overlap=False, prefix_cache=False, mtp=False, split_steps=False
        ),
    )
    requests = workload()[:2]
    assert serve(engine, requests) == base()[1][:2]
    assert_whole(engine)


class EchoDraft(DeepSeekV4):
    """The tiny model with a dominant next-token rule, for exercising speculative acceptance.

    The target's logits get a large bonus on ``(token + 1) % vocab``, so greedy decoding
    counts up; the draft proposes the same rule except at positions divisible by 5, where it
    is wrong. Random weights almost never accept a draft; this model accepts most of them
    and rejects some, so partial acceptance, rewinds and the publishing of accepted drafts run.
    """

    def step(self, pools, batch, meta, table_buffer, **kw):
        out, pools = super().step(pools, batch, meta, table_buffer, **kw)
        bonus = 100.0 * jax.nn.one_hot((batch.tokens + 1) % self.cfg.vocab, self.cfg.vocab)
        return dataclasses.replace(out, logits=out.logits + bonus), pools

    def propose(self, pools, batch, meta, table_buffer, **kw):
        out, pools = super().propose(pools, batch, meta, table_buffer, **kw)
        k = out.tokens.shape[1]
        r = batch.tokens.shape[0]
        first = batch.tokens[jnp.clip(meta.row_slot, 0, r - 1)][:, None]
        i = jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]
        pos = meta.row_start[:, None] + i
        tokens = (first + i + jnp.where(pos % 5 == 0, 7, 0)) % self.cfg.vocab
        return dataclasses.replace(out, tokens=tokens.astype(jnp.int32)), pools


def serve_echo(options: EngineOptions):
    """Three requests on :class:`EchoDraft` under ``options``, every token checked against its
    counting rule; returns the engine and a generator for later prompts."""
    cfg, plan, _ = setup()
    model = EchoDraft.from_params(cfg, init_params(cfg, 1))
    engine = Engine(model, plan, options)
    rng = np.random.default_rng(11)
    requests = [(rng.integers(0, 64, n).tolist(), m) for n, m in ((7, 20), (12, 9), (3, 25))]
    got = serve(engine, requests)
    for (prompt, m), toks in zip(requests, got, strict=True):
        assert list(toks) == [(prompt[-1] + 1 + j) % 64 for j in range(m)]
    return engine, rng


def serve_continuation(engine: Engine, rng) -> None:
    """Accepted drafts are published with the right tokens: a prompt that continues a
    finished request hits its generated tokens too (served alone: nothing evicts them)."""
    prompt = rng.integers(0, 64, 3).tolist()
    (gen,) = serve(engine, [(prompt, 25)])
    seq = list(prompt) + list(gen)
    (more,) = serve(engine, [(seq, 4)])
    assert engine.outputs[max(engine.outputs)].hit_tokens == 16
    assert list(more) == [(seq[-1] + 1 + j) % 64 for j in range(4)]


def test_speculative_acceptance_keeps_outputs_and_publishes_accepted_drafts():
    engine, rng = serve_echo(EngineOptions(split_steps=False))
    st = engine.stats
    assert 0 < st.draft_accepted < st.draft_proposed
    serve_continuation(engine, rng)
    assert_whole(engine)
    assert st.compilations_after_warmup == 0


def test_an_extend_the_device_refuses_is_raised(monkeypatch):
    """A lane's extend refused for anything but pages (FIFO_FULL, TOO_LONG, STEP_FULL,
    STALE, BAD_ARG) would leave its request stalled and ``run()`` looping: raised, naming the
    step, the request and the status. The device never does this, so the report is altered
    on its way to the host (the first step's served rows read FIFO_FULL)."""
    from flatkv_jax.status import Status

    real = jax.device_get

    def tampered(x):
        rep = real(x)
        if isinstance(rep, dict) and "extend_status" in rep:
            st = np.array(rep["extend_status"])
            st[st == Status.OK] = Status.FIFO_FULL
            rep = {**rep, "extend_status": st}
        return rep

    _, plan, model = setup()
    engine = Engine(model, plan, BASE)
    engine.submit(list(range(1, 21)), 4)
    engine.step()  # admission only: no extend yet
    monkeypatch.setattr(jax, "device_get", tampered)
    with pytest.raises(
        RuntimeError,
        match=r"step \d+ extended request 0 with status FIFO_FULL: an engine bug \(a step "
        r"extends what its lanes hold; only OUT_OF_PAGES makes a request wait",
    ):
        engine.run()
