"""Runs the demo: the tiny V4 model, its cache plan, the serving engine and the workload.

:func:`run_demo` builds everything from a :class:`DemoOptions`, drives the engine with a
:class:`WorkloadDriver` (which submits each session's next turn once the previous one
finished), then checks the run three independent ways — the radix oracle's replay of the
engine's coordinator operations (:mod:`flatkv_jax.demo.replay`), dense recompute of a few
requests (max abs logit error), and the engine's own compile counter — and returns the
:class:`~flatkv_jax.demo.report.DemoReport` plus the per-step series for the figure.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from flatkv_jax.capacity import parse_size, plan_for_budget, plan_with_pages
from flatkv_jax.demo.replay import MAX_MISMATCHES, ReplayResult, replay_ops
from flatkv_jax.demo.report import DemoReport, GroupOccupancy, Parity, RankSummary, StepSeries
from flatkv_jax.demo.workload import Session, Workload, WorkloadConfig, make_workload
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan, ServingLimits
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups

#: fp32 rows: cached vs dense differ only in reduction order (docs/model.md, "Tolerances").
TOL_FP32 = 1e-5
#: Quantized rows: a 1-ulp difference before rounding can flip one code.
TOL_QUANT = 1e-3


def _tiny(**kw):
    from flatkv_jax.model import tiny_model

    return tiny_model(**kw)


#: ``--model`` presets: name -> (builder of the ModelConfig, parity tolerance, description).
MODELS: dict[str, tuple[Callable[[], Any], float, str]] = {
    "tiny": (
        lambda: _tiny(),
        TOL_FP32,
        "tiny V4: 4 layers (window, CSA 4, HCA 16) + MTP, fp32 rows",
    ),
    "tiny-quant": (
        # fp8_ds_mla needs head_dim - rope_dim to be a multiple of 64, MXFP4 a multiple of 32.
        lambda: _tiny(head_dim=80, rope_dim=16, kv_format="fp8_ds_mla", indexer_format="mxfp4"),
        TOL_QUANT,
        "tiny V4 with fp8_ds_mla KV rows and MXFP4 indexer keys",
    ),
}

#: Serving limits of the demo plan (max_context follows the workload).
MAX_REQUESTS = 8
CHUNK_TOKENS = 32
VERIFY_WIDTH = 2
#: Default pool budget: small enough that pools fill, the LRU evicts cached prefixes and the
#: occupancy plot shows pressure; large enough that retractions stay rare.
DEFAULT_HBM = "2MiB"
#: Requests the parity check recomputes densely (spread over the finished ones).
PARITY_REQUESTS = 3


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """What ``flatkv demo`` runs (one field per command-line option).

    Attributes:
      model: a key of :data:`MODELS`.
      requests: total requests (turns) of the workload.
      seed: workload and weight seed.
      hbm: pool budget (``"2MiB"``); exclusive with ``pages``; both None = :data:`DEFAULT_HBM`.
      pages: usable pages of every pool.
      prefix_cache, overlap, mtp: engine options.
      impl: kernel implementation (``"reference"`` or ``"pallas"``).
      workload: the workload shape apart from ``requests`` (None = defaults).
      devices: data-parallel ranks (``EngineOptions.devices``); each rank gets the whole
        plan (its own request slots and pools), requests are routed by prefix affinity.
      routing: ``EngineOptions.routing`` (``"affinity"`` or ``"least_loaded"``).
    """

    model: str = "tiny"
    requests: int = 40
    seed: int = 0
    hbm: str | None = None
    pages: int | None = None
    prefix_cache: bool = True
    overlap: bool = True
    mtp: bool = True
    impl: str = "reference"
    workload: WorkloadConfig | None = None
    devices: int = 1
    routing: str = "affinity"

    def __post_init__(self):
        check_positive_int("--devices", self.devices)
        if self.routing not in ("affinity", "least_loaded"):
            fail("--routing", self.routing, "it must be affinity or least_loaded",
                 "pass --routing affinity")  # fmt: skip
        if self.model not in MODELS:
            fail("--model", self.model, f"known presets are {sorted(MODELS)}", "pick one of them")
        check_positive_int("--requests", self.requests)
        if self.hbm is not None and self.pages is not None:
            fail(
                "--pages",
                self.pages,
                "--hbm and --pages both size the pools",
                "pass only one of them",
            )
        if self.pages is not None:
            check_positive_int("--pages", self.pages)


def workload_for(options: DemoOptions, vocab: int) -> Workload:
    """The options' workload (its token ids fit the model's vocabulary)."""
    base = options.workload or WorkloadConfig()
    return make_workload(
        options.seed, dataclasses.replace(base, requests=options.requests, vocab=vocab)
    )


def build_plan(options: DemoOptions, cfg, workload: Workload) -> CachePlan:
    """The demo's cache plan: :data:`MAX_REQUESTS` slots, context for the longest session.

    Raises:
      ValueError: the ``--hbm`` budget or ``--pages`` count cannot hold one request; the
        message names the flag.
    """
    max_context = -(-workload.config.max_session_tokens // 64) * 64
    limits = ServingLimits(
        max_requests=MAX_REQUESTS,
        max_context=max_context,
        chunk_tokens=CHUNK_TOKENS,
        verify_width=VERIFY_WIDTH,
    )
    groups = deepseek_v4_groups(cfg.cache, verify_width=VERIFY_WIDTH)
    if options.pages is not None:
        try:
            return plan_with_pages(groups, limits, options.pages, name=options.model)
        except ValueError as e:
            raise ValueError(f"--pages {options.pages}: {e}") from e
    text = options.hbm if options.hbm is not None else DEFAULT_HBM
    shown = text if options.hbm is not None else f"{text} (the default)"
    budget = parse_size(text, "--hbm")
    try:
        return plan_for_budget(groups, limits, budget, name=options.model)
    except ValueError as e:
        raise ValueError(f"--hbm {shown}: {e}") from e


class CompileClock:
    """Sums the seconds JAX spends tracing, lowering and compiling while it is active.

    Uses JAX's public monitoring events (``/jax/core/compile/...`` durations), so it counts
    compilations wherever they happen — the engine compiles its step functions at the first
    steps that use them — without knowing the engine's internals.
    """

    PREFIX = "/jax/core/compile/"

    def __init__(self):
        self.seconds = 0.0

    def _listen(self, event: str, duration: float, **_) -> None:
        if event.startswith(self.PREFIX):
            self.seconds += duration

    def __enter__(self) -> CompileClock:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> bool:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listen)
        return False


@dataclasses.dataclass
class _Pending:
    ready_step: int
    session: Session
    turn: int
    prompt: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Submitted:
    """One request the driver submitted.

    Attributes:
      request_id: the engine's id.
      session, turn: which turn of which session.
      namespace: the tenant.
      prompt: the prompt submitted.
      step: the step clock when it was submitted.
    """

    request_id: int
    session: int
    turn: int
    namespace: int
    prompt: tuple[int, ...]
    step: int


class WorkloadDriver:
    """Feeds a :class:`Workload` to an engine, turn after turn.

    The clock is the engine's step count. A session's first turn is submitted at its arrival
    step; each later turn once the previous turn finished and its think steps passed, with
    the prompt ``previous prompt + previous answer + new user tokens``. When the engine is
    idle the clock jumps to the next submission. An aborted turn ends its session.

    Args:
      workload: what to submit.
      engine: anything with ``submit(prompt, max_new_tokens, namespace) -> id``,
        ``step() -> record | None``, ``has_work() -> bool`` and ``outputs`` (id -> an object
        with ``tokens``, ``finished``, ``aborted``).
    """

    def __init__(self, workload: Workload, engine):
        self.workload = workload
        self.engine = engine
        self.submitted: list[Submitted] = []
        self.records: list[Any] = []
        self.clock = 0

    def run(self, on_step: Callable[[Any, int], None] | None = None) -> list[Submitted]:
        """Runs until every turn of every session finished (or its session was aborted).

        Args:
          on_step: called after each engine step with the step's record and the number of
            requests finished so far.

        Returns:
          The submitted requests, in submission order.

        Raises:
          RuntimeError: the engine went idle with requests unfinished (an engine bug).
        """
        wl, eng = self.workload, self.engine
        queue = [_Pending(s.arrival_step, s, 0, wl.first_prompt(s)) for s in wl.sessions]
        queue.sort(key=lambda p: (p.ready_step, p.session.index))
        active: dict[int, tuple[_Pending, Submitted]] = {}
        done = 0
        while queue or active:
            while queue and queue[0].ready_step <= self.clock:
                item = queue.pop(0)
                turn = item.session.turns[item.turn]
                rid = eng.submit(item.prompt, turn.max_new_tokens, namespace=item.session.namespace)
                sub = Submitted(
                    rid,
                    item.session.index,
                    item.turn,
                    item.session.namespace,
                    item.prompt,
                    self.clock,
                )
                self.submitted.append(sub)
                active[rid] = (item, sub)
            if eng.has_work():
                rec = eng.step()
                self.clock += 1
                if rec is not None:
                    self.records.append(rec)
            elif queue:
                self.clock = max(self.clock, queue[0].ready_step)
                continue
            elif active:
                raise RuntimeError(
                    f"the engine is idle but requests {sorted(active)[:8]} never finished"
                )
            for rid in list(active):
                out = eng.outputs.get(rid)
                if out is None or not (out.finished or out.aborted):
                    continue
                item, _ = active.pop(rid)
                done += 1
                nxt = item.turn + 1
                if out.aborted or nxt >= len(item.session.turns):
                    continue
                turn = item.session.turns[nxt]
                prompt = wl.next_prompt(item.prompt, out.tokens, turn)
                pending = _Pending(self.clock + turn.think_steps, item.session, nxt, prompt)
                # Keep the queue sorted by (ready step, session): insertion, O(queue).
                k = len(queue)
                while k and (queue[k - 1].ready_step, queue[k - 1].session.index) > (
                    pending.ready_step,
                    pending.session.index,
                ):
                    k -= 1
                queue.insert(k, pending)
            if on_step is not None and self.records:
                on_step(self.records[-1], done)
        return self.submitted


def _occupancy(names, usable, in_use) -> tuple[GroupOccupancy, ...]:
    arr = np.asarray(in_use, np.int64).reshape(-1, len(names))
    if arr.shape[0] == 0:
        arr = np.zeros((1, len(names)), np.int64)
    return tuple(
        GroupOccupancy(name, int(u), int(arr[:, g].max()), float(arr[:, g].mean()))
        for g, (name, u) in enumerate(zip(names, usable, strict=True))
    )


def parity_check(model, plan: CachePlan, outputs: dict, request_ids, tolerance: float) -> Parity:
    """Compares the engine's logits of ``request_ids`` with dense, cache-free recompute.

    Each sequence is padded to one fixed length (the model is causal, so padding cannot
    change the real positions), so the dense forward compiles once.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, weights = nnx.split(model)
    dense = jax.jit(lambda w, t: nnx.merge(graphdef, w).dense(t)[0])
    length = plan.limits.max_context + plan.limits.verify_width + 1
    worst, tokens, mismatches = 0.0, 0, 0
    for rid in request_ids:
        out = outputs[rid]
        seq = list(out.prompt) + list(out.tokens)
        if out.logits is None or not out.tokens:
            continue
        padded = np.zeros(length, np.int32)
        padded[: len(seq) - 1] = seq[:-1]
        ref = np.asarray(dense(weights, jnp.asarray(padded)))
        p = len(out.prompt)
        rows = ref[p - 1 : p - 1 + len(out.tokens)]
        got = np.asarray(out.logits, np.float32)
        worst = max(worst, float(np.max(np.abs(got - rows))))
        mismatches += int(np.sum(np.argmax(rows, axis=-1) != np.asarray(out.tokens)))
        tokens += len(out.tokens)
    return Parity(tuple(request_ids), tokens, worst, tolerance, mismatches)


