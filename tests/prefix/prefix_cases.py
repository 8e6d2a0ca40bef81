"""Shared helpers for the prefix-index tests: plans, a publisher, and a pure-Python matcher.

Long local run (more hypothesis examples): ``FLATKV_PREFIX_EXAMPLES=2000 pytest tests/prefix``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax import ServingLimits, plan_with_pages
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import keys as keys_lib
from flatkv_jax.recipes import deepseek_v4_groups, tiny_v4

_block_keys = jax.jit(keys_lib.block_keys, static_argnames="block_tokens")

#: The key seed of every index the prefix tests build (the coordinator draws a secret one).
SEED = 7
_insert = jax.jit(index_lib.insert)


def reach(g) -> int:
    """Tokens behind a hit boundary a window group still needs (independent of
    ``GroupSpec.hit_reach``): the window behind the first computed position, or, for a group
    with a period (hits land on its boundaries), only its carry."""
    return g.window - 1 if g.period is None else min(g.carry, g.window - 1)


def examples(n: int) -> int:
    """Hypothesis examples per test: ``n`` in CI, ``$FLATKV_PREFIX_EXAMPLES`` for long runs."""
    return int(os.environ.get("FLATKV_PREFIX_EXAMPLES", n))


def tiny_plan(pages: int = 400, max_context: int = 256):
    """The tiny V4 plan (verify 2): swa 4/8, mtp 4/8, c4_kv 16, c4 states 4/8, c16_kv 16, c16_state 4/20."""
    groups = deepseek_v4_groups(tiny_v4(), verify_width=2)
    return plan_with_pages(groups, ServingLimits(4, max_context, 32, 2), pages)


def publish(plan, indexes, tokens, length, namespace, blocks, next_page):
    """Publishes chosen blocks of one prompt. ``blocks[g]`` lists block indices of group g.

    Returns ``(indexes, pages, next_page)`` where ``pages[g][i]`` is the page given to block i.
    """
    # Fixed padded widths keep one compilation per group geometry across calls.
    tokens = np.asarray(tokens, np.int32)
    width = -(-max(len(tokens), 1) // 128) * 128
    padded = np.zeros((1, width), np.int32)
    padded[0, : len(tokens)] = tokens
    lengths = jnp.array([length], jnp.int32)
    out, pages = list(indexes), []
    for gi, g in enumerate(plan.groups):
        chosen = sorted(blocks.get(g.name, ()))
        got = {}
        if chosen:
            keys, valid = _block_keys(
                jnp.asarray(padded), lengths, namespace, seed=SEED, block_tokens=g.block_tokens
            )
            n = keys.shape[1]
            assert bool(np.all(np.asarray(valid)[0, chosen]))
            pg = np.zeros(n, np.int32)
            pg[chosen] = np.arange(next_page[gi], next_page[gi] + len(chosen))
            next_page[gi] += len(chosen)
            sel = np.zeros(n, bool)
            sel[chosen] = True
            out[gi], taken = _insert(out[gi], keys[0], jnp.asarray(pg), jnp.asarray(sel))
            assert np.asarray(taken).tolist() == sel.tolist()
            got = {i: int(pg[i]) for i in chosen}
        pages.append(got)
    return tuple(out), pages, next_page


def ref_match(plan, granularity, length, cached):
    """Pure-Python hit length. ``cached[g]`` is the set of block indices of group g that hit."""
    best = 0
    for b in range(granularity, length, granularity):  # b <= length - 1
        ok = True
        for gi, g in enumerate(plan.groups):
            bt = g.block_tokens
            if g.is_window:
                lo = max(0, (b - reach(g)) // bt)
                need = range(lo, b // bt)
            else:
                need = range(b // bt)
            ok = ok and all(i in cached[gi] for i in need)
        if ok:
            best = b
    return best


def ref_rows(plan, hit, pages, slots):
    """Expected table rows of a hit: pages for needed slots, 0 for holes, -1 beyond."""
    rows = []
    for gi, g in enumerate(plan.groups):
        bt = g.block_tokens
        row = np.full(slots[gi], -1, np.int32)
        n = hit // bt
        lo = max(0, (hit - reach(g)) // bt) if g.is_window else 0
        for i in range(n):
            row[i] = pages[gi][i] if i >= lo else 0
        rows.append(row)
    return rows
