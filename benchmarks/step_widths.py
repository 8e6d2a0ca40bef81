"""What a serving step's coordinator work costs at the static shapes it is compiled for.

A serving step compiles its coordinator calls for static shapes. Two of them follow engine
options, not the batch (docs/serving.md):

- the per-row token bound ``max_count`` of ``extend`` and ``retire``: ``chunk_tokens`` for a
  step that may hold a prefill chunk, ``1 + verify_width`` for the engine's decode-only
  (narrow) kind;
- the rows of the admission batch, each of ``max_context`` prompt tokens: ``max_requests``
  before ``EngineOptions.admit_rows`` (default ``min(max_requests, 16)``).

This script replays ``benchmarks/vs_vllm.py``'s trace (V4-Flash groups, prefix reuse on, B =
256 by default) and captures a few states of it, then times, side by side (every variant on
its own fresh copy of each state, in a random order, so all see the same steps on the same
machine at the same moment):

- **decode widths**: the same decode batch (every running lane one token: ``extend`` then
  ``retire_reclaim``, as the engine's step runs them) compiled at each ``--widths`` value,
  and (``split``) as a step split by ``EngineOptions.prefill_rows`` runs its decode lanes: at
  the smallest width, beside an extend and a retire of ``--split-rows`` (empty) prefill rows
  at the largest;
- **admission rows**: the same admission (the prompts of one admission call of the trace, at
  most the smallest ``--admit-rows`` of them; ``admit`` with the engine's ``max_count`` and
  ``max_context`` token columns) in a batch of each ``--admit-rows`` value (padding rows
  masked).

Prints each variant's median and min microseconds per call and the median of its per-call
ratios to the first.

Run (about three minutes on the 2-vCPU machine)::

    python benchmarks/step_widths.py --widths 1 3 64 512 4096 --admit-rows 1 16 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ab_compiled
import jax
import jax.numpy as jnp
import numpy as np
from _platform import add_platform_argument, use_platform

from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator import ops
from flatkv_jax.coordinator.batches import AdmitBatch, ExtendBatch, RetireBatch


def capture(run, states: int, min_rows: int, max_prompts: int, seed: int) -> tuple[list, list]:
    """``states`` decode pairs (state, packed decode batch) with at least ``min_rows`` running
    lanes and ``states`` admission pairs (state, packed admission) of at most ``max_prompts``
    prompts (every batch size compared holds all of them), spread over the trace."""
    rng = np.random.default_rng(seed)
    dec, adm = [], []
    orig = run._timed

    def snapshot():
        return jax.tree.map(lambda x: x.copy(), run.state)

    def timed(key, fn, *a):
        packed = np.asarray(a[0])
        if key == "decode":
            if int(packed[0].sum()) >= min_rows and len(dec) < states and rng.random() < 0.05:
                dec.append((snapshot(), packed))
        elif (
            key[0] == "admit"
            and int((packed[:, 0] != 0).sum()) <= max_prompts
            and len(adm) < states
            and rng.random() < 0.05
        ):
            adm.append((snapshot(), packed))
        return orig(key, fn, *a)

    run._timed = timed
    for _ in run.steps():
        if len(dec) >= states and len(adm) >= states:
            break
    run._timed = orig
    return dec, adm


def decode_at(plan, width: int):
    """The decode batch's extend + retire_reclaim, compiled for ``max_count = width``."""

    def step(state, packed):
        v, slot, gen, tok = packed[0] != 0, packed[1], packed[2], packed[3]
        ones = jnp.ones_like(slot)
        toks = jnp.zeros((slot.shape[0], width), jnp.int32).at[:, 0].set(tok)
        eb = ExtendBatch(v, slot, gen, ones, toks)
        state, er = ops.extend_fn(plan, state, eb, max_count=width)
        rb = RetireBatch(v, slot, gen, ones)
        state, rr = ops.retire_reclaim_fn(plan, state, rb, max_count=width)
        return state, jnp.stack([er.status, rr.status])

    return jax.jit(step, donate_argnums=0, compiler_options=COORDINATOR_COMPILER_OPTIONS)


def split_at(plan, narrow: int, width: int, rows: int):
    """The decode batch as a split step runs its decode lanes: extend and retire_reclaim at
    ``narrow``, beside an extend and a retire_reclaim of ``rows`` prefill rows at ``width``
    (empty here: what the split adds when its wide call holds nothing)."""

    def step(state, packed):
        v, slot, gen, tok = packed[0] != 0, packed[1], packed[2], packed[3]
        ones = jnp.ones_like(slot)
        toks = jnp.zeros((slot.shape[0], narrow), jnp.int32).at[:, 0].set(tok)
        state, er = ops.extend_fn(
            plan, state, ExtendBatch(v, slot, gen, ones, toks), max_count=narrow
        )
        z = jnp.zeros((rows,), jnp.int32)
        off = z != 0
        wide = ExtendBatch(off, z, z, z + 1, jnp.zeros((rows, width), jnp.int32))
        state, _ = ops.extend_fn(plan, state, wide, max_count=width, same_step=(er,))
        rb = RetireBatch(v, slot, gen, ones)
        state, rr = ops.retire_reclaim_fn(plan, state, rb, max_count=narrow)
        rw = RetireBatch(off, z, z, z + 1)
        state, _ = ops.retire_reclaim_fn(plan, state, rw, max_count=width)
        return state, jnp.stack([er.status, rr.status])

    return jax.jit(step, donate_argnums=0, compiler_options=COORDINATOR_COMPILER_OPTIONS)


