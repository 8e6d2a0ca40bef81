"""The differential harness: replay a trace on two backends and compare after every op.

After every operation it compares, between the two backends:

- the result of every row (status; for admit the handle, hit length, scheduled tokens and the
  short pool; for extend the scheduled tokens and short pool);
- :class:`~flatkv_jax.oracle.batches.Counts`: free / in-use / cached-only pages per pool, and
  per slot live, generation, extent, committed, in-flight steps, pending release;
- the tables up to relabelling of page ids (holes, unallocated entries and which table
  entries share one page must agree — page ids themselves are backend-private);
- the logical token -> content mapping: every complete row of every live token, read through
  each backend's own tables (before this op's writes, so freshly handed-out pages are
  compared while they must still read zeros).

and, on each backend on its own, that every row reads the token-derived pattern the harness
wrote for that prefix (a hit row must hold exactly what the request would have written), holes
read zeros, and every page handed out by the op reads zeros in every pool array. It then
writes the pattern rows of the new positions through both backends, as a model step would.
A backend that has a ``violations()`` method (the oracle) is also checked for broken
invariants. The first divergence stops the run and is reported with a readable diff.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flatkv_jax.oracle.backend import Backend
from flatkv_jax.oracle.batches import (
    Counts,
    LogicalView,
    OpResult,
    admit_batch,
    extend_batch,
    handle_batch,
)
from flatkv_jax.oracle.patterns import prefix_hashes, row_values, salt
from flatkv_jax.oracle.traces import Op, OpKind, Trace
from flatkv_jax.status import Status

#: Result fields compared per op kind.
_RESULT_FIELDS = {
    OpKind.ADMIT: ("status", "slot", "generation", "hit", "count", "short_group", "short_pages"),
    OpKind.EXTEND: ("status", "count", "short_group", "short_pages"),
}
_COUNT_FIELDS = (
    "free",
    "in_use",
    "cached_only",
    "live",
    "generation",
    "extent",
    "committed",
    "in_flight",
    "pending",
)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first disagreement of a run.

    Attributes:
      op_index: index of the op in the trace (``len(ops)`` for the final check).
      op: the op (``None`` for the final check).
      what: a readable description of what differs.
      recent: the ops before it (up to 5), oldest first.
      seed: the trace's seed (to replay it).
    """

    op_index: int
    op: Op | None
    what: str
    recent: tuple[Op, ...]
    seed: int

    def __str__(self) -> str:
        lines = [
            f"divergence at op #{self.op_index} of trace seed {self.seed}: {self.op}",
            f"  {self.what}",
        ]
        if self.recent:
            lines.append("  preceding ops:")
            lines += [f"    {op}" for op in self.recent]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class RunReport:
    """What a run did.

    Attributes:
      ops: operations run (up to and including a divergent one).
      rows: valid batch rows run.
      admitted: requests admitted.
      prompt_tokens: prompt tokens of admitted requests.
      hit_tokens: prefix-hit tokens of admitted requests.
      divergence: the first divergence, or ``None``.
    """

    ops: int
    rows: int
    admitted: int
    prompt_tokens: int
    hit_tokens: int
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


