"""Long differential run from the command line (docs/oracle.md).

    python -m flatkv_jax.oracle.long_run --ops 100000                  # oracle vs oracle
    python -m flatkv_jax.oracle.long_run --ops 100000 --device         # oracle vs coordinator
    python -m flatkv_jax.oracle.long_run --ops 100000 --device --no-prefix

``--device`` runs ``--lanes`` traces at a time in lockstep (:mod:`flatkv_jax.oracle.lockstep`);
prefix reuse is on when the coordinator has the prefix index, unless ``--no-prefix``.

Traces are seeded ``--seed``, ``--seed + 1``, ...; the run stops at the first divergence
and prints it (exit status 1), else prints the totals (exit status 0).
"""

from __future__ import annotations

import argparse
import sys
import time

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.cli import whole_number
from flatkv_jax.oracle.differential import run_trace
from flatkv_jax.oracle.oracle import RadixOracle
from flatkv_jax.oracle.traces import TraceConfig, random_trace
from flatkv_jax.recipes import deepseek_v4_groups, tiny_v4

#: Pools small enough that traces hit OUT_OF_PAGES and LRU eviction.
DIFF_PAGES = {
    "swa_kv": 24,
    "mtp_swa_kv": 24,
    "c4_kv": 12,
    "c4_state": 24,
    "c4_index_state": 24,
    "c16_kv": 12,
    "c16_state": 30,
}


def diff_plan():
    """The plan of the differential runs: tiny V4 (7 groups, granularity 16), small dims."""
    groups = deepseek_v4_groups(tiny_v4(head_dim=16, rope_dim=4, index_head_dim=8), verify_width=2)
    # A random trace's extend/admit calls schedule more than a serving step would (several
    # prefill chunks at once): 40 step tokens keep STEP_FULL frequent without starving the
    # requests that must run long enough to reach TOO_LONG.
    limits = ServingLimits(
        max_requests=4, max_context=64, chunk_tokens=16, verify_width=2, step_tokens=40
    )
    return plan_with_pages(groups, limits, DIFF_PAGES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m flatkv_jax.oracle.long_run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Every count is checked by its argparse type: a trace of 0 ops would never advance the
    # total (an endless loop) and a negative total would divide by zero in the summary.
    ap.add_argument(
        "--ops", type=whole_number("--ops", 1), default=100_000, help="operations in total"
    )
    ap.add_argument(
        "--trace-ops", type=whole_number("--trace-ops", 1), default=40, help="operations per trace"
    )
    ap.add_argument(
        "--seed", type=whole_number("--seed", 0), default=10_000, help="seed of the first trace"
    )
    ap.add_argument("--device", action="store_true", help="compare with the device coordinator")
    ap.add_argument(
        "--lanes",
        type=whole_number("--lanes", 1),
        default=256,
        help="device traces run in lockstep",
    )
    ap.add_argument("--no-prefix", action="store_true", help="device: pass no tokens (no hits)")
    args = ap.parse_args(argv)
    plan = diff_plan()
    cfg = TraceConfig(num_ops=args.trace_ops)
    if args.device:
        return _device(plan, cfg, args)
    other = RadixOracle(plan)
    names = ("oracle", "oracle2")
    oracle = RadixOracle(plan)
    total = traces = hits = prompt = 0
    t0 = time.perf_counter()
    seed = args.seed
    while total < args.ops:
        rep = run_trace(random_trace(plan, seed, cfg), oracle, other, names=names)
        total += rep.ops
        traces += 1
        hits += rep.hit_tokens
        prompt += rep.prompt_tokens
        if not rep.ok:
            print(rep.divergence)
            return 1
        seed += 1
    dt = time.perf_counter() - t0
    print(
        f"{traces} traces, {total} ops, 0 divergences, hit rate {hits / max(prompt, 1):.3f}, {dt:.1f} s ({1e3 * dt / total:.2f} ms/op)"
    )
    return 0


def _device(plan, cfg: TraceConfig, args) -> int:
    from flatkv_jax.oracle.lockstep import LockstepDevice, run_lockstep

    dev = LockstepDevice(plan, args.lanes, prefix_reuse=False if args.no_prefix else None)
    total = traces = hits = prompt = 0
    t0 = time.perf_counter()
    seed = args.seed
    while total < args.ops:
        n = min(args.lanes, -(-(args.ops - total) // max(cfg.num_ops, 1)))
        batch = [random_trace(plan, seed + i, cfg) for i in range(n)]
        seed += n
        for rep in run_lockstep(batch, dev):
            total += rep.ops
            traces += 1
            hits += rep.hit_tokens
            prompt += rep.prompt_tokens
            if not rep.ok:
                print(rep.divergence)
                return 1
    dt = time.perf_counter() - t0
    print(
        f"{traces} traces, {total} ops, 0 divergences (device, prefix "
        f"{'on' if dev.prefix_reuse else 'off'}), hit rate {hits / max(prompt, 1):.3f}, "
        f"{dt:.1f} s ({1e3 * dt / max(total, 1):.2f} ms/op incl. compilation)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
