"""Serving engine throughput on the tiny model: host time vs device time per step, tokens/s.

For each batch size ``B`` (= ``max_requests``) the engine serves ``2 * B`` requests with random
prompts twice after a warm-up run that compiles its step kinds:

- **sync** (``overlap=False``): every step is waited for, so a step's wall time is host work
  plus device time; device time per step = wall - host.
- **overlap** (``overlap=True``): step N+1 is dispatched before step N's results are read;
  the tokens/s of this run is the engine's throughput.

Run::

    python benchmarks/serving.py                      # B = 8, 32, 128
    python benchmarks/serving.py --batch 8 --new 16   # one batch size, shorter decode
    python benchmarks/serving.py --tiny               # smoke settings (seconds)

Prints one row per B (and per ``--prefill-rows`` value: ``EngineOptions.prefill_rows``, the
rows of a mixed step's wide call; ``--prefill-rows 16 128`` at ``--batch 128`` compares split
mixed steps with unsplit ones side by side): steps, steps run as the decode-only (narrow) step
kind, host ms/step, device ms/step (sync), tokens/s (sync, overlap: prompt + generated tokens
per second), draft acceptance and retractions. ``--max-context`` sizes the plan for longer
contexts than the requests hold (default: prompt + new), and ``--admit-widths`` adds a row per
``EngineOptions.admit_widths`` value (``none`` for the engine's default, ``512`` or
``512,2048``): a plan of long contexts serving short prompts, with and without widths.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time

import jax
import numpy as np
from _platform import add_platform_argument, use_platform

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.model import DeepSeekV4, init_params, tiny_model
from flatkv_jax.recipes.deepseek_v4 import deepseek_v4_groups
from flatkv_jax.serving import Engine, EngineOptions


def make_plan(cfg, batch: int, context: int, chunk: int, verify: int):
    limits = ServingLimits(
        max_requests=batch, max_context=context, chunk_tokens=chunk, verify_width=verify
    )
    groups = deepseek_v4_groups(cfg.cache, verify_width=verify)
    probe = plan_with_pages(groups, limits, 1 << 14)  # only its geometry is used
    # Every request can hold its whole context at once: no preemption in the measurement.
    pages = max(probe.min_usable_pages(g) for g in probe.groups) * batch + 8
    return plan_with_pages(groups, limits, pages)


def serve(model, plan, options, requests):
    engine = Engine(model, plan, options)
    for prompt, new in requests:
        engine.submit(prompt, new)
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    return engine, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[8, 32, 128])
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--no-prefix", action="store_true")
    ap.add_argument("--max-context", type=int, default=None, help="plan max_context")
    ap.add_argument(
        "--admit-widths",
        nargs="*",
        default=["none"],
        help="EngineOptions.admit_widths values, one row each: none, or comma-separated ints",
    )
    ap.add_argument(
        "--prefill-rows",
        type=int,
        nargs="*",
        default=[None],
        help="EngineOptions.prefill_rows values, one row each (default: the engine's)",
    )
    ap.add_argument("--tiny", action="store_true", help="smoke settings: B=4, short requests")
    add_platform_argument(ap)
    args = ap.parse_args()
    backend = use_platform(args.platform)
    if args.tiny:
        args.batch, args.prompt, args.new, args.chunk = [4], 10, 6, 12
    cfg = tiny_model()
    verify = 0 if args.no_mtp else 2
    model = DeepSeekV4.from_params(cfg, init_params(cfg, 0))
    print(f"# jax {jax.__version__} on {platform.machine()} ({backend}), tiny model")
    print(f"# prompt {args.prompt}, new {args.new}, chunk {args.chunk}, verify {verify}, "
          f"prefix cache {not args.no_prefix}")  # fmt: skip
    print(
        "| B | prefill rows | admit widths | steps | narrow | host ms/step | device ms/step "
        "| tok/s sync | tok/s overlap | accept | retracted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for b in args.batch:
        plan = make_plan(cfg, b, args.max_context or args.prompt + args.new, args.chunk, verify)
        requests = [
            (rng.integers(0, cfg.vocab, args.prompt).tolist(), args.new) for _ in range(2 * b)
        ]
        for rows, widths in itertools.product(args.prefill_rows, args.admit_widths):
            # Older trees (timed from a worktree) have neither option: leave them out.
            extra = {} if rows is None else {"prefill_rows": rows}
            if widths != "none":
                extra["admit_widths"] = tuple(int(w) for w in widths.split(","))
            opts = dict(mtp=verify > 0, prefix_cache=not args.no_prefix, **extra)
            serve(model, plan, EngineOptions(overlap=False, **opts), requests[:b])  # warm-up
            sync, sync_wall = serve(model, plan, EngineOptions(overlap=False, **opts), requests)
            over, over_wall = serve(model, plan, EngineOptions(overlap=True, **opts), requests)
            tokens = sum(len(p) + n for p, n in requests)
            st = sync.stats
            host = st.host_s / st.steps
            device = max(0.0, st.wall_s - st.host_s) / st.steps
            assert over.stats.compilations_after_warmup == 0
            # getattr: the script also times older trees from a worktree (PYTHONPATH), whose
            # engines have no narrow_steps / prefill_rows (docs/benchmarks.md compares them).
            print(
                f"| {b} | {getattr(sync, 'prefill_rows', '-')} | {widths} | {st.steps} | "
                f"{getattr(st, 'narrow_steps', 0)} | {host * 1e3:.2f} | {device * 1e3:.2f} | "
                f"{tokens / sync_wall:.0f} | {tokens / over_wall:.0f} | "
                f"{over.stats.accept_rate:.2f} | {over.stats.retractions} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
