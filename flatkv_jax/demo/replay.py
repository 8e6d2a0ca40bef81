"""Replays the engine's coordinator operations through the host radix oracle.

The engine records every coordinator call it made (``EngineOptions(record_ops=True)``,
``Engine.op_log``): which requests it admitted with which first chunk, extended, retired
with how many accepted tokens, reclaimed and released, and the status and prefix hit the
device returned per row. :func:`replay_ops` runs the same sequence on
:class:`flatkv_jax.oracle.RadixOracle` — an independent host implementation of the contract
that matches prefixes on the tokens themselves (a trie, no hashing) — and compares every
row's status and every admission's hit. On an agreeing run the oracle's hit tokens equal the
engine's; the demo reports both.

Token ids are not in the log: with one-step overlap the engine extends a decode step before
it has read the token it feeds. They are derived here from each request's final sequence
(prompt, then generated tokens): position ``p`` holds ``sequence[p]``. That is exact for every
position that is ever committed (the only ones the index publishes); positions past the
sequence (a draft that was rejected) are padded with 0 and never committed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from flatkv_jax.errors import fail
from flatkv_jax.oracle import (
    Handle,
    RadixOracle,
    ReleaseMode,
    admit_batch,
    extend_batch,
    handle_batch,
)
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.status import Status

#: The operation kinds of an op log and the fields of their rows (after ``request_id``).
OP_FIELDS = {
    "admit": ("namespace", "prompt_len", "first_chunk", "status", "hit"),
    "extend": ("count", "status"),
    "retire": ("accepted", "status"),
    "rewind": ("extent", "status"),
    "reclaim": ("status",),
    "release": ("mode", "status"),
}

#: Disagreements kept in :attr:`ReplayResult.mismatches` (the count is always exact).
MAX_MISMATCHES = 8


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What the oracle did on the engine's operations.

    Attributes:
      ops: batched operations replayed.
      admissions: admit rows the oracle served (status OK).
      hit_tokens: prefix tokens the oracle reused over all its admissions.
      prompt_tokens: prompt tokens of those admissions (the hit rate's denominator).
      engine_hit_tokens, engine_prompt_tokens: the same sums over the admissions the engine
        logged as served, with the hits it logged.
      mismatch_count: rows whose status or hit differed from the engine's.
      mismatches: the first few, one line each (op index, kind, request, engine vs oracle).
      violations: the oracle's broken invariants at the end (empty on a sound replay).
    """

    ops: int
    admissions: int
    hit_tokens: int
    prompt_tokens: int
    engine_hit_tokens: int
    engine_prompt_tokens: int
    mismatch_count: int
    mismatches: tuple[str, ...]
    violations: tuple[str, ...]

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / prompt_tokens`` (0 when nothing was admitted)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def engine_hit_rate(self) -> float:
        """The engine's hit rate on the same admissions, from its own log."""
        return (
            self.engine_hit_tokens / self.engine_prompt_tokens if self.engine_prompt_tokens else 0.0
        )

    @property
    def agrees(self) -> bool:
        """No row disagreed and the oracle's invariants hold."""
        return self.mismatch_count == 0 and not self.violations


def _check_log(op_log: object) -> list[tuple[str, tuple[tuple, ...]]]:
    if not isinstance(op_log, Sequence) or isinstance(op_log, str | bytes):
        fail(
            "op_log",
            type(op_log).__name__,
            "it must be a list of (kind, rows)",
            "pass Engine.op_log of an engine built with record_ops=True",
            exc=TypeError,
        )
    out = []
    for i, entry in enumerate(op_log):
        if not (isinstance(entry, tuple) and len(entry) == 2 and entry[0] in OP_FIELDS):
            fail(
                f"op_log[{i}]",
                entry,
                f"an entry is (kind, rows) with kind in {sorted(OP_FIELDS)}",
                "pass Engine.op_log unchanged",
            )
        kind, rows = entry
        width = 1 + len(OP_FIELDS[kind])
        for row in rows:
            if not (isinstance(row, tuple) and len(row) == width):
                fail(
                    f"op_log[{i}] {kind} row",
                    row,
                    f"a {kind} row is (request_id, {', '.join(OP_FIELDS[kind])})",
                    "pass Engine.op_log unchanged",
                )
        out.append((kind, tuple(rows)))
    return out