def _spread(ids: list[int], k: int) -> list[int]:
    """``k`` ids spread evenly over ``ids`` (deterministic)."""
    if len(ids) <= k:
        return list(ids)
    return [ids[round(i * (len(ids) - 1) / (k - 1))] for i in range(k)] if k > 1 else [ids[-1]]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` builds before anything compiles: model config, workload, plan."""

    options: DemoOptions
    cfg: Any
    workload: Workload
    plan: CachePlan


def prepare(options: DemoOptions) -> Prepared:
    """The model config, workload and plan of ``options`` (fast; nothing compiles).

    Raises:
      ValueError: ``--hbm`` / ``--pages`` cannot hold one request (the message names the flag).
    """
    cfg = MODELS[options.model][0]()
    workload = workload_for(options, cfg.vocab)
    return Prepared(options, cfg, workload, build_plan(options, cfg, workload))


def run_demo(
    options: DemoOptions,
    *,
    prepared: Prepared | None = None,
    on_start: Callable[[int], None] | None = None,
    on_step: Callable[[Any, int], None] | None = None,
) -> tuple[DemoReport, StepSeries]:
    """Builds the model, plan and engine, serves the workload, checks and reports.

    Args:
      options: what to run.
      prepared: :func:`prepare` of ``options``, if the caller already built it.
      on_start: called with the number of requests once the workload is drawn (progress).
      on_step: called after each engine step with its record and requests finished so far.

    Returns:
      ``(report, series)``.
    """
    prep = prepare(options) if prepared is None else prepared
    cfg, workload, plan = prep.cfg, prep.workload, prep.plan
    tolerance = MODELS[options.model][1]

    import jax
    from flax import nnx

    from flatkv_jax.model import DeepSeekV4
    from flatkv_jax.serving import Engine, EngineOptions

    if on_start is not None:
        on_start(workload.requests)
    t0 = time.perf_counter()
    model = DeepSeekV4(cfg, rngs=nnx.Rngs(options.seed))
    engine = Engine(
        model,
        plan,
        EngineOptions(
            impl=options.impl,
            overlap=options.overlap,
            prefix_cache=options.prefix_cache,
            mtp=options.mtp,
            record_ops=True,
            keep_logits=True,
            # One step kind, one compilation: on 2 CPU cores compiling a step function costs
            # about a minute and serving a step ~30 ms; two kinds (admit / no admit) save
            # ~8 ms a step, far less than the second compilation over a few hundred steps.
            split_steps=False,
            devices=options.devices,
            routing=options.routing,
        ),
    )
    setup_s = time.perf_counter() - t0
    driver = WorkloadDriver(workload, engine)
    with CompileClock() as compiling:
        submitted = driver.run(on_step)
    wall_s = time.perf_counter() - t0
    warmup_s = setup_s + compiling.seconds
    t_check = time.perf_counter()
    stats = engine.stats
    outputs = engine.outputs

    sequences = {
        s.request_id: tuple(outputs[s.request_id].prompt) + tuple(outputs[s.request_id].tokens)
        for s in submitted
    }
    # Each rank has its own coordinator: its operations replay on an oracle of its own.
    replay = _combine(
        [
            replay_ops(
                plan,
                log,
                {rid: s for rid, s in sequences.items() if engine.rank_of(rid) == r},
                prefix_reuse=options.prefix_cache,
            )
            for r, log in enumerate(engine.rank_op_logs)
        ]
    )
    served = [s.request_id for s in submitted if outputs[s.request_id].finished]
    aborted = sum(1 for s in submitted if outputs[s.request_id].aborted)
    parity = (
        parity_check(model, plan, outputs, _spread(served, PARITY_REQUESTS), tolerance)
        if served
        else None
    )
    check_s = time.perf_counter() - t_check
    names = tuple(g.name for g in plan.groups)
    usable = tuple(plan.usable_pages(g) for g in plan.groups)
    recs = driver.records
    in_use = tuple(tuple(int(x) for x in r.in_use) for r in recs)
    series = StepSeries(
        group_names=names,
        usable=usable,
        in_use=in_use,
        prefill_tokens=tuple(int(r.prefill_tokens) for r in recs),
        decode_tokens=tuple(int(r.decode_tokens) for r in recs),
        prompt_tokens=tuple(int(getattr(r, "prompt_tokens", 0)) for r in recs),
        hit_tokens=tuple(int(r.hit_tokens) for r in recs),
    )
    notes = replay.mismatches + tuple(f"oracle invariant: {v}" for v in replay.violations)
    ranks = tuple(
        RankSummary(
            rank=r,
            requests=sum(1 for s in submitted if engine.rank_of(s.request_id) == r),
            prompt_tokens=int(rs.prompt_tokens),
            hit_tokens=int(rs.hit_tokens),
            occupancy=_occupancy(
                names,
                rs.usable_pages,
                [rec.ranks[r].in_use if rec.ranks else rec.in_use for rec in recs],
            ),
        )
        for r, rs in enumerate(engine.rank_stats)
    )
    rt = engine.routing
    routing = {
        "policy": options.routing,
        "requests_per_rank": list(rt.routed),
        "balance": round(rt.balance, 4),
        "keyed_requests": rt.keyed,
        "routing_misses": rt.routing_misses,
        "routing_miss_tokens": rt.miss_tokens,
        "jax_device_count": jax.device_count(),
    }
    report = DemoReport(
        model=options.model,
        seed=options.seed,
        options={
            "prefix_cache": options.prefix_cache,
            "overlap": options.overlap,
            "mtp": options.mtp,
        },
        plan={
            "name": plan.name,
            "groups": len(plan.groups),
            "max_requests": plan.limits.max_requests,
            "max_context": plan.limits.max_context,
            "chunk_tokens": plan.limits.chunk_tokens,
            "verify_width": plan.limits.verify_width,
            "step_tokens": plan.limits.step_tokens,
            "pool_bytes": int(sum(plan.pool_bytes(g) for g in plan.groups)),
            "ranks": engine.ranks,
            "total_pool_bytes": engine.ranks * int(sum(plan.pool_bytes(g) for g in plan.groups)),
        },
        sessions=len(workload.sessions),
        tenants=workload.config.tenants,
        submitted=len(submitted),
        served=len(served),
        aborted=aborted,
        steps=int(stats.steps),
        wall_s=wall_s,
        warmup_s=warmup_s,
        check_s=check_s,
        prefill_tokens=int(stats.prefill_tokens),
        decode_tokens=int(stats.decode_tokens),
        prompt_tokens=replay.engine_prompt_tokens,
        hit_tokens=replay.engine_hit_tokens,
        oracle_prompt_tokens=replay.prompt_tokens,
        oracle_hit_tokens=replay.hit_tokens,
        oracle_mismatches=replay.mismatch_count,
        oracle_notes=notes,
        occupancy=_occupancy(names, tuple(engine.ranks * u for u in usable), in_use),
        pages_zeroed=int(stats.pages_zeroed),
        retractions=int(stats.retractions),
        compilations=int(stats.compilations),
        compilations_after_warmup=int(stats.compilations_after_warmup),
        draft_proposed=int(stats.draft_proposed),
        draft_accepted=int(stats.draft_accepted),
        parity=parity,
        devices=engine.ranks,
        ranks=ranks,
        routing=routing,
    )
    return report, series


def _combine(results: list[ReplayResult]) -> ReplayResult:
    """One rank's replay, or the sum of every rank's (mismatch lines name the rank)."""
    if len(results) == 1:
        return results[0]

    def total(name: str) -> int:
        return sum(getattr(x, name) for x in results)

    return ReplayResult(
        ops=total("ops"),
        admissions=total("admissions"),
        hit_tokens=total("hit_tokens"),
        prompt_tokens=total("prompt_tokens"),
        engine_hit_tokens=total("engine_hit_tokens"),
        engine_prompt_tokens=total("engine_prompt_tokens"),
        mismatch_count=total("mismatch_count"),
        mismatches=tuple(f"rank {r}: {m}" for r, x in enumerate(results) for m in x.mismatches)[
            :MAX_MISMATCHES
        ],
        violations=tuple(f"rank {r}: {v}" for r, x in enumerate(results) for v in x.violations),
    )
