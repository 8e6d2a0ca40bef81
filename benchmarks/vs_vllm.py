"""Side by side with vLLM's KV cache manager: our coordinator on the peer's own trace.

``../shared/peers/vllm_kv_bench.py`` (the peer harness; its README defines the trace) drives
vLLM 0.34.0's unmodified ``KVCacheManager``. This script drives the flatkv_jax coordinator —
DeepSeek-V4-Flash groups (no MTP, no speculation, as the peer's ``dsv4`` config), prefix reuse
on, our own keyed hashing included — with **exactly** that trace and scheduling rule, and
prints the same columns:

- ``decode``: µs per request-step of the decode loop: one jitted call per step (extend one
  token with its id, retire it — publishing the blocks it completes, hashing included —, and
  reclaim the window pages behind), divided by the requests decoding; median over steps.
  The step's batch travels as one ``int32[4, B]`` array (an admission's as one
  ``int32[rows, 2 + width]``) and its statuses come back as one array: one transfer each way
  per call, as a serving step would (each further array fetched costs ~10 us a call here).
- ``admit``: µs per admitted request **including hashing**: one jitted call admits a batch
  (match the prompts against the index, allocate) and retires the prefill (publishing the
  prompt's blocks); the call's time divided by the requests it admitted, median over
  admissions. Compare with the peer's ``admit + hash_admit``.
- ``hit``: prefix hit tokens / prompt tokens over admissions; ``hit ceiling`` is what an
  unbounded cache would give in the same admission order (the longest granule prefix each
  prompt shares with an earlier one): the gap is hits lost to eviction, with the count of
  admissions that hit less than their ceiling.
- ``peak``: per pool, the most pages held by requests (cached-only pages count as free, as
  in vLLM's usage metric) / usable pages.

The trace (``make_trace``) is read from the peer script's source (``--peer``), so both use
the same function; the FCFS rule is the peer's: every running request decodes one token,
then prompts are admitted whole while fewer than ``B`` run and the prompt fits what is left
of the step's token budget (a hit's tokens are not charged), then finished requests are
freed. Within one step vLLM lets a request hit blocks that an earlier admission of the same
step computes; our coordinator shares only published blocks, so one admission call never
holds two prompts with the same first granule (the next call sees the first one's blocks).

Admission shapes. One admission call is compiled per ``(rows, width)``: ``rows`` is the next
power of two holding the call's prompts (1, 2, 4, 8, at most ``--admit-rows``) and ``width``
the token width ``host.token_width`` gives its longest prompt (a power of two: 1024, 2048 or
4096 on the default trace). Both ``admit`` and the prefill's ``retire`` get ``max_count =
width``, so a call hashes, matches, allocates and publishes ``rows x width`` token columns,
never ``admit_rows x chunk_tokens``. With the peer's 8 system prompts a call holds at most 8
prompts (one per distinct first granule), so at most 4 x 3 = 12 shapes occur and usually
about 8. Each costs ~30-50 s of XLA compilation on the 2-core machine (the compiled
retire alone is ~30 s whatever the width: its HLO size, not the width, drives it), so the
script keeps XLA's persistent compilation cache (``--compile-cache``): a second run
compiles nothing. Compile seconds are printed per shape (``compile`` lines).

``--oracle`` replays every call in lockstep on the host oracle (``flatkv_jax.oracle``: a
plan with the same page geometry and page counts, one layer and one-byte rows, since only
the bookkeeping is compared) and stops at the first row whose status or hit differs, or
whose pool counts (free / in use / cached-only) differ after a step; it prints both hit
rates. Use it with a small ``B`` (at most 32: the oracle is plain Python).

``--reclaim-prefill decode`` drops the window pages a prefill wrote behind its window at the
request's first decode step (as vLLM does: its ``admit`` column leaves them out, its
``decode`` column frees them; ``benchmarks/peer_prefill_blocks.py`` shows it), not in the
admission call (the default). Measured: both of our columns get worse (docs/benchmarks.md).

``--evict-ahead-tokens T`` builds the plan with ``CachePlan.evict_ahead_tokens = T`` (an
admission that evicts tops every pool's free stack up for ``T`` more tokens per request slot;
docs/semantics.md). ``--compare-evict-ahead A,B`` runs the trace twice in one process, the
two plans differing only in that value, taking turns call by call (``Run.steps`` pauses before
every timed call), and prints both rows and the median of step-for-step decode ratios: on
this 2-vCPU machine separate runs drift by more than the 5 % such a change makes.

The first call of every compiled shape is not timed (compilation). Run both in one go (see
docs/benchmarks.md, "Versus vLLM")::

    bash ../shared/peers/setup_vllm_peer.sh /tmp/vllmpeer
    /tmp/vllmpeer/bin/python ../shared/peers/vllm_kv_bench.py --configs dsv4 --batches 256
    python benchmarks/vs_vllm.py --batches 256
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import pathlib
import platform
import random
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from _platform import add_platform_argument, use_platform

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator import (
    AdmitBatch,
    ExtendBatch,
    ReleaseBatch,
    ReleaseMode,
    RetireBatch,
    create_state,
    host,
    ops,
)
from flatkv_jax.formats import RowFormat
from flatkv_jax.groups import FieldSpec
from flatkv_jax.oracle import (
    OracleAdmitBatch,
    OracleExtendBatch,
    OracleHandleBatch,
    RadixOracle,
)
from flatkv_jax.recipes import deepseek_v4_groups, v4_flash
from flatkv_jax.status import Status

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "vllm_kv_bench.py"


def load_make_trace(peer: pathlib.Path):
    """``make_trace`` and ``VOCAB`` from the peer script's source, without importing it (it
    imports vLLM at module level)."""
    tree = ast.parse(peer.read_text())
    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name == "make_trace")
        or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "VOCAB" for t in node.targets)
        )
    ]
    if len(keep) != 2:
        raise SystemExit(f"{peer}: make_trace or VOCAB not found; pass --peer")
    ns = {"random": random}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(peer), "exec"), ns)
    return ns["make_trace"], ns["VOCAB"]


GRANULARITY = {128: {}, 256: {"c4_rows": 64, "c128_rows": 2}}


def groups(granularity: int = 128):
    """V4-Flash as the peer's dsv4 config has it: no MTP layer, no speculative decoding.
    ``granularity`` 256 doubles the compressed pages (``c4_rows=64, c128_rows=2``: vLLM's
    256-token blocks); the default is ours (128-token hits)."""
    cfg = v4_flash(num_mtp_layers=0, **GRANULARITY[granularity])
    return deepseek_v4_groups(cfg, verify_width=0)


def pool_pages(gs, batch: int, max_len: int, budget: int, factor: float) -> dict[str, int]:
    """Per pool, the peer's sizing rule applied per group: ``factor * (B * steady + 2 *
    transient)`` (steady: a decoding request's pages; transient: one step's prefill)."""
    out = {}
    for g in gs:
        bt = g.block_tokens
        steady = -(-g.window // bt) + 2 if g.is_window else -(-max_len // bt)
        transient = -(-budget // bt) + 1
        out[g.name] = math.ceil(factor * (batch * steady + 2 * transient))
    return out


def row_bucket(n: int, cap: int) -> int:
    """Rows of an admission call holding ``n`` prompts: the next power of two, at most
    ``cap`` (few compiled shapes; padding rows are masked and cost ``rows x width``)."""
    r = 1
    while r < n:
        r *= 2
    return min(r, max(cap, n))


def hit_ceilings(prompts, granularity: int) -> list[int]:
    """Per prompt, in admission order, the hit an unbounded cache would give: the longest
    prefix, in whole ``granularity``-token granules, that it shares with an earlier prompt,
    leaving at least its last token to compute. A hit below its ceiling means the blocks it
    needed were evicted (or were not yet published when it was admitted)."""
    seen: set[int] = set()
    out = []
    for p in prompts:
        full = (len(p) - 1) // granularity
        h, shared = 0, 0
        for k in range(full):
            # Chained: granule k's hash covers the whole prefix, so it is seen only if every
            # earlier granule was.
            h = hash((h, tuple(p[k * granularity : (k + 1) * granularity])))
            if h in seen:
                shared = k + 1
            seen.add(h)
        out.append(shared * granularity)
    return out


def oracle_plan(plan):
    """``plan``'s page geometry (spans, windows, retention, page counts, limits) with one
    layer and one-byte rows per group: the oracle's bookkeeping is the same, and its host
    page contents (one NumPy array per layer and field) stay small."""
    tiny = FieldSpec("x", RowFormat("byte", "uint8", (1,)))
    gs = tuple(dataclasses.replace(g, layers=g.layers[:1], fields=(tiny,)) for g in plan.groups)
    out = plan_with_pages(
        gs,
        plan.limits,
        {g.name: plan.usable_pages(g) for g in plan.groups},
        evict_ahead_tokens=plan.evict_ahead_tokens,
    )
    for a, b in zip(plan.groups, out.groups, strict=True):
        if plan.pages(a) != out.pages(b) or a.block_tokens != b.block_tokens:
            raise SystemExit(f"oracle plan: group {a.name} differs ({plan.pages(a)} pages)")
    if out.prefix_granularity != plan.prefix_granularity:
        raise SystemExit("oracle plan: another prefix granularity")
    return out


def parse_pair(text: str) -> tuple[int, int]:
    """``"A,B"`` as two non-negative ints (``--compare-evict-ahead``)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--compare-evict-ahead {text!r}: write two counts, e.g. 0,16")
    return int(parts[0]), int(parts[1])