def admit_at(plan):
    """The admission as the engine's admitting step runs it: ``admit`` of packed rows (valid,
    prompt length, the prompt's token columns) at the plan's ``max_count`` (the first chunk:
    the prompt, at most ``max_count``). Returns ``(state, AdmitResult)``."""

    def step(state, packed):
        pl = packed[:, 1]
        first = jnp.minimum(pl, plan.limits.max_count)
        ab = AdmitBatch(packed[:, 0] != 0, pl, first, packed[:, 2:], jnp.zeros_like(pl))
        return ops.admit_fn(plan, state, ab)

    return jax.jit(step, donate_argnums=0, compiler_options=COORDINATOR_COMPILER_OPTIONS)


def padded(packed: np.ndarray, rows: int, width: int) -> np.ndarray:
    """An admission's valid rows in a batch of ``rows`` rows of ``2 + width`` columns."""
    valid = packed[packed[:, 0] != 0]
    out = np.zeros((rows, 2 + width), np.int32)
    out[: valid.shape[0], : valid.shape[1]] = valid
    return out


def side_by_side(name, variants, calls, repeats: int, unit: str) -> None:
    """Times every variant on fresh copies of every captured state; prints the table."""
    us = {v: [] for v in variants}
    rng = np.random.default_rng(1)
    for _ in range(repeats):
        for i_state in range(len(calls[variants[0]])):
            for i in rng.permutation(len(variants)):
                fn, state, arg = calls[variants[i]][i_state]
                fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
                t = time.perf_counter()
                jax.block_until_ready(fn(fresh, arg))
                us[variants[i]].append((time.perf_counter() - t) * 1e6)
    first = us[variants[0]]
    for v in variants:
        ratio = statistics.median(x / y for x, y in zip(us[v], first, strict=True))
        print(
            f"{name} {v!s:>5}: median {statistics.median(us[v]):9.0f} us/{unit}, min "
            f"{min(us[v]):9.0f}, x{ratio:.2f} of {name} {variants[0]}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="*", default=[1, 3, 64, 512, 4096])
    ap.add_argument("--admit-rows", type=int, nargs="*", default=[1, 16, 256])
    ap.add_argument(
        "--split-rows",
        type=int,
        default=16,
        help="prefill rows of the split variant (0: leave it out): the decode batch at the "
        "smallest width beside an empty wide call of this many rows at the largest",
    )
    ap.add_argument("--states", type=int, default=4, help="states captured of each kind")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per state and variant")
    ap.add_argument("--peer", default=None, help="vllm_kv_bench.py (default: vs_vllm's)")
    add_platform_argument(ap)
    args = ap.parse_args()
    device = use_platform(args.platform)
    vs = ab_compiled._import_vs_vllm()
    run = ab_compiled._make_run(vs, args, evict_ahead_tokens=16)
    plan = run.plan
    limit = plan.limits.max_count
    bad = [w for w in args.widths if not 1 <= w <= limit]
    if bad:
        raise SystemExit(f"--widths {bad}: each must lie in [1, {limit}] (the plan's max_count)")
    bad = [a for a in args.admit_rows if not 1 <= a <= args.batch]
    if bad:
        raise SystemExit(f"--admit-rows {bad}: each must lie in [1, {args.batch}] (--batch)")
    few = min(args.admit_rows, default=1)
    dec, adm = capture(run, args.states, args.batch * 3 // 4, few, seed=0)
    print(
        f"{device}, {os.cpu_count()} CPUs, jax {jax.__version__}, B = {args.batch}: "
        f"{len(dec)} decode states (~{int(np.mean([p[0].sum() for _, p in dec] or [0]))} "
        f"running lanes), {len(adm)} admissions "
        f"(~{np.mean([(p[:, 0] != 0).sum() for _, p in adm] or [0]):.1f} prompts), "
        f"{args.repeats} calls each",
        flush=True,
    )
    if args.widths and dec:
        calls = {}
        for w in args.widths:
            fn = decode_at(plan, w).lower(*dec[0]).compile()
            calls[w] = [(fn, s, p) for s, p in dec]
        if args.split_rows and len(args.widths) > 1:
            lo, hi = min(args.widths), max(args.widths)
            fn = split_at(plan, lo, hi, args.split_rows).lower(*dec[0]).compile()
            calls["split"] = [(fn, s, p) for s, p in dec]
            side_by_side("width", [*args.widths, "split"], calls, args.repeats, "step")
        else:
            side_by_side("width", args.widths, calls, args.repeats, "step")
    if args.admit_rows and adm:
        ctx = plan.limits.max_context
        calls = {}
        for a in args.admit_rows:
            fn = admit_at(plan).lower(adm[0][0], padded(adm[0][1], a, ctx)).compile()
            calls[a] = [(fn, s, padded(p, a, ctx)) for s, p in adm]
        side_by_side("rows", args.admit_rows, calls, args.repeats, "admission")


if __name__ == "__main__":
    main()
