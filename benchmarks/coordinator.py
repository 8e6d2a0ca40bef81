"""Cost of one jitted decode step of the coordinator on DeepSeek-V4-Flash groups.

One step = retire (previous step's verify result) + reclaim (one ``retire_reclaim``) + extend
(1 + verify_width tokens per request) + step metadata, composed from the ``*_fn`` operations
inside one ``jax.jit`` with the state donated — what a serving loop runs per step. Every
request in the batch is running; the pools hold either 16k or 1M pages per group (the goal:
the 1M / 16k time ratio stays <= 1.3, i.e. cost does not follow the pool size).

Run::

    python benchmarks/coordinator.py                 # B = 32, 128, 256, 512; 16k and 1M pages
    python benchmarks/coordinator.py --batch 256 --steps 400
    python benchmarks/coordinator.py --no-prefix     # create_state(prefix=False): no index

Prints a table of microseconds per step and per request-step (synchronous: each step is
waited for, so the jit dispatch is included). The pool-size configurations run interleaved in
rounds and the best round's median is reported, so a noisy shared machine affects both alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from _platform import add_platform_argument, use_platform

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator import (
    ExtendBatch,
    HandleBatch,
    RetireBatch,
    create_state,
    extend_fn,
    host,
    ops,
    retire_reclaim_fn,
    step_metadata_fn,
)
from flatkv_jax.recipes import deepseek_v4_groups, v4_flash
from flatkv_jax.status import Status

VERIFY = 1
MAX_CONTEXT = 65536
PROMPT = 384


def make_plan(batch: int, pages: int, max_context: int = MAX_CONTEXT):
    groups = deepseek_v4_groups(v4_flash(), verify_width=VERIFY)
    limits = ServingLimits(
        max_requests=batch, max_context=max_context, chunk_tokens=PROMPT, verify_width=VERIFY
    )
    return plan_with_pages(groups, limits, pages, name=f"v4-flash B={batch} pages={pages}")


def decode_step(plan, state, retire_b, handles_b, extend_b):
    """retire + reclaim (one ``retire_reclaim_fn``: one sweep) -> extend -> metadata, as one
    jitted function (state donated). ``handles_b`` is unused: retire_reclaim reclaims the rows
    it commits (every row here)."""
    del handles_b
    dec = plan.limits.decode_tokens
    state, r1 = retire_reclaim_fn(plan, state, retire_b, max_count=dec)
    state, r3 = extend_fn(plan, state, extend_b, max_count=dec)
    md = step_metadata_fn(plan, state, (r3,), max_count=dec)
    return state, (r1.status, r3.status, md)


def compile_step(plan):
    """The jitted step with the plan closed over: a static ``plan`` argument would be hashed
    and compared on every call (CachePlan does not cache its hash; ~0.2 ms per call on V4),
    compiled with the library's options for coordinator programs (no XLA:CPU thread split of
    small fusions: flatkv_jax.compile_options)."""
    return jax.jit(
        functools.partial(decode_step, plan),
        donate_argnums=0,
        compiler_options=COORDINATOR_COMPILER_OPTIONS,
    )


def setup(plan, prefix: bool = True):
    """Admits max_requests requests with a PROMPT-token prompt (in waves, reclaiming as it goes)
    and retires their prefill, so every slot is running decode. With ``prefix`` the prompts
    (distinct per request) and the decode tokens are passed, so every step publishes the
    blocks it completes (the prefix-reuse path); without, the state has no prefix index
    (``create_state(plan, prefix=False)``) and the step compiles without prefix code."""
    b = plan.limits.max_requests
    rng = np.random.default_rng(0)
    state = create_state(plan, prefix=prefix)
    # One admission call is one step: its first chunks must fit the step's token budget.
    wave = max(1, min(32, plan.limits.step_tokens // PROMPT))
    hs = []
    for lo in range(0, b, wave):
        k = min(wave, b - lo)
        toks = rng.integers(0, 1 << 20, (k, PROMPT)).tolist() if prefix else None
        state, res = ops.admit(
            plan, state, host.admit_batch(plan, [(PROMPT, PROMPT)] * k, size=wave, tokens=toks)
        )
        got = host.handles(res, k)
        assert all(h is not None for h in got), host.statuses(res, k)
        state, _ = ops.retire(
            plan, state, host.retire_batch(plan, [(h, PROMPT) for h in got], size=wave)
        )
        state, _ = ops.reclaim(plan, state, host.handle_batch(plan, got, size=wave))
        hs += got
    slot = jnp.asarray([h[0] for h in hs], jnp.int32)
    gen = jnp.asarray([h[1] for h in hs], jnp.int32)
    valid = jnp.ones((b,), jnp.bool_)
    dec = plan.limits.decode_tokens
    handles_b = HandleBatch(valid, slot, gen)
    step_tokens = jnp.asarray(rng.integers(0, 1 << 20, (b, dec)), jnp.int32) if prefix else None
    extend_b = ExtendBatch(valid, slot, gen, jnp.full((b,), dec, jnp.int32), step_tokens)
    # Step 0 has nothing to retire yet: extend once outside the timed loop.
    state, res = ops.extend(plan, state, extend_b, max_count=dec)
    assert (np.asarray(res.status) == Status.OK).all()
    retire_bs = [
        RetireBatch(valid, slot, gen, jnp.full((b,), a, jnp.int32)) for a in (dec, dec - 1)
    ]
    return state, handles_b, extend_b, retire_bs


class Runner:
    """One configuration: a plan, its running state and its compiled step."""

    def __init__(self, batch: int, pages: int, max_context: int, prefix: bool = True):
        self.plan = make_plan(batch, pages, max_context)
        self.state, self.handles_b, self.extend_b, self.retire_bs = setup(self.plan, prefix)
        self.step = compile_step(self.plan)
        self.i = 0
        self.run(5)  # compile and warm up

    def run(self, steps: int) -> list[float]:
        """Runs ``steps`` decode steps, waiting for each; returns their wall times in seconds."""
        times = []
        for _ in range(steps):
            # Alternate full acceptance and one rejected draft token (a rewind every other step).
            t0 = time.perf_counter()
            self.state, out = self.step(
                self.state, self.retire_bs[self.i % 2], self.handles_b, self.extend_b
            )
            jax.block_until_ready((self.state, out))
            times.append(time.perf_counter() - t0)
            self.i += 1
        assert (np.asarray(out[0]) == Status.OK).all() and (np.asarray(out[1]) == Status.OK).all()
        return times


def bench(
    batch: int,
    pages: list[int],
    steps: int,
    rounds: int,
    max_context: int = MAX_CONTEXT,
    prefix: bool = True,
) -> list[float]:
    """Per pool size, the best round's median step time (seconds). The configurations run
    interleaved, round by round, so they see the same machine noise."""
    runners = [Runner(batch, p, max_context, prefix) for p in pages]
    best = [float("inf")] * len(pages)
    for _ in range(rounds):
        for k, r in enumerate(runners):
            best[k] = min(best[k], float(np.median(r.run(steps // rounds))))
    return best


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, nargs="*", default=[32, 128, 256, 512])
    ap.add_argument("--pages", type=int, nargs="*", default=[16384, 1 << 20])
    ap.add_argument("--steps", type=int, default=300, help="timed steps per configuration")
    ap.add_argument("--max-context", type=int, default=MAX_CONTEXT, help="sets the table widths")
    ap.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="interleaved rounds; the best round's median is reported",
    )
    ap.add_argument(
        "--no-prefix",
        action="store_true",
        help="state without a prefix index (create_state(plan, prefix=False)), no tokens",
    )
    add_platform_argument(ap)
    args = ap.parse_args()
    device = use_platform(args.platform)
    print(
        f"jax {jax.__version__} on {device}, {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        f"V4-Flash groups, verify_width={VERIFY}, max_context={args.max_context}; best of {args.rounds} interleaved "
        f"rounds of the median of {args.steps // args.rounds} synchronous steps"
    )
    header = f"{'B':>5} " + " ".join(
        f"{'us/step ' + _k(p):>16} {'us/req-step':>12}" for p in args.pages
    )
    if len(args.pages) == 2:
        header += f" {'ratio':>6}"
    print(header)
    for b in args.batch:
        res = [
            t * 1e6
            for t in bench(
                b, args.pages, args.steps, args.rounds, args.max_context, not args.no_prefix
            )
        ]
        line = f"{b:>5} " + " ".join(f"{t:>16,.0f} {t / b:>12.2f}" for t in res)
        if len(res) == 2:
            line += f" {res[1] / res[0]:>6.2f}"
        print(line, flush=True)


def _k(p: int) -> str:
    return f"{p >> 20}M" if p >= 1 << 20 else f"{p >> 10}k"


if __name__ == "__main__":
    main()
