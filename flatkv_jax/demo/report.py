"""The demo's report: what was served, how fast, and the checks that prove it right.

:class:`DemoReport` holds the numbers; :func:`format_report` renders the text the demo prints
and :meth:`DemoReport.to_dict` the object ``--json`` prints. :class:`StepSeries` holds the
per-step series the ``--plot`` figure draws. Every line is explained in docs/serving.md
("flatkv demo").
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class GroupOccupancy:
    """Pages in use of one pool over the run (sampled once per step).

    Attributes:
      name: the cache group.
      usable: usable pages of its pool (the plan's size without the null/scratch pages).
      peak: most pages in use at once.
      mean: mean pages in use over the steps.
    """

    name: str
    usable: int
    peak: int
    mean: float


@dataclasses.dataclass(frozen=True)
class RankSummary:
    """One data-parallel rank of the run.

    Attributes:
      rank: its index.
      requests: requests (turns) the router sent to it.
      prompt_tokens, hit_tokens: over its admissions (its own coordinator's hits: a prefix
        cached on another rank never hits here).
      occupancy: its pools (usable pages per rank, peak and mean in use).
    """

    rank: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    occupancy: tuple[GroupOccupancy, ...]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "occupancy": {
                o.name: {"usable": o.usable, "peak": o.peak, "mean": round(o.mean, 2)}
                for o in self.occupancy
            },
        }


@dataclasses.dataclass(frozen=True)
class Parity:
    """The spot parity check against dense, cache-free recompute.

    Attributes:
      requests: request ids checked.
      tokens: generated tokens compared (one logit row each).
      max_abs_error: largest ``|engine logit - dense logit|`` over those rows.
      tolerance: the bound for the model's row formats (docs/model.md, "Tolerances").
      greedy_mismatches: generated tokens that are not the dense logits' argmax.
    """

    requests: tuple[int, ...]
    tokens: int
    max_abs_error: float
    tolerance: float
    greedy_mismatches: int

    @property
    def ok(self) -> bool:
        """Within tolerance and every token the greedy choice."""
        return self.max_abs_error <= self.tolerance and self.greedy_mismatches == 0


@dataclasses.dataclass(frozen=True)
class DemoReport:
    """Everything the demo reports (see docs/serving.md, "flatkv demo").

    Attributes:
      model: the model preset (``--model``).
      seed: the workload and weight seed.
      options: engine options as run (``prefix_cache``, ``overlap``, ``mtp``).
      plan: plan summary (name, request slots, context, chunk, verify width, step tokens,
        groups, pool bytes).
      sessions, tenants: workload shape.
      submitted, served, aborted: requests (turns) submitted, finished normally, aborted.
      steps: engine steps.
      wall_s: seconds of the whole serving run (compilation included).
      warmup_s: seconds of the engine's warm-up, part of wall_s: building the model and engine,
        and the steps that compiled a step function.
      check_s: seconds of the checks after the run (oracle replay, dense recompute).
      prefill_tokens, decode_tokens: tokens the engine wrote in prefill chunks / decode and
        verify steps (accepted or not).
      prompt_tokens, hit_tokens: prompt tokens of every admission and those the prefix cache
        supplied (as the engine logged them).
      oracle_prompt_tokens, oracle_hit_tokens: the same on the radix oracle's replay.
      oracle_mismatches: rows where the replay's status or hit differed (0 = agree).
      oracle_notes: the first disagreements or oracle invariant violations, one line each.
      occupancy: per pool, peak and mean pages in use.
      pages_zeroed: recycled pages zeroed before reuse.
      retractions: requests preempted for want of pages (readmitted later).
      compilations: step functions the engine compiled (one per step kind it used).
      compilations_after_warmup: jit compilations after warm-up (must be 0).
      draft_proposed, draft_accepted: MTP draft tokens verified / accepted.
      parity: the spot parity check (None when no request finished).
      devices: data-parallel ranks (1: the single-device engine).
      ranks: per rank: requests, hit rate, pool occupancy (one entry on one device).
      routing: the router's numbers (policy, requests per rank, balance, keyed requests,
        routing misses: requests sent away from the rank that served their prefix key).
    """

    model: str
    seed: int
    options: dict
    plan: dict
    sessions: int
    tenants: int
    submitted: int
    served: int
    aborted: int
    steps: int
    wall_s: float
    warmup_s: float
    check_s: float
    prefill_tokens: int
    decode_tokens: int
    prompt_tokens: int
    hit_tokens: int
    oracle_prompt_tokens: int
    oracle_hit_tokens: int
    oracle_mismatches: int
    oracle_notes: tuple[str, ...]
    occupancy: tuple[GroupOccupancy, ...]
    pages_zeroed: int
    retractions: int
    compilations: int
    compilations_after_warmup: int
    draft_proposed: int
    draft_accepted: int
    parity: Parity | None
    devices: int = 1
    ranks: tuple[RankSummary, ...] = ()
    routing: dict | None = None

    # --- derived --------------------------------------------------------------------------
    @property
    def serve_s(self) -> float:
        """Seconds after warm-up (the throughput denominator)."""
        return max(self.wall_s - self.warmup_s, 1e-9)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.serve_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.serve_s

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def oracle_hit_rate(self) -> float:
        return (
            self.oracle_hit_tokens / self.oracle_prompt_tokens if self.oracle_prompt_tokens else 0.0
        )

    @property
    def oracle_agrees(self) -> bool:
        """The replay agreed row by row and reused exactly the engine's hit tokens."""
        return (
            self.oracle_mismatches == 0
            and not self.oracle_notes
            and self.oracle_hit_tokens == self.hit_tokens
            and self.oracle_prompt_tokens == self.prompt_tokens
        )

    @property
    def draft_accepted_rate(self) -> float:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def ok(self) -> bool:
        """Every check passed: all served, oracle agrees, no recompilation, parity holds."""
        return (
            self.served == self.submitted
            and self.oracle_agrees
            and self.compilations_after_warmup == 0
            and (self.parity is None or self.parity.ok)
        )

    def to_dict(self) -> dict:
        """The machine-readable report (what ``flatkv demo --json`` prints)."""
        return {
            "model": self.model,
            "seed": self.seed,
            "options": dict(self.options),
            "plan": dict(self.plan),
            "workload": {
                "requests": self.submitted,
                "sessions": self.sessions,
                "tenants": self.tenants,
            },
            "requests": {
                "submitted": self.submitted,
                "served": self.served,
                "aborted": self.aborted,
            },
            "steps": self.steps,
            "wall_s": round(self.wall_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "check_s": round(self.check_s, 3),
            "prefill": {
                "tokens": self.prefill_tokens,
                "tokens_per_s": round(self.prefill_tokens_per_s, 1),
            },
            "decode": {
                "tokens": self.decode_tokens,
                "tokens_per_s": round(self.decode_tokens_per_s, 1),
            },
            "prefix": {
                "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens,
                "hit_rate": round(self.hit_rate, 4),
                "oracle_prompt_tokens": self.oracle_prompt_tokens,
                "oracle_hit_tokens": self.oracle_hit_tokens,
                "oracle_hit_rate": round(self.oracle_hit_rate, 4),
                "oracle_agrees": self.oracle_agrees,
                "oracle_mismatches": self.oracle_mismatches,
                "oracle_notes": list(self.oracle_notes),
            },
            "occupancy": {
                o.name: {"usable": o.usable, "peak": o.peak, "mean": round(o.mean, 2)}
                for o in self.occupancy
            },
            "pages_zeroed": self.pages_zeroed,
            "retractions": self.retractions,
            "compilations": self.compilations,
            "compilations_after_warmup": self.compilations_after_warmup,
            "drafts": {
                "proposed": self.draft_proposed,
                "accepted": self.draft_accepted,
                "accepted_rate": round(self.draft_accepted_rate, 4),
            },
            "parity": None
            if self.parity is None
            else {
                "requests": list(self.parity.requests),
                "tokens": self.parity.tokens,
                "max_abs_logit_error": self.parity.max_abs_error,
                "tolerance": self.parity.tolerance,
                "greedy_mismatches": self.parity.greedy_mismatches,
                "ok": self.parity.ok,
            },
            "devices": self.devices,
            "ranks": [x.to_dict() for x in self.ranks],
            "routing": None if self.routing is None else dict(self.routing),
            "ok": self.ok,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclasses.dataclass(frozen=True)
class StepSeries:
    """Per-step series for the figure.

    Attributes:
      group_names: the pools, in plan order.
      usable: usable pages per pool.
      in_use: per step, pages in use per pool.
      prefill_tokens, decode_tokens: per step.
      prompt_tokens, hit_tokens: per step, over the admissions of that step.
    """

    group_names: tuple[str, ...]
    usable: tuple[int, ...]
    in_use: tuple[tuple[int, ...], ...]
    prefill_tokens: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    hit_tokens: tuple[int, ...]


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def format_report(r: DemoReport) -> str:
    """The text report the demo prints."""
    p = r.plan
    opts = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in r.options.items())
    ok = "yes" if r.oracle_agrees else "NO"
    lines = [
        f"flatkv demo: model {r.model} (random weights), seed {r.seed}; {opts}",
        f"plan: {p['groups']} pools, {p['max_requests']} request slots, context "
        f"{p['max_context']}, chunk {p['chunk_tokens']}, verify {p['verify_width']}, "
        f"{p['step_tokens']} tokens/step, pools {p['pool_bytes'] / 2**20:.2f} MiB",
        f"workload: {r.submitted} requests in {r.sessions} sessions over {r.tenants} tenants",
        "",
        f"requests served            {r.served} / {r.submitted}"
        + (f" ({r.aborted} aborted)" if r.aborted else ""),
        f"steps                      {r.steps:,}",
        f"wall time                  {r.wall_s:.1f} s = warm-up {r.warmup_s:.1f} s (compiling "
        f"{r.compilations} step function{'' if r.compilations == 1 else 's'}) + serving "
        f"{r.serve_s:.1f} s; checks {r.check_s:.1f} s",
        f"prefill                    {r.prefill_tokens:,} tokens, {r.prefill_tokens_per_s:,.0f} "
        "tokens/s of serving time",
        f"decode                     {r.decode_tokens:,} tokens, {r.decode_tokens_per_s:,.0f} "
        "tokens/s of serving time",
        f"prefix hit rate            {r.hit_rate:.3f}  ({r.hit_tokens:,} of {r.prompt_tokens:,} "
        "prompt tokens)",
        f"  radix oracle, same trace {r.oracle_hit_rate:.3f}  ({r.oracle_hit_tokens:,} of "
        f"{r.oracle_prompt_tokens:,}); agrees: {ok}"
        + (f" ({r.oracle_mismatches} rows differ)" if r.oracle_mismatches else ""),
    ]
    lines += [f"    {note}" for note in r.oracle_notes]
    lines += [
        f"accepted drafts            {r.draft_accepted_rate:.3f}  ({r.draft_accepted:,} of "
        f"{r.draft_proposed:,} proposed)"
        if r.draft_proposed
        else "accepted drafts            -  (MTP off)",
        f"retractions                {r.retractions:,}",
        f"pages zeroed               {r.pages_zeroed:,}",
        f"compilations after warm-up {r.compilations_after_warmup}"
        + ("" if r.compilations_after_warmup == 0 else "  (must be 0)"),
    ]
    if r.parity is None:
        lines.append("parity vs dense recompute  -  (no finished request)")
    else:
        q = r.parity
        lines.append(
            f"parity vs dense recompute  max |logit error| {q.max_abs_error:.1e} "
            f"(tolerance {q.tolerance:.0e}) over {q.tokens} tokens of {len(q.requests)} requests; "
            + (
                "greedy tokens equal"
                if q.greedy_mismatches == 0
                else f"{q.greedy_mismatches} tokens differ"
            )
        )
    if r.devices > 1:
        rt = r.routing or {}
        lines += [
            f"data-parallel ranks        {r.devices}; routing {rt.get('policy', '-')}: requests "
            f"per rank {' / '.join(str(x) for x in rt.get('requests_per_rank', ()))} (balance "
            f"{rt.get('balance', 0):.2f}); prefix misses by routing "
            f"{rt.get('routing_misses', 0)} of {rt.get('keyed_requests', 0)} keyed requests",
            f"capacity                   {p['pool_bytes'] / 2**20:.2f} MiB of pools per rank, "
            f"{p.get('total_pool_bytes', p['pool_bytes']) / 2**20:.2f} MiB total",
        ]
        for x in r.ranks:
            lines.append(
                f"  rank {x.rank:<3}                {x.requests:>3} requests, hit rate "
                f"{x.hit_rate:.3f}  ({x.hit_tokens:,} of {x.prompt_tokens:,} prompt tokens)"
            )
    width = max([len(o.name) for o in r.occupancy] + [5])
    lines += [
        "",
        "pool occupancy (pages in use, of usable)",
        f"  {'group':<{width}}  {'usable':>7}  {'peak':>12}  {'mean':>14}",
    ]
    for o in r.occupancy:
        lines.append(
            f"  {o.name:<{width}}  {o.usable:>7,}  {o.peak:>6,} {_pct(o.peak, o.usable):>5}"
            f"  {o.mean:>8,.1f} {_pct(o.mean, o.usable):>5}"
        )
    if r.devices > 1 and r.ranks:
        head = "".join(f"  {'rank ' + str(x.rank):>12}" for x in r.ranks)
        lines += [
            "",
            "pool occupancy per rank (peak pages in use, of usable per rank)",
            f"  {'group':<{width}}  {'usable':>7}{head}",
        ]
        for g, o in enumerate(r.ranks[0].occupancy):
            cells = "".join(
                f"  {x.occupancy[g].peak:>6,} {_pct(x.occupancy[g].peak, o.usable):>5}"
                for x in r.ranks
            )
            lines.append(f"  {o.name:<{width}}  {o.usable:>7,}{cells}")
    lines += ["", "all checks passed" if r.ok else "SOME CHECKS FAILED (see above)"]
    return "\n".join(lines)