class _Found(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@dataclasses.dataclass
class _Record:
    """What the harness wrote for one live request."""

    generation: int
    namespace: int
    tokens: list[int]
    hashes: list[int]
    written: int


def _batch(plan, op: Op, handles: dict[int, tuple[int, int]]):
    def h(rid: int) -> tuple[int, int]:
        # A rid that was never admitted names slot 0 with a generation no slot ever has.
        return handles.get(rid, (0, -1))

    if op.kind is OpKind.ADMIT:
        return admit_batch(plan, [None if r is None else (r[1], r[2], r[3]) for r in op.rows])
    if op.kind is OpKind.EXTEND:
        return extend_batch(plan, [None if r is None else (h(r[0]), r[1]) for r in op.rows])
    if op.kind is OpKind.RECLAIM:
        return handle_batch(plan, [None if r is None else h(r[0]) for r in op.rows])
    return handle_batch(plan, [None if r is None else (h(r[0]), r[1]) for r in op.rows])


def canonical_tables(view: LogicalView) -> tuple[np.ndarray, ...]:
    """Tables with page ids relabelled 1, 2, ... in row-major order of first use."""
    out = []
    for t in view.tables:
        flat = np.asarray(t, np.int64).ravel()
        canon = flat.copy()
        pages = flat[flat >= 1]
        if pages.size:
            uniq, first, inv = np.unique(pages, return_index=True, return_inverse=True)
            rank = np.empty(uniq.size, np.int64)
            rank[np.argsort(first)] = np.arange(uniq.size)
            canon[flat >= 1] = rank[inv] + 1
        out.append(canon.reshape(np.shape(t)))
    return tuple(out)


def _same_up_to_relabelling(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two tables agree on -1/0 entries and page ids map one-to-one between them."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    if a.shape != b.shape:
        return False
    pa, pb = a >= 1, b >= 1
    if not np.array_equal(np.where(pa, 1, a), np.where(pb, 1, b)):
        return False
    a, b = a[pa], b[pb]
    if not a.size:
        return True
    # a -> b and b -> a are both functions iff the relation is a bijection; the last write
    # wins in each map, so reading them back finds any page mapped two ways.
    fwd = np.zeros(int(a.max()) + 1, np.int64)
    bwd = np.zeros(int(b.max()) + 1, np.int64)
    fwd[a], bwd[b] = b, a
    return bool(np.array_equal(fwd[a], b) and np.array_equal(bwd[b], a))


class _Harness:
    def __init__(
        self,
        trace: Trace,
        backends: tuple[Backend, ...],
        names: tuple[str, ...],
        *,
        every_op: bool = True,
    ):
        # every_op=False (lockstep CI runs): the absolute pattern check runs after admits
        # (where hits happen) and at the end, and invariants only at the end; the backends are
        # still compared with each other after every op.
        self.every_op = every_op
        self.plan, self.trace, self.backends, self.names = trace.plan, trace, backends, names
        self.handles: dict[int, tuple[int, int]] = {}
        self.records: dict[int, _Record] = {}
        self.prev: list[tuple[Counts, LogicalView] | None] = [None] * len(backends)
        self.stats = dict(rows=0, admitted=0, prompt_tokens=0, hit_tokens=0)

    # --- comparisons ------------------------------------------------------------------------
    def _diff(self, what: str, arrays: list[np.ndarray]) -> None:
        a = np.asarray(arrays[0])
        for name, b in zip(self.names[1:], arrays[1:], strict=True):
            b = np.asarray(b)
            if a.shape != b.shape or not np.array_equal(a, b):
                raise _Found(f"{what}: {self.names[0]}={a.tolist()} {name}={b.tolist()}")

    def _compare_results(self, kind: OpKind, results: list[OpResult]) -> None:
        for f in _RESULT_FIELDS.get(kind, ("status",)):
            vals = [getattr(r, f) for r in results]
            if f == "status":
                vals = [[Status(int(x)).name for x in v] for v in vals]
            self._diff(f"result.{f}", vals)

    def _compare_views(self, counts: Counts, views: list[LogicalView]) -> None:
        for gi, g in enumerate(self.plan.groups):
            t0 = views[0].tables[gi]
            if all(_same_up_to_relabelling(t0, v.tables[gi]) for v in views[1:]):
                continue
            canon = [canonical_tables(v)[gi] for v in views]
            self._diff(f"tables of {g.name} (page ids relabelled)", canon)
        extent = np.where(counts.live, counts.extent, 0)
        for gi, g in enumerate(self.plan.groups):
            r = g.tokens_per_row
            width = views[0].rows[gi][0][0].shape[1]
            mask = (np.arange(width)[None, :] + 1) * r <= extent[
                :, None
            ]  # complete rows of live tokens
            for fi, f in enumerate(g.fields):
                for li, layer in enumerate(g.layers):
                    ref = np.asarray(views[0].rows[gi][fi][li])
                    for name, v in zip(self.names[1:], views[1:], strict=True):
                        other = np.asarray(v.rows[gi][fi][li])
                        same = np.all((ref == other).reshape(*mask.shape, -1), axis=2) | ~mask
                        if not same.all():
                            s, row = (int(x[0]) for x in np.nonzero(~same))
                            raise _Found(
                                f"content of slot {s} group {g.name} field {f.name} layer {layer} row {row} "
                                f"(token {row * r + r - 1}): {self.names[0]}={ref[s, row].ravel()[:4].tolist()} "
                                f"{name}={other[s, row].ravel()[:4].tolist()}"
                            )

    def _check_expected(self, name: str, view: LogicalView) -> None:
        """Every written row reads the pattern of its own prefix; holes read zero."""
        for gi, g in enumerate(self.plan.groups):
            r, rpp, b = g.tokens_per_row, g.rows_per_page, g.block_tokens
            slots, rows, hashes = [], [], []
            for s, rec in self.records.items():
                nrows = rec.written // r
                slots += [s] * nrows
                rows += range(nrows)
                hashes += rec.hashes[r - 1 : nrows * r : r]
            if not slots:
                continue
            slots, rows = np.array(slots), np.array(rows)
            kinds = np.asarray(view.tables[gi])[slots, rows // rpp]
            if (kinds < 0).any():
                x = int(np.flatnonzero(kinds < 0)[0])
                raise _Found(
                    f"{name}: slot {slots[x]} group {g.name} row {rows[x]} of a written token is unallocated"
                )
            hv = np.array(hashes, np.uint64)
            for fi, f in enumerate(g.fields):
                for li, layer in enumerate(g.layers):
                    got = np.asarray(view.rows[gi][fi][li])[slots, rows]
                    want = row_values(hv, salt(gi, fi, li), f.format)
                    want[kinds == 0] = 0
                    ok = np.all((got == want).reshape(len(slots), -1), axis=1)
                    if not ok.all():
                        x = int(np.flatnonzero(~ok)[0])
                        s, j = int(slots[x]), int(rows[x])
                        kind = "a hole" if kinds[x] == 0 else f"page {int(kinds[x])}"
                        raise _Found(
                            f"{name}: slot {s} group {g.name} field {f.name} layer {layer} row {j} (tokens "
                            f"[{j * r}, {j * r + r}) of block {j * r // b}, {kind}) reads "
                            f"{got[x].ravel()[:4].tolist()}, the pattern of its prefix is {want[x].ravel()[:4].tolist()}"
                        )

    def _check_fresh(
        self, name: str, view: LogicalView, fresh: dict[int, list[np.ndarray]]
    ) -> None:
        """Every page handed out by this op reads zeros, in every pool array of its group."""
        for gi, g in enumerate(self.plan.groups):
            rpp = g.rows_per_page
            pairs = [
                (s, i) for s, per_group in fresh.items() for i in np.flatnonzero(per_group[gi])
            ]
            if not pairs:
                continue
            slots = np.repeat([s for s, _ in pairs], rpp)
            rows = (
                np.array([i for _, i in pairs])[:, None] * rpp + np.arange(rpp)[None, :]
            ).ravel()
            for fi, f in enumerate(g.fields):
                for li, layer in enumerate(g.layers):
                    got = np.asarray(view.rows[gi][fi][li])[slots, rows]
                    nz = np.any(got.reshape(len(slots), -1) != 0, axis=1)
                    if nz.any():
                        x = int(np.flatnonzero(nz)[0])
                        raise _Found(
                            f"{name}: slot {int(slots[x])} group {g.name} field {f.name} layer {layer}: block "
                            f"{int(rows[x]) // rpp} was handed out by this op but row {int(rows[x])} is not zero: "
                            f"{got[x].ravel()[:4].tolist()}"
                        )

    def _fresh(
        self, k: int, counts: Counts, view: LogicalView, admitted: dict[int, int]
    ) -> dict[int, list[np.ndarray]]:
        """Per live slot, per group, table slots that got a page in this op."""
        prev = self.prev[k]
        out = {}
        for s in np.flatnonzero(counts.live):
            s = int(s)
            per_group = []
            for gi, g in enumerate(self.plan.groups):
                now = np.asarray(view.tables[gi][s]) >= 1
                if s in admitted:
                    idx = np.arange(now.size)
                    per_group.append(now & (idx >= admitted[s] // g.block_tokens))
                elif (
                    prev is not None
                    and prev[0].live[s]
                    and prev[0].generation[s] == counts.generation[s]
                ):
                    per_group.append(now & (np.asarray(prev[1].tables[gi][s]) == -1))
                else:
                    per_group.append(np.zeros(now.size, bool))
            out[s] = per_group
        return out

    # --- writing ----------------------------------------------------------------------------
    def _write(self, steps: list[tuple[int, int, list[int]]]) -> None:
        """Writes the pattern of positions ``[start, start + len(tokens))`` of each slot."""
        plan = self.plan
        for s, start, toks in steps:
            rec = self.records[s]
            del rec.tokens[start:], rec.hashes[start:]
            seed = rec.hashes[start - 1] if start else None
            rec.tokens.extend(toks)
            rec.hashes.extend(prefix_hashes(rec.namespace, rec.tokens, start, seed))
            rec.written = len(rec.tokens)
        for gi, g in enumerate(plan.groups):
            r = g.tokens_per_row
            slots, rows, hashes = [], [], []
            for s, start, toks in steps:
                rec = self.records[s]
                for p in range(start, start + len(toks)):
                    if (p + 1) % r == 0:
                        slots.append(s)
                        rows.append(p // r)
                        hashes.append(rec.hashes[p])
            if not slots:
                continue
            hv = np.array(hashes, np.uint64)
            values = tuple(
                tuple(row_values(hv, salt(gi, fi, li), f.format) for li in range(len(g.layers)))
                for fi, f in enumerate(g.fields)
            )
            for be in self.backends:
                be.write(gi, np.array(slots, np.int64), np.array(rows, np.int64), values)

    # --- one op -----------------------------------------------------------------------------
    def step(self, op: Op, batch=None) -> None:
        # ``batch``: the op's batch if the caller already built it (lockstep runs).
        if batch is None:
            batch = _batch(self.plan, op, self.handles)
        self.stats["rows"] += int(np.sum(batch.valid))
        results = [getattr(be, op.kind.value)(batch) for be in self.backends]
        self._compare_results(op.kind, results)
        res = results[0]
        counts = [be.counts() for be in self.backends]
        for f in _COUNT_FIELDS:
            self._diff(f"counts.{f}", [getattr(c, f) for c in counts])
        c0 = counts[0]
        # Forget requests that ended; cut records to the extent (rewinds drop tokens).
        for s in list(self.records):
            rec = self.records[s]
            if not c0.live[s] or c0.generation[s] != rec.generation:
                del self.records[s]
            else:
                rec.written = min(rec.written, int(c0.extent[s]))
                del rec.tokens[rec.written :], rec.hashes[rec.written :]
        steps, admitted = [], {}
        ok = np.flatnonzero(res.status == Status.OK)
        if op.kind is OpKind.ADMIT:
            for i in ok:
                rid, ns, toks, _ = op.rows[i]
                s, h, n = int(res.slot[i]), int(res.hit[i]), int(res.count[i])
                self.handles[rid] = (s, int(res.generation[i]))
                self.records[s] = _Record(
                    int(res.generation[i]), ns, list(toks[:h]), prefix_hashes(ns, list(toks[:h])), h
                )
                admitted[s] = h
                self.stats["admitted"] += 1
                self.stats["prompt_tokens"] += len(toks)
                self.stats["hit_tokens"] += h
                if n:
                    steps.append((s, h, list(toks[h : h + n])))
        elif op.kind is OpKind.EXTEND:
            for i in ok:
                s, n = int(batch.slot[i]), int(res.count[i])
                steps.append((s, int(c0.extent[s]) - n, [int(x) for x in batch.tokens[i, :n]]))
        views = [be.view() for be in self.backends]
        self._compare_views(c0, views)
        # The views agree on every live row, so the pattern check of the first covers all.
        if self.every_op or op.kind is OpKind.ADMIT:
            self._check_expected(self.names[0], views[0])
        for k, (name, be) in enumerate(zip(self.names, self.backends, strict=True)):
            self._check_fresh(name, views[k], self._fresh(k, counts[k], views[k], admitted))
            bad = be.violations() if self.every_op and hasattr(be, "violations") else []
            if bad:
                raise _Found(f"{name} broke invariants: " + "; ".join(bad))
            self.prev[k] = (counts[k], views[k])
        self._write(steps)

    def final(self) -> None:
        counts = [be.counts() for be in self.backends]
        views = [be.view() for be in self.backends]
        self._compare_views(counts[0], views)
        self._check_expected(self.names[0], views[0])
        for name, be in zip(self.names, self.backends, strict=True):
            bad = be.violations() if hasattr(be, "violations") else []
            if bad:
                raise _Found(f"{name} broke invariants: " + "; ".join(bad))


def run_trace(trace: Trace, *backends: Backend, names: tuple[str, ...] | None = None) -> RunReport:
    """Replays ``trace`` on every backend (reset first) and compares them after each op.

    With one backend it checks that backend alone: token patterns, zeroing and (for the
    oracle) invariants.

    Args:
      trace: the trace (its plan must be the backends' plan).
      *backends: one or more backends; the first is the reference in diffs.
      names: display names, default ``("a", "b", ...)``.

    Returns:
      A :class:`RunReport`; ``report.divergence`` is the first divergence or ``None``.
    """
    if not backends:
        raise TypeError("run_trace needs at least one backend")
    names = names or tuple("abcdefgh"[: len(backends)])
    for be in backends:
        be.reset()
    h = _Harness(trace, tuple(backends), names)
    divergence, n = None, 0
    for k, op in enumerate(trace.ops):
        n = k + 1
        try:
            h.step(op)
        except _Found as e:
            divergence = Divergence(k, op, e.what, trace.ops[max(0, k - 5) : k], trace.seed)
            break
    else:
        try:
            h.final()
        except _Found as e:
            divergence = Divergence(len(trace.ops), None, e.what, trace.ops[-5:], trace.seed)
    return RunReport(ops=n, divergence=divergence, **h.stats)
