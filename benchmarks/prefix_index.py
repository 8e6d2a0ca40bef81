"""Micro-benchmark: prefix lookup + match for a batch of prompts on V4-Flash geometry.

Builds V4-Flash groups (verify width 2), publishes every block of the first ``--cached`` tokens
of ``--batch`` distinct prompts in every group's index, then times (medians, µs):

- ``hash``: keyed chain lanes of the whole batch (``chain_lanes``),
- ``match``: hashing + every group's lookups + the common-hit rule (``match_prompts``),
- ``insert``: publishing one step's blocks (one new block per prompt per group),
- ``evict``: popping ``--evict`` cached-only pages from one pool's LRU.

Usage: ``python benchmarks/prefix_index.py [--batch 256] [--tokens 4096] [--cached 3072]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.prefix import index as I
from flatkv_jax.prefix import keys as K
from flatkv_jax.prefix import lru as L
from flatkv_jax.prefix.match import MatchLayout, match_prompts
from flatkv_jax.recipes import deepseek_v4_groups, v4_flash


def _time(f, *args, reps: int) -> float:
    jax.block_until_ready(f(*args))  # compile + warm up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--cached", type=int, default=3072)
    ap.add_argument("--evict", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    b, n, cached = args.batch, args.tokens, args.cached

    groups = deepseek_v4_groups(v4_flash(), verify_width=2)
    pages = {g.name: b * (cached // g.block_tokens) + 2 * b + 64 for g in groups}
    plan = plan_with_pages(groups, ServingLimits(b, n, 512, 2), pages, name="v4-flash bench")
    layout = MatchLayout.for_plan(plan, n)
    print(
        f"plan: {[f'{g.name}:B={g.block_tokens}' + (f',W={g.window}' if g.is_window else '') for g in groups]}"
    )
    print(
        f"granularity {layout.granularity}, hash unit {layout.unit}, candidates {layout.candidates}"
    )
    lookups = 0
    for gm in layout.groups:
        lookups += gm.slots if not gm.is_window else min(layout.candidates * gm.need, gm.slots)
    print(f"lookups per prompt: {lookups}; batch {b} x {n} tokens")

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 129_280, (b, n)).astype(np.int32))
    lengths = jnp.full((b,), n, jnp.int32)
    ns = jnp.asarray(K.namespace_words(0))
    insert = jax.jit(I.insert)
    seed = jnp.asarray(K.new_seed())  # as create_state draws it
    block_keys = jax.jit(K.block_keys, static_argnames="block_tokens")
    indexes, published = [], []
    for g in groups:
        keys, valid = block_keys(
            tokens, jnp.full((b,), cached, jnp.int32), ns, seed=seed, block_tokens=g.block_tokens
        )
        flat_valid = np.asarray(valid).reshape(-1)
        pg = np.where(flat_valid, np.cumsum(flat_valid), 0).astype(np.int32)  # distinct pages 1..
        idx = I.create_index(plan.pages(g))
        idx, taken = insert(idx, keys.reshape(-1, K.KEY_WORDS), jnp.asarray(pg), valid.reshape(-1))
        assert int(jnp.sum(taken)) == int(jnp.sum(valid)), g.name
        indexes.append(idx)
        published.append(np.asarray(keys).reshape(-1, K.KEY_WORDS)[flat_valid])  # row p-1 = page p
    indexes = tuple(indexes)

    chain = jax.jit(K.chain_lanes, static_argnames="unit")
    match = jax.jit(match_prompts, static_argnums=0)
    m = match(layout, indexes, tokens, lengths, ns, seed=seed)
    hits = np.asarray(m.hit)
    print(
        f"hit tokens: min {hits.min()} max {hits.max()} (expected {cached - cached % layout.granularity})"
    )
    t_hash = _time(
        lambda t: chain(t, lengths, ns, seed=seed, unit=layout.unit).lanes, tokens, reps=args.reps
    )
    t_match = _time(
        lambda i, t: match(layout, i, t, lengths, ns, seed=seed), indexes, tokens, reps=args.reps
    )
    print(f"hash  (chain_lanes, {b}x{n}):        {t_hash:10.0f} us")
    print(
        f"match (hash + lookups + rule):       {t_match:10.0f} us   ({t_match / b:.1f} us per prompt)"
    )
    print(f"lookup + match without hashing:      {t_match - t_hash:10.0f} us")

    # Publish one new block per prompt into the full c4_state index (the widest), donated as
    # the coordinator's step donates its state: the update is in place, O(keys inserted).
    gi = plan.group_index("c4_state")
    keys, _ = block_keys(tokens, lengths, ns, seed=seed, block_tokens=4)
    new_keys = keys[:, cached // 4 + 1]
    insert_d = jax.jit(I.insert, donate_argnums=0)
    remove_d = jax.jit(I.remove, donate_argnums=0)
    idx = indexes[gi]
    new_pages = jnp.arange(b, dtype=jnp.int32) + int(idx.count) + 1
    ts = []
    for _ in range(args.reps + 1):
        t = time.perf_counter()
        idx, taken = insert_d(idx, new_keys, new_pages, None)
        jax.block_until_ready(taken)
        ts.append(time.perf_counter() - t)
        assert bool(jnp.all(taken))
        idx, _ = remove_d(idx, new_pages, None)
    print(
        f"insert ({b} keys into {idx.capacity} entries, donated): {statistics.median(ts[1:]) * 1e6:8.0f} us"
    )

    evict_d = jax.jit(L.evict, static_argnames="max_pages", donate_argnums=(0, 1))
    release_d = jax.jit(L.cache, donate_argnums=0)
    lru = L.create_lru(plan.pages(groups[gi]))
    ts = []
    for _ in range(args.reps + 1):
        lru = release_d(lru, jnp.arange(1, 2 * args.evict + 1, dtype=jnp.int32), None)
        jax.block_until_ready(lru)
        t = time.perf_counter()
        lru, idx, out, got = evict_d(lru, idx, jnp.int32(args.evict), max_pages=args.evict)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
        # Put the evicted pages' entries back for the next round (same keys, same pages).
        assert int(got) == args.evict
        idx, back = insert_d(idx, jnp.asarray(published[gi][np.asarray(out) - 1]), out, None)
        assert bool(jnp.all(back))
    print(f"evict ({args.evict} pages, donated):        {statistics.median(ts[1:]) * 1e6:8.0f} us")


if __name__ == "__main__":
    main()
