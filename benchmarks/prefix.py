"""Prefix reuse benchmark: hit rate on a multi-turn agentic trace, and the cost of admission.

1. Hit rate. A built-in agentic workload — tenants (namespaces) with a shared system prompt,
   agents that run several turns (each turn's prompt is the previous turn's committed tokens
   plus a tool result), chunked prefill, speculative decode steps with random acceptance,
   reclaim every step, FINISH at the end of a turn — is driven through the radix oracle and,
   when the device coordinator has the prefix index (issue 5), through the device too; the hit
   lengths of every admission must be equal.
2. Admission cost at B = 256: one batched admit of 256 new requests (first chunk allocated in
   every group) on the device coordinator, median over reps, and the oracle's host time for
   the same batch.

    python benchmarks/prefix.py            # both parts
    python benchmarks/prefix.py --quick    # fewer agents and reps
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _platform import add_platform_argument, use_platform

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.oracle import RadixOracle, ReleaseMode, admit_batch, extend_batch, handle_batch
from flatkv_jax.recipes import deepseek_v4_groups, tiny_v4
from flatkv_jax.status import Status

GROUPS = deepseek_v4_groups(tiny_v4(head_dim=16, rope_dim=4, index_head_dim=8), verify_width=2)


def agentic_plan(max_requests: int = 16):
    limits = ServingLimits(
        max_requests=max_requests, max_context=2048, chunk_tokens=64, verify_width=2
    )
    return plan_with_pages(GROUPS, limits, 4096)


def run_agents(backend, *, agents: int, turns: int, seed: int = 0) -> tuple[list[int], int]:
    """Drives ``backend`` through the agentic workload; returns every admission's hit and
    the prompt tokens admitted."""
    plan = backend.plan
    rng = np.random.default_rng(seed)
    b, chunk, dec = plan.limits.max_requests, plan.limits.chunk_tokens, plan.limits.decode_tokens
    systems = [list(rng.integers(0, 50_000, 300)) for _ in range(4)]
    waiting = [
        (
            i % 4,
            systems[i % 4] + list(rng.integers(0, 50_000, 40)),
            turns,
            int(rng.integers(16, 48)),
        )
        for i in range(agents)
    ]
    running = {}  # slot -> [handle, ns, prompt, turns_left, gen_left, tokens]
    hits, prompt_tokens = [], 0
    backend.reset()
    while waiting or running:
        free = b - len(running)
        if waiting and free:
            batch, waiting = waiting[:free], waiting[free:]
            res = backend.admit(
                admit_batch(plan, [(ns, p, min(chunk, len(p))) for ns, p, _, _ in batch])
            )
            for (ns, p, t, g), st, s, gen, h in zip(
                batch, res.status, res.slot, res.generation, res.hit, strict=False
            ):
                if st == Status.OK:
                    hits.append(int(h))
                    prompt_tokens += len(p)
                    running[int(s)] = [
                        (int(s), int(gen)),
                        ns,
                        p,
                        t,
                        g,
                        list(p[: int(h) + min(chunk, len(p) - int(h))]),
                    ]
                else:
                    waiting.append((ns, p, t, g))
            # The first chunks are in flight: retire them (prefill is always accepted).
            counts = backend.counts()
            rows = [
                (r[0], int(counts.extent[r[0][0]] - counts.committed[r[0][0]]))
                for r in running.values()
                if counts.in_flight[r[0][0]]
            ]
            if rows:
                backend.retire(handle_batch(plan, rows))
        counts = backend.counts()
        ext, accepted = [], []
        for s, r in running.items():
            n = int(counts.extent[s])
            if n < len(r[2]):
                toks = r[2][n : n + chunk]
                ext.append((r[0], toks))
                accepted.append(len(toks))
            else:
                toks = list(rng.integers(0, 50_000, dec))
                ext.append((r[0], toks))
                accepted.append(int(rng.integers(1, dec + 1)))
        res = backend.extend(extend_batch(plan, ext))
        for (h, toks), st in zip(ext, res.status, strict=False):
            if st == Status.OK:
                running[h[0]][5] += [int(x) for x in toks]
        backend.retire(
            handle_batch(
                plan,
                [
                    (h, a)
                    for (h, _), a, st in zip(ext, accepted, res.status, strict=False)
                    if st == Status.OK
                ],
            )
        )
        backend.reclaim(handle_batch(plan, [r[0] for r in running.values()]))
        counts = backend.counts()
        for s, r in running.items():  # rejected drafts are gone: keep tokens [0, n)
            del r[5][int(counts.extent[s]) :]
        done = []
        for s, r in running.items():
            if (
                counts.committed[s] >= len(r[2]) + r[4]
                or counts.extent[s] >= plan.limits.max_context - 2 * chunk
            ):
                done.append(s)
        if done:
            # Each agent's next turn: its committed tokens so far + a tool result.
            for s in done:
                r = running[s]
                c = int(counts.committed[s])
                if r[3] > 1:
                    toks = r[5][:c]
                    waiting.append(
                        (
                            r[1],
                            toks + list(rng.integers(0, 50_000, 40)),
                            r[3] - 1,
                            int(rng.integers(16, 48)),
                        )
                    )
            backend.release(
                handle_batch(plan, [(running[s][0], int(ReleaseMode.FINISH)) for s in done])
            )
            for s in done:
                del running[s]
    return hits, prompt_tokens


def admission_cost(reps: int) -> dict:
    out = {}
    plan = plan_with_pages(
        GROUPS,
        ServingLimits(max_requests=256, max_context=2048, chunk_tokens=64, verify_width=2),
        64 * 256,
    )
    rng = np.random.default_rng(1)
    rows = [(i % 4, list(rng.integers(0, 50_000, 200)), 64) for i in range(256)]
    batch = admit_batch(plan, rows)
    o = RadixOracle(plan)
    t = []
    for _ in range(reps):
        o.reset()
        t0 = time.perf_counter()
        o.admit(batch)
        t.append((time.perf_counter() - t0) * 1e3)
    out["oracle admit B=256 (ms)"] = statistics.median(t)
    try:
        from flatkv_jax import coordinator as coord
        from flatkv_jax.oracle.device_adapter import DeviceBackend
    except ImportError:
        return out
    dev = DeviceBackend(plan)

    def timed(start) -> float:
        t = []
        for _ in range(reps + 2):
            dev.state = jax.tree_util.tree_map(jnp.copy, start)
            jax.block_until_ready(dev.state)
            t0 = time.perf_counter()
            res = dev.admit(batch)
            t.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(t[2:]), res

    empty = coord.create_state(plan)
    label = "with matching" if dev.prefix_reuse else "no matching yet"
    ms, _ = timed(empty)
    out[f"device admit B=256 ({label}, empty index, incl. zeroing, ms)"] = ms
    if dev.prefix_reuse:
        # Warm index: the same 256 prompts ran their first chunk and finished, so every row
        # matches 64 tokens (4 blocks of 16 in 7 groups) and pins/increfs the shared pages.
        dev.state = jax.tree_util.tree_map(jnp.copy, empty)
        res = dev.admit(batch)
        handles = [(int(s), int(g)) for s, g in zip(res.slot, res.generation, strict=True)]
        dev.retire(handle_batch(plan, [(h, 64) for h in handles]))
        dev.release(handle_batch(plan, [(h, int(ReleaseMode.FINISH)) for h in handles]))
        warm = jax.tree_util.tree_map(jnp.copy, dev.state)
        ms, res = timed(warm)
        o.reset()
        o.admit(batch)
        o.retire(handle_batch(plan, [(h, 64) for h in handles]))
        o.release(handle_batch(plan, [(h, int(ReleaseMode.FINISH)) for h in handles]))
        ores = o.admit(batch)
        out[
            f"device admit B=256 (with matching, warm index: hits {int(res.hit.sum())}, "
            f"oracle hits {int(ores.hit.sum())}, incl. zeroing, ms)"
        ] = ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    add_platform_argument(ap)
    args = ap.parse_args()
    device = use_platform(args.platform)
    agents, turns, reps = (16, 3, 3) if args.quick else (64, 4, 10)
    plan = agentic_plan()
    t0 = time.perf_counter()
    hits, prompt = run_agents(RadixOracle(plan), agents=agents, turns=turns)
    dt = time.perf_counter() - t0
    print(f"jax {jax.__version__} on {device}")
    print(
        f"agentic trace: {agents} agents x {turns} turns, {len(hits)} admissions, oracle {dt:.1f} s"
    )
    print(f"  oracle: hit rate {sum(hits) / prompt:.3f} ({sum(hits)} of {prompt} prompt tokens)")
    try:
        from flatkv_jax.oracle.device_adapter import DeviceBackend

        dev = DeviceBackend(plan)
        if dev.prefix_reuse:
            dev_hits, _ = run_agents(dev, agents=agents, turns=turns)
            print(
                f"  device: hit rate {sum(dev_hits) / prompt:.3f}; every hit equal to the oracle's: {dev_hits == hits}"
            )
        else:
            print("  device: prefix index not integrated yet (no hits to compare)")
    except ImportError:
        print("  device: coordinator not available")
    for k, v in admission_cost(reps).items():
        print(f"{k}: {v:.2f}")


if __name__ == "__main__":
    main()
