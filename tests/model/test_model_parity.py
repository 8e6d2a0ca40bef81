"""Cached execution == dense recomputation (fp32: max |logits error| <= 1e-5).

Every scenario drives the jitted step (pools donated) through ``model_harness.Engine``, i.e.
through the real coordinator (admit / extend / step_metadata / retire / reclaim / release) and
its device metadata, then compares the target logits of every accepted
position — and the MTP layer's logits, and the first draft proposal of every verify round —
with ``dense_forward`` over the final sequence.

Long local run of the random-schedule test: ``FLATKV_MODEL_EXAMPLES=200 pytest tests/model``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_harness import QUANT_TOL, TOL, Engine, Setup

from flatkv_jax.model import tiny_model
from flatkv_jax.pools import Pools, create_pools

EXAMPLES = int(os.environ.get("FLATKV_MODEL_EXAMPLES", "4"))


def _prompt(rng, n, vocab=64):
    return rng.integers(0, vocab, n).tolist()


def test_chunked_prefill_with_boundaries_inside_compression_windows(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params)
    a = e.admit(_prompt(rng, 35))
    # Chunk ends at 5, 12, 23, 35: inside ratio-4 windows (5, 23, 35) and ratio-16 windows.
    for count in (5, 7, 11, 12):
        e.run([(a, count)])
    assert e.check_parity(a) <= TOL


def test_decode_past_several_windows_reclaims_pages(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params)
    a = e.admit(_prompt(rng, 9))
    e.run([(a, 9)])
    peak = 0
    while e.c(a) < 60:  # 7.5 windows of 8
        e.run([(a, 1)])
        peak = max(peak, e.in_use("swa_kv"))
    assert e.check_parity(a) <= TOL
    # The window group never holds more than the live blocks of one request ...
    assert peak <= s.plan.group("swa_kv").live_blocks(1)
    # ... so pages slid out of the window were reclaimed, zeroed and reused.
    assert e.recycled > 0
    e.check_state()


def test_prefix_hit_from_another_request(fp32_setup, rng):
    """The hit is written into the coordinator state by ``share_prefix`` (test allocator) until
    the coordinator matches prefixes itself; test_model_coordinator.py has that version."""
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params)
    shared = _prompt(rng, 16)
    donor = e.admit([*shared, *_prompt(rng, 10)])
    e.run([(donor, 12)])
    e.run([(donor, 4)])
    hit = 16  # the plan's prefix granularity (lcm of block spans)
    assert s.plan.prefix_granularity == hit
    other = e.admit([*shared, *_prompt(rng, 7)], share_from=donor, hit=hit)
    # Both requests continue in the same batches, writing their own pages past the hit.
    e.run([(donor, 10), (other, 6)])
    e.run([(donor, 1), (other, 1)])
    for _ in range(3):
        e.verify([donor, other])
    e.run([(donor, 1), (other, 1)])
    assert e.check_parity(donor) <= TOL
    assert e.check_parity(other) <= TOL
    e.check_state()


def test_mtp_rounds_with_random_acceptance_and_rewinds(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params, rng=np.random.default_rng(7))
    a = e.admit(_prompt(rng, 13))
    b = e.admit(_prompt(rng, 6))
    e.run([(a, 12), (b, 3)])
    e.run([(a, 1), (b, 3)])
    accepted = []
    while max(e.c(a), e.c(b)) < 50:
        accepted += e.verify([a, b]).values()
    assert min(accepted) < s.plan.limits.verify_width  # some rounds rewound
    assert max(accepted) > 0
    assert e.check_parity(a) <= TOL
    assert e.check_parity(b) <= TOL


def test_retract_and_readmit(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params)
    a = e.admit(_prompt(rng, 20))
    b = e.admit(_prompt(rng, 11))
    e.run([(a, 12), (b, 4)])
    e.run([(a, 8), (b, 7)])
    for _ in range(3):
        e.verify([a, b])
    tokens = e.retract(a)
    # b keeps running and takes a's freed pages (zeroed before reuse).
    for _ in range(4):
        e.run([(b, 1)])
    a2 = e.admit(tokens)
    while e.n(a2) < len(tokens) - 1:
        e.run([(a2, min(12, len(tokens) - 1 - e.n(a2))), (b, 1)])
    e.run([(a2, 1)])
    e.verify([a2, b])
    assert e.seq[a2][: len(tokens)] == tokens
    assert e.check_parity(a2) <= TOL
    assert e.check_parity(b) <= TOL


def test_batches_mixing_prefill_and_decode(fp32_setup, rng):
    s = fp32_setup
    e = Engine(s.cfg, s.plan, s.params)
    a = e.admit(_prompt(rng, 5))
    e.run([(a, 5)])
    b = e.admit(_prompt(rng, 30))
    c = e.admit(_prompt(rng, 9))
    e.run([(a, 1), (b, 12), (c, 3)])
    e.run([(b, 9), (a, 1), (c, 6)])
    e.run([(c, 1), (b, 9), (a, 1)])
    e.run([(a, 1), (b, 1), (c, 1)])
    for rid in (a, b, c):
        assert e.check_parity(rid) <= TOL


def test_poisoned_pools_are_never_read_outside_written_rows(fp32_setup, rng):
    """Every non-null page starts as NaN: a read of a row that was neither zeroed nor written
    (scratch page, an unzeroed recycled page, a hole) would turn the logits into NaN."""
    s = fp32_setup
    pools = jax.tree.map(
        lambda a: a.at[1:].set(jnp.nan) if a.dtype == jnp.float32 else a, _fresh_pools(s)
    )
    e = Engine(s.cfg, s.plan, s.params, pools=pools)
    a = e.admit(_prompt(rng, 23))
    e.run([(a, 11)])
    e.run([(a, 12)])
    for _ in range(4):
        e.verify([a])
    assert e.check_parity(a) <= TOL


def _fresh_pools(s) -> Pools:
    return create_pools(s.plan)


@st.composite
def _schedules(draw):
    ops = []
    for _ in range(draw(st.integers(4, 10))):
        ops.append(
            draw(
                st.one_of(
                    st.tuples(st.just("admit"), st.integers(2, 24)),
                    st.tuples(st.just("chunk"), st.integers(1, 12)),
                    st.tuples(st.just("decode"), st.integers(1, 3)),
                    st.tuples(st.just("verify"), st.integers(1, 3)),
                    st.tuples(st.just("retract"), st.integers(0, 3)),
                )
            )
        )
    return ops


@settings(max_examples=EXAMPLES, deadline=None)
@given(ops=_schedules(), seed=st.integers(0, 2**16))
def test_random_schedules(fp32_setup, ops, seed):
    s = fp32_setup
    rng = np.random.default_rng(seed)
    e = Engine(s.cfg, s.plan, s.params, rng=rng)
    limit = s.plan.limits.max_context - 4
    for op, arg in ops:
        live = e.live()
        prefilling = [x for x in live if e.n(x) < len(e.seq[x]) - 1]
        decoding = [x for x in live if e.n(x) == len(e.seq[x]) - 1 and e.c(x) < limit]
        if op == "admit" and len(live) < s.plan.limits.max_requests:
            e.admit(_prompt(rng, arg))
        elif op == "chunk" and prefilling:
            work, budget = [], s.plan.limits.step_tokens
            for x in prefilling:
                n = min(arg, len(e.seq[x]) - 1 - e.n(x), budget)
                if n:
                    work.append((x, n))
                    budget -= n
            e.run(work)
        elif op == "decode" and decoding:
            for _ in range(arg):
                e.run([(x, 1) for x in decoding])
        elif op == "verify" and decoding:
            for _ in range(arg):
                ok = [x for x in decoding if e.c(x) < limit]
                if ok:
                    e.verify(ok)
        elif op == "retract" and live:
            x = live[arg % len(live)]
            if e.c(x) > 0:
                e.check_parity(x)
            e.retract(x)
    e.check_state()
    for x in e.live():
        if e.c(x) > 0:
            assert e.check_parity(x) <= TOL


@pytest.mark.parametrize(
    "formats",
    [
        pytest.param(
            dict(head_dim=80, rope_dim=16, kv_format="fp8_ds_mla", indexer_format="mxfp4"),
            id="fp8_ds_mla-mxfp4",
        ),
        pytest.param(dict(kv_format="bf16", indexer_format="fp8"), id="bf16-fp8"),
    ],
)
def test_quantized_formats_cached_equals_dense(formats, rng):
    """The dense reference applies the same codec to every cached row, so the cached path
    agrees up to a rare one-code flip of a quantized value (bound QUANT_TOL, docs/model.md)."""
    s = Setup(tiny_model(**formats))
    e = Engine(s.cfg, s.plan, s.params, rng=np.random.default_rng(3))
    a = e.admit(_prompt(rng, 21))
    b = e.admit(_prompt(rng, 7))
    e.run([(a, 9), (b, 7)])
    e.run([(a, 12)])
    for _ in range(5):
        e.verify([a, b])
    assert e.check_parity(a, tol=QUANT_TOL) <= QUANT_TOL
    assert e.check_parity(b, tol=QUANT_TOL) <= QUANT_TOL
    # The pools hold the storage dtype of the format (packed bytes for fp8_ds_mla).
    fmt = s.plan.group("swa_kv").field("kv").format
    assert e.pools.get(s.plan, "swa_kv", "kv", 0).dtype == jnp.dtype(fmt.dtype)
