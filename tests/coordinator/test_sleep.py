"""Sleep / wake (flatkv_jax.coordinator.sleep, docs/sleep.md).

A tiny serving loop drives the coordinator on the shared tiny-V4 plan: every step admits or
extends requests with their tokens (prefix reuse on), zeroes the pages handed out, writes a
value derived from (position, step) at every write slot of every pool array, then retires the
step fully. Sleeping happens between steps (no step in flight).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from coordinator_cases import PLAN, make_plan

from flatkv_jax import create_pools
from flatkv_jax.coordinator import (
    ReleaseMode,
    Sleeping,
    SleepMode,
    audit,
    create_state,
    host,
    ops,
    sleep,
    step_metadata,
    wake,
)
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import lru as lru_lib
from flatkv_jax.status import Status

CHUNK = PLAN.limits.chunk_tokens
SYS = list(range(500, 532))  # 32 shared tokens: two 16-token prefix blocks


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("pools",))
def _write(plan, pools, zero, md, salt):
    """Zeroes the pages handed out (``zero``: the results' zero lists, ``[G, K]``), then
    writes ``pos * 8 + salt + 1`` (never 0) into every row the step's tokens write."""
    for gi in range(len(plan.groups)):
        pools = pools.zero_group(gi, zero[gi])
    out = []
    for gi, g in enumerate(plan.groups):
        rows = g.rows_per_page * plan.pages(g)
        slot = md.write_slot[gi]
        slot = jnp.where(slot >= 0, slot, rows)
        val = (md.token_pos * 8 + salt + 1).astype(jnp.float32)
        new = []
        for a in pools.flat_group(gi):
            flat = a.reshape(rows, *a.shape[2:])
            v = jnp.broadcast_to(
                val.reshape(-1, *([1] * (flat.ndim - 1))), (val.shape[0], *flat.shape[1:])
            )
            new.append(flat.at[slot].set(v.astype(a.dtype), mode="drop").reshape(a.shape))
        out.append(tuple(new))
    for gi, flat in enumerate(out):
        pools = pools.with_flat_group(gi, flat)
    return pools


class Loop:
    """One coordinator state and its pools, advanced one fully retired step at a time."""

    def __init__(self, plan=PLAN, pools=None):
        self.plan = plan
        self.state = create_state(plan)
        self.pools = create_pools(plan) if pools is None else pools
        self.tokens: dict[tuple[int, int], list[int]] = {}  # handle -> the request's tokens
        self.salt = 0

    def step(self, admits=(), extends=()):
        """Admits ``admits`` (token lists; first chunk up to CHUNK) and extends ``extends``
        (``(handle, count)``, the next tokens of the request), writes, retires everything.
        Returns the admit result's ``(status, handle, hit)`` per admitted row."""
        p = self.plan
        results, out, running = [], [], []
        if admits:
            batch = host.admit_batch(
                p,
                [(len(t), min(CHUNK, len(t))) for t in admits],
                tokens=[list(t) for t in admits],
            )
            self.state, res = ops.admit(p, self.state, batch)
            results.append(res)
            for i, t in enumerate(admits):
                st, h, hit = (
                    Status(int(res.status[i])),
                    host.handles(res, len(admits))[i],
                    int(res.hit[i]),
                )
                out.append((st, h, hit))
                if st is Status.OK:
                    self.tokens[h] = list(t)
                    running.append((h, int(res.count[i])))
        if extends:
            toks = [self.tokens[h][self._c(h) : self._c(h) + n] for h, n in extends]
            batch = host.extend_batch(p, list(extends), tokens=toks)
            self.state, res = ops.extend(p, self.state, batch)
            assert host.statuses(res, len(extends)) == [Status.OK] * len(extends)
            results.append(res)
            running += list(extends)
        md = step_metadata(p, self.state, tuple(results))
        self.salt += 1
        self.pools = _write(p, self.pools, md.zero, md, self.salt)
        if running:
            self.state, r = ops.retire(p, self.state, host.retire_batch(p, running))
            assert host.statuses(r, len(running)) == [Status.OK] * len(running)
        audit.check_state(p, self.state, shared_ok=True)
        return out

    def _c(self, h) -> int:
        return int(self.state.committed[h[0]])

    def prefill(self, h):
        """Steps ``h`` until its whole prompt is committed."""
        while (c := self._c(h)) < len(self.tokens[h]):
            self.step(extends=[(h, min(CHUNK, len(self.tokens[h]) - c))])

    def release(self, h, mode=ReleaseMode.FINISH):
        self.state, r = ops.release(
            self.plan, self.state, host.release_batch(self.plan, [(h, mode)])
        )
        assert host.statuses(r, 1) == [Status.OK]
        audit.check_state(self.plan, self.state, shared_ok=True)


def _bits(tree) -> list[np.ndarray]:
    """Every leaf as raw bits (NaN payloads compare exactly)."""
    out = []
    for a in jax.tree_util.tree_leaves(tree):
        a = np.asarray(a)
        out.append(a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a.copy())
    return out


def _assert_bits_equal(a, b):
    la, lb = _bits(a), _bits(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _noise_pools(plan, seed: int):
    """Pools full of random bits (NaNs with payloads included): a restore must be bit-exact."""
    rng = np.random.default_rng(seed)

    def fill(a):
        u = np.dtype(f"u{a.dtype.itemsize}")
        bits = rng.integers(0, np.iinfo(u).max, a.shape, dtype=u, endpoint=True)
        return jax.device_put(bits.view(a.dtype), a.sharding)

    return jax.tree_util.tree_map(fill, create_pools(plan))


def _phase1(loop: Loop):
    """A finished request (its blocks published, cached-only), one sharing its prefix (a hit,
    live) and one partly prefilled (live)."""
    a = loop.step(admits=[[*SYS, *range(1, 17)]])[0][1]
    loop.prefill(a)
    loop.release(a)
    (st, b, hit), (st2, c, _) = loop.step(admits=[[*SYS, *range(40, 56)], list(range(900, 940))])
    assert st is st2 is Status.OK and hit == 32
    return b, c


def _phase2(loop: Loop, b, c):
    loop.prefill(b)
    loop.step(extends=[(c, CHUNK)])
    loop.release(b)
    return loop.step(admits=[[*SYS, *range(70, 90)]])[0]


def test_offload_then_wake_continues_bit_identically():
    run = Loop(pools=_noise_pools(PLAN, 1))
    b, c = _phase1(run)
    before = (jax.tree.map(np.array, run.state), jax.tree.map(np.array, run.pools))
    leaves = jax.tree_util.tree_leaves(run.pools)
    live_before = sum(x.nbytes for x in jax.live_arrays())
    asleep = sleep(PLAN, run.state, run.pools, SleepMode.OFFLOAD)
    # The device memory is released: every pool buffer is deleted, not just unreferenced.
    assert all(x.is_deleted() for x in leaves)
    freed = live_before - sum(x.nbytes for x in jax.live_arrays())
    assert freed >= PLAN.total_pool_bytes == asleep.device_bytes == asleep.host_bytes
    woken = wake(asleep)
    assert woken.retracted == ()
    _assert_bits_equal(woken.state, before[0])
    _assert_bits_equal(woken.pools, before[1])
    run.state, run.pools = woken.state, woken.pools
    after = _phase2(run, b, c)

    ref = Loop(pools=_noise_pools(PLAN, 1))
    assert _phase1(ref) == (b, c)
    assert _phase2(ref, b, c) == after and after[2] == 32  # the cached prefix still hits
    _assert_bits_equal(run.state, ref.state)
    _assert_bits_equal(run.pools, ref.pools)


def test_discard_then_wake_repairs_the_state_and_never_serves_a_stale_hit():
    loop = Loop()
    b, c = _phase1(loop)
    counts = audit.page_counts(PLAN, loop.state)
    assert sum(x.cached_only for x in counts.values()) > 0  # pages the index holds alone
    shardings = [x.sharding for x in jax.tree_util.tree_leaves(loop.pools)]
    # The recipe this replaces (clear the index, fresh LRUs) leaks every cached page: its
    # refcount keeps the index's reference with no holder left.
    naive = dataclasses.replace(
        jax.tree.map(jnp.copy, loop.state),
        index=index_lib.clear_set(loop.state.index),
        lru=lru_lib.create_lru_set(PLAN),
    )
    with pytest.raises(
        audit.StateInvariantError,
        match=r"refcount \d+ != table references \d+ \+ index references 0",
    ):
        audit.check_state(PLAN, naive, shared_ok=True)
    woken = wake(sleep(PLAN, loop.state, loop.pools, "discard"))
    state, pools = woken.state, woken.pools
    # Every live request is retracted: its handle is listed and now stale.
    assert woken.retracted == (b, c)
    audit.check_state(PLAN, state)
    for name, x in audit.page_counts(PLAN, state).items():
        assert (x.free, x.in_use, x.cached_only) == (x.total, 0, 0), name
    for ix, lr in zip(state.indexes, state.lrus, strict=True):
        assert int(ix.count) == 0 and int(lr.count) == 0
    # Pools re-created as zeros, same shapes, dtypes and shardings.
    assert [x.sharding for x in jax.tree_util.tree_leaves(pools)] == shardings
    assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(pools))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), pools) == jax.tree.map(
        lambda x: (x.shape, x.dtype), create_pools(PLAN)
    )
    loop.state, loop.pools = state, pools
    stale = ops.extend(PLAN, loop.state, host.extend_batch(PLAN, [(b, 1)], tokens=[[1]]))
    loop.state = stale[0]
    assert host.statuses(stale[1], 1) == [Status.STALE]
    # Readmitted, the retracted requests recompute from scratch: no hit on lost contents.
    retracted = [loop.tokens[h] for h in woken.retracted]
    rows = loop.step(admits=retracted)
    assert [(st, hit) for st, _, hit in rows] == [(Status.OK, 0), (Status.OK, 0)]
    b2, c2 = rows[0][1], rows[1][1]
    loop.prefill(b2)
    loop.prefill(c2)
    loop.release(b2)
    loop.release(c2)
    audit.check_state(PLAN, loop.state)
    # What they published again after the wake is served again.
    assert loop.step(admits=[[*SYS, *range(70, 90)]])[0][2] == 32


