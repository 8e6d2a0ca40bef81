"""The engine's jitted step: every state transition of one scheduler iteration, on device.

One call of the function :func:`build_step` returns runs, in this order (mutate first, read
last; docs/coordinator.md):

1. ``release`` of the lanes the host ends (FINISH, ABORT, RETRACT). A lane with a step in
   flight gets ``DEFERRED`` and is freed by the retire below (an aborted step publishes
   nothing, a retracted or finished one publishes its committed blocks).
2. ``retire`` of every lane's in-flight step (the previous call's), with the accepted count
   that call computed and kept on device, then ``reclaim`` of the lanes it committed (window
   pages behind the window): one ``retire_reclaim``.
3. per lane, what to schedule: a prefill chunk (``min(allowance, prompt_len - extent)``
   tokens from the lane's token buffer) or a decode / speculative-verify row (``1 +
   verify_width`` tokens when the allowance holds them, else 1). The host only grants
   *allowances* whose sum is at most ``step_tokens``; the device never schedules more than a
   lane's allowance, so a step can never overflow the token budget whatever the host did
   not know yet (prefix hits, failed steps, finished requests).
4. ``extend`` (running lanes, in the host's order: oldest admission first, so a shortage of
   pages fails the latest admitted) and ``admit`` (new lanes, in arrival order).
5. ``step_metadata``; with MTP the draft layer proposes into each verify block; the model
   step; greedy sampling (argmax) and acceptance of the longest matching draft prefix; the
   emitted tokens go into the lane's token buffer, the accepted count is kept for step 2 of
   the next call.

Requests live in *lanes* (``max_requests`` of them): the host names lanes, the device maps a
lane to its coordinator handle (set from ``admit``'s result inside the step), so the host
never needs a step's results before dispatching the next one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flatkv_jax.coordinator.batches import (
    AdmitBatch,
    ExtendBatch,
    ReleaseBatch,
    RetireBatch,
)
from flatkv_jax.coordinator.metadata import step_metadata_fn
from flatkv_jax.coordinator.ops import (
    admit_fn,
    extend_fn,
    release_fn,
    resolve_max_count,
    retire_reclaim_fn,
)
from flatkv_jax.coordinator.state import CacheState
from flatkv_jax.errors import fail
from flatkv_jax.model.cache_io import DraftBatch, StepBatch
from flatkv_jax.plan import CachePlan
from flatkv_jax.status import Status

_I32 = jnp.int32
_SAME_STEP = "same_step" in inspect.signature(admit_fn).parameters


def _dataclass(cls):
    return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


@_dataclass
class Lanes:
    """Per-lane device state carried from step to step (donated).

    Attributes:
      slot, generation: ``int32[R]``, the lane's coordinator handle (-1: no request).
      seq: ``int32[R, L]``, the lane's tokens by position (prompt, then every emitted token,
        drafts past the committed end); ``L = max_context + verify_width + 1``.
      prompt_len: ``int32[R]``, prompt tokens of the lane's admission.
      remaining: ``int32[R]``, tokens the request may still emit.
      hidden: ``float32[R, H]``, target hidden of the position before the next step's first.
      accept: ``int32[R]``, tokens to retire for the lane's in-flight step (0: none).
    """

    slot: jax.Array
    generation: jax.Array
    seq: jax.Array
    prompt_len: jax.Array
    remaining: jax.Array
    hidden: jax.Array
    accept: jax.Array


@_dataclass
class StepInputs:
    """What the host decides for one step (``[R]`` each).

    Attributes:
      allow: tokens each lane may schedule (0: none).
      order: lanes in extension order (-1 padding).
      release_lane: lanes to release (-1 padding); release_mode: their ``ReleaseMode``.
    """

    allow: jax.Array
    order: jax.Array
    release_lane: jax.Array
    release_mode: jax.Array


@_dataclass
class AdmitInputs:
    """Admissions of one step, rows in arrival order (``[A]`` each, ``tokens [A, C]``; ``A``:
    the engine's admission rows, at most ``max_requests``; ``C``: the kind's ``admit_width``,
    at most ``max_context``).

    Attributes:
      lane: the lane each row takes (-1 padding).
      prompt_len, first, remaining, namespace: per row.
      tokens: the prompts, padded to the step kind's ``admit_width`` (``max_context`` by
        default; every prompt of the batch fits it).
    """

    lane: jax.Array
    prompt_len: jax.Array
    first: jax.Array
    remaining: jax.Array
    namespace: jax.Array
    tokens: jax.Array


def seq_width(plan: CachePlan) -> int:
    """Columns of :attr:`Lanes.seq`: every position a request reaches, drafts included."""
    return plan.limits.max_context + plan.limits.verify_width + 1


def create_lanes(plan: CachePlan, hidden: int) -> Lanes:
    """Empty lanes for ``plan`` (no request anywhere)."""
    r = plan.limits.max_requests
    return Lanes(
        slot=jnp.full((r,), -1, _I32),
        generation=jnp.zeros((r,), _I32),
        seq=jnp.zeros((r, seq_width(plan)), _I32),
        prompt_len=jnp.zeros((r,), _I32),
        remaining=jnp.zeros((r,), _I32),
        hidden=jnp.zeros((r, hidden), jnp.float32),
        accept=jnp.zeros((r,), _I32),
    )


def _scatter(size: int, idx: jax.Array, on: jax.Array, values: jax.Array, fill) -> jax.Array:
    """``out[idx[i]] = values[i]`` where ``on[i]`` (others ``fill``); idx -1 safe."""
    shape = (size, *values.shape[1:])
    out = jnp.full(shape, fill, values.dtype)
    return out.at[jnp.where(on, idx, size)].set(values, mode="drop")


def _accepts_interpret(fn) -> bool:
    try:
        return "interpret" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class StepKind:
    """Static configuration of one compiled step (hashable: the jit cache key).

    Attributes:
      num_draft: drafts per verify row (0: no MTP).
      admit: the step admits new requests (an admit call and its batch are compiled in).
      prefix: token ids go to admit/extend (prefix matching and publishing).
      impl: kernel implementation (``kernels_pallas.Impl`` value).
      interpret: Pallas interpret mode (CPU), forwarded when the model accepts it.
      keep_logits: return the logits each emitted token was sampled from.
      narrow: a decode-only step: every row it schedules and every step it retires holds at
        most ``1 + num_draft`` tokens (no admission, no prefill chunk wider than that), so
        extend, retire, the metadata and the model run at ``max_count = 1 + num_draft``
        instead of the plan's ``max_count``. The host picks it only when that holds
        (:class:`~flatkv_jax.serving.engine.Engine`); it costs what the batch holds, not
        ``max_requests x chunk_tokens``.
      prefill_rows: in the other kinds, the most extend rows of more than ``1 + num_draft``
        tokens (prefill chunks) the host schedules a step (0: no bound). Below
        ``max_requests`` such a step extends its decode rows in a call at ``max_count = 1 +
        num_draft`` and its prefill rows, compacted to ``prefill_rows`` rows, in a second call
        at the plan's ``max_count``, and retires the same way (the prefill rows of the step
        before, admissions included: ``prefill_rows + admit_rows`` rows): a mixed step costs
        what it holds, not ``max_requests x chunk_tokens``.
      admit_rows: rows of the admission batch (``AdmitInputs``; sizes the wide retire).
      admit_width: in an admitting kind, the prompt-token columns of its admission batch
        (``AdmitInputs.tokens`` is ``[A, admit_width]``; 0: ``max_context``). Matching hashes
        and looks up every column of every row, so an engine compiles one admitting kind per
        width bucket and admits into the smallest that holds the step's prompts
        (``EngineOptions.admit_widths``).
    """

    num_draft: int
    admit: bool
    prefix: bool
    impl: str
    interpret: bool
    keep_logits: bool
    narrow: bool = False
    prefill_rows: int = 0
    admit_rows: int = 0
    admit_width: int = 0


@functools.cache
def build_step(graphdef, plan: CachePlan, kind: StepKind):
    """The jitted step ``fn(weights, pools, state, lanes, inputs, admits) -> (pools, state,
    lanes, report)`` for one (model graph, plan, step kind); pools, state and lanes donated.

    Cached, so every engine over the same model graph, plan and kind shares one compilation.
    """
    return jax.jit(step_body(graphdef, plan, kind), donate_argnums=(1, 2, 3))


@functools.cache
def build_sharded_step(graphdef, plan: CachePlan, kind: StepKind, mesh: Mesh):
    """The step of :func:`build_step` run by every data-parallel rank of ``mesh`` at once.

    Same signature, but pools, state, lanes, inputs, admits and the report carry a leading
    rank axis sharded over ``mesh``'s axis (``P(RANK_AXIS)``); the weights are replicated
    (``P()``). Inside ``jax.shard_map`` each device sees its own rank (the leading axis of
    size one is squeezed) and runs the single-rank step on it: nothing in the body reads
    another rank's data, so the compiled step has no collective (the tests assert it on the
    HLO text). One compilation per (model graph, plan, kind, mesh).
    """
    body = step_body(graphdef, plan, kind)
    axis = mesh.axis_names[0]

    def per_rank(weights, pools, state, lanes, inp, adm):
        one = functools.partial(jax.tree.map, lambda x: x[0])
        out = body(weights, one(pools), one(state), one(lanes), one(inp), one(adm))
        return jax.tree.map(lambda x: x[None], out)

    ranked = P(axis)
    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), ranked, ranked, ranked, ranked, ranked),
        out_specs=ranked,
        # The body is the single-rank step: every value is per rank by construction, so
        # varying-axis type checking adds nothing (and rejects constants mixed with rank
        # data in lax.cond branches of the coordinator).
        check_vma=False,
    )
    return jax.jit(fn, donate_argnums=(1, 2, 3))


def create_lanes_sharded(plan: CachePlan, hidden: int, mesh: Mesh) -> Lanes:
    """Empty lanes for every rank of ``mesh``: each leaf gets a leading rank axis, created
    directly sharded (``P(axis)``: each device allocates its own rank's zeros)."""
    n = mesh.size
    spec = NamedSharding(mesh, P(mesh.axis_names[0]))

    def make():
        one = create_lanes(plan, hidden)
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n, *x.shape)), one)

    return jax.jit(make, out_shardings=spec)()


