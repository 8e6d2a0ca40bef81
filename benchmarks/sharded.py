"""Weak scaling of the sharded decode step over 1, 2, 4, 8 data-parallel ranks.

Each rank runs the same single-rank step (``flatkv_jax.sharding.per_rank``): retire the
previous step (publishing its blocks to the prefix index), reclaim, extend every request by a
speculative decode step (``1 + verify`` tokens, token ids given, prefix on), build the step
metadata, zero recycled pages and write every token's rows with the reference write kernels.
The per-device batch is fixed (``--batch`` requests per rank), so with perfect scaling the
step time stays flat as ranks are added; the ratios to one rank are printed.

Window slots behind the window are reclaimed every step, as a serving loop does.

The script makes ``--devices`` virtual CPU devices (``XLA_FLAGS``) before importing JAX. On
CPU the virtual devices share the machine's cores, so this measures the overhead of the
sharded dispatch on a fixed core budget, not a speedup; on a multi-GPU/TPU host each rank has
its own chip (pass ``--platform gpu``/``tpu`` and the real devices are used).

Run::

    python benchmarks/sharded.py                 # ranks 1 2 4 8, batch 8 per rank
    python benchmarks/sharded.py --tiny          # smoke settings (seconds after compiling)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, default=8, help="requests per rank (fixed)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per rank count")
    p.add_argument("--verify", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--platform", default="cpu", help="cpu (virtual devices), gpu or tpu")
    p.add_argument("--tiny", action="store_true", help="smoke settings")
    return p.parse_args()


ARGS = _args()
if ARGS.tiny:
    ARGS.ranks, ARGS.batch, ARGS.steps, ARGS.prompt = [1, 2], 2, 3, 16
if ARGS.platform == "cpu":
    # Before JAX is imported: the host platform is split into virtual devices.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={max(ARGS.ranks)}".strip()
        )
os.environ.setdefault("JAX_PLATFORMS", ARGS.platform)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from flatkv_jax import ServingLimits, plan_with_pages  # noqa: E402
from flatkv_jax.coordinator import host, ops  # noqa: E402
from flatkv_jax.coordinator.metadata import step_metadata_fn  # noqa: E402
from flatkv_jax.recipes import hybrid_swa_groups  # noqa: E402
from flatkv_jax.sharding import (  # noqa: E402
    create_pools_sharded,
    create_state_sharded,
    per_rank,
    rank_mesh,
    rank_sharding,
)
from kernels_pallas import Impl, write_rows  # noqa: E402


def make_plan(batch: int, prompt: int, steps: int, verify: int):
    """A full + sliding-window hybrid (K and V rows of 2 heads x 64 float32), pages for
    ``batch`` requests of the whole run's length."""
    groups = hybrid_swa_groups("FS", 2, 64, 64, dtype="float32", rows_per_page=16)
    context = 1 << (prompt + (steps + 4) * (1 + verify) - 1).bit_length()
    limits = ServingLimits(
        max_requests=batch,
        max_context=context,
        chunk_tokens=prompt,
        verify_width=verify,
        step_tokens=batch * prompt,  # the admission step prefills every prompt at once
    )
    per_request = {"full_kv": context // 16 + 1, "swa_kv": 64 // 16 + 2}
    return plan_with_pages(groups, limits, {g: batch * n + 4 for g, n in per_request.items()})


def write_step(plan, pools, meta):
    t = meta.token_pos.shape[0]
    for gi in range(len(plan.groups)):
        pools = pools.zero_group(gi, meta.zero[gi])
        flat = list(pools.flat_group(gi))
        for k, arr in enumerate(flat):
            v = ((meta.token_pos + k) % 97).astype(arr.dtype).reshape(t, 1, 1)
            rows = jnp.broadcast_to(v, (t, *arr.shape[2:]))
            flat[k] = write_rows(arr, rows, meta.write_slot[gi], impl=Impl.REFERENCE)
        pools = pools.with_flat_group(gi, tuple(flat))
    return pools


def admit_step(plan, state, pools, admit):
    state, res = ops.admit_fn(plan, state, admit)
    return state, write_step(plan, pools, step_metadata_fn(plan, state, (res,))), res


def decode_step(plan, state, pools, retire, reclaim, extend):
    """One rank's decode step: retire the last step, drop window slots behind the window,
    extend by 1 + verify, write."""
    state, r_ret = ops.retire_fn(plan, state, retire)
    state, _ = ops.reclaim_fn(plan, state, reclaim)
    state, r_ext = ops.extend_fn(plan, state, extend)
    meta = step_metadata_fn(plan, state, (r_ext,))
    return state, write_step(plan, pools, meta), (r_ret.status, r_ext.status)


def stacked(batch, mesh):
    n = mesh.devices.size
    host_tree = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *x.shape)), batch)
    return jax.device_put(host_tree, rank_sharding(mesh))


def bench(n: int, plan, args) -> tuple[float, float]:
    """Median and min ms per decode step on ``n`` ranks."""
    mesh = rank_mesh(n)
    state = create_state_sharded(plan, mesh, seed=0)
    pools = create_pools_sharded(plan, mesh)
    b, p, d = args.batch, args.prompt, 1 + args.verify
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1, 1000, p)] for _ in range(b)]
    admit = host.admit_batch(plan, [(p, p)] * b, b, tokens=prompts)
    state, pools, res = per_rank(mesh, admit_step, static=(0,), donate=(1, 2))(
        plan, state, pools, stacked(admit, mesh)
    )
    assert (np.asarray(res.status) == 0).all(), np.asarray(res.status)
    handles = host.handles(jax.tree.map(lambda x: np.asarray(x)[0], res))
    step = per_rank(mesh, decode_step, static=(0,), donate=(1, 2))
    ext = stacked(host.extend_batch(plan, [(h, d) for h in handles], b, tokens=[[7] * d] * b), mesh)
    first = stacked(host.retire_batch(plan, [(h, p) for h in handles], b), mesh)
    again = stacked(host.retire_batch(plan, [(h, d) for h in handles], b), mesh)
    reclaim = stacked(host.handle_batch(plan, handles, b), mesh)
    times = []
    for i in range(args.steps + 2):  # two warm-up steps (the first compiles)
        t0 = time.perf_counter()
        state, pools, st = step(plan, state, pools, first if i == 0 else again, reclaim, ext)
        jax.block_until_ready(st)
        times.append(time.perf_counter() - t0)
    st = np.asarray(st[0]), np.asarray(st[1])
    assert (st[0] == 0).all() and (st[1] == 0).all(), st  # every row served on every rank
    assert step.cache_size() == 1
    t = np.array(times[2:]) * 1e3
    return float(np.median(t)), float(t.min())


def main() -> int:
    args = ARGS
    plan = make_plan(args.batch, args.prompt, args.steps, args.verify)
    devs = jax.devices()
    print(
        f"sharded decode step, weak scaling: {args.batch} requests per rank, decode "
        f"{1 + args.verify} tokens, prompt {args.prompt}, {args.steps} timed steps; "
        f"{len(devs)} {devs[0].platform} devices, {os.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"{'ranks':>5}  {'ms/step median':>14}  {'min':>8}  {'ratio to 1':>10}")
    base = None
    for n in args.ranks:
        med, low = bench(n, plan, args)
        base = med if base is None else base
        print(f"{n:>5}  {med:>14.2f}  {low:>8.2f}  {med / base:>10.2f}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