def test_sleep_refuses_steps_in_flight():
    state = create_state(PLAN)
    pools = create_pools(PLAN)
    state, _ = ops.admit(PLAN, state, host.admit_batch(PLAN, [(8, 8), (4, 0)]))
    with pytest.raises(ValueError) as e:
        sleep(PLAN, state, pools, SleepMode.OFFLOAD)
    assert str(e.value) == (
        "state='1 request(s) with steps in flight (slots [0])' is invalid: sleep needs every "
        "step retired: an in-flight step's tokens are written into the pools that sleep "
        "releases. Fix: retire (or rewind and retire) every in-flight step, then sleep; in a "
        "serving loop, sleep between steps after reading their results."
    )
    # Refused means untouched: the pools are still there.
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(pools))
    state, r = ops.retire(PLAN, state, host.retire_batch(PLAN, [((0, 0), 8)]))
    assert host.statuses(r, 1) == [Status.OK]
    woken = wake(sleep(PLAN, state, pools, SleepMode.DISCARD))
    assert woken.retracted == ((0, 0), (1, 0))


def test_error_messages():
    state, pools = create_state(PLAN), create_pools(PLAN)
    with pytest.raises(
        ValueError,
        match=r"mode='nap' is invalid: it must be SleepMode.OFFLOAD or SleepMode.DISCARD \('offload' or 'discard'\)\. Fix: pass SleepMode.OFFLOAD to keep",
    ):
        sleep(PLAN, state, pools, "nap")
    with pytest.raises(TypeError, match=r"mode=3 is invalid: it must be SleepMode.OFFLOAD"):
        sleep(PLAN, state, pools, 3)
    with pytest.raises(TypeError, match=r"plan='str' is invalid: it must be a CachePlan"):
        sleep("plan", state, pools, "offload")
    with pytest.raises(
        TypeError,
        match=r"state='dict' is invalid: it must be a CacheState\. Fix: pass the state create_state\(plan\) made",
    ):
        sleep(PLAN, {}, pools, "offload")
    with pytest.raises(
        TypeError,
        match=r"pools='tuple' is invalid: it must be the pools \(a Pools, or a pytree of device arrays\)",
    ):
        sleep(PLAN, state, (), "offload")
    other = make_plan(24)
    with pytest.raises(
        ValueError,
        match=r"state='a CacheState of another plan' is invalid: its tables and pools are laid out for a different plan\. Fix: pass the plan the state was created with",
    ):
        sleep(other, state, create_pools(other), "offload")
    with pytest.raises(
        ValueError,
        match=r"pools='a Pools of another plan' is invalid: its arrays' shapes or dtypes are not the plan's pool_specs",
    ):
        sleep(PLAN, state, create_pools(other), "offload")
    asleep = sleep(PLAN, state, pools, "discard")
    assert isinstance(asleep, Sleeping) and asleep.host is None and asleep.host_bytes == 0
    with pytest.raises(
        ValueError,
        match=r"pools='pools with \d+ deleted array\(s\)' is invalid: sleep needs live pools",
    ):
        sleep(PLAN, create_state(PLAN), pools, "discard")
    woken = wake(asleep)
    with pytest.raises(
        ValueError,
        match=r"sleeping='a Sleeping value woken already' is invalid: a sleeping cache can be woken once",
    ):
        wake(asleep)
    # OFFLOAD hands its state out as is (nothing deleted): a second wake is refused all the
    # same, or two callers would continue one state with two copies of the pools.
    offloaded = sleep(PLAN, woken.state, woken.pools, "offload")
    woken = wake(offloaded)
    with pytest.raises(ValueError, match=r"sleeping='a Sleeping value woken already'"):
        wake(offloaded)
    # A state that ran on after its wake is deleted (donated): a copy of the Sleeping value
    # that was never woken is refused for that.
    twin = dataclasses.replace(sleep(PLAN, woken.state, woken.pools, "offload"), _woken=[])
    run_on = wake(twin).state
    ops.retire(PLAN, run_on, host.retire_batch(PLAN, []))
    with pytest.raises(ValueError, match=r"sleeping='a Sleeping value whose state is deleted'"):
        wake(dataclasses.replace(twin, _woken=[]))
    with pytest.raises(
        TypeError,
        match=r"sleeping='tuple' is invalid: it must be the Sleeping value sleep\(\) returned",
    ):
        wake((woken.state, woken.pools))


def test_any_pytree_of_pools_sleeps_and_wakes():
    """Target and draft pools held together (a tuple) sleep as one."""
    state = create_state(PLAN)
    pair = (create_pools(PLAN), {"draft": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)})
    woken = wake(sleep(PLAN, state, pair, SleepMode.OFFLOAD))
    assert isinstance(woken.pools, tuple) and isinstance(woken.pools[1], dict)
    np.testing.assert_array_equal(
        np.asarray(woken.pools[1]["draft"], np.float32), np.arange(6).reshape(2, 3)
    )
