"""Small plans and a one-request-at-a-time driver for the oracle tests."""

from __future__ import annotations

import numpy as np

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.oracle import RadixOracle, ReleaseMode, admit_batch, extend_batch, handle_batch
from flatkv_jax.recipes import deepseek_v4_groups, full_attention_groups, hybrid_swa_groups, tiny_v4
from flatkv_jax.status import Status

V4_GROUPS = deepseek_v4_groups(tiny_v4(head_dim=16, rope_dim=4, index_head_dim=8), verify_width=2)


def v4_plan(
    pages: int | dict = 40, *, max_requests: int = 4, max_context: int = 64, chunk: int = 16
):
    """tiny V4: swa/mtp/c4_state/c4_index_state blocks of 4 tokens (window 8), c16_state
    window 20, c4_kv and c16_kv blocks of 16 tokens; prefix granularity 16."""
    lim = ServingLimits(
        max_requests=max_requests, max_context=max_context, chunk_tokens=chunk, verify_width=2
    )
    return plan_with_pages(V4_GROUPS, lim, pages)


def full_plan(
    pages: int = 32,
    *,
    max_requests: int = 4,
    max_context: int = 48,
    chunk: int = 8,
    verify: int = 2,
):
    """One history group, blocks of 4 tokens (granularity 4)."""
    groups = full_attention_groups(1, 1, 4, dtype="float32", rows_per_page=4)
    lim = ServingLimits(
        max_requests=max_requests, max_context=max_context, chunk_tokens=chunk, verify_width=verify
    )
    return plan_with_pages(groups, lim, pages)


def hybrid_plan(
    full: int = 40, swa: int = 12, *, max_requests: int = 4, max_context: int = 48, chunk: int = 16
):
    """``full_kv`` (history) + ``swa_kv`` (window 8), blocks of 4 tokens, granularity 4."""
    groups = hybrid_swa_groups("SF", 1, 4, 8, dtype="float32", rows_per_page=4)
    lim = ServingLimits(
        max_requests=max_requests, max_context=max_context, chunk_tokens=chunk, verify_width=2
    )
    return plan_with_pages(groups, lim, {"full_kv": full, "swa_kv": swa})


def toks(*parts) -> list[int]:
    """Concatenates ints and ranges into a token list."""
    out = []
    for p in parts:
        out += list(p) if not isinstance(p, int) else [p]
    return out


class Driver:
    """Drives a :class:`RadixOracle` one request at a time (statuses as ``Status``)."""

    def __init__(self, plan):
        self.plan = plan
        self.o = RadixOracle(plan)
        self.ns = 0

    def admit(self, tokens, first_chunk=None, namespace=None):
        chunk = (
            min(self.plan.limits.chunk_tokens, len(tokens)) if first_chunk is None else first_chunk
        )
        ns = self.ns if namespace is None else namespace
        res = self.o.admit(admit_batch(self.plan, [(ns, tokens, chunk)]))
        return (
            Status(int(res.status[0])),
            (int(res.slot[0]), int(res.generation[0])),
            int(res.hit[0]),
        )

    def probe(self, tokens, namespace=None) -> int:
        """The hit ``tokens`` would get now (admits without a first chunk, then aborts; the
        hit pages go back to the LRU list as the most recently released)."""
        st, h, hit = self.admit(tokens, first_chunk=0, namespace=namespace)
        assert st is Status.OK, st
        assert self.release(h, ReleaseMode.ABORT) is Status.OK
        return hit

    def admit_many(self, rows):
        return self.o.admit(admit_batch(self.plan, rows))

    def extend(self, h, tokens) -> Status:
        return Status(int(self.o.extend(extend_batch(self.plan, [(h, tokens)])).status[0]))

    def retire(self, h, accepted) -> Status:
        return Status(int(self.o.retire(handle_batch(self.plan, [(h, accepted)])).status[0]))

    def rewind(self, h, extent) -> Status:
        return Status(int(self.o.rewind(handle_batch(self.plan, [(h, extent)])).status[0]))

    def reclaim(self, h) -> Status:
        return Status(int(self.o.reclaim(handle_batch(self.plan, [h])).status[0]))

    def release(self, h, mode=ReleaseMode.FINISH) -> Status:
        return Status(int(self.o.release(handle_batch(self.plan, [(h, int(mode))])).status[0]))

    def state(self, h):
        c = self.o.counts()
        return int(c.extent[h[0]]), int(c.committed[h[0]])

    def retire_all(self, h):
        """Retires every in-flight step with everything accepted."""
        while self.o.counts().in_flight[h[0]]:
            count = self.o.requests[h[0]].fifo[0][1]
            assert self.retire(h, count) is Status.OK

    def run(self, tokens, *, namespace=None, reclaim=False):
        """Admits ``tokens`` and prefills all of them (every step accepted); returns the
        handle and the hit."""
        st, h, hit = self.admit(tokens, namespace=namespace)
        assert st is Status.OK, st
        self.retire_all(h)
        n, _ = self.state(h)
        chunk = self.plan.limits.chunk_tokens
        while n < len(tokens):
            assert self.extend(h, tokens[n : n + chunk]) is Status.OK
            self.retire_all(h)
            if reclaim:
                self.reclaim(h)
            n, _ = self.state(h)
        return h, hit

    def decode(self, h, tokens, *, reclaim=False):
        """Decodes ``tokens`` one step of 1 token at a time, all accepted."""
        for t in tokens:
            assert self.extend(h, [t]) is Status.OK
            assert self.retire(h, 1) is Status.OK
            if reclaim:
                assert self.reclaim(h) is Status.OK

    def counts(self, group: str):
        c = self.o.counts()
        gi = self.plan.group_index(group)
        return int(c.free[gi]), int(c.in_use[gi]), int(c.cached_only[gi])

    def check(self):
        assert self.o.violations() == []


def rng_tokens(seed: int, n: int, vocab: int = 1000) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]