def step_body(graphdef, plan: CachePlan, kind: StepKind):
    """The un-jitted single-rank step function (see :func:`build_step`)."""
    k = kind.num_draft
    if kind.narrow and kind.admit:
        raise ValueError(
            f"StepKind(narrow=True, admit=True) is invalid: {kind}: an admission schedules a "
            "first chunk wider than a decode row. Fix: pass narrow=False for admitting steps"
        )
    # A decode-only step's rows and the rows it retires hold at most 1 + k tokens: every
    # width below (token columns, pages per row, hashed columns, window columns) follows the
    # batch, not chunk_tokens (B = 256, chunk 4,096 on V4-Flash: ~1 ms against ~30 ms of
    # coordinator work on XLA:CPU, docs/benchmarks.md).
    mc = resolve_max_count(plan, 1 + k if kind.narrow else None)
    lim = plan.limits
    r, t_len, d = lim.max_requests, lim.step_tokens, 1 + k
    width = seq_width(plan)
    ng = len(plan.groups)
    # A mixed step's decode rows at 1 + k tokens, its few prefill rows at mc (see StepKind).
    split = not kind.narrow and 0 < kind.prefill_rows < r and d < mc
    p_rows = kind.prefill_rows
    w_ret = min(r, kind.prefill_rows + kind.admit_rows)

    def tokens_of(seq, lane, start, n):
        """``[rows, n]`` token ids of ``lane`` from position ``start`` (for publishing)."""
        pos = jnp.clip(start[:, None] + jnp.arange(n, dtype=_I32)[None, :], 0, width - 1)
        return seq[lane[:, None], pos]

    def fn(weights, pools, state: CacheState, lanes: Lanes, inp: StepInputs, adm):
        model = nnx.merge(graphdef, weights)
        extra = {}
        if kind.interpret and _accepts_interpret(model.step):
            extra["interpret"] = True
        prev_accept = lanes.accept
        # 1. releases (deferred while a step is in flight; the retire below completes them).
        rl = inp.release_lane
        rsafe = jnp.clip(rl, 0, r - 1)
        rv = (rl >= 0) & (lanes.slot[rsafe] >= 0)
        state, rel = release_fn(
            plan,
            state,
            ReleaseBatch(rv, lanes.slot[rsafe], lanes.generation[rsafe], inp.release_mode),
        )
        # 2. retire the previous step of every lane, then reclaim.
        inflight = (lanes.accept > 0) & (lanes.slot >= 0)
        # One op, one sweep: the deferred releases it completes and the window pages behind
        # every committed lane (retire_fn then reclaim_fn of the committed lanes would hold
        # a second sweep in this program, for the rare release).
        wide_overflow = jnp.zeros((), bool)
        if split:
            # Decode lanes in one call at 1 + k tokens, then the prefill lanes (more than
            # 1 + k accepted), compacted in lane order, at mc: two sweeps, each its rows.
            big = inflight & (lanes.accept > d)
            state, ret = retire_reclaim_fn(
                plan,
                state,
                RetireBatch(inflight & ~big, lanes.slot, lanes.generation, lanes.accept),
                max_count=d,
            )
            wl = jnp.nonzero(big, size=w_ret, fill_value=r)[0].astype(_I32)
            wv = wl < r
            ws = jnp.clip(wl, 0, r - 1)
            state, ret_w = retire_reclaim_fn(
                plan,
                state,
                RetireBatch(wv, lanes.slot[ws], lanes.generation[ws], lanes.accept[ws]),
                max_count=mc,
            )
            to = jnp.where(wv, wl, r)
            ret_status = ret.status.at[to].set(ret_w.status, mode="drop")
            ret_released = ret.released.at[to].set(ret_w.released, mode="drop")
            wide_overflow = jnp.sum(big) > w_ret
        else:
            big = jnp.zeros((r,), bool)
            state, ret = retire_reclaim_fn(
                plan,
                state,
                RetireBatch(inflight, lanes.slot, lanes.generation, lanes.accept),
                max_count=mc,
            )
            ret_status, ret_released = ret.status, ret.released
        retired = inflight & (ret_status == Status.OK) & ~ret_released
        freed = _scatter(r, rl, rv & (rel.status == Status.OK), jnp.ones((r,), bool), False)
        freed = freed | (inflight & ret_released)
        slot = jnp.where(freed, -1, lanes.slot)
        gen = lanes.generation
        live = slot >= 0
        ssafe = jnp.clip(slot, 0, r - 1)
        ext_now = jnp.where(live, state.extent[ssafe], 0)
        # 3. what each lane schedules, within its allowance.
        allow = jnp.minimum(inp.allow, mc)
        prefilling = ext_now < lanes.prompt_len
        dec = jnp.where(allow >= d, d, jnp.minimum(allow, 1)) if k else jnp.minimum(allow, 1)
        count = jnp.where(prefilling, jnp.minimum(allow, lanes.prompt_len - ext_now), dec)
        count = jnp.where(live & (lanes.remaining > 0), jnp.maximum(count, 0), 0)
        # 4. extend (host order), admit (arrival order).
        order = inp.order
        osafe = jnp.clip(order, 0, r - 1)
        ecount = jnp.where(order >= 0, count[osafe], 0)
        ev = ecount > 0

        def extend_rows(state, valid, rows, counts, n, **same):
            """``extend_fn`` of the ``valid`` rows (lanes ``rows``, ``counts`` tokens each, read
            from each lane's extent) at ``max_count = n``."""
            tok = tokens_of(lanes.seq, rows, ext_now[rows], n) if kind.prefix else None
            batch = ExtendBatch(valid, slot[rows], gen[rows], jnp.where(valid, counts, 1), tok)
            return extend_fn(plan, state, batch, max_count=n, **same)

        if split:
            # Decode rows (host order) at 1 + k tokens, then the prefill rows (host order,
            # compacted to p_rows) at mc; a page shortage fails prefill rows first.
            wide = ev & (ecount > d)
            nv = ev & ~wide
            state, er = extend_rows(state, nv, osafe, ecount, d)
            wi = jnp.nonzero(wide, size=p_rows, fill_value=r)[0].astype(_I32)
            wv = wi < r
            wo = osafe[jnp.clip(wi, 0, r - 1)]
            wcount = ecount[jnp.clip(wi, 0, r - 1)]
            state, er_w = extend_rows(state, wv, wo, wcount, mc, same_step=(er,))
            results = (er, er_w)
            row_lane = jnp.concatenate([jnp.where(nv, order, -1), jnp.where(wv, wo, -1)])
            ext_status = _scatter(r, order, order >= 0, er.status, Status.IDLE)
            ext_status = ext_status.at[jnp.where(wv, wo, r)].set(er_w.status, mode="drop")
            ext_wide = _scatter(r, order, wide, jnp.ones((r,), bool), False)
            wide_overflow = wide_overflow | (jnp.sum(wide) > p_rows)
        else:
            state, er = extend_rows(state, ev, osafe, ecount, mc)
            results = (er,)
            row_lane = jnp.where(ev, order, -1)
            ext_status = _scatter(r, order, order >= 0, er.status, Status.IDLE)
            ext_wide = jnp.zeros((r,), bool)
        seq, prompt_len, remaining, hidden = (
            lanes.seq,
            lanes.prompt_len,
            lanes.remaining,
            lanes.hidden,
        )
        adm_status = jnp.full((r,), Status.IDLE, _I32)
        adm_hit = jnp.zeros((r,), _I32)
        if kind.admit:
            want = kind.admit_width or plan.limits.max_context
            if adm.tokens.shape[1] != want:
                fail("AdmitInputs.tokens columns", adm.tokens.shape[1],
                     f"this step kind admits prompts of {want} columns (its admit_width)",
                     "pad or slice the admission tokens to the kind's admit_width")  # fmt: skip
            av = adm.lane >= 0
            ab = AdmitBatch(
                av,
                jnp.where(av, adm.prompt_len, 1),
                jnp.where(av, adm.first, 0),
                adm.tokens if kind.prefix else None,
                adm.namespace if kind.prefix else None,
            )
            # The admit sees the extend's result: the coordinator keeps the two within
            # step_tokens together (when it supports ``same_step``).
            same = {"same_step": results} if _SAME_STEP else {}
            state, ar = admit_fn(plan, state, ab, max_count=mc, **same)
            aok = av & (ar.status == Status.OK)
            idx = jnp.where(av, adm.lane, r)
            slot = slot.at[idx].set(jnp.where(aok, ar.slot, -1), mode="drop")
            gen = gen.at[idx].set(ar.generation, mode="drop")
            toks = (
                jnp.zeros((av.shape[0], width), _I32).at[:, : adm.tokens.shape[1]].set(adm.tokens)
            )
            seq = seq.at[idx].set(toks, mode="drop")
            prompt_len = prompt_len.at[idx].set(adm.prompt_len, mode="drop")
            remaining = remaining.at[idx].set(adm.remaining, mode="drop")
            hidden = hidden.at[idx].set(0.0, mode="drop")
            adm_status = _scatter(r, adm.lane, av, ar.status, Status.IDLE)
            adm_hit = _scatter(r, adm.lane, aok, ar.hit, 0)
            results = (*results, ar)
            row_lane = jnp.concatenate([row_lane, jnp.where(aok, adm.lane, -1)])
        md = step_metadata_fn(plan, state, results, max_count=mc)
        # Per metadata row: its lane and whether it decodes (starts past the prompt).
        on = md.row_slot >= 0
        rlane = jnp.clip(row_lane, 0, r - 1)
        start, cnt, off = md.row_start, md.row_count, jnp.maximum(md.row_offset, 0)
        is_dec = on & (start >= prompt_len[rlane])
        rslot = jnp.clip(md.row_slot, 0, r - 1)
        prev_hidden = _scatter(r, md.row_slot, on, hidden[rlane], 0.0)
        jd = jnp.arange(d, dtype=_I32)
        proposed = jnp.zeros_like(cnt)
        if k:
            verify = is_dec & (cnt == d)
            dbatch = DraftBatch(
                tokens=_scatter(r, md.row_slot, verify, seq[rlane, jnp.maximum(start, 0)], 0),
                prev_hidden=_scatter(r, md.row_slot, verify, hidden[rlane], 0.0),
                active=_scatter(r, md.row_slot, verify, jnp.ones_like(verify), False),
            )
            dout, pools = model.propose(
                pools,
                dbatch,
                md,
                state.table_buffer,
                plan=plan,
                num_draft=k,
                max_count=mc,
                impl=kind.impl,
                **extra,
            )
            jk = jnp.arange(k, dtype=_I32)
            dpos = jnp.where(verify[:, None], start[:, None] + 1 + jk[None, :], width)
            seq = seq.at[rlane[:, None], dpos].set(dout.tokens, mode="drop")
            proposed = jnp.where(verify, k, 0)
            if kind.prefix:
                # The verify block's tokens ride with its extend (for publishing at retire);
                # the drafts exist only now, so they join the in-flight step's token record.
                dep = state.fifo_depth
                tail = (state.fifo_head[rslot] + state.fifo_len[rslot] - 1) % dep
                fs = jnp.where(verify, rslot, r)
                ft = state.fifo_tokens.at[fs[:, None], tail[:, None], 1 + jk[None, :]].set(
                    dout.tokens, mode="drop"
                )
                state = dataclasses.replace(state, fifo_tokens=ft)
        trow = md.token_row
        tlane = jnp.clip(row_lane[jnp.clip(trow, 0, row_lane.shape[0] - 1)], 0, r - 1)
        tokens = jnp.where(trow >= 0, seq[tlane, jnp.clip(md.token_pos, 0, width - 1)], 0)
        out, pools = model.step(
            pools,
            StepBatch(tokens=tokens, prev_hidden=prev_hidden),
            md,
            state.table_buffer,
            plan=plan,
            max_count=mc,
            impl=kind.impl,
            **extra,
        )
        # 5. greedy sampling on device, longest matching draft prefix.
        greedy = jnp.argmax(out.logits, axis=-1).astype(_I32)
        flat = jnp.clip(off[:, None] + jd[None, :], 0, t_len - 1)  # [S, d]
        g = greedy[flat]
        if k:
            drafts = seq[rlane[:, None], jnp.clip(start[:, None] + 1 + jd[None, :k], 0, width - 1)]
            match = (drafts == g[:, :k]) & (jd[None, :k] < cnt[:, None] - 1)
            a = jnp.sum(jnp.cumprod(match.astype(_I32), axis=1), axis=1)
        else:
            a = jnp.zeros_like(cnt)
        rem = remaining[rlane]
        emit_dec = jnp.minimum(a + 1, rem)
        final = on & ~is_dec & (start + cnt == prompt_len[rlane])
        emitted = jnp.where(is_dec, emit_dec, final.astype(_I32))
        emitted = jnp.where(on, emitted, 0)
        last = jnp.clip(off + cnt - 1, 0, t_len - 1)
        first_tok = jnp.where(is_dec, g[:, 0], greedy[last])
        emit_tok = g.at[:, 0].set(first_tok)
        emit_at = jnp.where(is_dec, start + 1, start + cnt)
        wpos = jnp.where(jd[None, :] < emitted[:, None], emit_at[:, None] + jd[None, :], width)
        seq = seq.at[rlane[:, None], wpos].set(emit_tok, mode="drop")
        accept = jnp.where(is_dec, emitted, cnt)
        hid_idx = jnp.clip(off + accept - 1, 0, t_len - 1)
        to_lane = jnp.where(on, row_lane, r)
        hidden = hidden.at[to_lane].set(out.hidden[hid_idx], mode="drop")
        remaining = remaining.at[to_lane].add(-emitted, mode="drop")
        acc_lane = _scatter(r, row_lane, on, accept, 0)
        lanes = Lanes(slot, gen, seq, prompt_len, remaining, hidden, acc_lane)

        def by_lane(v, fill=0):
            return _scatter(r, row_lane, on, v, fill)

        top = state.allocator.top
        cached = state.lru.count.astype(_I32) if kind.prefix else jnp.zeros((ng,), _I32)
        report = {
            "tokens": by_lane(jnp.where(jd[None, :] < emitted[:, None], emit_tok, -1), -1),
            "emitted": by_lane(emitted),
            "start": by_lane(start, -1),
            "count": by_lane(cnt),
            "decode": by_lane(is_dec, False),
            "proposed": by_lane(proposed),
            "accepted": by_lane(jnp.where(proposed > 0, jnp.minimum(a, emitted), 0)),
            "extend_status": ext_status,
            # Which lanes ran in the wide (prefill) extend / retire call of a split step.
            "extend_wide": ext_wide,
            "retire_wide": big,
            "wide_overflow": wide_overflow,
            "extend_count": _scatter(r, order, ev, ecount, 0),
            "admit_status": adm_status,
            "hit": adm_hit,
            "retire_status": jnp.where(inflight, ret_status, Status.IDLE),
            "retired": jnp.where(inflight, prev_accept, 0),
            "release_status": _scatter(r, rl, rl >= 0, rel.status, Status.IDLE),
            # retire_reclaim reclaims exactly the retired lanes (OK, each named once).
            "reclaim_status": jnp.where(retired, Status.OK, Status.IDLE),
            "free": top.astype(_I32),
            "cached": cached,
            "zeroed": jnp.sum(md.zero >= 0, axis=1).astype(_I32),
            "overflow": md.overflow,
        }
        if kind.keep_logits:
            src = jnp.where(jd[None, :] == 0, jnp.where(is_dec, off, last)[:, None], flat)
            report["logits"] = by_lane(out.logits[src], 0.0)
        return pools, state, lanes, report

    return fn
