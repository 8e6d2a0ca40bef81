"""The additive block keys this library used before keys had a secret seed, and a collision
crafted against them.

Old scheme (public seeds derived from the namespace only): the 128-bit lanes of a prefix were
the lane-wise sums (mod 2**32) of per-token terms ``fmix(fmix(fmix(t*C + a) ^ s_l) ^ (k*D +
c_l))``. Everything in it is public, and a sum of public per-position values is the setting of
Wagner's generalised birthday algorithm: with ``2**7`` positions and ``2**16`` candidate tokens
per position, a tree of merges cancels 16 bits per level and finds two different prompts of
128 tokens with equal keys in seconds (instead of ``2**64`` for a birthday search).
:func:`craft_collision` does exactly that; the tests check that the crafted pair collides
under :func:`old_lanes` and not under the seeded chain.
"""

from __future__ import annotations

import numpy as np

_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_TOKEN_MUL, _POS_MUL, _NS_SEED = np.uint32(0x9E3779B1), np.uint32(0x632BE5AB), np.uint32(0x27D4EB2F)
_LANE_SEEDS = np.array([0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09], np.uint32)
_POS_SEEDS = np.array([0x68E31DA4, 0xB5297A4D, 0x1B56C4E9, 0x7FEB352D], np.uint32)

LEVELS = 7  # 2**7 positions: 7 merges cancel 6 x 16 bits, the last one 32
POSITIONS = 1 << LEVELS
BITS = 16


def _fmix(x):
    x = x ^ (x >> np.uint32(16))
    x = x * _M1
    x = x ^ (x >> np.uint32(13))
    x = x * _M2
    return x ^ (x >> np.uint32(16))


def old_terms(tokens: np.ndarray, position: int, ns: tuple[int, int] = (0, 0)) -> np.ndarray:
    """uint32[N, 4]: the old scheme's terms of ``tokens`` at ``position``."""
    with np.errstate(over="ignore"):
        n0, n1 = np.uint32(ns[0]), np.uint32(ns[1])
        base = _fmix(n0 ^ _fmix(n1 + _NS_SEED))
        lane = _fmix(base ^ _LANE_SEEDS)
        pos = _fmix(base + _POS_SEEDS)
        inner = _fmix(tokens.astype(np.uint32) * _TOKEN_MUL + base)
        tag = np.uint32(position) * _POS_MUL + pos
        return _fmix(_fmix(inner[:, None] ^ lane[None, :]) ^ tag[None, :])


def old_lanes(prompt: np.ndarray, ns: tuple[int, int] = (0, 0)) -> np.ndarray:
    """uint32[4]: the old scheme's lanes of the whole ``prompt``."""
    total = np.zeros(4, np.uint64)
    for k, t in enumerate(prompt):
        total += old_terms(np.array([t]), k, ns)[0]
    return (total % (1 << 32)).astype(np.uint32)


def _field(sums: np.ndarray, level: int) -> np.ndarray:
    lane, shift = divmod(level * BITS, 32)
    return (sums[:, lane] >> np.uint32(shift)) & np.uint32((1 << BITS) - 1)


def _merge(left, right, level: int, cap: int, final: bool):
    """Pairs (x, y) with x + y == 0 on the level's field (the final level: on the rest)."""
    (ls, lt), (rs, rt) = left, right
    if final:  # the last lane, whole
        kl, kr = ls[:, 3], (-rs[:, 3].astype(np.int64)) % (1 << 32)
    else:
        kl = _field(ls, level).astype(np.int64)
        kr = (-_field(rs, level).astype(np.int64)) % (1 << BITS)
    order = np.argsort(kr, kind="stable")
    kr_s = kr[order]
    lo = np.searchsorted(kr_s, kl, "left")
    hi = np.searchsorted(kr_s, kl, "right")
    cnt = hi - lo
    li = np.repeat(np.arange(len(kl)), cnt)[:cap]
    starts = np.repeat(lo - np.concatenate([[0], np.cumsum(cnt)[:-1]]), cnt)[:cap]
    ri = order[starts + np.arange(len(li))]
    sums = (ls[li].astype(np.uint64) + rs[ri]) % (1 << 32)
    return sums.astype(np.uint32), np.concatenate([lt[li], rt[ri]], axis=1)


def craft_collision(list_size: int = 1 << 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two different 128-token prompts with equal old-scheme keys (namespace 0).

    Position ``k`` of the second prompt is a baseline token; list ``k`` holds the term
    differences of ``list_size`` other tokens against it, so a zero-sum choice across the
    lists is a prompt that collides with the baseline.
    """
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1 << 30, POSITIONS).astype(np.int64)
    lists = []
    for k in range(POSITIONS):
        cand = rng.choice(1 << 30, list_size, replace=False).astype(np.int64)
        cand = cand[cand != base[k]]
        d = (
            old_terms(cand, k).astype(np.int64) - old_terms(base[k : k + 1], k).astype(np.int64)
        ) % (1 << 32)
        lists.append((d.astype(np.uint32), cand[:, None]))
    for level in range(LEVELS):
        final = level == LEVELS - 1
        lists = [
            _merge(lists[i], lists[i + 1], level, 2 * list_size, final)
            for i in range(0, len(lists), 2)
        ]
    sums, tokens = lists[0]
    if not len(sums):
        raise RuntimeError("no collision found: raise list_size or change seed")
    assert not sums[0].any()
    return tokens[0].astype(np.int32), base.astype(np.int32)