def peer_command(args, batch: int, json_path: str) -> list[str]:
    """The peer's command line for one run on our trace and pool arguments (``--pairs``)."""
    return [
        str(args.peer_python), str(args.peer), "--configs", "dsv4", "--batches", str(batch),
        "--repeats", "1", "--json", json_path,
        "--requests-per-batch", str(args.requests_per_batch),
        "--decode-len", str(args.decode_len),
        "--prompt-min", str(args.prompt_min), "--prompt-max", str(args.prompt_max),
        "--num-system-prompts", str(args.num_system_prompts),
        "--system-prompt-len", str(args.system_prompt_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--pool-factor", str(args.pool_factor), "--seed", str(args.seed),
    ]  # fmt: skip


def run_peer(args, batch: int) -> dict:
    """One run of the peer (vLLM's manager, in its own venv) on the same trace: its dsv4 row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        cmd = peer_command(args, batch, out)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"the peer failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}"
            )
        rows = json.loads(pathlib.Path(out).read_text())["results"]
    row = next((r for r in rows if r["config"] == "dsv4" and r["batch"] == batch), None)
    if row is None:
        raise SystemExit(f"the peer wrote no dsv4 row for B={batch}: {' '.join(cmd)}")
    return row


def compare_evict_ahead(args, batch: int, trace, values: tuple[int, int]) -> dict:
    """Two runs of the trace whose plans differ only in ``evict_ahead_tokens``, taking turns
    call by call (the order flips every round), so both see the same machine at the same
    moment; the decode ratio is the median over steps of step-for-step ratios (both runs
    decode the same number of steps when their admissions agree)."""
    key = args.key_seed if args.key_seed is not None else int.from_bytes(os.urandom(16), "little")
    runs = [
        Run(argparse.Namespace(**{**vars(args), "evict_ahead_tokens": v}), batch, trace, key)
        for v in values
    ]
    gens = [r.steps() for r in runs]
    live, k = list(range(2)), 0
    while live:
        for i in list(live) if k % 2 == 0 else list(reversed(live)):
            try:
                next(gens[i])
            except StopIteration:
                live.remove(i)
        k += 1
    a, b = (r.decode_series for r in runs)
    n = min(len(a), len(b))
    return {
        "values": values,
        "results": [r.result for r in runs],
        "decode_ratio": statistics.median(y / x for x, y in zip(a[:n], b[:n], strict=True)),
        "paired_steps": n,
    }


def peer_totals(peer: dict) -> tuple[float, float]:
    """The peer's ``(decode + hash, admit + hash)`` µs: what our columns compare with."""
    return peer["decode_us"] + peer["hash_dec_us"], peer["admit_us"] + peer["hash_admit_us"]


def pair_ratios(peer: dict, ours: dict) -> tuple[float, float]:
    """``(decode, admission)`` ratios vLLM / flatkv of one pair, hashing on both sides."""
    v_dec, v_adm = peer_totals(peer)
    return v_dec / ours["decode_us"], v_adm / ours["admit_us"]


class OracleShadow:
    """The host oracle driven in lockstep with the coordinator (``--oracle``): every call is
    replayed on it, and the first row whose status or hit differs stops the run."""

    def __init__(self, plan, batch: int, reclaim_in_admission: bool = True):
        self.plan = plan
        self.reclaim_in_admission = reclaim_in_admission
        self.oracle = RadixOracle(oracle_plan(plan))
        self.handles: dict[int, tuple[int, int]] = {}  # rid -> the oracle's (slot, generation)
        self.b = batch
        self.hits = self.tokens = 0

    def _handles(self, rids, arg):
        n = max(len(rids), 1)
        v = np.zeros(n, bool)
        v[: len(rids)] = True
        slot = np.zeros(n, np.int32)
        gen = np.zeros(n, np.int32)
        for j, rid in enumerate(rids):
            slot[j], gen[j] = self.handles[rid]
        return OracleHandleBatch(v, slot, gen, np.asarray(arg, np.int32).reshape(-1)[:n])

    def _expect_ok(self, step, what, res, n):
        bad = [Status(int(x)).name for x in res.status[:n] if x != Status.OK]
        if bad:
            raise SystemExit(f"oracle: step {step} {what}: statuses {bad} where the device had OK")

    def admit(self, step, rids, ab: AdmitBatch, status, hit):
        rows = len(rids)
        ob = OracleAdmitBatch(
            valid=np.asarray(ab.valid)[:rows],
            namespace=np.zeros(rows, np.int32),
            tokens=np.asarray(ab.tokens)[:rows],
            prompt_len=np.asarray(ab.prompt_len)[:rows],
            first_chunk=np.asarray(ab.first_chunk)[:rows],
        )
        res = self.oracle.admit(ob)
        for j in range(rows):
            if res.status[j] != status[j] or res.hit[j] != hit[j]:
                raise SystemExit(
                    f"oracle: step {step} admission row {j} (req-{rids[j]}): device "
                    f"{Status(int(status[j])).name} hit {int(hit[j])}, oracle "
                    f"{Status(int(res.status[j])).name} hit {int(res.hit[j])}"
                )
        ok = [j for j in range(rows) if res.status[j] == Status.OK]
        for j in ok:
            self.handles[rids[j]] = (int(res.slot[j]), int(res.generation[j]))
            self.hits += int(res.hit[j])
            self.tokens += int(ob.prompt_len[j])
        with_step = [rids[j] for j in ok if res.count[j] > 0]
        counts = [int(res.count[j]) for j in ok if res.count[j] > 0]
        if with_step:
            r = self.oracle.retire(self._handles(with_step, counts))
            self._expect_ok(step, "prefill retire", r, len(with_step))
        if ok and self.reclaim_in_admission:
            oks = [rids[j] for j in ok]
            r = self.oracle.reclaim(self._handles(oks, np.zeros(len(oks))))
            self._expect_ok(step, "prefill reclaim", r, len(oks))

    def decode(self, step, rids, tokens):
        hb = self._handles(rids, np.ones(len(rids)))
        eb = OracleExtendBatch(
            hb.valid, hb.slot, hb.generation, np.ones(len(rids), np.int32),
            np.asarray(tokens, np.int32).reshape(-1, 1),
        )  # fmt: skip
        self._expect_ok(step, "decode extend", self.oracle.extend(eb), len(rids))
        self._expect_ok(step, "decode retire", self.oracle.retire(hb), len(rids))
        r = self.oracle.reclaim(self._handles(rids, np.zeros(len(rids))))
        self._expect_ok(step, "decode reclaim", r, len(rids))

    def release(self, step, rids):
        r = self.oracle.release(self._handles(rids, np.full(len(rids), int(ReleaseMode.FINISH))))
        self._expect_ok(step, "release", r, len(rids))
        for rid in rids:
            del self.handles[rid]

    def check_counts(self, step, state):
        c = self.oracle.counts()
        free = np.asarray(state.allocator.top)
        cached = np.asarray(state.lru.count)
        if not (np.array_equal(c.free, free) and np.array_equal(c.cached_only, cached)):
            raise SystemExit(
                f"oracle: step {step}: pool counts differ: free device {free.tolist()} "
                f"oracle {c.free.tolist()}, cached-only device {cached.tolist()} oracle "
                f"{c.cached_only.tolist()}"
            )

    def hit_rate(self) -> float:
        return self.hits / max(1, self.tokens)


class Run:
    """One pass of the trace through the coordinator."""

    def __init__(self, args, batch: int, trace, seed: int):
        self.args, self.b = args, batch
        max_len = args.prompt_max + args.decode_len * 2
        gs = groups(args.granularity)
        self.budget = args.max_num_batched_tokens
        limits = ServingLimits(
            max_requests=batch,
            max_context=max_len,
            chunk_tokens=args.prompt_max,
            verify_width=0,
            step_tokens=self.budget + batch,
        )
        pages = pool_pages(gs, batch, max_len, self.budget, args.pool_factor)
        self.plan = plan = plan_with_pages(
            gs, limits, pages, evict_ahead_tokens=args.evict_ahead_tokens
        )
        self.state = create_state(plan, seed=seed)
        self.trace = trace
        self.rows = args.admit_rows
        self.gran = plan.prefix_granularity
        reclaim_in_decode = args.reclaim_prefill == "decode"

        def decode(state, packed):
            # One host -> device transfer per step: rows (valid, slot, generation, token) of
            # int32[4, B] (twelve small transfers cost ~80 us per step on this machine).
            v, slot, gen, tok = packed[0] != 0, packed[1], packed[2], packed[3]
            ones = jnp.ones_like(slot)
            eb = ExtendBatch(v, slot, gen, ones, tok[:, None])
            state, er = ops.extend_fn(plan, state, eb, max_count=1)
            # Retire, then reclaim of the committed rows, in one sweep (ops.retire_reclaim_fn):
            # two calls would hold a second sweep, for deferred releases this loop never has.
            state, rr = ops.retire_reclaim_fn(
                plan, state, RetireBatch(v, slot, gen, ones), max_count=1
            )
            # One device -> host transfer back as well (two arrays cost ~10 us more per call).
            return state, jnp.stack([er.status, rr.status])

        def admit(state, packed):
            # int32[rows, 2 + width]: valid, prompt length, then the prompt (one transfer).
            pl = packed[:, 1]
            ab = AdmitBatch(packed[:, 0] != 0, pl, pl, packed[:, 2:], jnp.zeros_like(pl))
            # Static: the call's bucketed token width bounds the first chunk (every prompt
            # fits it) and the prefill's accepted count, so admit allocates and retire
            # hashes and publishes `width` columns per row, not `chunk_tokens`.
            mc = min(ab.tokens.shape[1], plan.limits.max_count)
            state, res = ops.admit_fn(plan, state, ab, max_count=mc)
            ok = res.status == Status.OK
            # Every admitted row has a step (h <= prompt_len - 1), so the retire's committed
            # rows are the admitted ones, which the reclaim of retire_reclaim_fn then covers.
            # The prefill drops up to `mc / B + 1` window columns per group and row: sweep
            # them in chunks sized for that, not a decode step's 64 entries.
            rb = RetireBatch(ok & (res.count > 0), res.slot, res.generation, res.count)
            if reclaim_in_decode:
                # As the peer counts it: vLLM frees the prefill's out-of-window blocks at the
                # request's first decode step (remove_skipped_blocks in its allocate_slots),
                # so our next decode step's retire_reclaim_fn drops them there.
                state, _ = ops.retire_fn(plan, state, rb, max_count=mc)
            else:
                state, _ = ops.retire_reclaim_fn(
                    plan, state, rb, max_count=mc, reclaim_max_count=mc
                )
            return state, jnp.stack([res.status, res.slot, res.generation, res.hit])

        def release(state, relb):
            return ops.release_fn(plan, state, relb)

        # The library's options for coordinator programs (flatkv_jax.compile_options), as a
        # serving step made of coordinator ops would pass them; --xla-task-split leaves
        # XLA's defaults (its CPU split of "costly" fusions across threads) for comparison.
        copts = {} if getattr(args, "xla_task_split", False) else COORDINATOR_COMPILER_OPTIONS
        self.decode = jax.jit(decode, donate_argnums=0, compiler_options=copts)
        self.admit = jax.jit(admit, donate_argnums=0, compiler_options=copts)
        self.release = jax.jit(release, donate_argnums=0, compiler_options=copts)
        self.seen: set = set()
        self.compile_s: dict = {}  # shape -> seconds of its first (compiling) call
        self.oracle = OracleShadow(plan, batch, not reclaim_in_decode) if args.oracle else None

    def _timed(self, key, fn, *a):
        t = time.perf_counter()
        self.state, out = fn(self.state, *a)
        out = jax.device_get(out)
        dt = time.perf_counter() - t
        first = key not in self.seen
        self.seen.add(key)
        if first:
            self.compile_s[key] = dt
            print(f"compile {key}: {dt:.1f}s", flush=True)
        return out, (None if first else dt)

    def in_use(self) -> np.ndarray:
        """Pages held by requests per pool (cached-only pages count as free)."""
        top = np.asarray(self.state.allocator.top)
        cached = np.asarray(self.state.lru.count)
        usable = np.array([self.plan.usable_pages(g) for g in self.plan.groups])
        return usable - top - cached

    def run(self) -> dict:
        """The whole trace; returns the result row."""
        for _ in self.steps():
            pass
        return self.result

    def steps(self):
        """The trace as a generator that pauses before every timed call (so two runs can
        take turns call by call: ``--compare-evict-ahead``); the result row is left in
        ``self.result``."""
        b, vocab_tok = self.b, self._token
        pending = list(self.trace)
        running: dict[int, list] = {}  # rid -> [slot, gen, next position, outputs, dlen]
        dec_us, adm_us, free_us = [], [], []
        hits = prompt_tokens = 0
        ceiling = dict(
            zip(
                (int(rid[4:]) for rid, _, _ in self.trace),
                hit_ceilings([p for _, p, _ in self.trace], self.gran),
                strict=True,
            )
        )
        ceiling_tokens = short = 0
        peak = np.zeros(len(self.plan.groups), np.int64)
        steps = 0
        i32 = np.int32
        while pending or running:
            steps += 1
            budget = self.budget
            # 1) every running request decodes one token (its previous output).
            if running:
                rids = list(running)
                v = np.zeros(b, bool)
                v[: len(rids)] = True
                slot = np.zeros(b, i32)
                gen = np.zeros(b, i32)
                tok = np.zeros((b, 1), i32)
                for j, rid in enumerate(rids):
                    r = running[rid]
                    slot[j], gen[j] = r[0], r[1]
                    tok[j, 0] = vocab_tok(rid, r[3] - 1)
                packed = np.stack([v.astype(i32), slot, gen, tok[:, 0]])
                yield
                (est, rst), dt = self._timed("decode", self.decode, packed)
                if (est[: len(rids)] != Status.OK).any() or (rst[: len(rids)] != Status.OK).any():
                    raise SystemExit(
                        f"decode step {steps}: statuses {set(est[: len(rids)].tolist())}: "
                        "pools too small for this trace; raise --pool-factor"
                    )
                if dt is not None:
                    dec_us.append(dt / len(rids) * 1e6)
                if self.oracle:
                    self.oracle.decode(steps, rids, [int(tok[j, 0]) for j in range(len(rids))])
                for rid in rids:
                    running[rid][2] += 1
                    running[rid][3] += 1
                budget -= len(rids)
            # 2) admissions, FCFS, whole prompts, within the step's token budget.
            while len(running) < b and pending:
                cands, rem, firsts = [], budget, set()
                for rid_s, prompt, dlen in pending:
                    if len(running) + len(cands) >= min(b, len(running) + self.rows):
                        break
                    if len(prompt) > rem:
                        break
                    first = tuple(prompt[: self.gran])
                    if first in firsts:
                        break  # shares its first granule with an earlier row: next call
                    firsts.add(first)
                    cands.append((rid_s, prompt, dlen))
                    rem -= len(prompt)
                if not cands:
                    break
                longest = max(len(p) for _, p, _ in cands)
                width = self.args.admit_width or host.token_width(self.plan, longest)
                rows = row_bucket(len(cands), self.rows)
                toks = np.zeros((rows, width), i32)
                pl = np.zeros(rows, i32)
                v = np.zeros(rows, bool)
                for j, (_, p, _) in enumerate(cands):
                    toks[j, : len(p)] = p
                    pl[j] = len(p)
                    v[j] = True
                ab = AdmitBatch(v, pl, pl.copy(), toks, np.zeros(rows, i32))
                packed = np.concatenate([v.astype(i32)[:, None], pl[:, None], toks], axis=1)
                yield
                (st, slot, gen, hit), dt = self._timed(("admit", rows, width), self.admit, packed)
                if self.oracle:
                    self.oracle.admit(steps, [int(c[0][4:]) for c in cands], ab, st, hit)
                n_ok = 0
                for j, (rid_s, p, dlen) in enumerate(cands):
                    if st[j] != Status.OK:
                        break
                    n_ok += 1
                    rid = int(rid_s[4:])
                    running[rid] = [int(slot[j]), int(gen[j]), len(p), 1, dlen]
                    hits += int(hit[j])
                    prompt_tokens += len(p)
                    ceiling_tokens += ceiling[rid]
                    short += int(hit[j]) < ceiling[rid]
                    budget -= len(p) - int(hit[j])
                if dt is not None and n_ok:
                    adm_us.extend([dt / n_ok * 1e6] * n_ok)
                pending = pending[n_ok:]
                if n_ok < len(cands):
                    if not running:
                        raise SystemExit(f"admission impossible: {Status(int(st[n_ok])).name}")
                    break
            peak = np.maximum(peak, self.in_use())
            # 3) finished requests (their last output was sampled this step) are freed.
            done = [rid for rid, r in running.items() if r[3] >= r[4]]
            if done:
                v = np.zeros(b, bool)
                v[: len(done)] = True
                slot = np.zeros(b, i32)
                gen = np.zeros(b, i32)
                for j, rid in enumerate(done):
                    slot[j], gen[j] = running.pop(rid)[:2]
                mode = np.full(b, int(ReleaseMode.FINISH), i32)
                yield
                res, dt = self._timed("release", self.release, ReleaseBatch(v, slot, gen, mode))
                if (np.asarray(res.status)[: len(done)] != Status.OK).any():
                    raise SystemExit("release failed")
                if dt is not None:
                    free_us.append(dt / len(done) * 1e6)
                if self.oracle:
                    self.oracle.release(steps, done)
            if self.oracle:
                self.oracle.check_counts(steps, self.state)
        usable = [self.plan.usable_pages(g) for g in self.plan.groups]
        self.decode_series = dec_us  # per timed decode step, µs per request
        self.result = {
            "decode_us": statistics.median(dec_us) if dec_us else float("nan"),
            "admit_us": statistics.median(adm_us) if adm_us else float("nan"),
            "free_us": statistics.median(free_us) if free_us else float("nan"),
            "hit_rate": hits / max(1, prompt_tokens),
            "hit_ceiling": ceiling_tokens / max(1, prompt_tokens),
            "short_hits": short,
            "peak": [int(x) for x in peak],
            "usable": usable,
            "steps": steps,
            "admissions": len(adm_us),
            "compile_s": sum(self.compile_s.values()),
            "shapes": len(self.compile_s),
            "oracle_hit_rate": self.oracle.hit_rate() if self.oracle else None,
        }

    @staticmethod
    def _token(rid: int, k: int) -> int:
        """The peer's output token ``k`` of request ``rid`` (``req-<rid>``)."""
        return (rid * 104729 + 7919 * k) % 150_000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="256", help="comma-separated B values (peer: --batches)")
    ap.add_argument("--requests-per-batch", type=float, default=4.0)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--prompt-min", type=int, default=1024)
    ap.add_argument("--prompt-max", type=int, default=4096)
    ap.add_argument("--num-system-prompts", type=int, default=8)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--pool-factor", type=float, default=1.25)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="trace seed (as the peer's)")
    ap.add_argument("--key-seed", type=int, default=None, help="prefix key seed (default: secret)")
    ap.add_argument(
        "--admit-rows",
        type=int,
        default=16,
        help="most rows of one admission call (calls are padded to the next power of two)",
    )
    ap.add_argument(
        "--admit-width",
        type=int,
        default=0,
        help="token width of every admission call (0: a power of two fitting the call's "
        "longest prompt, one compilation per bucket; --prompt-max: one compilation)",
    )
    ap.add_argument(
        "--reclaim-prefill",
        default="admit",
        choices=("admit", "decode"),
        help="where the prefill's window pages behind the window are dropped: in the "
        "admission call (admit, the default: the admission column pays for them) or at the "
        "request's first decode step (decode: where the peer frees them, so both sides' "
        "columns count the same work)",
    )
    ap.add_argument(
        "--granularity", type=int, default=128, choices=sorted(GRANULARITY), help="hit granularity"
    )
    ap.add_argument(
        "--evict-ahead-tokens",
        type=int,
        default=0,
        help="CachePlan.evict_ahead_tokens: an admission that runs a pool dry tops every "
        "pool's free stack up to the pages this many more tokens of every request slot would "
        "open there (0: the shortfall only)",
    )
    ap.add_argument(
        "--compare-evict-ahead",
        default="",
        metavar="A,B",
        help="instead of the table: two runs whose plans differ only in evict_ahead_tokens "
        "(A, then B), taking turns call by call; prints both and B's per-step decode ratio",
    )
    ap.add_argument("--peer", type=pathlib.Path, default=DEFAULT_PEER)
    ap.add_argument("--vllm", type=pathlib.Path, default=None, help="peer --json output: ratios")
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="interleaved pairs: run the peer (with --peer-python), then ours, K times, "
        "printing each pair's ratios and their median (replaces --vllm and --repeats)",
    )
    ap.add_argument(
        "--peer-python",
        type=pathlib.Path,
        default=pathlib.Path("/tmp/vllmpeer/bin/python"),
        help="the peer venv's python (bash ../shared/peers/setup_vllm_peer.sh /tmp/vllmpeer)",
    )
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--oracle",
        action="store_true",
        help="replay every call on the host oracle in lockstep (B <= 32): statuses, hits and "
        "pool counts must agree; prints both hit rates",
    )
    ap.add_argument(
        "--xla-task-split",
        action="store_true",
        help="compile the steps with XLA's default options, not the library's "
        "COORDINATOR_COMPILER_OPTIONS (XLA:CPU then splits costly-looking fusions across "
        "threads: decode ~x1.05 per step on the 2-vCPU machine)",
    )
    ap.add_argument(
        "--compile-cache",
        default=str(pathlib.Path.home() / ".cache" / "flatkv_jax" / "vs_vllm_xla"),
        help="XLA persistent compilation cache directory ('' : none)",
    )
    add_platform_argument(ap)
    args = ap.parse_args()
    device = use_platform(args.platform)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    batches = [int(x) for x in args.batches.split(",")]
    if args.oracle and max(batches) > 32:
        raise SystemExit(
            f"--oracle replays on the host oracle (plain Python): use B <= 32, not {max(batches)}"
        )
    if args.pairs:
        if args.vllm:
            raise SystemExit("--pairs runs the peer itself: drop --vllm (or --pairs)")
        if not args.peer_python.exists():
            raise SystemExit(
                f"--peer-python {args.peer_python} does not exist: build the peer's venv with "
                "bash ../shared/peers/setup_vllm_peer.sh /tmp/vllmpeer, or pass its python"
            )
    make_trace, vocab = load_make_trace(args.peer)
    assert vocab == 150_000, vocab
    print(
        json.dumps(
            {
                "nproc": os.cpu_count(),
                "python": platform.python_version(),
                "jax": jax.__version__,
                "device": device,
            }
        )
    )
    peer = {}
    if args.vllm:
        for r in json.loads(args.vllm.read_text())["results"]:
            if r["config"] == "dsv4":
                peer[r["batch"]] = r
    results = []
    for batch in batches:
        n = math.ceil(args.requests_per_batch * batch)
        trace = make_trace(
            n,
            args.seed,
            args.num_system_prompts,
            args.system_prompt_len,
            args.prompt_min,
            args.prompt_max,
            args.decode_len,
        )
        if args.compare_evict_ahead:
            vals = parse_pair(args.compare_evict_ahead)
            cmp = compare_evict_ahead(args, batch, trace, vals)
            for v, r in zip(vals, cmp["results"], strict=True):
                print(
                    f"evict_ahead_tokens={v:3d} B={batch}: decode {r['decode_us']:.2f}us "
                    f"admit {r['admit_us']:.1f}us free {r['free_us']:.1f}us "
                    f"hit {r['hit_rate'] * 100:.1f}% steps {r['steps']}",
                    flush=True,
                )
            print(
                f"decode x{cmp['decode_ratio']:.3f} with evict_ahead_tokens={vals[1]} against "
                f"{vals[0]} (median of {cmp['paired_steps']} step-for-step ratios)",
                flush=True,
            )
            results.append({"batch": batch, "compare_evict_ahead": cmp})
            continue
        runs, pairs = [], []
        for i in range(args.pairs or args.repeats):
            key = (
                args.key_seed
                if args.key_seed is not None
                else int.from_bytes(os.urandom(16), "little")
            )
            p = run_peer(args, batch) if args.pairs else None
            runs.append(Run(args, batch, trace, key).run())
            if p is not None:
                dec, adm = pair_ratios(p, runs[-1])
                pairs.append({"vllm": p, "decode_ratio": dec, "admission_ratio": adm})
                v_dec, v_adm = peer_totals(p)
                print(
                    f"pair {i + 1}/{args.pairs} B={batch}: vllm decode+hash {v_dec:.2f}us "
                    f"admit+hash {v_adm:.1f}us hit {p['hit_rate'] * 100:.1f}% | "
                    f"flatkv decode {runs[-1]['decode_us']:.2f}us admit "
                    f"{runs[-1]['admit_us']:.1f}us hit {runs[-1]['hit_rate'] * 100:.1f}% | "
                    f"ratio decode {dec:.2f}x admission {adm:.2f}x",
                    flush=True,
                )
        agg = dict(runs[0])
        for k in ("decode_us", "admit_us", "free_us"):
            agg[k] = statistics.median(r[k] for r in runs)
        agg.update(batch=batch, requests=n)
        if pairs:
            agg["pairs"] = pairs
        results.append(agg)
        print(
            f"compile B={batch}: {agg['shapes']} shapes, {agg['compile_s']:.0f}s in first calls "
            f"({'XLA defaults' if args.xla_task_split else 'COORDINATOR_COMPILER_OPTIONS'})",
            flush=True,
        )
        if args.oracle:
            o = agg["oracle_hit_rate"]
            print(
                f"oracle B={batch:4d} hit={o * 100:5.1f}% (flatkv {agg['hit_rate'] * 100:5.1f}%): "
                "every status, hit and pool count agreed",
                flush=True,
            )
            if o != agg["hit_rate"]:
                raise SystemExit(f"oracle hit rate {o} != flatkv {agg['hit_rate']}")
        peak = " ".join(
            f"{g.name}={p}/{u}"
            for g, p, u in zip(groups(args.granularity), agg["peak"], agg["usable"], strict=True)
        )
        print(
            f"flatkv B={batch:4d} N={n:5d} groups={len(agg['peak'])} "
            f"decode={agg['decode_us']:7.2f}us admit(+hash)={agg['admit_us']:8.1f}us "
            f"free={agg['free_us']:7.1f}us hit={agg['hit_rate'] * 100:5.1f}% "
            f"steps={agg['steps']} peak {peak}\n"
            f"hit ceiling {agg['hit_ceiling'] * 100:.1f}% (an unbounded cache, same order): "
            f"{agg['short_hits']} admissions hit less than an earlier prompt shares",
            flush=True,
        )
        if pairs:
            dec = [x["decode_ratio"] for x in pairs]
            adm = [x["admission_ratio"] for x in pairs]
            print(
                f"ratio  vllm/flatkv over {len(pairs)} interleaved pairs (each pair's peer and "
                f"flatkv runs back to back): decode median {statistics.median(dec):.2f}x "
                f"(min {min(dec):.2f}x, max {max(dec):.2f}x), admission median "
                f"{statistics.median(adm):.2f}x (min {min(adm):.2f}x, max {max(adm):.2f}x)",
                flush=True,
            )
        if batch in peer:
            p = peer[batch]
            v_dec, v_adm = peer_totals(p)
            print(
                f"vllm   B={batch:4d} decode+hash={v_dec:7.2f}us admit+hash={v_adm:8.1f}us "
                f"hit={p['hit_rate'] * 100:5.1f}% peak={p['peak_blocks']}/{p['num_blocks']}\n"
                f"ratio  vllm/flatkv: decode {v_dec / agg['decode_us']:.1f}x, "
                f"admission {v_adm / agg['admit_us']:.1f}x; hit {agg['hit_rate'] * 100:.1f}% vs "
                f"{p['hit_rate'] * 100:.1f}%",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