def replay_ops(
    plan: CachePlan,
    op_log: Sequence[tuple[str, Sequence[tuple]]],
    sequences: Mapping[int, Sequence[int]],
    *,
    prefix_reuse: bool = True,
    fifo_depth: int = 2,
    max_count: int | None = None,
) -> ReplayResult:
    """Runs ``op_log`` on a fresh :class:`RadixOracle` and compares it with the engine's.

    Args:
      plan: the engine's cache plan.
      op_log: the engine's operations, in order: ``(kind, rows)``, rows as in
        :data:`OP_FIELDS` (``request_id`` first).
      sequences: per request id, prompt then generated tokens (what positions hold).
      prefix_reuse: whether the engine ran with the prefix cache (``False``: the oracle never
        matches or publishes, like the engine's ``prefix_cache=False``).
      fifo_depth: in-flight steps per request (the coordinator's, default 2).
      max_count: the oracle's bound on tokens per row (default: the contract's).

    Returns:
      A :class:`ReplayResult`.

    Raises:
      ValueError: a malformed log, or a row naming a request with no sequence.
    """
    plan = check_plan(plan)
    log = _check_log(op_log)
    oracle = RadixOracle(
        plan, fifo_depth=fifo_depth, max_count=max_count, prefix_reuse=prefix_reuse
    )
    handles: dict[int, Handle] = {}
    stale = Handle(-1, -1)  # a request the oracle never admitted: every op on it is STALE
    mismatches: list[str] = []
    mismatch_count = admissions = hit_tokens = prompt_tokens = 0
    engine_hit_tokens = engine_prompt_tokens = 0

    def seq(rid: int) -> Sequence[int]:
        if rid not in sequences:
            fail(
                "request_id",
                rid,
                "the op log names a request with no token sequence",
                "pass prompt + generated tokens of every request in the log",
            )
        return sequences[rid]

    def tokens(rid: int, start: int, count: int) -> list[int]:
        s = seq(rid)
        part = [int(t) for t in s[start : start + count]]
        return part + [0] * (count - len(part))

    def compare(i: int, kind: str, rid: int, what: str, engine: int, oracle_value: int) -> None:
        nonlocal mismatch_count
        if int(engine) == int(oracle_value):
            return
        mismatch_count += 1
        if len(mismatches) < MAX_MISMATCHES:

            def name(v: int) -> str:
                return Status(int(v)).name if what == "status" else str(int(v))

            mismatches.append(
                f"op {i} {kind} request {rid}: {what} engine={name(engine)} oracle={name(oracle_value)}"
            )

    for i, (kind, rows) in enumerate(log):
        if not rows:
            continue
        rids = [row[0] for row in rows]
        size = len(rows)
        if kind == "admit":
            batch = admit_batch(
                plan,
                [
                    (int(ns), tokens(rid, 0, int(plen)), int(chunk))
                    for rid, ns, plen, chunk, _, _ in rows
                ],
                size=size,
            )
            res = oracle.admit(batch)
            for k, (rid, _, plen, _, status, hit) in enumerate(rows):
                compare(i, kind, rid, "status", status, res.status[k])
                if int(status) == Status.OK:
                    engine_hit_tokens += int(hit)
                    engine_prompt_tokens += int(plen)
                if int(res.status[k]) == Status.OK:
                    handles[rid] = Handle(int(res.slot[k]), int(res.generation[k]))
                    admissions += 1
                    hit_tokens += int(res.hit[k])
                    prompt_tokens += int(plen)
                    compare(i, kind, rid, "hit", hit, res.hit[k])
            continue
        if kind == "extend":
            ext_rows = []
            for rid, count, _ in rows:
                h = handles.get(rid, stale)
                live = 0 <= h.slot < len(oracle.requests) and oracle.requests[h.slot] is not None
                start = oracle.requests[h.slot].n if live else 0
                ext_rows.append((h, tokens(rid, start, int(count))))
            res = oracle.extend(extend_batch(plan, ext_rows, size=size))
        else:
            args = {
                "retire": lambda row: (handles.get(row[0], stale), int(row[1])),
                "rewind": lambda row: (handles.get(row[0], stale), int(row[1])),
                "reclaim": lambda row: handles.get(row[0], stale),
                "release": lambda row: (handles.get(row[0], stale), int(ReleaseMode(row[1]))),
            }[kind]
            batch = handle_batch(plan, [args(row) for row in rows], size=size)
            res = getattr(oracle, kind)(batch)
        for k, rid in enumerate(rids):
            compare(i, kind, rid, "status", rows[k][-1], res.status[k])
    return ReplayResult(
        ops=len(log),
        admissions=admissions,
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        engine_hit_tokens=engine_hit_tokens,
        engine_prompt_tokens=engine_prompt_tokens,
        mismatch_count=mismatch_count,
        mismatches=tuple(mismatches),
        violations=tuple(oracle.violations()),
    )
