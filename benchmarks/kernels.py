"""Benchmark of the page kernels: cost must follow the rows written, not the pool size.

Runs write_rows (256 and 4096 rows) and zero_pages (64 pages) on donated pools of ~18 MB,
~146 MB and ~584 MB (uint8 rows of 584 bytes, 64 rows per page) and prints, per operation, the
median and best time over several reps after warm-up, plus the ratio largest/smallest pool
(goal <= 1.3). With --page-runs it also times the XLA page-run form of a prefill write (64 whole
pages written as page blocks) against the same 4096 rows written as a row scatter.

    python benchmarks/kernels.py                       # reference and pallas_tpu (interpret)
    python benchmarks/kernels.py --impl reference --quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _platform import add_platform_argument, use_platform

from kernels_pallas import Impl, write_rows, zero_pages

ROW_BYTES = 584
ROWS_PER_PAGE = 64
PAGE_BYTES = ROW_BYTES * ROWS_PER_PAGE
POOL_MB = (18, 146, 584)


def _pages_for(mb: int) -> int:
    return round(mb * 1e6 / PAGE_BYTES)


def _time(fn, pool, args, *, warmup: int, reps: int):
    """Times ``pool = fn(pool, *args)`` with the pool donated; returns (pool, median, best) ms."""
    for _ in range(warmup):
        pool = fn(pool, *args)
    jax.block_until_ready(pool)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pool = fn(pool, *args)
        jax.block_until_ready(pool)
        times.append((time.perf_counter() - t0) * 1e3)
    return pool, statistics.median(times), min(times)


def _impl_kwargs(name: str) -> dict:
    if name == "reference":
        return dict(impl=Impl.REFERENCE)
    if name == "pallas_tpu":
        # No TPU here: CPU interpret mode (the kernel discharged into XLA ops).
        return dict(impl=Impl.PALLAS_TPU, interpret=jax.default_backend() != "tpu")
    raise ValueError(name)


def _ops(kw: dict):
    def write(pool, rows, slots):
        return write_rows(pool, rows, slots, **kw)

    def zero(pool, ids):
        (pool,) = zero_pages((pool,), ids, **kw)
        return pool

    return jax.jit(write, donate_argnums=0), jax.jit(zero, donate_argnums=0)


def _page_run_write(pool, rows, page_ids):
    """XLA page-run form: whole pages [K, R, row] written as page blocks, -1 pages dropped."""
    k = page_ids.shape[0]
    num_pages = pool.shape[0]
    valid = (page_ids >= 0) & (page_ids < num_pages)
    ids = jnp.where(valid, page_ids, num_pages + jnp.arange(k, dtype=jnp.int32))
    blocks = rows.reshape(k, pool.shape[1], *pool.shape[2:])
    return pool.at[ids].set(blocks, mode="drop", unique_indices=True)


def run(impls: list[str], *, quick: bool, page_runs: bool, device: str) -> None:
    warmup, reps = (1, 3) if quick else (3, 25)
    rng = np.random.default_rng(0)
    ops = [("write 256 rows", 256), ("write 4096 rows", 4096), ("zero 64 pages", 64)]
    if page_runs:
        ops += [("4096 rows as 64 page runs", 4096)]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    page_run_fn = jax.jit(_page_run_write, donate_argnums=0)
    for mb in POOL_MB:
        num_pages = _pages_for(mb)
        real_pages = np.arange(1, num_pages - 1)
        pool = jnp.zeros((num_pages, ROWS_PER_PAGE, ROW_BYTES), jnp.uint8)
        for impl in impls:
            write, zero = _ops(_impl_kwargs(impl))
            for op, n in ops:
                if op.startswith("zero"):
                    ids = jnp.asarray(rng.choice(real_pages, n, replace=False), jnp.int32)
                    pool, med, best = _time(zero, pool, (ids,), warmup=warmup, reps=reps)
                elif "page runs" in op:
                    if impl != "reference":
                        continue
                    k = n // ROWS_PER_PAGE
                    ids = jnp.asarray(rng.choice(real_pages, k, replace=False), jnp.int32)
                    rows = jnp.asarray(rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8))
                    pool, med, best = _time(
                        page_run_fn, pool, (rows, ids), warmup=warmup, reps=reps
                    )
                else:
                    # Distinct random slots on the real pages (not the null / scratch page).
                    real_slots = (num_pages - 2) * ROWS_PER_PAGE
                    slots = rng.choice(real_slots, n, replace=False) + ROWS_PER_PAGE
                    if "4096" in op and page_runs:
                        # Same volume as the page-run form: 64 whole pages, row by row.
                        pages = rng.choice(real_pages, n // ROWS_PER_PAGE, replace=False)
                        slots = (pages[:, None] * ROWS_PER_PAGE + np.arange(ROWS_PER_PAGE)).ravel()
                    rows = jnp.asarray(rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8))
                    slots = jnp.asarray(slots, jnp.int32)
                    pool, med, best = _time(write, pool, (rows, slots), warmup=warmup, reps=reps)
                results.setdefault((impl, op), []).append((med, best))
        del pool

    sizes = [f"{_pages_for(mb) * PAGE_BYTES / 1e6:.0f} MB" for mb in POOL_MB]
    print(
        f"\njax {jax.__version__} on {device}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"rows {ROW_BYTES} B uint8, {ROWS_PER_PAGE} rows/page; pool donated; "
        f"{warmup} warm-up + {reps} reps; median (best) ms\n"
    )
    header = "| impl | op | " + " | ".join(sizes) + " | ratio largest/smallest: median (best) |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for (impl, op), vals in results.items():
        cells = " | ".join(f"{m:.3f} ({b:.3f})" for m, b in vals)
        ratio = vals[-1][0] / vals[0][0]
        best_ratio = vals[-1][1] / vals[0][1]
        flag = "" if min(ratio, best_ratio) <= 1.3 else " **> 1.3**"
        shown = "pallas_tpu (interpret=True)" if impl == "pallas_tpu" else impl
        print(f"| {shown} | {op} | {cells} | {ratio:.2f} ({best_ratio:.2f}){flag} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--impl",
        choices=["reference", "pallas_tpu", "all"],
        default="all",
        help="implementation(s) to time; pallas_tpu runs in interpret mode off TPU",
    )
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 3 reps")
    parser.add_argument(
        "--page-runs",
        action="store_true",
        help="also time the XLA page-run form of a 4096-row prefill write (64 whole pages)",
    )
    add_platform_argument(parser)
    args = parser.parse_args()
    device = use_platform(args.platform)
    impls = ["reference", "pallas_tpu"] if args.impl == "all" else [args.impl]
    run(impls, quick=args.quick, page_runs=args.page_runs, device=device)


if __name__ == "__main__":
    main()
