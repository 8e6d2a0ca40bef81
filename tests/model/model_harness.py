"""Test harness: a tiny serving loop driving the cached step through the real coordinator.

``Engine`` runs every step the way a serving stack would: ``admit`` (a new request's first
chunk) and ``extend`` (everyone else) -> ``step_metadata`` -> (``propose``) -> ``step`` ->
``retire`` (accepted tokens; fewer than scheduled rewinds) -> ``reclaim``; ``release`` retracts.
Each step passes exactly one extend result and one admit result to ``step_metadata`` (either
may be empty), so the step has one shape and compiles once. The engine records what each
accepted position produced, for comparison with ``dense_forward``.

``share_prefix`` is the one piece of test allocator left: until the coordinator matches
prefixes itself, it writes into the coordinator state exactly what a prefix hit produces (the
donor's pages in the new request's tables, one more reference each, ``lo``/``hi``, ``n = c =
h``) and ``check_state`` verifies the result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.coordinator import ReleaseMode, create_state, host, ops, step_metadata
from flatkv_jax.coordinator.audit import check_state, page_counts
from flatkv_jax.model import (
    DeepSeekV4,
    DraftBatch,
    StepBatch,
    dense_forward,
    init_params,
    make_propose,
    make_step,
)
from flatkv_jax.pools import create_pools
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from flatkv_jax.status import Status

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


@functools.cache
def nnx_jitted(graphdef, plan):
    """The engine-side jit of a flax model (``nnx.split`` once, ``nnx.merge`` inside the jitted
    function, pools donated): ``fn(weights, pools, batch, meta, table_buffer)``."""

    @functools.partial(jax.jit, donate_argnums=1)
    def step(weights, pools, batch, meta, table_buffer):
        model = nnx.merge(graphdef, weights)
        return model.step(pools, batch, meta, table_buffer, plan=plan)

    @functools.partial(jax.jit, donate_argnums=1)
    def propose(weights, pools, batch, meta, table_buffer):
        model = nnx.merge(graphdef, weights)
        return model.propose(pools, batch, meta, table_buffer, plan=plan)

    return step, (propose if plan.limits.verify_width else None)


def dense(params, cfg, plan, tokens):
    """Dense recompute of ``tokens`` padded to a fixed length (one compilation per plan):
    ``dense_forward`` of a ``Params`` pytree, or ``DeepSeekV4.dense`` of a model.

    The model is causal, so the padding cannot change the outputs of the real positions.
    """
    length = plan.limits.max_context + plan.limits.verify_width + 1
    padded = np.zeros(length, np.int32)
    padded[: len(tokens)] = tokens
    if isinstance(params, DeepSeekV4):
        logits, hidden, draft = params.dense(jnp.asarray(padded))
    else:
        logits, hidden, draft = dense_forward(params, jnp.asarray(padded), cfg)
    cut = len(tokens)
    return (
        np.asarray(logits)[:cut],
        np.asarray(hidden)[:cut],
        None if draft is None else np.asarray(draft)[:cut],
    )


def share_prefix(plan, state, dst: int, src: int, h: int):
    """What a prefix hit of ``h`` tokens from request slot ``src`` gives request slot ``dst``
    (admitted with no chunk): the donor's pages for ``[0, h)`` (window groups from ``lo(h) =
    max(0, h - hit_reach) // B``, what the tokens after ``h`` read; holes below), one more
    reference each, ``n = c = h``. The donor's reclaim may already have dropped the rest (a
    group with a period drops its state before the last boundary)."""
    lay = state.layout
    tb = np.array(state.table_buffer)
    rc = np.array(state.allocator.refcount)
    lo, hi = np.array(state.lo), np.array(state.hi)
    for gi, g in enumerate(plan.groups):
        b, w, off = g.block_tokens, lay.table_width[gi], lay.table_offset[gi]
        assert h % b == 0, (g.name, h, b)
        first = max(0, h - g.hit_reach) // b if g.is_window else 0
        d, s = tb[off + dst * w : off + (dst + 1) * w], tb[off + src * w : off + (src + 1) * w]
        assert (d == -1).all() and (s[first : h // b] >= 1).all(), g.name
        d[:first] = 0
        d[first : h // b] = s[first : h // b]
        rc[lay.pools.page_offset[gi] + d[first : h // b]] += 1
        lo[gi, dst], hi[gi, dst] = first, h // b
    ext = np.array(state.extent)
    ext[dst] = h
    state = dataclasses.replace(
        state,
        table_buffer=jnp.asarray(tb),
        allocator=dataclasses.replace(state.allocator, refcount=jnp.asarray(rc)),
        lo=jnp.asarray(lo),
        hi=jnp.asarray(hi),
        extent=jnp.asarray(ext),
        committed=jnp.asarray(ext.copy()),
    )
    check_state(plan, state, shared_ok=True)
    return state


def _ok(result, n: int, what: str) -> None:
    got = host.statuses(result, n)
    assert got == [Status.OK] * n, (what, got)


class Engine:
    """A minimal serving loop over the real coordinator: prefill chunks, decode, MTP verify
    rounds, retract. Requests are named by engine ids (``admit``'s return value)."""

    def __init__(self, cfg, plan, params, *, pools=None, rng=None, publish=False):
        """``params``: a ``Params`` pytree (the functional ``make_step``) or a ``DeepSeekV4``
        module (jitted the flax way, see :func:`nnx_jitted`; dense reference ``model.dense``).
        ``publish``: pass token ids to admit/extend (prefix matching and publishing)."""
        self.cfg, self.plan = cfg, plan
        self.model = params if isinstance(params, DeepSeekV4) else None
        if self.model is None:
            self.params = params
            self.step_fn, self.propose_fn = jitted(cfg, plan)
        else:
            graphdef, self.params = nnx.split(self.model)
            self.step_fn, self.propose_fn = nnx_jitted(graphdef, plan)
        self.publish = publish
        self.by_prefix: dict[tuple[int, ...], np.ndarray] = {}  # hidden of a prefix's last token
        self.state = create_state(plan)
        self.pools = create_pools(plan) if pools is None else pools
        self.k = plan.limits.verify_width
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.handle: dict[int, tuple[int, int] | None] = {}  # None: admitted by its first step
        self.seq: dict[int, list[int]] = {}
        self.logits: dict[int, dict[int, np.ndarray]] = {}
        self.draft: dict[int, dict[int, np.ndarray]] = {}
        self.hidden: dict[int, dict[int, np.ndarray]] = {}
        self.proposed: dict[int, dict[int, np.ndarray]] = {}
        self.first: dict[int, int] = {}  # first position this request computed itself
        self.steps = 0
        self.zeroed = [set() for _ in plan.groups]
        self.recycled = 0  # zero-listed pages that had been handed out before

    # --- requests -------------------------------------------------------------------------
    def admit(self, prompt, *, share_from: int | None = None, hit: int = 0) -> int:
        """A new request; it is admitted by the first step that schedules it (its first chunk
        rides in that step's admit batch), or at once when it takes a prefix from
        ``share_from``."""
        rid = len(self.seq)
        self.seq[rid] = list(prompt)
        for d in (self.logits, self.draft, self.hidden, self.proposed):
            d[rid] = {}
        self.handle[rid] = None
        self.first[rid] = hit
        if share_from is not None and hit:
            assert self.seq[share_from][:hit] == self.seq[rid][:hit]
            self.state, res = ops.admit(
                self.plan, self.state, host.admit_batch(self.plan, [(len(prompt), 0)])
            )
            _ok(res, 1, "admit")
            self.handle[rid] = host.handles(res, 1)[0]
            src = self.handle[share_from][0]
            self.state = share_prefix(self.plan, self.state, self.handle[rid][0], src, hit)
            # The engine carries the target hidden of h - 1 for the MTP layer (see docs/model.md).
            self.hidden[rid][hit - 1] = self.hidden[share_from][hit - 1]
        return rid

    def live(self) -> list[int]:
        """Requests not retracted (admitted or waiting for their first step)."""
        return list(self.handle)

    def n(self, rid: int) -> int:
        h = self.handle[rid]
        return 0 if h is None else int(np.asarray(self.state.extent)[h[0]])

    def c(self, rid: int) -> int:
        h = self.handle[rid]
        return 0 if h is None else int(np.asarray(self.state.committed)[h[0]])

    def retract(self, rid: int) -> list[int]:
        """Releases the request (RETRACT); returns its accepted tokens (to readmit it later)."""
        tokens = self.seq[rid][: self.c(rid) + 1]
        if self.handle[rid] is not None:
            self.state, res = ops.release(
                self.plan,
                self.state,
                host.release_batch(self.plan, [(self.handle[rid], ReleaseMode.RETRACT)]),
            )
            _ok(res, 1, "release")
        del self.handle[rid]
        return tokens

    def in_use(self, group: str) -> int:
        return page_counts(self.plan, self.state)[group].in_use

    # --- steps ----------------------------------------------------------------------------
    def _schedule(self, work):
        """extend + admit for ``work = [(rid, count)]``; returns the step metadata and the
        engine id of each step row (extend rows first, then admit rows)."""
        r = self.plan.limits.max_requests
        ext = [(rid, n) for rid, n in work if self.handle[rid] is not None]
        adm = [(rid, n) for rid, n in work if self.handle[rid] is None]
        eb = host.extend_batch(self.plan, [(self.handle[rid], n) for rid, n in ext])
        ab = host.admit_batch(self.plan, [(len(self.seq[rid]), n) for rid, n in adm])
        if self.publish:
            mc = max(self.plan.limits.chunk_tokens, self.plan.limits.decode_tokens)
            et = np.zeros((r, mc), np.int32)
            for i, (rid, n) in enumerate(ext):
                start = self.n(rid)
                # A verify block's drafts are not known yet: verify() fills them in.
                known = self.seq[rid][start : start + n]
                et[i, : len(known)] = known
            at = np.zeros((r, self.plan.limits.max_context), np.int32)
            for i, (rid, _) in enumerate(adm):
                at[i, : len(self.seq[rid])] = self.seq[rid]
            eb = dataclasses.replace(eb, tokens=jnp.asarray(et))
            ab = dataclasses.replace(
                ab, tokens=jnp.asarray(at), namespace=jnp.zeros((r,), jnp.int32)
            )
        self.state, er = ops.extend(self.plan, self.state, eb)
        _ok(er, len(ext), "extend")
        self.state, ar = ops.admit(self.plan, self.state, ab, same_step=(er,))
        _ok(ar, len(adm), "admit")
        hits = np.asarray(ar.hit)
        for i, ((rid, _), h) in enumerate(zip(adm, host.handles(ar, len(adm)), strict=True)):
            self.handle[rid] = h
            self.first[rid] = int(hits[i])
        md = step_metadata(self.plan, self.state, (er, ar))
        assert not bool(md.overflow)
        zero = np.asarray(md.zero)
        for gi, ids in enumerate(zero):
            for page in ids[ids >= 0].tolist():
                self.recycled += page in self.zeroed[gi]
                self.zeroed[gi].add(page)
        rows = [rid for rid, _ in ext] + [None] * (r - len(ext))
        rows += [rid for rid, _ in adm] + [None] * (r - len(adm))
        return md, rows

    def _prev_hidden(self, md, rows):
        prev = np.zeros((self.plan.limits.max_requests, self.cfg.hidden), np.float32)
        row_slot, row_start = np.asarray(md.row_slot), np.asarray(md.row_start)
        for i, (slot, start) in enumerate(zip(row_slot, row_start, strict=True)):
            if slot >= 0 and start > 0:
                rid, p = rows[i], int(start) - 1
                # After a prefix hit the engine takes h_{h-1} from whoever computed that prefix.
                got = self.hidden[rid].get(p)
                prev[slot] = self.by_prefix[tuple(self.seq[rid][: p + 1])] if got is None else got
        return jnp.asarray(prev)

    def _step(self, md, rows, token_of):
        """The target step over the metadata's tokens; ``token_of(row, rid, pos)``."""
        tok = np.zeros(self.plan.limits.step_tokens, np.int32)
        trow, tpos = np.asarray(md.token_row), np.asarray(md.token_pos)
        for t in np.flatnonzero(trow >= 0):
            tok[t] = token_of(int(trow[t]), rows[trow[t]], int(tpos[t]))
        batch = StepBatch(tokens=jnp.asarray(tok), prev_hidden=self._prev_hidden(md, rows))
        out, self.pools = self.step_fn(self.params, self.pools, batch, md, self.state.table_buffer)
        self.steps += 1
        logits, hidden = np.asarray(out.logits), np.asarray(out.hidden)
        draft = None if out.draft_logits is None else np.asarray(out.draft_logits)
        for t in np.flatnonzero(trow >= 0):
            rid, p = rows[trow[t]], int(tpos[t])
            self.logits[rid][p] = logits[t]
            self.hidden[rid][p] = hidden[t]
            if self.publish:
                # A verify block's drafts join seq only after the step: take them from token_of.
                key = self.seq[rid][: p + 1]
                key = key + [token_of(int(trow[t]), rid, q) for q in range(len(key), p + 1)]
                self.by_prefix[tuple(key)] = hidden[t]
            if draft is not None:
                self.draft[rid][p] = draft[t]

    def _finish(self, accepted):
        """retire (``accepted = {rid: tokens}``) and reclaim."""
        hs = [(self.handle[rid], a) for rid, a in accepted.items()]
        self.state, res = ops.retire(self.plan, self.state, host.retire_batch(self.plan, hs))
        _ok(res, len(hs), "retire")
        self.state, res = ops.reclaim(
            self.plan, self.state, host.handle_batch(self.plan, [h for h, _ in hs])
        )
        _ok(res, len(hs), "reclaim")

    def run(self, work):
        """One step of plain work: ``[(rid, count)]``; every token is accepted.

        Prefill tokens come from the prompt; past the prompt each request generates greedily
        (a count > 1 past the prompt is not allowed: the token is not known yet).
        """
        for rid, count in work:
            assert self.n(rid) + count <= len(self.seq[rid]), "cannot prefill unknown tokens"
        md, rows = self._schedule(work)
        self._step(md, rows, lambda i, rid, p: self.seq[rid][p])
        # A prefix hit clips an admitted chunk: retire what each row actually scheduled.
        count = np.asarray(md.row_count)
        self._finish({rid: int(count[i]) for i, rid in enumerate(rows) if rid is not None})
        for rid, _ in work:
            c = self.c(rid)
            assert self.first[rid] < c
            if c == len(self.seq[rid]):
                self.seq[rid].append(int(np.argmax(self.logits[rid][c - 1])))

    def verify(self, rids, accept=None):
        """One speculative round for each of ``rids`` (each must be past its prompt).

        The MTP layer proposes k tokens, the target verifies ``1 + k`` positions, ``accept``
        (default: random) drafts are accepted (``retire`` with ``a + 1``: fewer than ``1 + k``
        rewinds) and the target's next token is appended.
        """
        r = self.plan.limits.max_requests
        for rid in rids:
            assert self.n(rid) == len(self.seq[rid]) - 1
        md, rows = self._schedule([(rid, 1 + self.k) for rid in rids])
        tokens = np.zeros(r, np.int32)
        active = np.zeros(r, bool)
        row_slot, row_start = np.asarray(md.row_slot), np.asarray(md.row_start)
        for i, rid in enumerate(rows):
            if rid is not None:
                tokens[row_slot[i]], active[row_slot[i]] = self.seq[rid][row_start[i]], True
        batch = DraftBatch(
            tokens=jnp.asarray(tokens),
            prev_hidden=self._prev_hidden(md, rows),
            active=jnp.asarray(active),
        )
        out, self.pools = self.propose_fn(
            self.params, self.pools, batch, md, self.state.table_buffer
        )
        drafts, prop_logits = np.asarray(out.tokens), np.asarray(out.logits)
        block = {}
        for i, rid in enumerate(rows):
            if rid is not None:
                n = int(row_start[i])
                self.proposed[rid][n] = prop_logits[i, 0]
                block[rid] = (n, [self.seq[rid][n], *drafts[i].tolist()])
        if self.publish:
            # The extend recorded the block's tokens before the drafts existed: put the drafts
            # into the in-flight step's token record, so retire publishes the verified tokens.
            ft = np.array(self.state.fifo_tokens)
            head, flen = np.asarray(self.state.fifo_head), np.asarray(self.state.fifo_len)
            for i, rid in enumerate(rows):
                if rid is not None:
                    slot = int(row_slot[i])
                    tail = (head[slot] + flen[slot] - 1) % ft.shape[1]
                    ft[slot, tail, 1 : 1 + self.k] = drafts[i]
            self.state = dataclasses.replace(self.state, fifo_tokens=jnp.asarray(ft))
        self._step(md, rows, lambda i, rid, p: block[rid][1][p - block[rid][0]])
        accepted = {}
        for rid, (_, toks) in block.items():
            a = int(self.rng.integers(0, self.k + 1)) if accept is None else accept
            self.seq[rid] += toks[1 : 1 + a]
            accepted[rid] = a
        self._finish({rid: a + 1 for rid, a in accepted.items()})
        for rid, (n, _) in block.items():
            c = self.c(rid)
            assert c == n + accepted[rid] + 1
            self.seq[rid].append(int(np.argmax(self.logits[rid][c - 1])))
        return accepted

    # --- checks ---------------------------------------------------------------------------
    def check_parity(self, rid: int, tol: float = TOL, draft: bool = True) -> float:
        """Max |cached - dense| over the request's accepted, self-computed positions."""
        c = self.c(rid)
        ref = self.params if self.model is None else self.model
        ref_logits, _, ref_draft = dense(ref, self.cfg, self.plan, self.seq[rid][:c])
        positions = range(self.first[rid], c)
        got = np.stack([self.logits[rid][p] for p in positions])
        err = float(np.abs(got - ref_logits[self.first[rid] : c]).max())
        assert err <= tol, f"request {rid}: target logits differ by {err}"
        if draft and ref_draft is not None:
            got = np.stack([self.draft[rid][p] for p in positions])
            derr = float(np.abs(got - ref_draft[self.first[rid] : c]).max())
            assert derr <= tol, f"request {rid}: draft logits differ by {derr}"
            for p, lg in self.proposed[rid].items():
                if p < c:
                    perr = float(np.abs(lg - ref_draft[p]).max())
                    assert perr <= tol, f"request {rid}: first proposal at {p} differs by {perr}"
            err = max(err, derr)
        return err

    def check_state(self) -> None:
        """Every coordinator invariant holds (pages may be shared after a prefix hit)."""
        check_state(self.plan, self.state, shared_ok=True)
