"""What an admission costs at the prompt-token width of its batch, on a long-context plan.

An admitting step's batch has ``admit_rows`` rows of some width of prompt tokens, and matching
hashes and looks up every column of every row (docs/serving.md, "Admission widths"). Before
``EngineOptions.admit_widths`` the width was always ``max_context``. This script builds the
V4-Flash plan (``vs_vllm.py``'s groups, prefix reuse on) for ``--max-context`` tokens, fills
its prefix index by admitting and publishing ``--warm`` prompts that share a system prompt,
then times, side by side (every width on its own fresh copy of the same state, in a random
order), one admission of a new prompt of ``--prompt`` tokens with the same system prompt
(``admit`` with the plan's ``max_count``) in a batch of ``--rows`` rows (the others masked)
at each ``--widths`` value. Prints each width's median and min microseconds per call and the
median of its per-call ratios to the first.

Run (about a minute on the 2-vCPU machine)::

    python benchmarks/admit_widths.py --max-context 131072 --widths 4096 131072
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import vs_vllm
from _platform import add_platform_argument, use_platform
from step_widths import admit_at

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator import ops
from flatkv_jax.coordinator.batches import ReleaseBatch, ReleaseMode, RetireBatch
from flatkv_jax.coordinator.state import create_state
from flatkv_jax.status import Status


def packed(prompts: list[list[int]], rows: int, width: int) -> np.ndarray:
    out = np.zeros((rows, 2 + width), np.int32)
    for i, p in enumerate(prompts):
        out[i, :2] = 1, len(p)
        out[i, 2 : 2 + len(p)] = p
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--widths", type=int, nargs="+", default=[4096, 131072])
    ap.add_argument("--rows", type=int, default=16, help="rows of the admission batch")
    ap.add_argument("--prompt", type=int, default=2500, help="tokens of the timed prompt")
    ap.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--warm", type=int, default=8, help="prompts published before timing")
    ap.add_argument("--repeats", type=int, default=20)
    add_platform_argument(ap)
    args = ap.parse_args()
    device = use_platform(args.platform)
    bad = [w for w in args.widths if not args.prompt <= w <= args.max_context]
    if bad:
        raise SystemExit(f"--widths {bad}: each must hold --prompt and be <= --max-context")
    gs = vs_vllm.groups()
    rows = args.rows
    limits = ServingLimits(
        max_requests=rows, max_context=args.max_context, chunk_tokens=4096, verify_width=0
    )
    # Pools for the warm prompts' history and every row's window: the timed state holds them.
    pages = vs_vllm.pool_pages(gs, rows, 2 * args.prompt, 4096 + rows, 2.0)
    plan = plan_with_pages(gs, limits, pages)
    rng = np.random.default_rng(0)
    system = rng.integers(1, 1000, args.system).tolist()

    def prompt():
        return system + rng.integers(1, 1000, args.prompt - args.system).tolist()

    state = create_state(plan, seed=0)
    warm = admit_at(plan)
    retire = jax.jit(
        lambda st, rb: ops.retire_reclaim_fn(plan, st, rb)[0],
        donate_argnums=0,
        compiler_options=COORDINATOR_COMPILER_OPTIONS,
    )
    release = jax.jit(
        lambda st, rb: ops.release_fn(plan, st, rb)[0],
        donate_argnums=0,
        compiler_options=COORDINATOR_COMPILER_OPTIONS,
    )
    for _ in range(args.warm):  # admit, publish the prefill, finish: blocks stay cached
        state, res = warm(state, packed([prompt()], rows, args.max_context))
        ok = res.status == Status.OK
        state = retire(state, RetireBatch(ok, res.slot, res.generation, res.count))
        mode = jnp.full_like(res.slot, int(ReleaseMode.FINISH))
        state = release(state, ReleaseBatch(ok, res.slot, res.generation, mode))
    timed = [prompt() for _ in range(4)]
    calls = {}
    for w in args.widths:
        fn = admit_at(plan).lower(state, packed(timed[:1], rows, w)).compile()
        calls[w] = [(fn, packed([p], rows, w)) for p in timed]
    us = {w: [] for w in args.widths}
    order = np.random.default_rng(1)
    for _ in range(args.repeats):
        for i_p in range(len(timed)):
            for i in order.permutation(len(args.widths)):
                w = args.widths[i]
                fn, arg = calls[w][i_p]
                fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
                t = time.perf_counter()
                _, res = jax.block_until_ready(fn(fresh, arg))
                us[w].append((time.perf_counter() - t) * 1e6)
                if int(res.status[0]) != Status.OK or int(res.hit[0]) < args.system // 2:
                    raise SystemExit(f"width {w}: status {int(res.status[0])}, hit {res.hit[0]}")
    print(
        f"{device}, {os.cpu_count()} CPUs, jax {jax.__version__}: V4-Flash, max_context "
        f"{args.max_context}, one {args.prompt}-token prompt ({args.system} shared) in {rows} "
        f"rows, {len(timed)} prompts x {args.repeats} calls, hit {int(res.hit[0])} tokens"
    )
    first = us[args.widths[0]]
    for w in args.widths:
        ratio = statistics.median(x / y for x, y in zip(us[w], first, strict=True))
        print(
            f"width {w:7d}: median {statistics.median(us[w]):9.0f} us/admission, min "
            f"{min(us[w]):9.0f}, x{ratio:.2f} of width {args.widths[0]}"
        )


if __name__ == "__main__":
    main()
