"""A continuous-batching serving engine over the jitted coordinator and a flax model.

The host side: request bookkeeping, the scheduler (token allowances per lane within
``step_tokens``, admission in arrival order, preemption), reading the step reports. Every
state transition runs in the jitted step of :mod:`flatkv_jax.serving.device`. See
docs/serving.md for the contract and the scheduling policy.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from flatkv_jax.coordinator.batches import ReleaseMode
from flatkv_jax.coordinator.ops import resolve_max_count
from flatkv_jax.coordinator.sleep import Sleeping, SleepMode, in_flight_slots
from flatkv_jax.coordinator.sleep import sleep as sleep_cache
from flatkv_jax.coordinator.sleep import wake as wake_cache
from flatkv_jax.coordinator.state import CacheState, create_state
from flatkv_jax.errors import check_positive_int, fail, is_int
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.pools import Pools, create_pools
from flatkv_jax.serving.device import (
    AdmitInputs,
    Lanes,
    StepInputs,
    StepKind,
    build_sharded_step,
    build_step,
    create_lanes,
    create_lanes_sharded,
)
from flatkv_jax.serving.model import check_model
from flatkv_jax.status import Status
from kernels_pallas import Impl

#: :attr:`EngineOptions.routing` choices.
ROUTING_POLICIES = ("affinity", "least_loaded")

_IMPLS = {"reference": Impl.REFERENCE, "pallas": Impl.PALLAS_TPU, "pallas_tpu": Impl.PALLAS_TPU}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How the engine runs.

    Attributes:
      impl: page kernels: ``"reference"`` (plain JAX) or ``"pallas"`` (Pallas TPU kernels;
        interpret mode on CPU).
      interpret: Pallas interpret mode; ``None`` = on when the default backend is the CPU.
      overlap: dispatch step N+1 before reading step N's results (the host never waits on
        the device between steps). ``False``: read every step's results before the next.
      prefix_cache: pass token ids to the coordinator so prompts match and publish cached
        prefixes; ``False`` builds the lean state without a prefix index.
      mtp: speculative decoding with the model's MTP draft layer (``verify_width`` drafts
        per decode step, greedy verification).
      prefix_seed: seed of the prefix keys, passed to ``create_state`` when it takes one.
      fifo_depth: in-flight steps per request the coordinator state allows (>= 2).
      record_ops: keep :attr:`Engine.op_log`, the coordinator operations in the order they ran.
      keep_logits: keep, per request, the logits each generated token was sampled from.
      split_steps: compile a second step kind without the admission code for the steps that
        admit nothing, and a third, decode-only kind for the steps in which no row holds more
        than a decode row's ``1 + verify_width`` tokens, nor did any row of the step they
        retire: its extend, retire, metadata and model run at that width, not
        ``chunk_tokens`` (cheaper per step; up to two more compilations).
      devices: data-parallel ranks (one per device of a mesh over the first ``devices``
        devices). Each rank has its own coordinator state, pool slice, lanes and scheduler;
        one jitted step runs every rank's step at once (docs/routing.md). 1 (default): the
        single-device engine.
      routing: how :meth:`Engine.submit` picks a rank: ``"affinity"`` (default; least-loaded
        among the ranks that already served the request's prefix key, see docs/routing.md)
        or ``"least_loaded"`` (ignores prefixes).
      affinity_slack: with ``"affinity"``, how many more outstanding requests the affinity
        rank may have than the least-loaded rank before the request goes elsewhere (a routing
        miss); None = ``max_requests``.
      admit_rows: the most requests one step admits (per rank): the admitting step's batch has
        this many rows of prompt tokens, and matching hashes every row, so its cost follows
        ``admit_rows x`` its width, not ``max_requests x max_context``. None =
        ``min(max_requests, 16)``. Further waiting requests are admitted in later steps.
      admit_widths: prompt-token widths of the admitting step's batch, one admitting kind
        compiled for each (on first use), ``max_context`` always among them. A step admits
        into the smallest width that holds the longest prompt it admits, so an admission's
        matching costs ``admit_rows x`` that width, not ``x max_context`` (a plan of long
        contexts serving short prompts). None = ``(max_context,)``: one admitting kind.
      prefill_rows: the most running prompts a step extends by a chunk wider than a decode
        row (per rank). Below ``max_requests`` a step with prefill work extends (and next
        retires) its decode lanes at ``1 + verify_width`` tokens and its prefill lanes in a
        second call of ``prefill_rows`` rows at ``chunk_tokens`` (the retire's wide call:
        ``prefill_rows + admit_rows`` rows), so its cost follows what it holds. None =
        ``min(max_requests, 16)``. Further prefilling prompts wait for the next step.
    """

    impl: str = "reference"
    interpret: bool | None = None
    overlap: bool = True
    prefix_cache: bool = True
    mtp: bool = True
    prefix_seed: int | None = None
    fifo_depth: int = 2
    record_ops: bool = False
    keep_logits: bool = False
    split_steps: bool = True
    devices: int = 1
    routing: str = "affinity"
    affinity_slack: int | None = None
    admit_rows: int | None = None
    prefill_rows: int | None = None
    admit_widths: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.impl not in _IMPLS:
            fail(
                "impl",
                self.impl,
                f"it must be one of {sorted(_IMPLS)}",
                'pass impl="reference" or impl="pallas"',
            )
        for name in (
            "overlap", "prefix_cache", "mtp", "record_ops", "keep_logits", "split_steps"
        ):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "it must be a bool", f"pass {name}=True or False",
                     exc=TypeError)  # fmt: skip
        if isinstance(self.devices, bool) or not isinstance(self.devices, int):
            fail("devices", self.devices, "it must be an int", "pass devices=2 (ranks)",
                 exc=TypeError)  # fmt: skip
        if self.devices < 1:
            fail("devices", self.devices, "an engine needs at least one rank",
                 "pass devices >= 1")  # fmt: skip
        if self.routing not in ROUTING_POLICIES:
            fail("routing", self.routing, f"it must be one of {list(ROUTING_POLICIES)}",
                 'pass routing="affinity" or routing="least_loaded"')  # fmt: skip
        if self.affinity_slack is not None and (
            not is_int(self.affinity_slack) or self.affinity_slack < 0
        ):
            fail("affinity_slack", self.affinity_slack, "it must be an int >= 0 or None",
                 "pass e.g. affinity_slack=4")  # fmt: skip
        if self.admit_rows is not None:
            check_positive_int(
                "admit_rows",
                self.admit_rows,
                "pass admit_rows >= 1, or None for min(max_requests, 16)",
            )
        if self.prefill_rows is not None:
            check_positive_int(
                "prefill_rows",
                self.prefill_rows,
                "pass prefill_rows >= 1, or None for min(max_requests, 16)",
            )
        if self.admit_widths is not None:
            if not isinstance(self.admit_widths, tuple) or not self.admit_widths:
                fail("admit_widths", self.admit_widths, "it must be a non-empty tuple of ints",
                     "pass e.g. admit_widths=(1024, 8192), or None for (max_context,)",
                     exc=TypeError)  # fmt: skip
            for w in self.admit_widths:
                check_positive_int(
                    "admit_widths entry", w, "pass admit_widths of ints >= 1, e.g. (1024, 8192)"
                )
        if not is_int(self.fifo_depth):
            fail("fifo_depth", self.fifo_depth, "it must be an int", "pass fifo_depth=2",
                 exc=TypeError)  # fmt: skip
        if self.fifo_depth < 2:
            fail(
                "fifo_depth",
                self.fifo_depth,
                "the engine keeps one step in flight per request while it schedules the next",
                "pass fifo_depth >= 2",
            )
        if self.interpret is not None and not isinstance(self.interpret, bool):
            fail("interpret", self.interpret, "it must be a bool or None",
                 "pass interpret=True or False, or None (on when the backend is the CPU)",
                 exc=TypeError)  # fmt: skip
        # NumPy integers pass the checks above; the options keep Python ints (they are
        # static arguments of compiled steps and part of their cache keys).
        for name in ("fifo_depth", "affinity_slack", "admit_rows", "prefill_rows"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.admit_widths is not None:
            object.__setattr__(self, "admit_widths", tuple(int(w) for w in self.admit_widths))


@dataclasses.dataclass
class RequestOutput:
    """A request's result.

    Attributes:
      request_id: what :meth:`Engine.submit` returned.
      prompt: the prompt token ids.
      tokens: generated token ids so far.
      finished: all ``max_new_tokens`` were generated.
      aborted: :meth:`Engine.abort` ended it.
      hit_tokens: prompt tokens reused from the prefix cache, over all its admissions.
      prompt_tokens: prompt tokens over all its admissions (a readmission counts its
        prompt plus the tokens generated before it).
      retractions: times it was preempted (and later readmitted).
      logits: with ``keep_logits``, ``float32[len(tokens), vocab]``: row ``i`` is what
        ``tokens[i]`` was sampled from, set when the request ends (finished or aborted);
        else None.
    """

    request_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...] = ()
    finished: bool = False
    aborted: bool = False
    hit_tokens: int = 0
    prompt_tokens: int = 0
    retractions: int = 0
    logits: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step did (read from its report).

    Attributes:
      index: step number (0-based, dispatch order).
      prefill_tokens: prompt tokens computed (prefill chunks).
      decode_tokens: tokens scheduled by decode / verify rows.
      emitted: tokens generated.
      hit_tokens: prefix-hit tokens of the step's admissions.
      prompt_tokens: prompt tokens of the step's admissions.
      in_use: pages in use per group after the step's allocations.
      cached: cached-only pages per group.
      zeroed: pages handed out (and zeroed) per group.
      retractions: requests preempted because of this step's page shortage.
      proposed, accepted: drafts proposed and accepted.
      host_s: host seconds spent on this step (scheduling, building inputs, reading).
      wall_s: wall seconds between this step's dispatch and its report being read.
      ranks: on an engine of several ranks, each rank's record of this step (the fields
        above are their sums, in_use / cached / zeroed per group over all ranks); ``()``
        on one device.
    """

    index: int
    prefill_tokens: int
    decode_tokens: int
    emitted: int
    hit_tokens: int
    prompt_tokens: int
    in_use: tuple[int, ...]
    cached: tuple[int, ...]
    zeroed: tuple[int, ...]
    retractions: int
    proposed: int
    accepted: int
    host_s: float
    wall_s: float
    ranks: tuple[StepRecord, ...] = ()


@dataclasses.dataclass
class EngineStats:
    """Totals over the engine's life.

    Attributes:
      steps, prefill_tokens, decode_tokens, emitted_tokens, hit_tokens, prompt_tokens,
      retractions, pages_zeroed, draft_proposed, draft_accepted: counts.
      compilations: jit cache entries of the engine's step functions (one per step kind used).
      compilations_after_warmup: entries beyond one per step kind (must stay 0).
      narrow_steps: steps run as the decode-only kind (``split_steps=True``: no admission and
        nothing wider than a decode row scheduled in the step or in the step it retires).
      admit_width_steps: steps that admitted, by the prompt-token width of their admission
        batch (``EngineOptions.admit_widths``).
      group_names: the plan's groups (order of the per-group tuples).
      usable_pages: per group (on several ranks: the total over ranks).
      occupancy: per step, pages in use per group (on several ranks: summed over ranks;
        :attr:`Engine.rank_stats` has each rank's).
      wall_s: wall seconds inside :meth:`Engine.step`; host_s: host seconds of it.
    """

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    emitted_tokens: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    retractions: int = 0
    pages_zeroed: int = 0
    draft_proposed: int = 0
    draft_accepted: int = 0
    compilations: int = 0
    compilations_after_warmup: int = 0
    narrow_steps: int = 0
    admit_width_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    group_names: tuple[str, ...] = ()
    usable_pages: tuple[int, ...] = ()
    occupancy: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    host_s: float = 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed drafts (0 when none were proposed)."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0


@dataclasses.dataclass
class _Request:
    rid: int
    prompt: tuple[int, ...]
    max_new: int
    namespace: int
    arrival: int
    out: RequestOutput
    lane: int | None = None
    admitted_at: int = -1  # admission counter of the current admission
    prompt_len: int = 0  # prompt of the current admission (prompt + generated before)
    extent: int = 0  # prefill progress known from reports
    pending: dict = dataclasses.field(default_factory=dict)  # step -> unread prefill allowance
    releasing: bool = False
    logits: list = dataclasses.field(default_factory=list)

    @property
    def seq(self) -> tuple[int, ...]:
        return self.prompt + self.out.tokens


@dataclasses.dataclass
class _Dispatched:
    index: int
    lanes: dict[int, int]  # lane -> rid of lanes with an allowance
    admits: dict[int, int]  # lane -> rid admitted
    admit_first: dict[int, int]  # lane -> first chunk asked for
    releases: list[tuple[int, int, ReleaseMode]]  # (lane, rid, mode)
    retire_rids: dict[int, int]  # lane -> rid of the step this one retires
    report: dict
    t0: float
    host_s: float
    admit_pages: np.ndarray


@dataclasses.dataclass
class _Prepared:
    index: int
    inputs: StepInputs  # numpy
    adm: AdmitInputs | None  # numpy; None: nothing to admit
    with_admit: bool
    lanes: dict[int, int]
    admits: dict[int, int]
    admit_first: dict[int, int]
    releases: list[tuple[int, int, ReleaseMode]]
    admit_pages: np.ndarray
    t0: float
    host_s: float
    small: bool  # nothing scheduled wider than a decode row (no admission either)
    admit_len: int = 0  # the longest prompt admitted (0: none): picks the admission width


class _SharedReport:
    """A sharded step's report (leading rank axis): fetched to the host once, the first
    time any rank reads it."""

    def __init__(self, report: dict):
        self.report = report
        self.host: dict | None = None

    def get(self) -> dict:
        if self.host is None:
            self.host = jax.device_get(self.report)
            self.report = None
        return self.host


@dataclasses.dataclass(frozen=True)
class _RankView:
    shared: _SharedReport
    rank: int

    def get(self) -> dict:
        return {k: v[self.rank] for k, v in self.shared.get().items()}


@dataclasses.dataclass
class RoutingStats:
    """What the router decided (see docs/routing.md).

    Attributes:
      ranks: data-parallel ranks.
      routed: requests routed to each rank.
      keyed: requests whose prompt has a whole block that can hit (longer than
        ``prefix_granularity`` tokens).
      routing_misses: requests sent to a rank that had seen fewer of their leading blocks
        than another rank (their prefix, cached elsewhere, is recomputed: a prefix miss
        caused by routing).
      miss_tokens: the prompt tokens of those requests that another rank had seen and
        theirs had not (blocks of ``prefix_granularity`` tokens).
    """

    ranks: int = 1
    routed: list[int] = dataclasses.field(default_factory=list)
    keyed: int = 0
    routing_misses: int = 0
    miss_tokens: int = 0

    def __post_init__(self):
        if not self.routed:
            self.routed = [0] * self.ranks

    @property
    def balance(self) -> float:
        """Least over most requests routed to a rank (1.0 = perfectly even)."""
        return min(self.routed) / max(self.routed) if max(self.routed, default=0) else 1.0


class Router:
    """Host routing policy of a sharded engine: which rank serves a new request.

    A request's prompt is cut into ``key_tokens``-token blocks (the prefix granularity: hits
    come in whole blocks, at most ``prompt_len - 1`` tokens); its *chain* is one key per
    block, ``(namespace, first i blocks)``. The router remembers, per rank, the chains of
    the prompts it sent there (the prefixes that rank has computed and cached), so for a new
    request it knows each rank's *depth*: how many leading blocks of the prompt the rank has
    seen. Prompts of at most ``key_tokens`` tokens have no block (they cannot hit).

    - ``"affinity"``: among the ranks of greatest depth (> 0), the least-loaded, unless its
      load exceeds the least-loaded rank's by more than ``slack``; then, or when no rank has
      seen the prompt's first block, the least-loaded rank.
    - ``"least_loaded"``: always the least-loaded rank.

    Load = requests waiting or running on the rank. Ties go to the lowest rank. A request
    sent to a rank of smaller depth than another rank's is a routing miss of ``(greatest
    depth - its rank's depth) * key_tokens`` tokens (cached elsewhere, recomputed here).
    """

    def __init__(self, ranks: int, policy: str, *, key_tokens: int, slack: int):
        self.ranks = ranks
        self.policy = policy
        self.key_tokens = key_tokens
        self.slack = slack
        self.seen: list[set[int]] = [set() for _ in range(ranks)]

    def chain(self, prompt: Sequence[int], namespace: int) -> list[int]:
        """One key per whole block that can hit (hashes of the namespace and the prefix)."""
        g = self.key_tokens
        keys, h = [], hash(("flatkv-route", namespace))
        for i in range((len(prompt) - 1) // g):
            h = hash((h, tuple(prompt[i * g : (i + 1) * g])))
            keys.append(h)
        return keys

    def route(self, prompt: Sequence[int], namespace: int, loads: Sequence[int]):
        """Returns ``(rank, blocks, missed_blocks)`` for a request given each rank's load:
        ``blocks`` = whole blocks of the prompt that can hit (0: no key), ``missed_blocks``
        = blocks another rank has seen beyond what the chosen rank has."""
        least = min(range(self.ranks), key=lambda r: (loads[r], r))
        chain = self.chain(prompt, namespace)
        if not chain:
            return least, 0, 0
        depth = []
        for seen in self.seen:
            d = 0
            while d < len(chain) and chain[d] in seen:
                d += 1
            depth.append(d)
        deepest = max(depth)
        rank = least
        if self.policy == "affinity" and deepest > 0:
            best = min(
                (r for r in range(self.ranks) if depth[r] == deepest), key=lambda r: (loads[r], r)
            )
            if loads[best] <= loads[least] + self.slack:
                rank = best
        self.seen[rank].update(chain)
        return rank, len(chain), deepest - depth[rank]


def _resolve_mesh(mesh, devices: int):
    """The engine's mesh: the one given, a mesh over the first ``devices`` devices, or None
    (single-device engine)."""
    if mesh is None:
        if devices == 1:
            return None
        from flatkv_jax.sharding import rank_mesh

        have = jax.device_count()
        if devices > have:
            fail(
                "EngineOptions.devices",
                devices,
                f"it exceeds the {have} device(s) JAX sees (jax.device_count())",
                f"pass devices <= {have}, or on CPU start Python with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} (set before JAX "
                "initializes its backend)",
            )
        return rank_mesh(devices)
    if not isinstance(mesh, Mesh):
        fail("mesh", type(mesh).__name__, "it must be a jax.sharding.Mesh",
             "pass flatkv_jax.sharding.rank_mesh(n)", exc=TypeError)  # fmt: skip
    if len(mesh.axis_names) != 1:
        fail("mesh", f"axes {mesh.axis_names}", "the engine's mesh has one data-parallel axis",
             "pass flatkv_jax.sharding.rank_mesh(n)")  # fmt: skip
    if devices not in (1, mesh.size):
        fail("EngineOptions.devices", devices,
             f"it disagrees with the mesh's {mesh.size} device(s)",
             "pass devices=1 (the default) with a mesh, or no mesh")  # fmt: skip
    return mesh


def _admit_widths(plan: CachePlan, widths: tuple[int, ...] | None) -> tuple[int, ...]:
    """``EngineOptions.admit_widths`` checked against ``plan``, sorted, with ``max_context``."""
    ctx = plan.limits.max_context
    for w in widths or ():
        if int(w) > ctx:
            fail("admit_widths entry", w, f"it must be <= max_context = {ctx}",
                 "drop it: max_context is always among the widths")  # fmt: skip
    return tuple(sorted({int(w) for w in widths or ()} | {ctx}))


#: Admission statuses that send a request back to the queue: the device found pages or a
#: request slot short (the host's page estimate is an estimate). Any other refusal of a row
#: the host built is raised as an engine bug.
_ADMIT_RETRY = frozenset({Status.NO_SLOT, Status.OUT_OF_PAGES})
_ADMIT_RETRY_NAMES = " / ".join(sorted(s.name for s in _ADMIT_RETRY))
#: Extend statuses a scheduled lane may meet: served, nothing scheduled (IDLE), or pages
#: short (the engine then preempts). Any other refusal of a row the device built from the
#: lanes (FIFO_FULL, TOO_LONG, STEP_FULL, STALE, BAD_ARG) would leave the request stalled
#: and ``run()`` looping: raised instead.
_EXTEND_EXPECTED = frozenset({Status.OK, Status.IDLE, Status.OUT_OF_PAGES})


def _admission_width(widths: tuple[int, ...], need: int) -> int:
    """The smallest of the sorted ``widths`` that holds a prompt of ``need`` tokens (the last
    is ``max_context``, which holds every prompt)."""
    return next(w for w in widths if w >= need)


def _at_width(adm: AdmitInputs, width: int) -> AdmitInputs:
    """``adm`` with its prompt tokens cut to ``width`` columns (every prompt fits them)."""
    return dataclasses.replace(adm, tokens=adm.tokens[:, :width])


def _rows(plan: CachePlan, value: int | None) -> int:
    """An engine row bound (``admit_rows``, ``prefill_rows``): ``value`` (at most
    ``max_requests``), default ``min(max_requests, 16)``."""
    return min(plan.limits.max_requests, 16 if value is None else int(value))


class Engine:
    """Continuous batching over a flax model, its cache plan and the coordinator.

    Example::

        engine = Engine(DeepSeekV4(tiny_model(), rngs=nnx.Rngs(0)), plan, EngineOptions())
        rid = engine.submit([1, 2, 3], max_new_tokens=8)
        outputs = engine.run()
        outputs[rid].tokens

    Args:
      model: a ``flax.nnx.Module`` with ``cfg``, ``step``, ``propose`` and ``dense``
        (:class:`flatkv_jax.serving.model.ServedModel`).
      plan: the cache plan (groups must be the model's recipe groups).
      options: :class:`EngineOptions`.
      mesh: a one-axis ``jax.sharding.Mesh`` whose devices are the data-parallel ranks
        (e.g. :func:`flatkv_jax.sharding.rank_mesh`); None = ``rank_mesh(options.devices)``
        when ``options.devices > 1``, else the single-device engine. A mesh of one device
        runs the sharded step on one rank.

    With more than one rank, :attr:`state`, :attr:`pools` and :attr:`lanes` carry a leading
    rank axis (sharded over the mesh); :meth:`rank_state` / :meth:`rank_pools` give one
    rank's view, :attr:`rank_stats` each rank's statistics, :attr:`routing` the router's
    counts. See docs/routing.md.
    """

    def __init__(
        self,
        model,
        plan: CachePlan,
        options: EngineOptions | None = None,
        *,
        mesh: Mesh | None = None,
    ):
        self.plan = check_plan(plan)
        self.options = options = EngineOptions() if options is None else options
        if not isinstance(options, EngineOptions):
            fail("options", type(options).__name__, "it must be EngineOptions",
                 "pass EngineOptions(...)", exc=TypeError)  # fmt: skip
        check_model(model, plan)
        lim = plan.limits
        if options.mtp and (not model.cfg.has_mtp or lim.verify_width < 1):
            fail(
                "options.mtp",
                True,
                "MTP needs a model with a draft layer and a plan with verify_width >= 1 "
                f"(model has_mtp={model.cfg.has_mtp}, verify_width={lim.verify_width})",
                "pass EngineOptions(mtp=False) or a plan with ServingLimits(verify_width=k)",
            )
        self.model = model
        self.cfg = model.cfg
        self.k = lim.verify_width if options.mtp else 0
        self.mc = resolve_max_count(plan, None)
        self.admit_rows = _rows(plan, options.admit_rows)
        self.prefill_rows = _rows(plan, options.prefill_rows)
        self.admit_widths = _admit_widths(plan, options.admit_widths)
        interpret = options.interpret
        if interpret is None:
            interpret = jax.default_backend() == "cpu"
        impl = _IMPLS[options.impl]
        splits = self.prefill_rows < lim.max_requests and 1 + self.k < self.mc
        base = StepKind(
            num_draft=self.k,
            admit=False,
            prefix=options.prefix_cache,
            impl=impl.value,
            interpret=bool(interpret) and impl is Impl.PALLAS_TPU,
            keep_logits=options.keep_logits,
            # Only a step that can split names its row bounds: the other kinds stay those of
            # every engine without the split (one compilation each, shared).
            prefill_rows=self.prefill_rows if splits else 0,
            admit_rows=self.admit_rows if splits else 0,
        )
        self.graphdef, self.weights = nnx.split(model)
        self.mesh = mesh = _resolve_mesh(mesh, options.devices)
        # Keyed (admission width, narrow); width 0: no admission code. A decode-only step
        # (nothing wider than a decode row in it or in the step it retires) runs at max_count
        # = 1 + k: its cost follows the batch, not chunk_tokens. An admitting step's matching
        # hashes every column of its batch: one admitting kind per width bucket. Each kind
        # compiles on first use.
        ctx = lim.max_context
        kinds = {
            (0, False): base,
            (0, True): dataclasses.replace(base, narrow=True),
            **{
                (w, False): dataclasses.replace(base, admit=True, admit_width=0 if w == ctx else w)
                for w in self.admit_widths
            },
        }
        if mesh is None:
            self._fns = {a: build_step(self.graphdef, plan, kd) for a, kd in kinds.items()}
        else:
            self._fns = {
                a: build_sharded_step(self.graphdef, plan, kd, mesh) for a, kd in kinds.items()
            }
            # Replicated once here, so no step moves weights between devices.
            self.weights = jax.device_put(self.weights, NamedSharding(mesh, P()))
        self._cache0 = {a: f._cache_size() for a, f in self._fns.items()}
        self._block = np.array([g.block_tokens for g in plan.groups])
        self._init_host()
        self.rank = 0
        kw = {"prefix": options.prefix_cache}
        if mesh is None:
            if options.prefix_seed is not None and (
                "seed" in inspect.signature(create_state).parameters
            ):
                kw["seed"] = options.prefix_seed
            self.state: CacheState = create_state(plan, options.fifo_depth, **kw)
            self.pools: Pools = create_pools(plan)
            self.lanes: Lanes = create_lanes(plan, self.cfg.hidden)
            self._ranks: list[Engine] = [self]
        else:
            from flatkv_jax.sharding import create_pools_sharded, create_state_sharded

            self.state = create_state_sharded(
                plan, mesh, options.fifo_depth, seed=options.prefix_seed, **kw
            )
            self.pools = create_pools_sharded(plan, mesh)
            self.lanes = create_lanes_sharded(plan, self.cfg.hidden, mesh)
            self._ranks = [self._rank_scheduler(i) for i in range(mesh.size)]
            n = mesh.size
            self.stats.usable_pages = tuple(n * u for u in self.stats.usable_pages)
        self.routing = RoutingStats(ranks=len(self._ranks))
        self._router = Router(
            len(self._ranks),
            options.routing,
            key_tokens=plan.prefix_granularity,
            slack=lim.max_requests if options.affinity_slack is None else options.affinity_slack,
        )
        self._rank_of: dict[int, int] = {}

    def _rank_scheduler(self, rank: int) -> Engine:
        """A host-only scheduler for one rank of a sharded engine (no device arrays of its
        own: the parent dispatches every rank's inputs in one sharded step)."""
        child = object.__new__(Engine)
        for name in ("plan", "options", "model", "cfg", "k", "mc", "admit_rows", "prefill_rows",
                     "admit_widths", "graphdef", "_block"):  # fmt: skip
            setattr(child, name, getattr(self, name))
        child.weights = child.state = child.pools = child.lanes = child.mesh = None
        child._fns, child._cache0 = {}, {}
        child._init_host()
        child.outputs = self.outputs  # one dict: every rank's outputs, by global id
        child.rank = rank
        child._ranks = [child]
        return child

    def _init_host(self) -> None:
        """The host-side scheduler state (per rank)."""
        plan, lim = self.plan, self.plan.limits
        r = lim.max_requests
        a = self.admit_rows
        none, zeros = np.full((a,), -1, np.int32), np.zeros((a,), np.int32)
        self._no_admits = AdmitInputs(
            none, zeros, zeros, zeros, zeros, np.zeros((a, lim.max_context), np.int32)
        )
        self._sleeping: Sleeping | None = None
        self._free_lanes = list(range(r))
        self._lane_rid: dict[int, int] = {}
        self._requests: dict[int, _Request] = {}
        self._waiting: list[int] = []  # rids, kept sorted by arrival
        self._releases: list[tuple[int, int, ReleaseMode]] = []
        self._inflight: list[_Dispatched] = []
        self._prev_small = True  # the last dispatched step scheduled only decode rows
        self._last_lanes: dict[int, int] = {}  # lanes of the last dispatched step
        self._arrivals = 0
        self._admissions = 0
        self._steps = 0
        self._barrier = 0  # page failures seen in steps before this one are already handled
        self._supply: np.ndarray = np.array([plan.usable_pages(g) for g in plan.groups])
        self.outputs: dict[int, RequestOutput] = {}
        self.op_log: list[tuple[str, tuple[tuple, ...]]] = []
        self.stats = EngineStats(
            group_names=tuple(g.name for g in plan.groups),
            usable_pages=tuple(plan.usable_pages(g) for g in plan.groups),
        )
        self.records: list[StepRecord] = []

    # --- requests ---------------------------------------------------------------------------
    def submit(self, prompt_tokens: Sequence[int], max_new_tokens: int, namespace: int = 0) -> int:
        """Queues a request; returns its id.

        Raises:
          TypeError: a prompt that is not a sequence of ints, a non-int count or namespace.
          ValueError: an empty prompt, a token outside the vocabulary, ``max_new_tokens < 1``,
            or a request that can never fit: ``prompt + max_new_tokens > max_context`` (the
            message names the limit to raise). Pages need no check of their own: a
            ``CachePlan`` refuses pools smaller than one ``max_context`` request, so a request
            within ``max_context`` always fits once the others are preempted.
        """
        if isinstance(prompt_tokens, str | bytes) or not isinstance(prompt_tokens, Sequence):
            fail("prompt_tokens", type(prompt_tokens).__name__, "it must be a sequence of ints",
                 "pass a list of token ids", exc=TypeError)  # fmt: skip
        prompt = []
        for i, t in enumerate(prompt_tokens):
            if isinstance(t, bool) or not isinstance(t, int | np.integer):
                fail(f"prompt_tokens[{i}]", t, "token ids are ints", "pass int token ids",
                     exc=TypeError)  # fmt: skip
            if not 0 <= int(t) < self.cfg.vocab:
                fail(f"prompt_tokens[{i}]", int(t), f"token ids lie in [0, {self.cfg.vocab})",
                     "pass ids of the model's vocabulary")  # fmt: skip
            prompt.append(int(t))
        if not prompt:
            fail("prompt_tokens", [], "a prompt needs at least one token",
                 "pass a non-empty prompt")  # fmt: skip
        for what, v in (("max_new_tokens", max_new_tokens), ("namespace", namespace)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                fail(what, v, "it must be an int", f"pass {what} as an int", exc=TypeError)
        if max_new_tokens < 1:
            fail("max_new_tokens", max_new_tokens, "a request generates at least one token",
                 "pass max_new_tokens >= 1")  # fmt: skip
        if not -(2**31) <= namespace < 2**31:
            fail("namespace", namespace, "it must fit int32", "pass a namespace in int32 range")
        lim = self.plan.limits
        total = len(prompt) + int(max_new_tokens)
        if total > lim.max_context:
            fail(
                "max_new_tokens",
                int(max_new_tokens),
                f"prompt ({len(prompt)}) + max_new_tokens = {total} tokens exceeds "
                f"ServingLimits.max_context = {lim.max_context}",
                "raise ServingLimits.max_context (a new plan) or shorten the request",
            )
        rid = self._arrivals
        self._arrivals += 1
        rank = self._route(prompt, int(namespace))
        self._rank_of[rid] = rank
        self._ranks[rank]._enqueue(rid, tuple(prompt), int(max_new_tokens), int(namespace))
        return rid

    def _enqueue(self, rid: int, prompt: tuple[int, ...], max_new: int, namespace: int) -> None:
        """Queues a checked request on this rank's scheduler (arrival order = global id)."""
        out = RequestOutput(request_id=rid, prompt=prompt)
        self._requests[rid] = _Request(rid, prompt, max_new, namespace, rid, out)
        self.outputs[rid] = out
        self._waiting.append(rid)

    def _route(self, prompt: Sequence[int], namespace: int) -> int:
        """Picks the rank of a new request (see :class:`Router`) and counts it."""
        loads = [len(rk._waiting) + len(rk._lane_rid) for rk in self._ranks]
        rank, blocks, missed = self._router.route(prompt, namespace, loads)
        rs = self.routing
        rs.routed[rank] += 1
        if blocks:
            rs.keyed += 1
        if missed:
            rs.routing_misses += 1
            rs.miss_tokens += missed * self._router.key_tokens
        return rank

    def rank_of(self, request_id: int) -> int:
        """The rank a request was routed to (0 on a single-device engine).

        Raises:
          ValueError: an unknown request id.
        """
        rank = self._rank_of.get(int(request_id)) if is_int(request_id) else None
        if rank is None:
            fail("request_id", request_id, "no request has this id",
                 "pass an id returned by submit")  # fmt: skip
        return rank

    @property
    def ranks(self) -> int:
        """Data-parallel ranks (1 on a single-device engine)."""
        return len(self._ranks)

    @property
    def rank_stats(self) -> tuple[EngineStats, ...]:
        """Each rank's statistics (one entry, :attr:`stats` itself, on one device)."""
        return tuple(rk.stats for rk in self._ranks)

    @property
    def rank_op_logs(self) -> tuple[list, ...]:
        """Each rank's :attr:`op_log` (``record_ops=True``); a rank's log replays on its own."""
        return tuple(rk.op_log for rk in self._ranks)

    def rank_state(self, rank: int) -> CacheState:
        """Rank ``rank``'s coordinator state (host view; for audits and tests)."""
        return self._rank_view(self.state, rank)

    def rank_pools(self, rank: int) -> Pools:
        """Rank ``rank``'s pool slice (host view; for audits and tests)."""
        return self._rank_view(self.pools, rank)

    def step_hlo(self, admit: bool = True, *, narrow: bool = False) -> str:
        """The compiled HLO text of one step kind (for audits, e.g. that a sharded step has
        no collective). Free once that kind has run: the compilation is cached.

        Args:
          admit: the kind with the admission code (the only kind with ``split_steps=False``).
          narrow: the decode-only kind (``max_count`` = 1 + the drafts per step; not with
            ``admit``; only used with ``split_steps=True``).
        """
        return self.compiled_step(admit, narrow=narrow).as_text()

    def compiled_step(
        self, admit: bool = True, *, narrow: bool = False, width: int | None = None
    ) -> jax.stages.Compiled:
        """One step kind, compiled (for audits: ``cost_analysis()``, ``memory_analysis()``).

        Args:
          admit, narrow: the kind, as in :meth:`step_hlo`.
          width: the admitting kind's prompt-token width, one of :attr:`admit_widths` (None:
            ``max_context``); only with ``admit=True``.

        Raises:
          ValueError: ``admit`` and ``narrow`` both True (no such kind), a ``width`` not
            among :attr:`admit_widths`, or a ``width`` for a non-admitting kind.
        """
        if admit and narrow:
            fail("narrow", narrow, "an admitting step is never a narrow (decode-only) one",
                 "pass admit=False with narrow=True")  # fmt: skip
        if not admit and width is not None:
            fail("width", width, "a step kind that admits nothing has no admission width",
                 "pass width=None with admit=False")  # fmt: skip
        w = self.plan.limits.max_context if width is None else width
        if w not in self.admit_widths:
            fail("width", width, f"the engine's admission widths are {self.admit_widths}",
                 "pass one of them (EngineOptions.admit_widths), or None")  # fmt: skip
        lim = self.plan.limits
        r = lim.max_requests
        neg = np.full((r,), -1, np.int32)
        one = (
            StepInputs(np.zeros((r,), np.int32), neg, neg, np.zeros((r,), np.int32)),
            _at_width(self._ranks[0]._no_admits, w) if admit else None,
        )
        if self.mesh is None:
            inputs, adm = jax.tree.map(jnp.asarray, one)
        else:
            n = len(self._ranks)
            stacked = jax.tree.map(lambda x: np.stack([x] * n), one)
            inputs, adm = jax.device_put(
                stacked, NamedSharding(self.mesh, P(self.mesh.axis_names[0]))
            )
        fn = self._fns[w if admit else 0, narrow]
        return fn.lower(self.weights, self.pools, self.state, self.lanes, inputs, adm).compile()

    def _rank_view(self, tree, rank: int):
        if not isinstance(rank, int) or not 0 <= rank < len(self._ranks):
            fail("rank", rank, f"the engine has ranks 0..{len(self._ranks) - 1}",
                 "pass a rank in that range")  # fmt: skip
        if self.mesh is None:
            return tree
        from flatkv_jax.sharding import unstack_rank

        return unstack_rank(tree, rank)

    def abort(self, request_id: int) -> None:
        """Cancels a request at any time: waiting, mid-prefill or mid-decode.

        Its pages are released (nothing it computed is published) at the next step; its
        output keeps the tokens generated so far with ``aborted=True``. Aborting a finished
        or already aborted request does nothing.

        Raises:
          ValueError: an unknown request id.
        """
        rank = self.rank_of(request_id)
        self._ranks[rank]._abort(request_id)

    def _abort(self, request_id: int) -> None:
        req = self._requests[request_id]
        if req.out.finished or req.out.aborted:
            return
        req.out.aborted = True
        if req.releasing:
            # A retraction (preemption) of it is queued and not dispatched yet: it leaves as
            # an abort instead, so its in-flight step publishes nothing (a retraction's
            # would).
            self._releases = [
                (lane, rid, ReleaseMode.ABORT if rid == req.rid else mode)
                for lane, rid, mode in self._releases
            ]
        if self.options.keep_logits:
            # Its tokens are final now (later reports skip an aborted request): so are its
            # logits, one row per token, as a finished request's.
            req.out.logits = (
                np.concatenate(req.logits)
                if req.logits
                else np.zeros((0, self.cfg.vocab), np.float32)
            )
        if req.rid in self._waiting:
            self._waiting.remove(req.rid)
        self._end(req, ReleaseMode.ABORT)

    def _end(self, req: _Request, mode: ReleaseMode) -> None:
        """Queues the release of the request's lane (if it has one)."""
        if req.lane is not None and not req.releasing:
            req.releasing = True
            self._releases.append((req.lane, req.rid, mode))

    def has_work(self) -> bool:
        """Requests waiting or running, releases not yet done, or results not yet read."""
        return any(
            rk._waiting or rk._lane_rid or rk._releases or rk._inflight for rk in self._ranks
        )

    # --- the loop ---------------------------------------------------------------------------
    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> dict[int, RequestOutput]:
        """Steps until every request is finished or aborted; returns :attr:`outputs`."""
        while self.has_work():
            rec = self.step()
            if rec is not None and on_step is not None:
                on_step(rec)
        return self.outputs

    def step(self) -> StepRecord | None:
        """One scheduler iteration: dispatch a step (if anything is to do) and read the
        results of a dispatched one (with overlap, the previous step's, so the host never
        waits between steps). Returns that step's :class:`StepRecord` or None."""
        t0 = time.perf_counter()
        if self._sleeping is not None:
            self._refuse_asleep("step")
        if not self.has_work():
            return None
        dispatched = None
        if any(rk._waiting or rk._lane_rid or rk._releases for rk in self._ranks):
            dispatched = self._dispatch()
        depth = 1 if (self.options.overlap and dispatched is not None) else 0
        rec = None
        if len(self._ranks[0]._inflight) > depth:
            rec = self._read_step()
        wall = time.perf_counter() - t0
        self.stats.wall_s += wall
        return rec

    def _schedule(self):
        """Allowances (decode first, then prefill chunks, oldest admission first), then
        admissions in arrival order while the budget, a lane and the pages last
        reported allow."""
        lim = self.plan.limits
        budget = lim.step_tokens
        d = 1 + self.k
        running = sorted(
            (self._requests[rid] for rid in self._lane_rid.values()),
            key=lambda q: q.admitted_at,
        )
        running = [q for q in running if not q.releasing and not q.out.finished]
        allow: dict[int, int] = {}
        prefill = []
        for q in running:
            done = q.extent + sum(q.pending.values())
            if done >= q.prompt_len:
                if len(q.out.tokens) >= q.max_new:
                    continue
                take = d if budget >= d else min(budget, 1)
                if take:
                    allow[q.lane] = take
                    budget -= take
            else:
                prefill.append((q, q.prompt_len - done))
        wide = 0  # prefill rows wider than a decode row: at most prefill_rows a step
        for q, left in prefill:
            take = min(self.mc, left, budget)
            if take > d and wide >= self.prefill_rows:
                continue
            if take > 0:
                allow[q.lane] = take
                budget -= take
                wide += take > d
        admits = []
        supply = self._supply.copy()
        for f in self._inflight:
            supply -= f.admit_pages
        reserve = len(running)
        admit_pages = np.zeros_like(supply)
        for rid in list(self._waiting):
            if budget < 1 or len(admits) >= min(len(self._free_lanes), self.admit_rows):
                break
            q = self._requests[rid]
            plen = len(q.seq)
            first = min(self.mc, plen, budget)
            need = -(-first // self._block) + 1
            if np.any(supply - admit_pages - reserve < need):
                break
            admit_pages += need
            reserve += 1
            budget -= first
            self._waiting.remove(rid)
            admits.append((q, first))
        return running, allow, admits, admit_pages

    def _dispatch(self, drain: bool = False) -> None:
        """Dispatches one step of every rank; ``drain``: schedules nothing (no allowance, no
        admission), so the step only releases, retires and reclaims."""
        preps = [rk._prepare(drain) for rk in self._ranks]
        kind = any(p.with_admit for p in preps) or not self.options.split_steps
        # Narrow (decode-only) when no rank schedules more than a decode row now and none did
        # in the step this one retires (its accepted counts bound the retire's width).
        small = all(p.small for p in preps)
        narrow = self.options.split_steps and not kind and small and self._prev_small
        self._prev_small = small
        if narrow:
            self.stats.narrow_steps += 1
        # The admission width: the smallest bucket that holds every rank's longest prompt
        # admitted now (a step that admits nothing takes the smallest, the cheapest kind).
        need = max(p.admit_len for p in preps)
        width = _admission_width(self.admit_widths, need) if kind else 0
        if need:
            st = self.stats.admit_width_steps
            st[width] = st.get(width, 0) + 1
        fn = self._fns[width, narrow]
        if self.mesh is None:
            (p,) = preps
            adm = (p.adm if p.adm is not None else self._no_admits) if kind else None
            adm = None if adm is None else _at_width(adm, width)
            inputs, adm = jax.tree.map(jnp.asarray, (p.inputs, adm))
            self.pools, self.state, self.lanes, report = fn(
                self.weights, self.pools, self.state, self.lanes, inputs, adm
            )
            views = [report]
        else:
            adm = (
                [
                    _at_width(p.adm if p.adm is not None else rk._no_admits, width)
                    for p, rk in zip(preps, self._ranks, strict=True)
                ]
                if kind
                else None
            )
            stacked = (
                jax.tree.map(lambda *xs: np.stack(xs), *[p.inputs for p in preps]),
                (None if adm is None else jax.tree.map(lambda *xs: np.stack(xs), *adm)),
            )
            # Each device receives its own rank's rows only (sharded transfer).
            inputs, adm = jax.device_put(
                stacked, NamedSharding(self.mesh, P(self.mesh.axis_names[0]))
            )
            self.pools, self.state, self.lanes, report = fn(
                self.weights, self.pools, self.state, self.lanes, inputs, adm
            )
            shared = _SharedReport(report)
            views = [_RankView(shared, r) for r in range(len(self._ranks))]
        for rk, p, view in zip(self._ranks, preps, views, strict=True):
            rk._commit(p, view)

    def _prepare(self, drain: bool) -> _Prepared:
        """This rank's host decisions for the next step (its step inputs, as numpy)."""
        t0 = time.perf_counter()
        lim = self.plan.limits
        r = lim.max_requests
        releases, self._releases = self._releases, []
        for lane, _, _ in releases:
            rid = self._lane_rid.pop(lane)
            self._requests[rid].lane = None
            self._requests[rid].releasing = False
            self._free_lanes.append(lane)
        self._free_lanes.sort()
        if drain:
            running, allow, admits = [], {}, []
            admit_pages = np.zeros_like(self._supply)
        else:
            running, allow, admits, admit_pages = self._schedule()
        index = self._steps
        self._steps += 1
        a = np.zeros(r, np.int32)
        order = np.full(r, -1, np.int32)
        for i, q in enumerate(q for q in running if q.lane in allow):
            a[q.lane] = allow[q.lane]
            order[i] = q.lane
            if q.extent + sum(q.pending.values()) < q.prompt_len:
                q.pending[index] = allow[q.lane]
        rel_lane = np.full(r, -1, np.int32)
        rel_mode = np.zeros(r, np.int32)
        for i, (lane, _, mode) in enumerate(releases):
            rel_lane[i], rel_mode[i] = lane, int(mode)
        inputs = StepInputs(a, order, rel_lane, rel_mode)
        adm_lanes = {}
        with_admit = bool(admits)
        adm = None
        if with_admit:
            cols = {
                n: np.zeros(self.admit_rows, np.int32)
                for n in ("lane", "plen", "first", "rem", "ns")
            }
            cols["lane"][:] = -1
            toks = np.zeros((self.admit_rows, lim.max_context), np.int32)
            for i, (q, first) in enumerate(admits):
                lane = self._free_lanes.pop(0)
                seq = q.seq
                q.lane, q.admitted_at = lane, self._admissions
                self._admissions += 1
                q.prompt_len, q.extent, q.pending = len(seq), 0, {index: first}
                self._lane_rid[lane] = q.rid
                adm_lanes[lane] = q.rid
                cols["lane"][i], cols["plen"][i], cols["first"][i] = lane, len(seq), first
                cols["rem"][i], cols["ns"][i] = q.max_new - len(q.out.tokens), q.namespace
                toks[i, : len(seq)] = seq
            adm = AdmitInputs(*(cols[n] for n in ("lane", "plen", "first", "rem", "ns")), toks)
        return _Prepared(
            index=index,
            inputs=inputs,
            adm=adm,
            with_admit=with_admit,
            lanes={int(lane): self._lane_rid[int(lane)] for lane in order if lane >= 0},
            admits=adm_lanes,
            admit_first={
                lane: int(first) for (q, first), lane in zip(admits, adm_lanes, strict=True)
            },
            releases=releases,
            admit_pages=admit_pages,
            t0=t0,
            host_s=time.perf_counter() - t0,
            small=not with_admit and int(a.max(initial=0)) <= 1 + self.k,
            admit_len=max((len(q.seq) for q, _ in admits), default=0),
        )

    def _commit(self, p: _Prepared, report) -> None:
        """Records a dispatched step of this rank (its report is read later)."""
        d = _Dispatched(
            index=p.index,
            lanes=p.lanes,
            admits=p.admits,
            admit_first=p.admit_first,
            releases=p.releases,
            retire_rids=self._last_lanes,
            report=report,
            t0=p.t0,
            host_s=p.host_s,  # the dispatch call itself is device time, not host work
            admit_pages=p.admit_pages,
        )
        self._last_lanes = {**d.lanes, **d.admits}
        self._inflight.append(d)

    def _read(self, d: _Dispatched) -> StepRecord:
        """Applies a step's report to the requests (blocks until that step is done)."""
        rep = d.report.get() if isinstance(d.report, _RankView) else jax.device_get(d.report)
        t0 = time.perf_counter()
        if bool(rep["overflow"]):
            raise RuntimeError(
                f"step {d.index} scheduled more than step_tokens tokens: a scheduler bug"
            )
        if bool(rep["wide_overflow"]):
            raise RuntimeError(
                f"step {d.index} scheduled more prefill rows than its compiled prefill_rows "
                "(or retired more than prefill_rows + admit_rows): a scheduler bug"
            )
        st = self.stats
        prefill = decode = emitted = hits = prompts = proposed = accepted = retracted = 0
        if self.options.record_ops:
            self._log_ops(d, rep)
        short = False
        for _, rid, mode in d.releases:
            q = self._requests[rid]
            q.pending = {}
            if mode is ReleaseMode.RETRACT and not (q.out.aborted or q.out.finished):
                self._insert_waiting(rid)
        for lane, rid in {**d.lanes, **d.admits}.items():
            q = self._requests[rid]
            if lane in d.admits:
                status = int(rep["admit_status"][lane])
                if status not in _ADMIT_RETRY and status != Status.OK:
                    # The host built this row: any other refusal (BAD_ARG: a prompt wider
                    # than the step's admission width; TOO_LONG, STEP_FULL, ...) is an engine
                    # bug, not a request to wait.
                    raise RuntimeError(
                        f"step {d.index} admitted request {rid} with status "
                        f"{Status(status).name}: an engine bug (only {_ADMIT_RETRY_NAMES} "
                        "send a request back to wait)"
                    )
                if status != Status.OK:
                    # Not admitted (pages or slots short): back to the queue, nothing happened.
                    if q.lane == lane:
                        self._lane_rid.pop(lane, None)
                        self._free_lanes.append(lane)
                        q.lane, q.pending = None, {}
                        if q.releasing:  # nothing to release any more
                            self._releases = [x for x in self._releases if x[0] != lane]
                            q.releasing = False
                        if not (q.out.aborted or q.out.finished) and rid not in self._waiting:
                            self._insert_waiting(rid)
                    continue
                h = int(rep["hit"][lane])
                q.out.hit_tokens += h
                q.out.prompt_tokens += q.prompt_len
                hits += h
                prompts += q.prompt_len
            else:
                status = int(rep["extend_status"][lane])
                if status == Status.OUT_OF_PAGES:
                    short = True
                elif status not in _EXTEND_EXPECTED:
                    raise RuntimeError(
                        f"step {d.index} extended request {rid} with status "
                        f"{Status(status).name}: an engine bug (a step extends what its lanes "
                        "hold; only OUT_OF_PAGES makes a request wait, by preemption)"
                    )
            n = int(rep["count"][lane])
            if q.lane == lane:
                q.pending.pop(d.index, None)
            if q.out.aborted or n == 0:
                continue
            if bool(rep["decode"][lane]):
                decode += n
            else:
                prefill += n
                if q.lane == lane:
                    q.extent = int(rep["start"][lane]) + n
            k = int(rep["emitted"][lane])
            if k:
                q.out.tokens = q.out.tokens + tuple(int(x) for x in rep["tokens"][lane][:k])
                if self.options.keep_logits:
                    q.logits.append(np.asarray(rep["logits"][lane][:k]))
                emitted += k
            proposed += int(rep["proposed"][lane])
            accepted += int(rep["accepted"][lane])
            if len(q.out.tokens) >= q.max_new and not q.out.finished:
                q.out.finished = True
                if self.options.keep_logits:
                    q.out.logits = np.concatenate(q.logits)
                self._end(q, ReleaseMode.FINISH)
        if short and d.index >= self._barrier:
            retracted = self._preempt()
        # Admissions not reported yet keep their pages out of the supply (see _schedule).
        self._supply = rep["free"] + rep["cached"]
        usable = np.array(st.usable_pages)
        in_use = tuple(int(x) for x in usable - rep["free"] - rep["cached"])
        zeroed = tuple(int(x) for x in rep["zeroed"])
        host = d.host_s + time.perf_counter() - t0
        rec = StepRecord(
            index=d.index,
            prefill_tokens=prefill,
            decode_tokens=decode,
            emitted=emitted,
            hit_tokens=hits,
            prompt_tokens=prompts,
            in_use=in_use,
            cached=tuple(int(x) for x in rep["cached"]),
            zeroed=zeroed,
            retractions=retracted,
            proposed=proposed,
            accepted=accepted,
            host_s=host,
            wall_s=time.perf_counter() - d.t0,
        )
        st.steps += 1
        st.prefill_tokens += prefill
        st.decode_tokens += decode
        st.emitted_tokens += emitted
        st.hit_tokens += hits
        st.prompt_tokens += prompts
        st.retractions += retracted
        st.pages_zeroed += sum(zeroed)
        st.draft_proposed += proposed
        st.draft_accepted += accepted
        st.occupancy.append(in_use)
        st.host_s += host
        # Entries this engine added (another engine may have compiled a kind before; a
        # jax.clear_caches() in between can only lower the count).
        self._count_compilations()
        self.records.append(rec)
        return rec

    def _count_compilations(self) -> None:
        st = self.stats
        sizes = {a: max(0, f._cache_size() - self._cache0[a]) for a, f in self._fns.items()}
        st.compilations = sum(sizes.values())
        st.compilations_after_warmup = sum(max(0, n - 1) for n in sizes.values())

    def _read_step(self) -> StepRecord:
        """Reads the oldest dispatched step of every rank; returns the step's record (on
        several ranks: the sum over ranks, with each rank's record in ``ranks``)."""
        if self.mesh is None:
            return self._read(self._inflight.pop(0))
        recs = tuple(rk._read(rk._inflight.pop(0)) for rk in self._ranks)
        total = {
            f.name: sum(getattr(r, f.name) for r in recs)
            for f in dataclasses.fields(StepRecord)
            if f.name not in ("index", "in_use", "cached", "zeroed", "ranks", "host_s", "wall_s")
        }
        rec = StepRecord(
            index=recs[0].index,
            in_use=tuple(int(x) for x in np.sum([r.in_use for r in recs], axis=0)),
            cached=tuple(int(x) for x in np.sum([r.cached for r in recs], axis=0)),
            zeroed=tuple(int(x) for x in np.sum([r.zeroed for r in recs], axis=0)),
            host_s=sum(r.host_s for r in recs),
            wall_s=max(r.wall_s for r in recs),
            ranks=recs,
            **total,
        )
        st = self.stats
        st.steps += 1
        st.prefill_tokens += rec.prefill_tokens
        st.decode_tokens += rec.decode_tokens
        st.emitted_tokens += rec.emitted
        st.hit_tokens += rec.hit_tokens
        st.prompt_tokens += rec.prompt_tokens
        st.retractions += rec.retractions
        st.pages_zeroed += sum(rec.zeroed)
        st.draft_proposed += rec.proposed
        st.draft_accepted += rec.accepted
        st.occupancy.append(rec.in_use)
        st.host_s += rec.host_s
        self._count_compilations()
        self.records.append(rec)
        return rec

    # --- sleep / wake -----------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Whether the engine is between :meth:`sleep` and :meth:`wake`."""
        return self._sleeping is not None

    def sleep(self, mode: SleepMode | str = SleepMode.OFFLOAD) -> Sleeping:
        """Releases the pools' device memory (target and draft pools); :meth:`wake` gets it back.

        First drains the pipeline: one step that schedules nothing (no allowance, no
        admission; the same compiled step) retires every step in flight, and every
        dispatched step's results are read. Then the coordinator's
        :func:`~flatkv_jax.coordinator.sleep` takes the state and the pools: their device
        buffers are deleted. While asleep :attr:`state` and :attr:`pools` are ``None``,
        :meth:`step` and :meth:`run` raise, and :meth:`submit` and :meth:`abort` still work
        (host-only: requests queue and are scheduled after :meth:`wake`).

        Args:
          mode: :attr:`SleepMode.OFFLOAD` (``"offload"``, the default): a host copy, the run
            continues exactly after :meth:`wake`. :attr:`SleepMode.DISCARD` (``"discard"``):
            the contents are dropped; at :meth:`wake` every running request is requeued and
            recomputes.

        Returns:
          The coordinator's :class:`~flatkv_jax.coordinator.Sleeping` value (for its
          ``device_bytes`` / ``host_bytes``); the engine keeps it, pass nothing back.

        Raises:
          ValueError: the engine is asleep already; an unknown mode.
          TypeError: a mode that is neither a :class:`SleepMode` nor a string.
        """
        if self.mesh is not None:
            fail(
                "engine",
                f"{len(self._ranks)} ranks",
                "sleep() and wake() are implemented for the single-device engine only",
                "serve with EngineOptions(devices=1) and no mesh to use sleep/wake",
            )
        if self._sleeping is not None:
            fail(
                "engine",
                f"asleep ({self._sleeping.mode.value})",
                "an engine sleeps once until it is woken (its pools are released already)",
                "call engine.wake() first",
            )
        if not isinstance(mode, SleepMode | str):
            fail("mode", type(mode).__name__, "it must be a SleepMode or 'offload'/'discard'",
                 "pass SleepMode.OFFLOAD or SleepMode.DISCARD", exc=TypeError)  # fmt: skip
        if isinstance(mode, str):
            if mode not in {m.value for m in SleepMode}:
                fail("mode", mode, "it must be 'offload' or 'discard'",
                     "pass SleepMode.OFFLOAD or SleepMode.DISCARD")  # fmt: skip
            mode = SleepMode(mode)
        # The coordinator refuses steps in flight: the engine always has one (overlap, and a
        # step is retired by the next call), so retire them with a step that adds nothing.
        if self._inflight or in_flight_slots(self.state):
            self._dispatch(drain=True)
        while self._inflight:
            self._read(self._inflight.pop(0))
        self._sleeping = sleep_cache(self.plan, self.state, self.pools, mode)
        self.state = self.pools = None
        return self._sleeping

    def wake(self) -> tuple[int, ...]:
        """Gets the pools back after :meth:`sleep`; returns the ids of the requeued requests.

        After :attr:`SleepMode.OFFLOAD` the state and pools are restored bit for bit and the
        run continues as if never interrupted (returns ``()``). After
        :attr:`SleepMode.DISCARD` the pools are zeroed and the coordinator is repaired (no
        request live, prefix index and LRUs empty: no hit can be served from the lost
        contents); every request that was running is requeued in arrival order with its
        prompt plus the tokens generated so far as its new prompt (a retraction: its
        ``retractions`` count grows), and the per-lane device state is reset. Greedy outputs
        are the same as without the sleep.

        Raises:
          ValueError: the engine is awake.
        """
        if self._sleeping is None:
            fail(
                "engine",
                "awake",
                "wake() undoes a sleep(), and the engine is not asleep",
                "call engine.sleep(mode) first (or drop this wake call)",
            )
        woken = wake_cache(self._sleeping)
        mode, self._sleeping = self._sleeping.mode, None
        self.state, self.pools = woken.state, woken.pools
        if mode is not SleepMode.DISCARD:
            return ()
        if len(woken.retracted) != len(self._lane_rid):
            raise RuntimeError(
                f"wake: the coordinator retracted {len(woken.retracted)} requests but "
                f"{len(self._lane_rid)} lanes are running: an engine bug"
            )
        pending = {lane: m for lane, _, m in self._releases}
        requeued = []
        for lane, rid in sorted(self._lane_rid.items()):
            q = self._requests[rid]
            q.lane, q.releasing, q.pending, q.extent = None, False, {}, 0
            if q.out.finished or q.out.aborted:
                continue  # its release (FINISH / ABORT) was pending; the repair did it
            if pending.get(lane) is not ReleaseMode.RETRACT:  # a preemption counted already
                q.out.retractions += 1
                self.stats.retractions += 1
            if rid not in self._waiting:
                self._insert_waiting(rid)
            requeued.append(rid)
        self._releases = []
        self._lane_rid = {}
        self._free_lanes = list(range(self.plan.limits.max_requests))
        self._last_lanes = {}
        self._barrier = self._steps
        self._supply = np.array(self.stats.usable_pages)
        self.lanes = create_lanes(self.plan, self.cfg.hidden)
        return tuple(sorted(requeued, key=lambda rid: self._requests[rid].arrival))

    def _refuse_asleep(self, what: str) -> None:
        fail(
            "engine",
            f"asleep ({self._sleeping.mode.value})",
            f"{what}() needs the pools, which sleep() released",
            f"call engine.wake() before engine.{what}()",
        )

    def _insert_waiting(self, rid: int) -> None:
        arrival = self._requests[rid].arrival
        i = 0
        while i < len(self._waiting) and self._requests[self._waiting[i]].arrival < arrival:
            i += 1
        self._waiting.insert(i, rid)

    def _preempt(self) -> int:
        """Retracts the latest admitted running request (the victim); it waits in arrival
        order and is readmitted when its next chunk fits. Returns 1 if one was retracted."""
        cands = [
            self._requests[rid]
            for rid in self._lane_rid.values()
            if not self._requests[rid].releasing and not self._requests[rid].out.finished
            and not self._requests[rid].out.aborted
        ]  # fmt: skip
        if not cands:
            return 0
        victim = max(cands, key=lambda q: q.admitted_at)
        victim.out.retractions += 1
        self._end(victim, ReleaseMode.RETRACT)
        # It rejoins the queue when the report of its release is read: every step it ran in
        # has been read by then, so its readmission prompt holds every token it committed.
        # Failures in steps dispatched before the release takes effect are the same shortage.
        self._barrier = self._steps + 1
        return 1

    def _log_ops(self, d: _Dispatched, rep) -> None:
        """Appends the coordinator operations of step ``d`` in the order they ran."""
        log = self.op_log
        rel = tuple(
            (rid, int(mode), int(rep["release_status"][lane])) for lane, rid, mode in d.releases
        )
        if rel:
            log.append(("release", rel))
        # A split step retires its decode lanes, then its prefill lanes, each call followed
        # by its reclaim; it extends the same way (StepKind.prefill_rows).
        for wide in (False, True):
            lanes = [
                (lane, rid)
                for lane, rid in d.retire_rids.items()
                if bool(rep["retire_wide"][lane]) == wide
            ]
            ret = tuple(
                (rid, int(rep["retired"][lane]), int(rep["retire_status"][lane]))
                for lane, rid in lanes
                if int(rep["retire_status"][lane]) != Status.IDLE
            )
            if ret:
                log.append(("retire", ret))
                rec = tuple(
                    (rid, int(rep["reclaim_status"][lane]))
                    for lane, rid in lanes
                    if int(rep["reclaim_status"][lane]) != Status.IDLE
                )
                if rec:
                    log.append(("reclaim", rec))
        for wide in (False, True):
            ext = tuple(
                (rid, int(rep["extend_count"][lane]), int(rep["extend_status"][lane]))
                for lane, rid in d.lanes.items()
                if int(rep["extend_status"][lane]) != Status.IDLE
                and bool(rep["extend_wide"][lane]) == wide
            )
            if ext:
                log.append(("extend", ext))
        adm = []
        for lane, rid in d.admits.items():
            q = self._requests[rid]
            st = int(rep["admit_status"][lane])
            adm.append(
                (rid, q.namespace, q.prompt_len, d.admit_first[lane], st, int(rep["hit"][lane]))
            )
        if adm:
            log.append(("admit", tuple(adm)))
