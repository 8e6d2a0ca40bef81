"""The capacity planner: size every pool from an HBM budget, or from explicit page counts.

Window (and compressor-state) groups grow with concurrency: each running request holds
``live_blocks(1 + verify_width)`` pages in steady decode, one request in chunked prefill holds
``live_blocks(chunk_tokens)``, and ``cached_window_requests`` more requests' worth is kept so
prefix hits can find a window group's trailing run after its owner finished. History groups
grow with tokens: the planner finds the largest token count ``T`` such that every history
group holds ``ceil(T / block_tokens) + max_requests`` pages (one partial block per request)
and everything — pools, null and scratch pages, and the int32 tables — fits the budget.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction

from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail, is_int
from flatkv_jax.groups import GroupSpec
from flatkv_jax.plan import RESERVED_PAGES, CachePlan, ServingLimits

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str | int, what: str = "size") -> int:
    """Parses ``"80GiB"``, ``"80k"``, ``"1.5GB"`` or ``4096`` into an int (bytes or tokens).

    An int (Python or NumPy) is returned as is. A string is a decimal number with an optional
    unit; the result must be a whole number (``"1.5k"`` is 1500, ``"1.5"`` is refused, never
    truncated), computed exactly (no float rounding).

    Raises:
      ValueError: not a number with a known unit, or not a whole number.
      TypeError: a bool or a float (write the size as a string or an int).
    """
    if is_int(text):
        return int(text)
    if not isinstance(text, str):
        fail(
            what,
            text,
            "a size is an int or a string such as '80GiB'",
            "pass an int or a string",
            exc=TypeError,
        )
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        fail(
            what,
            text,
            "expected a number with an optional unit (k, M, G, KiB, MiB, GiB, TiB)",
            "write e.g. 80GiB or 80k",
        )
    value = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    if value.denominator != 1:
        fail(
            what,
            text,
            "it must be a whole number of bytes or tokens (it is never truncated)",
            "write a whole number, e.g. 2 or 1.5k",
        )
    return int(value)


def window_pages(
    g: GroupSpec, limits: ServingLimits, prefill_requests: int, cached_window_requests: int
) -> int:
    """Usable pages a window group needs for ``limits`` (see the module docstring)."""
    steady = g.live_blocks(limits.decode_tokens)
    prefill_extra = max(0, g.live_blocks(limits.chunk_tokens) - steady)
    return (
        limits.max_requests + cached_window_requests
    ) * steady + prefill_requests * prefill_extra


def _history_pages(g: GroupSpec, limits: ServingLimits, tokens: int) -> int:
    return -(-tokens // g.block_tokens) + limits.max_requests


def plan_for_budget(
    groups: tuple[GroupSpec, ...],
    limits: ServingLimits,
    hbm_bytes: int | str,
    *,
    prefill_requests: int = 1,
    cached_window_requests: int | None = None,
    name: str = "",
    evict_ahead_tokens: int = 0,
) -> CachePlan:
    """Sizes every pool so that ``hbm_bytes`` serves the most history tokens.

    Args:
      groups: the cache groups (e.g. from a recipe).
      limits: serving limits.
      hbm_bytes: the device budget for pools and tables, in bytes or as ``"80GiB"``.
      prefill_requests: requests that may be in chunked prefill in the same step.
      cached_window_requests: extra requests' worth of window pages kept for prefix hits;
        defaults to ``max_requests``.
      name: label for reports.
      evict_ahead_tokens: :attr:`CachePlan.evict_ahead_tokens` (0: evict exactly the
        shortfall).

    Returns:
      The plan.

    Raises:
      ValueError: the budget cannot hold the window groups plus one request at
        ``max_context``, or an argument is out of range.
    """
    budget = parse_size(hbm_bytes, "hbm_bytes")
    check_positive_int("hbm_bytes", budget)
    check_nonnegative_int("prefill_requests", prefill_requests)
    if cached_window_requests is None:
        cached_window_requests = limits.max_requests
    check_nonnegative_int("cached_window_requests", cached_window_requests)

    def pages_for(tokens: int) -> tuple[int, ...]:
        return tuple(
            RESERVED_PAGES
            + (
                window_pages(g, limits, prefill_requests, cached_window_requests)
                if g.is_window
                else _history_pages(g, limits, tokens)
            )
            for g in groups
        )

    def cost(pages: tuple[int, ...]) -> int:
        pools = sum(n * g.page_bytes for g, n in zip(groups, pages, strict=True))
        tables = sum(
            4 * limits.max_requests * g.blocks_for_tokens(limits.max_context + limits.verify_width)
            for g in groups
        )
        return pools + tables

    one_request = limits.max_context + limits.verify_width
    if cost(pages_for(one_request)) > budget:
        fail(
            "hbm_bytes",
            budget,
            f"the budget is too small for the window groups of {limits.max_requests} requests plus one request "
            f"of max_context={limits.max_context} tokens (needs {cost(pages_for(one_request)):,} bytes)",
            "raise the budget, or lower max_requests / max_context / chunk_tokens",
        )
    if all(g.is_window for g in groups):
        tokens = one_request
    else:
        # Largest T with cost(T) <= budget; cost is monotone in T.
        lo, hi = one_request, one_request
        while cost(pages_for(hi)) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if cost(pages_for(mid)) <= budget else (lo, mid)
        tokens = lo
    return CachePlan(
        groups=tuple(groups),
        limits=limits,
        num_pages=pages_for(tokens),
        name=name,
        evict_ahead_tokens=evict_ahead_tokens,
    )


def plan_with_pages(
    groups: tuple[GroupSpec, ...],
    limits: ServingLimits,
    pages: Mapping[str, int] | int,
    *,
    name: str = "",
    evict_ahead_tokens: int = 0,
) -> CachePlan:
    """A plan with explicit pool sizes.

    Args:
      groups: the cache groups.
      limits: serving limits.
      pages: usable pages per group name (the null and scratch pages are added), or one
        count for every group.
      name: label for reports.
      evict_ahead_tokens: :attr:`CachePlan.evict_ahead_tokens` (0: evict exactly the
        shortfall).

    Raises:
      ValueError: a group is missing from ``pages``, an unknown name is given, or a pool is too
        small for one request.
    """
    if is_int(pages):
        pages = {g.name: int(pages) for g in groups}
    if not isinstance(pages, Mapping):
        fail(
            "pages",
            pages,
            "expected a mapping of group name to page count, or one int",
            "pass {'swa_kv': 1024, ...}",
            exc=TypeError,
        )
    names = [g.name for g in groups]
    unknown = sorted(set(pages) - set(names))
    missing = [n for n in names if n not in pages]
    if unknown:
        fail(
            "pages",
            unknown,
            f"these are not groups of the plan (groups: {names})",
            "spell the group names as the recipe does",
        )
    if missing:
        fail("pages", missing, "every group needs a page count", "add the missing groups")
    counts = [check_positive_int(f"pages[{n}]", pages[n]) for n in names]
    return CachePlan(
        groups=tuple(groups),
        limits=limits,
        num_pages=tuple(c + RESERVED_PAGES for c in counts),
        name=name,
        evict_ahead_tokens=evict_ahead_tokens,
    )
