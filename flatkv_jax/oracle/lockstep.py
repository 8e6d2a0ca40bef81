"""Many differential traces against the device coordinator in lockstep, one device call a step.

Replaying one trace at a time pays the device's per-call overhead (dispatch, host transfers,
one small XLA program per op) on every op of every trace. Here ``N`` independent traces
(lanes) run side by side: every lane has its own coordinator state and pools, stacked on a
leading ``[N]`` axis, and one jitted *tick* advances every lane by one op:

1. the harness's pattern writes of the lane's previous op, through the lane's tables;
2. the lane's op — ``lax.switch`` over admit / extend / retire / rewind / reclaim / release /
   nothing, so lanes may run different ops;
3. zeroing of the pages the op handed out, in every pool array of their group;
4. what the harness observes: the counters, the tables and every row read through them.

The lanes run one after another inside the tick (``lax.map``), not ``vmap``-ed: under
``vmap`` a batched ``lax.switch``/``lax.cond`` becomes a select that evaluates every branch,
and the coordinator's conds that skip idle work (prefix matching, LRU eviction, sweeps) then
always run — measured 25x slower on this plan (440 ms vs 17 ms a tick at 64 lanes).

The host side is the unchanged harness (:mod:`flatkv_jax.oracle.differential`), one per lane,
each with its own oracle; a :class:`_Lane` stands in for the device backend and serves the
tick's precomputed outputs. The op functions are the coordinator's plain ``*_fn`` forms, so
what is compared is the same code the jitted ops run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax import coordinator as coord
from flatkv_jax.coordinator import ops as cops
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.oracle.batches import (
    Counts,
    LogicalView,
    OpResult,
    OracleAdmitBatch,
    OracleExtendBatch,
    OracleHandleBatch,
    empty_result,
)
from flatkv_jax.oracle.differential import Divergence, RunReport, _batch, _Found, _Harness
from flatkv_jax.oracle.oracle import RadixOracle
from flatkv_jax.oracle.traces import OpKind, Trace
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.pools import create_pools

_I32 = jnp.int32
#: Branch index of each op kind in the tick's ``lax.switch``; ``_NOOP`` observes only.
_KIND = {k: i for i, k in enumerate(OpKind)}
_NOOP = len(_KIND)


def prefix_api() -> bool:
    """Whether the coordinator's batches carry tokens (the prefix index is integrated)."""
    return "tokens" in {f.name for f in dataclasses.fields(coord.AdmitBatch)}


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Static sizes of one lane's tick inputs."""

    b: int  # batch rows
    ctx: int  # admit token width (max_context)
    step: int  # extend token width (step_tokens)
    writes: int  # padded pattern rows per group
    zero: int  # zero-list length per group (B * K)


def _shape(plan: CachePlan) -> _Shape:
    lim = plan.limits
    mc = cops.resolve_max_count(plan, None)
    return _Shape(
        b=lim.max_requests,
        ctx=lim.max_context,
        step=lim.step_tokens,
        writes=lim.max_requests * lim.max_count,
        zero=lim.max_requests * cops.pages_per_row(plan, mc),
    )


