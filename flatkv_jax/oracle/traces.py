"""Seeded random traces of coordinator operations, shaped like an agentic serving workload.

A trace is a plan plus a tuple of batched :class:`Op`s whose rows name requests by a
logical request id (``rid``), not by handle: the harness turns rids into the handles the
backends returned (a rid whose request was released becomes a stale handle). The generator
keeps a :class:`~flatkv_jax.oracle.oracle.RadixOracle` in the loop only to know which
requests are running and where they stand, so its choices are sensible; the trace itself is
plain data and replays identically on any backend.

What the traces exercise: shared system prompts per namespace, multi-turn continuations
(the next turn's prompt is the previous turn's committed tokens plus new ones), prompts that
diverge from an earlier conversation inside a block, chunked prefill, speculative decode
steps with random acceptance (including pipelined steps and DISCARDED results), explicit
rewinds, reclaim, FINISH / RETRACT (then readmission) / ABORT, deferred releases, stale
handles, masked rows, bad arguments, and pool pressure (small pools: OUT_OF_PAGES, LRU
eviction, pinning in batched admits).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail
from flatkv_jax.oracle.batches import ReleaseMode, admit_batch, extend_batch, handle_batch
from flatkv_jax.oracle.oracle import RadixOracle
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.status import Status


class OpKind(enum.Enum):
    """The batched operation an :class:`Op` calls."""

    ADMIT = "admit"
    EXTEND = "extend"
    RETIRE = "retire"
    REWIND = "rewind"
    RECLAIM = "reclaim"
    RELEASE = "release"


@dataclasses.dataclass(frozen=True)
class Op:
    """One batched operation.

    Attributes:
      kind: the operation.
      rows: one entry per batch row, ``None`` for a masked row, else
        ADMIT ``(rid, namespace, tokens, first_chunk)``; EXTEND ``(rid, tokens)``;
        RETIRE ``(rid, accepted)``; REWIND ``(rid, new_extent)``; RECLAIM ``(rid,)``;
        RELEASE ``(rid, mode)``. ``tokens`` are tuples of ints.
    """

    kind: OpKind
    rows: tuple[tuple | None, ...]

    def __str__(self) -> str:
        def short(row):
            if row is None:
                return "-"
            return (
                "("
                + ", ".join(f"<{len(x)} tok>" if isinstance(x, tuple) else str(x) for x in row)
                + ")"
            )

        return f"{self.kind.value}[" + " ".join(short(r) for r in self.rows) + "]"


@dataclasses.dataclass(frozen=True)
class Trace:
    """A seeded trace: replay it with :func:`flatkv_jax.oracle.differential.run_trace`."""

    plan: CachePlan
    seed: int
    ops: tuple[Op, ...]


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """Knobs of :func:`random_trace` (defaults: a short, dense trace for CI).

    Attributes:
      num_ops: operations in the trace.
      namespaces: namespaces requests are spread over.
      system_prompts: shared system prompts per namespace.
      vocab: token ids are drawn from ``[0, vocab)`` (small: accidental sharing happens).
      max_turns: turns of one conversation (multi-turn continuation).
      max_new_tokens: most tokens generated per turn.
      p_stale: chance that an op also carries a stale handle row.
      p_bad: chance that an op also carries a row with a bad argument.
      p_rewind: weight of explicit rewinds.
      accept_full: chance that a speculative step accepts every token.
    """

    num_ops: int = 40
    namespaces: int = 2
    system_prompts: int = 2
    vocab: int = 8
    max_turns: int = 3
    max_new_tokens: int = 24
    p_stale: float = 0.05
    p_bad: float = 0.03
    p_rewind: float = 0.3
    accept_full: float = 0.5

    def __post_init__(self):
        check_nonnegative_int("num_ops", self.num_ops)
        for name in ("namespaces", "system_prompts", "vocab", "max_turns", "max_new_tokens"):
            check_positive_int(name, getattr(self, name))
        for name in ("p_stale", "p_bad", "p_rewind", "accept_full"):
            v = getattr(self, name)
            if not isinstance(v, float | int) or not 0 <= v <= 1:
                fail(name, v, "a probability in [0, 1]", f"pass {name} between 0 and 1")


@dataclasses.dataclass
class _Conv:
    namespace: int
    prompt: list[int]  # the current turn's whole prompt
    turns_left: int
    new_tokens: int  # tokens this turn generates
    rid: int | None = None


class _Generator:
    def __init__(self, plan: CachePlan, seed: int, cfg: TraceConfig):
        self.plan, self.cfg = plan, cfg
        self.rng = np.random.default_rng(seed)
        self.oracle = RadixOracle(plan)
        self.b = plan.limits.max_requests
        self.max_ctx = plan.limits.max_context
        self.chunk = plan.limits.chunk_tokens
        self.decode = plan.limits.decode_tokens
        gran = plan.prefix_granularity
        self.system = [
            [
                self._tokens(int(self.rng.integers(1, 2 * gran + 2)))
                for _ in range(cfg.system_prompts)
            ]
            for _ in range(cfg.namespaces)
        ]
        self.waiting: list[_Conv] = []
        self.running: dict[int, _Conv] = {}  # rid -> conversation
        self.handles: dict[int, tuple[int, int]] = {}  # rid -> handle (live and dead)
        self.dead: list[int] = []
        self.next_rid = 0
        self.done: list[list[int]] = []  # committed token histories of finished turns
        self.admitting: dict[int, _Conv] = {}
        self.ended_mode: dict[int, ReleaseMode] = {}

    def _tokens(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(0, self.cfg.vocab, n)]

    def _clip(self, prompt: list[int]) -> list[int]:
        return prompt[: max(1, self.max_ctx - self.decode)]

    def _new_conversation(self) -> _Conv:
        rng, cfg = self.rng, self.cfg
        ns = int(rng.integers(cfg.namespaces))
        if self.done and rng.random() < 0.3:
            # Diverge from an earlier conversation at a random point (often inside a block).
            base = self.done[int(rng.integers(len(self.done)))]
            prompt = base[: int(rng.integers(1, len(base) + 1))] + self._tokens(
                int(rng.integers(1, 6))
            )
        else:
            sys = self.system[ns][int(rng.integers(cfg.system_prompts))]
            prompt = sys + self._tokens(int(rng.integers(1, 2 * self.plan.prefix_granularity)))
        return _Conv(
            ns,
            self._clip(prompt),
            int(rng.integers(1, cfg.max_turns + 1)),
            int(rng.integers(1, cfg.max_new_tokens + 1)),
        )

    def _live(self, rid: int):
        slot, gen = self.handles[rid]
        return self.oracle._req(slot, gen, allow_pending=True)

    def _pad(self, rows: list, kind: OpKind) -> tuple:
        rows = rows[: self.b]
        if len(rows) < self.b and self.dead and self.rng.random() < self.cfg.p_stale:
            rid = int(self.dead[int(self.rng.integers(len(self.dead)))])
            stale = {
                OpKind.EXTEND: (rid, (1,)),
                OpKind.RETIRE: (rid, 0),
                OpKind.REWIND: (rid, 0),
                OpKind.RECLAIM: (rid,),
                OpKind.RELEASE: (rid, int(ReleaseMode.FINISH)),
            }
            if kind in stale:
                rows.append(stale[kind])
        rows += [None] * (self.b - len(rows))
        order = self.rng.permutation(self.b) if self.rng.random() < 0.3 else np.arange(self.b)
        return tuple(rows[i] for i in order)

    # --- choosing ops -----------------------------------------------------------------------
    def step(self) -> Op:
        rng = self.rng
        live = [rid for rid in self.running if self._live(rid) is not None]
        choices = {
            OpKind.ADMIT: 2.0 if (self.waiting or rng.random() < 0.5) else 0.2,
            OpKind.EXTEND: 3.0 if live else 0.0,
            OpKind.RETIRE: 3.0 if live else 0.0,
            OpKind.RECLAIM: 0.7 if live else 0.0,
            OpKind.RELEASE: 1.0 if live else 0.0,
            OpKind.REWIND: self.cfg.p_rewind if live else 0.0,
        }
        kinds = list(choices)
        w = np.array([choices[k] for k in kinds])
        for _ in range(8):  # an op with no valid row tests nothing: draw again
            kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
            op = getattr(self, f"_{kind.value}")(live)
            if any(r is not None for r in op.rows):
                break
        return op

    def _admit(self, live) -> Op:
        rng = self.rng
        while len(self.waiting) < 3:
            self.waiting.append(self._new_conversation())
        k = int(rng.integers(1, min(len(self.waiting), self.b) + 1))
        picked = [self.waiting[int(i)] for i in rng.choice(len(self.waiting), k, replace=False)]
        if rng.random() < 0.2 and picked:  # the same prompt twice in one batch (pinning, no hit)
            c = picked[0]
            picked.append(_Conv(c.namespace, list(c.prompt), 1, c.new_tokens))
        rows = []
        self.admitting = {}
        for conv in picked:
            rid = self.next_rid
            self.next_rid += 1
            self.admitting[rid] = conv
            chunk = int(rng.integers(0 if rng.random() < 0.05 else 1, self.chunk + 1))
            if rng.random() < self.cfg.p_bad:
                chunk = self.chunk + 1 + int(rng.integers(3))
            rows.append((rid, conv.namespace, tuple(conv.prompt), chunk))
        return Op(OpKind.ADMIT, self._pad(rows, OpKind.ADMIT))

    def _extend(self, live) -> Op:
        rng = self.rng
        rows = []
        for rid in live:
            req, conv = self._live(rid), self.running[rid]
            if req.pending is not None or rng.random() < 0.2:
                continue
            if req.n < len(conv.prompt):
                count = min(len(conv.prompt) - req.n, int(rng.integers(1, self.chunk + 1)))
                toks = conv.prompt[req.n : req.n + count]
            else:
                count = self.decode if rng.random() < 0.8 else 1
                if req.n > self.max_ctx - self.chunk and rng.random() < 0.2:
                    count = self.chunk  # a long step near the end: often TOO_LONG
                toks = self._tokens(count)
            if rng.random() < self.cfg.p_bad:
                toks = [] if rng.random() < 0.5 else self._tokens(self.plan.limits.step_tokens)
            rows.append((rid, tuple(toks)))
        return Op(OpKind.EXTEND, self._pad(rows, OpKind.EXTEND))

    def _retire(self, live) -> Op:
        rng = self.rng
        rows = []
        for rid in live:
            req, conv = self._live(rid), self.running[rid]
            if not req.fifo:
                if rng.random() < 3 * self.cfg.p_bad:  # nothing in flight: NO_STEP
                    rows.append((rid, 0))
                continue
            if rng.random() < 0.15:
                continue
            start, count, _ = req.fifo[0]
            prefill = start + count <= len(conv.prompt)
            if prefill or rng.random() < self.cfg.accept_full:
                acc = count
            else:
                acc = int(rng.integers(0, count + 1))
            if rng.random() < self.cfg.p_bad:
                acc = count + 1
            rows.append((rid, acc))
        return Op(OpKind.RETIRE, self._pad(rows, OpKind.RETIRE))

    def _rewind(self, live) -> Op:
        rows = []
        for rid in live:
            req = self._live(rid)
            if req.pending is None and req.n > req.c and self.rng.random() < 0.5:
                rows.append((rid, int(self.rng.integers(req.c, req.n + 1))))
        return Op(OpKind.REWIND, self._pad(rows, OpKind.REWIND))

    def _reclaim(self, live) -> Op:
        return Op(
            OpKind.RECLAIM,
            self._pad([(rid,) for rid in live if self.rng.random() < 0.7], OpKind.RECLAIM),
        )

    def _release(self, live) -> Op:
        rng = self.rng
        rows = []
        for rid in live:
            req, conv = self._live(rid), self.running[rid]
            if req.pending is not None:
                continue
            finished = req.c >= len(conv.prompt) + conv.new_tokens or req.n >= self.max_ctx
            r = rng.random()
            if finished and r < 0.8:
                rows.append((rid, int(ReleaseMode.FINISH)))
            elif r < 0.06:
                rows.append((rid, int(ReleaseMode.RETRACT)))
            elif r < 0.09:
                rows.append((rid, int(ReleaseMode.ABORT)))
        return Op(OpKind.RELEASE, self._pad(rows, OpKind.RELEASE))

    # --- applying ops to the generator's own oracle -------------------------------------------
    def apply(self, op: Op) -> None:
        o, plan = self.oracle, self.plan
        committed = {}
        for rid in self.running:
            req = self._live(rid)
            if req is not None:
                committed[rid] = list(req.tokens[: req.c])

        def handle(rid: int) -> tuple[int, int]:
            return self.handles.get(rid, (0, -1))

        if op.kind is OpKind.ADMIT:
            res = o.admit(admit_batch(plan, [None if r is None else r[1:] for r in op.rows]))
            for r, st, s, g in zip(op.rows, res.status, res.slot, res.generation, strict=True):
                if r is not None and st == Status.OK:
                    conv = self.admitting[r[0]]
                    self.handles[r[0]] = (int(s), int(g))
                    self.running[r[0]] = conv
                    if conv in self.waiting:
                        self.waiting.remove(conv)
            return
        if op.kind is OpKind.EXTEND:
            o.extend(
                extend_batch(plan, [None if r is None else (handle(r[0]), r[1]) for r in op.rows])
            )
        elif op.kind is OpKind.RECLAIM:
            o.reclaim(handle_batch(plan, [None if r is None else handle(r[0]) for r in op.rows]))
        else:
            getattr(o, op.kind.value)(
                handle_batch(plan, [None if r is None else (handle(r[0]), r[1]) for r in op.rows])
            )
        modes = {r[0]: r[1] for r in op.rows if r is not None and op.kind is OpKind.RELEASE}
        for rid in list(self.running):
            req = self._live(rid)
            if req is not None:
                continue
            # The request ended (now, or by a retire that ran its deferred release).
            conv = self.running.pop(rid)
            self.dead.append(rid)
            mode = self.ended_mode.pop(rid, modes.get(rid))
            toks = committed.get(rid, [])
            if mode == ReleaseMode.ABORT:
                if self.rng.random() < 0.5:  # retry the same prompt: an aborted request never hits
                    self.waiting.append(
                        _Conv(conv.namespace, list(conv.prompt), conv.turns_left, conv.new_tokens)
                    )
                continue
            if toks:
                self.done.append(toks)
            if mode == ReleaseMode.RETRACT:
                rest = conv.prompt[len(toks) :]
                self.waiting.append(
                    _Conv(
                        conv.namespace,
                        self._clip(toks + rest) or conv.prompt,
                        conv.turns_left,
                        conv.new_tokens,
                    )
                )
            elif conv.turns_left > 1:
                prompt = self._clip(toks + self._tokens(int(self.rng.integers(1, 8))))
                self.waiting.append(
                    _Conv(
                        conv.namespace,
                        prompt,
                        conv.turns_left - 1,
                        int(self.rng.integers(1, self.cfg.max_new_tokens + 1)),
                    )
                )
        for rid in self.running:  # deferred releases end later, by a retire
            req = self._live(rid)
            if req.pending is not None:
                self.ended_mode[rid] = req.pending


def random_trace(plan: CachePlan, seed: int, config: TraceConfig | None = None) -> Trace:
    """A seeded random trace for ``plan`` (see the module docstring for what it exercises).

    Args:
      plan: the cache plan; batches have ``plan.limits.max_requests`` rows. Small pools give
        pool pressure.
      seed: the random seed; the same (plan, seed, config) gives the same trace.
      config: knobs, :class:`TraceConfig` by default.

    Returns:
      The trace.
    """
    check_plan(plan)
    check_nonnegative_int("seed", seed)
    cfg = TraceConfig() if config is None else config
    if not isinstance(cfg, TraceConfig):
        fail(
            "config",
            type(cfg).__name__,
            "it must be a TraceConfig",
            "pass TraceConfig(...)",
            exc=TypeError,
        )
    gen = _Generator(plan, seed, cfg)
    ops = []
    for _ in range(cfg.num_ops):
        op = gen.step()
        gen.apply(op)
        ops.append(op)
    return Trace(plan, seed, tuple(ops))
