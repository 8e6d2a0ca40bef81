"""Test harness: a trivial host allocator and a tiny serving loop around the cached step.

``HostCache`` keeps absolute tables the way docs/semantics.md describes them (``-1`` not
allocated, ``0`` hole, ``>= 1`` page), hands out pages from per-pool free lists, lists every
page it hands out in the next step's zero list, reclaims window slots below
``lo = max(0, (c - W + 1) // B)`` and can share a prefix of another live request (what a prefix
hit produces). ``Engine`` drives chunked prefill, decode and MTP verify rounds through the
jitted step and records what each accepted position produced, for comparison with
``dense_forward``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.groups import Owner
from flatkv_jax.model import (
    DraftBatch,
    StepBatch,
    StepMeta,
    dense_forward,
    init_params,
    make_propose,
    make_step,
)
from flatkv_jax.pools import create_pools
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups

TOL = 1e-5
#: Quantized formats: a 1-ulp fp32 difference can flip one quantized code (measured <= 6e-5).
QUANT_TOL = 1e-3

#: Tiny serving limits: 4 requests, 64 tokens (8 windows), chunks of <= 12, 2 draft tokens.
LIMITS = ServingLimits(
    max_requests=4, max_context=64, chunk_tokens=12, verify_width=2, step_tokens=16
)
PAGES = 40


def make_plan(cfg, limits=LIMITS, pages=PAGES):
    return plan_with_pages(
        deepseek_v4_groups(cfg.cache, verify_width=limits.verify_width), limits, pages
    )


class Setup:
    """A model config, its plan and random params."""

    def __init__(self, cfg, limits=LIMITS, pages=PAGES, seed=0):
        self.cfg = cfg
        self.plan = make_plan(cfg, limits, pages)
        self.params = init_params(cfg, seed)


@functools.cache
def jitted(cfg, plan):
    """One jitted (step, propose) pair per (cfg, plan), shared by every engine of a test run."""
    return make_step(cfg, plan), (make_propose(cfg, plan) if plan.limits.verify_width else None)


def dense(params, cfg, plan, tokens):
    """``dense_forward`` on ``tokens`` padded to a fixed length (one compilation per plan).

    The model is causal, so the padding cannot change the outputs of the real positions.
    """
    length = plan.limits.max_context + plan.limits.verify_width + 1
    padded = np.zeros(length, np.int32)
    padded[: len(tokens)] = tokens
    logits, hidden, draft = dense_forward(params, jnp.asarray(padded), cfg)
    cut = len(tokens)
    return (
        np.asarray(logits)[:cut],
        np.asarray(hidden)[:cut],
        None if draft is None else np.asarray(draft)[:cut],
    )


class HostCache:
    """Per-group free lists, refcounts and absolute tables for every request slot."""

    def __init__(self, plan):
        self.plan = plan
        r = plan.limits.max_requests
        self.tables = [np.full(plan.table_shape(g), -1, np.int32) for g in plan.groups]
        # pop() hands out the lowest id first; freed pages go to the end and are reused first.
        self.free = [list(range(plan.pages(g) - 2, 0, -1)) for g in plan.groups]
        self.ref = [np.zeros(plan.pages(g), np.int32) for g in plan.groups]
        self.n = np.zeros(r, np.int64)
        self.c = np.zeros(r, np.int64)
        self.live = np.zeros(r, bool)
        self.zero = [[] for _ in plan.groups]
        self.used = [set() for _ in plan.groups]
        self.recycled = 0  # pages handed out that had been used before

    def admit(self) -> int:
        slot = int(np.flatnonzero(~self.live)[0])
        self.live[slot] = True
        self.n[slot] = self.c[slot] = 0
        return slot

    def share_prefix(self, dst: int, src: int, h: int) -> None:
        """Point ``dst``'s tables at ``src``'s pages for the prefix ``[0, h)`` (a prefix hit)."""
        for gi, g in enumerate(self.plan.groups):
            b = g.block_tokens
            assert h % b == 0
            lo = max(0, (h - g.window) // b) if g.is_window else 0
            self.tables[gi][dst, :lo] = 0
            for i in range(lo, h // b):
                page = self.tables[gi][src, i]
                assert page >= 1, (g.name, i)
                self.tables[gi][dst, i] = page
                self.ref[gi][page] += 1
        self.n[dst] = self.c[dst] = h

    def extend(self, slot: int, count: int) -> None:
        n = int(self.n[slot])
        for gi, g in enumerate(self.plan.groups):
            b = g.block_tokens
            for i in range(n // b, (n + count - 1) // b + 1):
                if self.tables[gi][slot, i] < 1:
                    page = self.free[gi].pop()
                    self.recycled += page in self.used[gi]
                    self.used[gi].add(page)
                    self.tables[gi][slot, i] = page
                    self.ref[gi][page] = 1
                    self.zero[gi].append(page)
        self.n[slot] = n + count

    def commit(self, slot: int, c: int) -> None:
        """Accepts positions ``[0, c)`` and rewinds the extent to ``c`` (pages are kept)."""
        self.c[slot] = self.n[slot] = c

    def _decref(self, gi: int, page: int) -> None:
        self.ref[gi][page] -= 1
        if self.ref[gi][page] == 0:
            self.free[gi].append(page)

    def reclaim(self, slot: int) -> None:
        for gi, g in enumerate(self.plan.groups):
            if not g.is_window:
                continue
            lo = max(0, (int(self.c[slot]) - g.window + 1) // g.block_tokens)
            for i in range(lo):
                page = self.tables[gi][slot, i]
                if page >= 1:
                    self._decref(gi, page)
                    self.tables[gi][slot, i] = 0

    def release(self, slot: int) -> None:
        for gi in range(len(self.plan.groups)):
            for page in self.tables[gi][slot]:
                if page >= 1:
                    self._decref(gi, page)
            self.tables[gi][slot] = -1
        self.live[slot] = False

    def zero_lists(self, owners=None):
        """Pads and clears the pending zero lists (only groups owned by ``owners``, if given)."""
        out = []
        for gi, g in enumerate(self.plan.groups):
            k = self.plan.usable_pages(g)
            ids = np.full(k, -1, np.int32)
            if owners is None or g.owner in owners:
                ids[: len(self.zero[gi])] = self.zero[gi]
                self.zero[gi] = []
            out.append(jnp.asarray(ids))
        return tuple(out)

    def table_arrays(self):
        return tuple(jnp.asarray(t) for t in self.tables)

    def in_use(self, gi: int) -> int:
        return int((self.ref[gi] > 0).sum())


class Engine:
    """A minimal serving loop: prefill chunks, decode, MTP verify rounds, retract."""

    def __init__(self, cfg, plan, params, *, pools=None, rng=None):
        self.cfg, self.plan, self.params = cfg, plan, params
        self.cache = HostCache(plan)
        self.pools = create_pools(plan) if pools is None else pools
        self.step_fn, self.propose_fn = jitted(cfg, plan)
        self.k = plan.limits.verify_width
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.seq: dict[int, list[int]] = {}
        self.logits: dict[int, dict[int, np.ndarray]] = {}
        self.draft: dict[int, dict[int, np.ndarray]] = {}
        self.hidden: dict[int, dict[int, np.ndarray]] = {}
        self.proposed: dict[int, dict[int, np.ndarray]] = {}
        self.first: dict[int, int] = {}  # first position this request computed itself
        self.steps = 0

    # --- requests -------------------------------------------------------------------------
    def admit(self, prompt, *, share_from: int | None = None, hit: int = 0) -> int:
        slot = self.cache.admit()
        self.seq[slot] = list(prompt)
        for d in (self.logits, self.draft, self.hidden, self.proposed):
            d[slot] = {}
        if share_from is not None and hit:
            assert self.seq[share_from][:hit] == self.seq[slot][:hit]
            self.cache.share_prefix(slot, share_from, hit)
            # The engine carries the target hidden of h - 1 for the MTP layer (see docs/model.md).
            self.hidden[slot][hit - 1] = self.hidden[share_from][hit - 1]
        self.first[slot] = hit
        return slot

    def retract(self, slot: int) -> list[int]:
        """Frees the request; returns its accepted tokens (to readmit it later)."""
        tokens = self.seq[slot][: int(self.cache.c[slot]) + 1]
        self.cache.release(slot)
        return tokens

    def _prev_hidden(self, slots_starts):
        prev = np.zeros((self.plan.limits.max_requests, self.cfg.hidden), np.float32)
        for slot, start in slots_starts:
            if start > 0:
                prev[slot] = self.hidden[slot][start - 1]
        return jnp.asarray(prev)

    # --- steps ----------------------------------------------------------------------------
    def _run(self, items, draft_zeroed: bool):
        """One step over ``items = [(slot, start, tokens)]``; returns the StepOutput as numpy."""
        s = self.plan.limits.step_tokens
        tok = np.zeros(s, np.int32)
        tslot = np.full(s, -1, np.int32)
        tpos = np.full(s, -1, np.int32)
        i = 0
        for slot, start, tokens in items:
            m = len(tokens)
            tok[i : i + m] = tokens
            tslot[i : i + m] = slot
            tpos[i : i + m] = np.arange(start, start + m)
            i += m
        assert i <= s
        owners = {Owner.TARGET} if draft_zeroed else None
        meta = StepMeta(
            token_slot=jnp.asarray(tslot),
            token_pos=jnp.asarray(tpos),
            tables=self.cache.table_arrays(),
            zero_pages=self.cache.zero_lists(owners),
        )
        batch = StepBatch(
            tokens=jnp.asarray(tok), prev_hidden=self._prev_hidden([(a, b) for a, b, _ in items])
        )
        out, self.pools = self.step_fn(self.params, self.pools, batch, meta)
        self.steps += 1
        logits = np.asarray(out.logits)
        hidden = np.asarray(out.hidden)
        draft = None if out.draft_logits is None else np.asarray(out.draft_logits)
        i = 0
        for slot, start, tokens in items:
            for j in range(len(tokens)):
                self.logits[slot][start + j] = logits[i + j]
                self.hidden[slot][start + j] = hidden[i + j]
                if draft is not None:
                    self.draft[slot][start + j] = draft[i + j]
            i += len(tokens)

    def run(self, work):
        """One step of plain work: ``[(slot, count)]``; every token is accepted.

        Prefill tokens come from the prompt; past the prompt each request generates greedily
        (a count > 1 past the prompt is not allowed: the token is not known yet).
        """
        items = []
        for slot, count in work:
            n = int(self.cache.n[slot])
            assert n + count <= len(self.seq[slot]), "cannot prefill unknown tokens"
            self.cache.extend(slot, count)
            items.append((slot, n, self.seq[slot][n : n + count]))
        self._run(items, draft_zeroed=False)
        for slot, n, tokens in items:
            c = n + len(tokens)
            self.cache.commit(slot, c)
            self.cache.reclaim(slot)
            if c == len(self.seq[slot]):
                self.seq[slot].append(int(np.argmax(self.logits[slot][c - 1])))

    def verify(self, slots, accept=None):
        """One speculative round for each of ``slots`` (each must be past its prompt).

        The MTP layer proposes k tokens, the target verifies ``1 + k`` positions, ``accept``
        (default: random) drafts are accepted and the target's next token is appended.
        """
        r = self.plan.limits.max_requests
        tokens = np.zeros(r, np.int32)
        start = np.full(r, -1, np.int32)
        for slot in slots:
            n = int(self.cache.n[slot])
            assert n == len(self.seq[slot]) - 1
            tokens[slot], start[slot] = self.seq[slot][n], n
            self.cache.extend(slot, 1 + self.k)
        batch = DraftBatch(
            tokens=jnp.asarray(tokens),
            start_pos=jnp.asarray(start),
            prev_hidden=self._prev_hidden([(s, int(start[s])) for s in slots]),
        )
        tables = self.cache.table_arrays()
        zeros = self.cache.zero_lists({Owner.DRAFT})
        out, self.pools = self.propose_fn(self.params, self.pools, batch, tables, zeros)
        drafts = np.asarray(out.tokens)
        prop_logits = np.asarray(out.logits)
        items = []
        for slot in slots:
            n = int(start[slot])
            self.proposed[slot][n] = prop_logits[slot, 0]
            items.append((slot, n, [self.seq[slot][n], *drafts[slot].tolist()]))
        self._run(items, draft_zeroed=True)
        accepted = {}
        for slot, n, toks in items:
            a = int(self.rng.integers(0, self.k + 1)) if accept is None else accept
            self.seq[slot] += toks[1 : 1 + a]
            c = n + a + 1
            self.seq[slot].append(int(np.argmax(self.logits[slot][c - 1])))
            self.cache.commit(slot, c)
            self.cache.reclaim(slot)
            accepted[slot] = a
        return accepted

    # --- checks ---------------------------------------------------------------------------
    def check_parity(self, slot: int, tol: float = TOL, draft: bool = True) -> float:
        """Max |cached - dense| over the request's accepted, self-computed positions."""
        c = int(self.cache.c[slot])
        ref_logits, _, ref_draft = dense(self.params, self.cfg, self.plan, self.seq[slot][:c])
        positions = range(self.first[slot], c)
        got = np.stack([self.logits[slot][p] for p in positions])
        err = float(np.abs(got - ref_logits[self.first[slot] : c]).max())
        assert err <= tol, f"slot {slot}: target logits differ by {err}"
        if draft and ref_draft is not None:
            got = np.stack([self.draft[slot][p] for p in positions])
            derr = float(np.abs(got - ref_draft[self.first[slot] : c]).max())
            assert derr <= tol, f"slot {slot}: draft logits differ by {derr}"
            for p, lg in self.proposed[slot].items():
                if p < c:
                    perr = float(np.abs(lg - ref_draft[p]).max())
                    assert perr <= tol, f"slot {slot}: first proposal at {p} differs by {perr}"
            err = max(err, derr)
        return err
