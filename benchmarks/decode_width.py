"""What a decode step's coordinator work costs at the static width it is compiled for.

A serving step compiles its coordinator calls for a per-row token bound, ``max_count``. A
step that may hold a prefill chunk needs ``max_count = chunk_tokens``; a decode-only step
needs ``1 + verify_width`` (the serving engine's narrow step kind, docs/serving.md). This
script replays ``benchmarks/vs_vllm.py``'s trace (V4-Flash groups, prefix reuse on, B = 256
by default), captures a few decode states with most lanes running, and times the same decode
batch (every running lane one token: ``extend`` then ``retire_reclaim``, as the engine's step
runs them) compiled at each ``--widths`` value (``extend``'s and ``retire``'s ``max_count``),
every width on its own fresh copy of each state in a random order, so all widths see the
same steps on the same machine at the same moment. Prints each width's median and min
microseconds per step and the median of its per-step ratios to the first width.

Run (about two minutes on the 2-vCPU machine)::

    python benchmarks/decode_width.py --widths 1 3 64 512 4096
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
from flatkv_jax.coordinator.batches import ExtendBatch, RetireBatch


def capture(run, states: int, min_rows: int, seed: int) -> list:
    """``states`` (state, packed decode batch) pairs from the replay, each with at least
    ``min_rows`` running lanes, spread over the trace."""
    rng = np.random.default_rng(seed)
    out = []
    orig = run._timed

    def timed(key, fn, *a):
        full = key == "decode" and int(np.asarray(a[0])[0].sum()) >= min_rows
        if full and len(out) < states and rng.random() < 0.05:
            out.append((jax.tree.map(lambda x: x.copy(), run.state), np.asarray(a[0])))
        return orig(key, fn, *a)

    run._timed = timed
    for _ in run.steps():
        if len(out) >= states:
            break
    run._timed = orig
    return out


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 3, 64, 512, 4096])
    ap.add_argument("--states", type=int, default=4, help="decode states captured")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per state and width")
    ap.add_argument("--peer", default=None, help="vllm_kv_bench.py (default: vs_vllm's)")
    add_platform_argument(ap)
    args = ap.parse_args()
    device = use_platform(args.platform)
    vs = ab_compiled._import_vs_vllm()
    run = ab_compiled._make_run(vs, args, evict_ahead_tokens=16)
    limit = run.plan.limits.max_count
    bad = [w for w in args.widths if not 1 <= w <= limit]
    if bad:
        raise SystemExit(f"--widths {bad}: each must lie in [1, {limit}] (the plan's max_count)")
    got = capture(run, args.states, args.batch * 3 // 4, seed=0)
    if not got:
        raise SystemExit("no decode step of the trace held enough running lanes")
    fns = {}
    for w in args.widths:
        t = time.perf_counter()
        fns[w] = decode_at(run.plan, w).lower(*got[0]).compile()
        print(f"compile width {w}: {time.perf_counter() - t:.1f}s", flush=True)
    us = {w: [] for w in args.widths}
    rng = np.random.default_rng(1)
    for _ in range(args.repeats):
        for state, packed in got:
            for i in rng.permutation(len(args.widths)):
                w = args.widths[i]
                fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
                t = time.perf_counter()
                jax.block_until_ready(fns[w](fresh, packed))
                us[w].append((time.perf_counter() - t) * 1e6)
    rows = int(np.mean([int(p[0].sum()) for _, p in got]))
    print(
        f"{device}, {os.cpu_count()} CPUs, jax {jax.__version__}, B = {args.batch}, {len(got)} decode "
        f"states (~{rows} running lanes), {args.repeats} calls each"
    )
    first = us[args.widths[0]]
    for w in args.widths:
        ratio = statistics.median(x / y for x, y in zip(us[w], first, strict=True))
        print(
            f"width {w:5d}: median {statistics.median(us[w]):9.0f} us/step, min "
            f"{min(us[w]):9.0f}, x{ratio:.2f} of width {args.widths[0]}"
        )


if __name__ == "__main__":
    main()