def _lane_tick(plan: CachePlan, prefix: bool, state, arrays, inp):
    """One lane's tick (:func:`_tick` maps it over the lanes); see the module docstring."""
    sh = _shape(plan)
    b = sh.b
    # 1. writes of the previous op: (slot, absolute row) -> page * rpp + row via the tables.
    arrays = list(arrays)
    for gi, g in enumerate(plan.groups):
        rpp, npg = g.rows_per_page, plan.pages(g)
        t = state.tables[gi]
        s, r = inp["w_slot"][gi], inp["w_row"][gi]
        page = t[jnp.clip(s, 0, t.shape[0] - 1), jnp.clip(r // rpp, 0, t.shape[1] - 1)]
        ok = (s >= 0) & (page >= 1)
        flat = jnp.where(ok, page * rpp + r % rpp, npg * rpp)
        new = []
        for fi, per_field in enumerate(arrays[gi]):
            per = []
            for li, a in enumerate(per_field):
                rows = a.reshape(npg * rpp, *a.shape[2:])
                rows = rows.at[flat].set(inp["w_val"][gi][fi][li], mode="drop")
                per.append(rows.reshape(a.shape))
            new.append(tuple(per))
        arrays[gi] = tuple(new)

    # 2. the op.
    valid, slot, gen, arg = inp["valid"], inp["slot"], inp["generation"], inp["arg"]

    def step_out(r):
        return dict(
            status=r.status,
            slot=r.slot,
            generation=r.generation,
            hit=r.hit,
            count=r.count,
            short_group=r.short_group,
            short_pages=r.short_pages,
            zero=r.zero,
        )

    def status_out(status):
        g = len(plan.groups)
        return dict(
            status=status,
            slot=jnp.full((b,), -1, _I32),
            generation=jnp.full((b,), -1, _I32),
            hit=jnp.zeros((b,), _I32),
            count=jnp.zeros((b,), _I32),
            short_group=jnp.full((b,), -1, _I32),
            short_pages=jnp.zeros((b,), _I32),
            zero=jnp.full((g, sh.zero), -1, _I32),
        )

    def admit(st):
        kw = dict(valid=valid, prompt_len=arg, first_chunk=inp["first_chunk"])
        if prefix:
            kw.update(tokens=inp["tokens"], namespace=inp["namespace"])
        st, r = cops.admit_fn(plan, st, coord.AdmitBatch(**kw))
        return st, step_out(r)

    def extend(st):
        kw = dict(valid=valid, slot=slot, generation=gen, count=arg)
        if prefix:
            kw.update(tokens=inp["step_tokens"])
        st, r = cops.extend_fn(plan, st, coord.ExtendBatch(**kw))
        return st, step_out(r)

    def retire(st):
        st, r = cops.retire_fn(
            plan, st, coord.RetireBatch(valid=valid, slot=slot, generation=gen, accepted=arg)
        )
        return st, status_out(r.status)

    def rewind(st):
        st, r = cops.rewind_fn(
            plan, st, coord.RewindBatch(valid=valid, slot=slot, generation=gen, extent=arg)
        )
        return st, status_out(r.status)

    def reclaim(st):
        st, r = cops.reclaim_fn(plan, st, coord.HandleBatch(valid=valid, slot=slot, generation=gen))
        return st, status_out(r.status)

    def release(st):
        st, r = cops.release_fn(
            plan, st, coord.ReleaseBatch(valid=valid, slot=slot, generation=gen, mode=arg)
        )
        return st, status_out(r.status)

    def noop(st):
        return st, status_out(jnp.zeros((b,), _I32))

    branches = {
        OpKind.ADMIT: admit,
        OpKind.EXTEND: extend,
        OpKind.RETIRE: retire,
        OpKind.REWIND: rewind,
        OpKind.RECLAIM: reclaim,
        OpKind.RELEASE: release,
    }
    fns = [branches[k] for k in OpKind] + [noop]
    state, out = jax.lax.switch(inp["kind"], fns, state)

    # 3. zero the pages handed out, in every pool array of their group.
    zero = out.pop("zero")
    for gi, g in enumerate(plan.groups):
        ids = zero[gi]
        ids = jnp.where(ids >= 0, ids, plan.pages(g))
        arrays[gi] = tuple(
            tuple(a.at[ids].set(0, mode="drop") for a in per_field) for per_field in arrays[gi]
        )

    # 4. observation: counters and every row read through the tables.
    free, in_use, cached, rows = [], [], [], []
    for gi, g in enumerate(plan.groups):
        npg = plan.pages(g)
        t = state.tables[gi]
        refs = jnp.zeros((npg,), _I32).at[jnp.where(t > 0, t, npg)].add(1, mode="drop")
        rc = state.pools[gi].refcount
        free.append(state.pools[gi].top)
        in_use.append(jnp.sum(refs > 0, dtype=_I32))
        cached.append(jnp.sum((rc > 0) & (refs == 0), dtype=_I32))
        pages = jnp.maximum(t, 0)
        rows.append(
            tuple(
                tuple(a[pages].reshape(t.shape[0], -1, *a.shape[2:]) for a in per_field)
                for per_field in arrays[gi]
            )
        )
    obs = dict(
        out,
        free=jnp.stack(free).astype(_I32),
        in_use=jnp.stack(in_use),
        cached=jnp.stack(cached),
        live=state.live,
        gen_all=state.generation,
        extent=state.extent,
        committed=state.committed,
        fifo_len=state.fifo_len,
        pending=state.pending,
        tables=tuple(state.tables),
        rows=tuple(rows),
    )
    return state, tuple(arrays), obs


@functools.cache
def _tick(plan: CachePlan, prefix: bool) -> Callable:
    """The jitted, lane-mapped tick for ``plan`` (state and pools donated)."""
    fn = functools.partial(_lane_tick, plan, prefix)

    def lanes(state, arrays, inp):
        return jax.lax.map(lambda x: fn(*x), (state, arrays, inp))

    return jax.jit(lanes, donate_argnums=(0, 1))


class _Lane:
    """One lane as a harness backend: serves the outputs of the tick it took part in."""

    def __init__(self, plan: CachePlan, prefix_reuse: bool):
        self.plan, self.prefix_reuse = plan, prefix_reuse
        self.result: OpResult | None = None
        self.obs: tuple[Counts, LogicalView] | None = None
        self.writes: dict[int, tuple] = {}

    def reset(self) -> None:
        self.result, self.obs, self.writes = None, None, {}

    def _op(self, batch) -> OpResult:
        res, self.result = self.result, None
        if res is None:
            raise RuntimeError("a lane op ran outside a lockstep tick")
        return res

    admit = extend = retire = rewind = reclaim = release = _op

    def counts(self) -> Counts:
        return self.obs[0]

    def view(self) -> LogicalView:
        return self.obs[1]

    def write(self, group: int, slots: np.ndarray, rows: np.ndarray, values) -> None:
        self.writes[group] = (slots, rows, values)


class LockstepDevice:
    """``lanes`` device coordinators (state + pools each) advanced together by one tick.

    Args:
      plan: the cache plan (every lane's).
      lanes: how many traces run side by side.
      fifo_depth: in-flight steps per request (as ``create_state``).
      prefix_reuse: pass prompts and step tokens (the coordinator matches and publishes);
        ``False`` passes none, so it never hits (compare with
        ``RadixOracle(plan, prefix_reuse=False)``). Default: whether the coordinator's
        batches have ``tokens``.
    """

    def __init__(
        self,
        plan: CachePlan,
        lanes: int,
        *,
        fifo_depth: int = 2,
        prefix_reuse: bool | None = None,
    ):
        check_plan(plan)
        check_positive_int("lanes", lanes)
        self.plan, self.lanes, self.fifo_depth = plan, lanes, fifo_depth
        if prefix_reuse and not prefix_api():
            fail(
                "prefix_reuse",
                prefix_reuse,
                "the coordinator's AdmitBatch has no tokens field (no prefix index)",
                "pass prefix_reuse=False",
            )
        self.prefix_reuse = prefix_api() if prefix_reuse is None else bool(prefix_reuse)
        self.shape = _shape(plan)
        one_state = coord.create_state(plan, fifo_depth, prefix=self.prefix_reuse)
        one_pools = create_pools(plan).arrays
        self._fresh = jax.jit(
            lambda s, a: jax.tree_util.tree_map(
                lambda x: jnp.broadcast_to(x, (lanes, *x.shape)), (s, a)
            )
        )
        self._one = (one_state, one_pools)
        self.reset()

    def reset(self) -> None:
        """Every lane back to the empty state and zero pools."""
        self.state, self.arrays = self._fresh(*self._one)
        self.state, self.arrays = jax.tree_util.tree_map(jnp.copy, (self.state, self.arrays))

    def _inputs(self, kinds, batches, writes) -> dict:
        """Packs per-lane op batches and pending writes into the tick's stacked arrays."""
        plan, sh, n = self.plan, self.shape, self.lanes
        z = functools.partial(np.zeros, dtype=np.int32)
        inp = dict(
            kind=np.asarray(kinds, np.int32),
            valid=np.zeros((n, sh.b), bool),
            slot=z((n, sh.b)),
            generation=z((n, sh.b)),
            arg=z((n, sh.b)),
            first_chunk=z((n, sh.b)),
            namespace=z((n, sh.b)),
            tokens=z((n, sh.b, sh.ctx)),
            step_tokens=z((n, sh.b, sh.step)),
        )
        for i, bt in enumerate(batches):
            if bt is None:
                continue
            inp["valid"][i] = bt.valid
            if isinstance(bt, OracleAdmitBatch):
                inp["arg"][i] = bt.prompt_len
                inp["first_chunk"][i] = bt.first_chunk
                inp["namespace"][i] = bt.namespace
                inp["tokens"][i] = bt.tokens
            elif isinstance(bt, OracleExtendBatch):
                inp["slot"][i], inp["generation"][i] = bt.slot, bt.generation
                inp["arg"][i] = bt.count
                inp["step_tokens"][i] = bt.tokens
            elif isinstance(bt, OracleHandleBatch):
                inp["slot"][i], inp["generation"][i], inp["arg"][i] = bt.slot, bt.generation, bt.arg
        w_slot, w_row, w_val = [], [], []
        for gi in range(len(plan.groups)):
            ws = np.full((n, sh.writes), -1, np.int32)
            wr = np.zeros((n, sh.writes), np.int32)
            vals = [
                [np.zeros((n, sh.writes, *a.shape[2:]), a.dtype) for a in per_field]
                for per_field in self._one[1][gi]
            ]
            for i, w in enumerate(writes):
                if gi not in w:
                    continue
                s, r, v = w[gi]
                k = len(s)
                if k > sh.writes:
                    fail(
                        "rows",
                        k,
                        f"one op writes at most {sh.writes} rows per group",
                        "write fewer rows per op",
                    )
                ws[i, :k], wr[i, :k] = s, r
                for fi, per_layer in enumerate(v):
                    for li, x in enumerate(per_layer):
                        vals[fi][li][i, :k] = x
            w_slot.append(ws)
            w_row.append(wr)
            w_val.append(tuple(tuple(x) for x in vals))
        inp.update(w_slot=tuple(w_slot), w_row=tuple(w_row), w_val=tuple(w_val))
        return inp

    def tick(self, kinds: Sequence[int], batches: Sequence, writes: Sequence[dict]) -> list:
        """Advances every lane by one op; returns per lane ``(OpResult, Counts, LogicalView)``.

        Args:
          kinds: per lane the branch (``_KIND[op.kind]`` or ``_NOOP``).
          batches: per lane the op's batch (oracle batch types) or ``None``.
          writes: per lane ``{group: (slots, rows, values)}`` of the previous op's writes.
        """
        fn = _tick(self.plan, self.prefix_reuse)
        inp = self._inputs(kinds, batches, writes)
        self.state, self.arrays, obs = fn(self.state, self.arrays, inp)
        o = jax.device_get(obs)
        out = []
        for i in range(self.lanes):
            res = empty_result(self.shape.b)
            for f in ("status", "slot", "generation", "hit", "count", "short_group", "short_pages"):
                getattr(res, f)[:] = o[f][i]
            live = o["live"][i]

            def m(x, live=live):
                return np.where(live, x, 0).astype(np.int64)

            counts = Counts(
                free=o["free"][i].astype(np.int64),
                in_use=o["in_use"][i].astype(np.int64),
                cached_only=o["cached"][i].astype(np.int64),
                live=live,
                generation=o["gen_all"][i].astype(np.int64),
                extent=m(o["extent"][i]),
                committed=m(o["committed"][i]),
                in_flight=m(o["fifo_len"][i]),
                pending=m(o["pending"][i]),
            )
            view = LogicalView(
                tuple(t[i] for t in o["tables"]),
                tuple(
                    tuple(tuple(a[i] for a in per_field) for per_field in per_group)
                    for per_group in o["rows"]
                ),
            )
            out.append((res, counts, view))
        return out


def run_lockstep(
    traces: Sequence[Trace],
    device: LockstepDevice,
    *,
    oracle: Callable[[CachePlan], RadixOracle] | None = None,
    every_op: bool = False,
) -> list[RunReport]:
    """Replays ``traces`` on the device (``device.lanes`` at a time) and on one oracle each.

    Args:
      traces: traces of ``device.plan``.
      device: the lockstep device.
      oracle: builds a fresh reference backend (default
        ``RadixOracle(plan, prefix_reuse=device.prefix_reuse)``).
      every_op: also run the absolute pattern check and the oracle's invariant check after
        every op (default: the pattern check after admits and at the end, invariants at the
        end; oracle and device are compared after every op either way).

    Returns:
      One :class:`~flatkv_jax.oracle.differential.RunReport` per trace, in order.
    """
    plan = device.plan
    make = oracle or (lambda p: RadixOracle(p, prefix_reuse=device.prefix_reuse))
    reports: list[RunReport] = []
    for lo in range(0, len(traces), device.lanes):
        reports += _run_group(traces[lo : lo + device.lanes], device, make, plan, every_op)
    return reports


def _run_group(traces, device: LockstepDevice, make, plan, every_op) -> list[RunReport]:
    n = device.lanes
    device.reset()
    lanes = [_Lane(plan, device.prefix_reuse) for _ in range(n)]
    harness: list[_Harness | None] = []
    for i in range(n):
        if i < len(traces):
            ref = make(plan)
            ref.reset()
            harness.append(
                _Harness(traces[i], (ref, lanes[i]), ("oracle", "device"), every_op=every_op)
            )
        else:
            harness.append(None)
    div: list[Divergence | None] = [None] * n
    done = [h is None for h in harness]
    steps = [0] * n
    longest = max(len(t.ops) for t in traces)
    for k in range(longest + 1):
        kinds, batches, writes = [], [], []
        for i, h in enumerate(harness):
            w, lanes[i].writes = lanes[i].writes, {}
            writes.append(w)
            # Past its last op a lane only observes (k == len: the final check after the
            # last writes); a finished or divergent lane idles.
            if done[i] or k >= len(h.trace.ops):
                kinds.append(_NOOP)
                batches.append(None)
            else:
                op = h.trace.ops[k]
                kinds.append(_KIND[op.kind])
                batches.append(_batch(plan, op, h.handles))
        outs = device.tick(kinds, batches, writes)
        for i, h in enumerate(harness):
            if done[i] or k > len(h.trace.ops):
                continue
            res, counts, view = outs[i]
            lanes[i].obs = (counts, view)
            ops = h.trace.ops
            try:
                if k == len(ops):
                    h.final()
                    done[i] = True
                else:
                    lanes[i].result = res
                    steps[i] = k + 1
                    h.step(ops[k], batches[i])
            except _Found as e:
                done[i] = True
                op = ops[k] if k < len(ops) else None
                div[i] = Divergence(k, op, e.what, ops[max(0, k - 5) : k], h.trace.seed)
    return [
        RunReport(ops=steps[i], divergence=div[i], **h.stats)
        for i, h in enumerate(harness)
        if h is not None
    ]
