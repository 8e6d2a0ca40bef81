"""The cache plan: the one authority for group geometry, pool sizes and table layout.

A :class:`CachePlan` is a frozen, hashable value (usable as a ``jax.jit`` static argument).
Everything downstream — pools, the coordinator's state shapes, device metadata, kernels'
strides, the memory report — is derived from it and restates nothing.

Page ids: in every pool, page 0 is the **null page** (never handed out, always zero, used
for holes) and the last page, ``num_pages - 1``, is the **scratch page** (never handed out;
kernels may dump padding there, and an out-of-range id that a lowering clamps lands there).
Pages ``1 .. num_pages - 2`` are usable.
"""

from __future__ import annotations

import dataclasses
import functools

from flatkv_jax.errors import check_nonnegative_int, check_positive_int, fail
from flatkv_jax.groups import GroupSpec, Owner, lcm_block_tokens

#: Page id of the null page in every pool.
NULL_PAGE = 0
#: Pages per pool that are never handed out: the null page and the scratch page.
RESERVED_PAGES = 2
#: Largest int32: positions, page ids, slot ids and table indices are int32 on the device.
INT32_MAX = 2**31 - 1
#: Most row addresses (``num_pages * rows_per_page``) one pool may have: the page kernels
#: (``kernels_pallas``) refuse pools past half the int32 range, so a plan past it could be
#: built but never written. One limit for both.
MAX_POOL_ROWS = INT32_MAX // 2


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """What the cache must serve at once.

    Every field is an integer (a Python int or a NumPy integer, stored as a Python int;
    bools and floats are refused).

    Attributes:
      max_requests: request slots (running requests at once).
      max_context: longest request in tokens (prompt + generated), excluding draft tokens.
      chunk_tokens: most new tokens one request writes in one step (the prefill chunk);
        at most ``max_context``.
      verify_width: speculative draft tokens verified per decode step (0 = no speculation).
        A decode step writes ``1 + verify_width`` tokens per request. Must equal the
        ``verify_width`` the recipe sized its groups for (checked by :class:`CachePlan`).
      step_tokens: most new tokens across the whole batch in one step (the flat token axis of
        the step's metadata; ``admit``/``extend`` refuse rows past it with ``STEP_FULL``).
        Defaults to one full chunk plus a decode step of every other request,
        ``max(chunk_tokens, 1 + verify_width) + (max_requests - 1) * (1 + verify_width)``.

    Raises:
      TypeError: a field that is not an integer.
      ValueError: a field out of range, ``chunk_tokens > max_context``, ``step_tokens`` below
        one chunk or one decode step, or positions past int32.
    """

    max_requests: int
    max_context: int
    chunk_tokens: int
    verify_width: int = 0
    step_tokens: int | None = None

    def __post_init__(self):
        # Stored as Python ints: NumPy integers are accepted (as the host builders do) but
        # must not change the plan's hash or repr.
        for name, check in (
            ("max_requests", check_positive_int),
            ("max_context", check_positive_int),
            ("chunk_tokens", check_positive_int),
            ("verify_width", check_nonnegative_int),
        ):
            object.__setattr__(self, name, check(name, getattr(self, name)))
        if self.chunk_tokens > self.max_context:
            fail(
                "chunk_tokens",
                self.chunk_tokens,
                f"a chunk is part of one request, at most max_context={self.max_context} tokens",
                f"lower chunk_tokens to <= {self.max_context} (or raise max_context)",
            )
        last = self.max_context + self.verify_width + self.max_count
        if last > INT32_MAX:
            fail(
                "max_context",
                self.max_context,
                f"positions are int32: max_context + verify_width + one step's tokens = {last:,} "
                f"must stay <= 2**31 - 1 = {INT32_MAX:,}",
                "lower max_context",
            )
        if self.step_tokens is None:
            object.__setattr__(
                self,
                "step_tokens",
                self.max_count + (self.max_requests - 1) * self.decode_tokens,
            )
        object.__setattr__(self, "step_tokens", check_positive_int("step_tokens", self.step_tokens))
        if self.step_tokens > INT32_MAX:
            fail(
                "step_tokens",
                self.step_tokens,
                f"a step's token indices are int32 (<= {INT32_MAX:,})",
                "lower step_tokens (or max_requests / verify_width, which set its default)",
            )
        if self.step_tokens < self.max_count:
            fail(
                "step_tokens",
                self.step_tokens,
                f"a step must fit one whole chunk ({self.chunk_tokens}) and one decode step ({self.decode_tokens})",
                "raise step_tokens or lower chunk_tokens",
            )

    @property
    def decode_tokens(self) -> int:
        """Tokens one request writes in a decode (verify) step: ``1 + verify_width``."""
        return 1 + self.verify_width

    @property
    def max_count(self) -> int:
        """The most tokens one request writes in one step: a whole chunk or a decode step,
        ``max(chunk_tokens, 1 + verify_width)`` (the default ``max_count`` of the operations
        and the width of a step's token record)."""
        return max(self.chunk_tokens, self.decode_tokens)


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """Groups, serving limits and the page count of every pool.

    Build one with :func:`flatkv_jax.capacity.plan_for_budget` (size pools from an HBM budget)
    or :func:`flatkv_jax.capacity.plan_with_pages` (explicit page counts).

    Attributes:
      groups: the cache groups, one pool each, in a fixed order (the pool index).
      limits: the serving limits the plan was sized for.
      num_pages: per group, pages in its pool array including the null and scratch pages.
      name: a label for reports.
      evict_ahead_tokens: with prefix reuse, an admission whose allocation has to evict LRU
        cached-only pages from some pool then tops up every pool's free stack to the pages
        ``evict_ahead_tokens`` more tokens of every request slot would open there
        (:meth:`evict_ahead_pages`), evicting LRU cached-only pages, so the next steps take
        free pages instead of each running an eviction of its own (on XLA:CPU the eviction
        costs an evicting decode step ~30 thunks, ~50-80 us; V4-Flash at B = 256, T = 16:
        decode x0.95, admission x1.03). 0 (the default): evict exactly the shortfall. A
        larger value evicts cached pages a little earlier than needed (docs/semantics.md,
        "Eviction ahead of demand").
    """

    groups: tuple[GroupSpec, ...]
    limits: ServingLimits
    num_pages: tuple[int, ...]
    name: str = ""
    evict_ahead_tokens: int = 0

    def __post_init__(self):
        if not isinstance(self.groups, tuple) or not self.groups:
            fail(
                "groups",
                self.groups,
                "a plan needs at least one cache group",
                "pass a non-empty tuple of GroupSpec",
            )
        for g in self.groups:
            if not isinstance(g, GroupSpec):
                fail(
                    "groups",
                    g,
                    "every group must be a GroupSpec",
                    "build groups with flatkv_jax.groups.GroupSpec",
                    exc=TypeError,
                )
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            fail("groups", names, "group names must be unique", "rename the duplicate group")
        if not isinstance(self.limits, ServingLimits):
            fail(
                "limits",
                self.limits,
                "it must be a ServingLimits",
                "pass ServingLimits(...)",
                exc=TypeError,
            )
        if not isinstance(self.num_pages, tuple) or len(self.num_pages) != len(self.groups):
            fail(
                "num_pages",
                self.num_pages,
                f"one page count per group ({len(self.groups)})",
                "pass a tuple in group order",
            )
        object.__setattr__(
            self,
            "num_pages",
            tuple(
                check_positive_int(f"num_pages[{g.name}]", n)
                for g, n in zip(self.groups, self.num_pages, strict=True)
            ),
        )
        for g in self.groups:
            if g.verify_width is not None and g.verify_width != self.limits.verify_width:
                fail(
                    "verify_width",
                    self.limits.verify_width,
                    f"group {g.name!r} was sized by its recipe for verify_width={g.verify_width}, "
                    "and the serving limits must verify the same number of draft tokens",
                    "pass the same verify_width to the recipe (e.g. deepseek_v4_groups(cfg, "
                    "verify_width=...)) and to ServingLimits",
                )
        for g, n in zip(self.groups, self.num_pages, strict=True):
            if n * g.rows_per_page > MAX_POOL_ROWS:
                fail(
                    f"num_pages[{g.name}]",
                    n,
                    f"slot ids page * rows_per_page + row are int32 and the page kernels take "
                    f"at most {MAX_POOL_ROWS:,} row addresses a pool: {n:,} pages x "
                    f"{g.rows_per_page} rows = {n * g.rows_per_page:,}",
                    "lower the page count (a smaller HBM budget) for this group",
                )
            need = self.min_usable_pages(g) + RESERVED_PAGES
            if n < need:
                fail(
                    f"num_pages[{g.name}]",
                    n,
                    f"one request at max_context={self.limits.max_context} (chunk {self.limits.chunk_tokens}, "
                    f"verify {self.limits.verify_width}) needs {need} pages in group {g.name!r} "
                    f"(including the null and scratch pages)",
                    "give the group more pages (a larger budget) or lower max_context/chunk_tokens",
                )
        object.__setattr__(
            self,
            "evict_ahead_tokens",
            check_nonnegative_int("evict_ahead_tokens", self.evict_ahead_tokens),
        )
        if sum(self.num_pages) > INT32_MAX:
            fail(
                "num_pages",
                self.num_pages,
                f"the allocator indexes every pool's pages in one int32 array: {sum(self.num_pages):,} "
                "pages in all > 2**31 - 1",
                "lower the page counts (a smaller HBM budget)",
            )
        entries = sum(self.limits.max_requests * self.table_width(g) for g in self.groups)
        if entries > INT32_MAX:
            fail(
                "max_context",
                self.limits.max_context,
                f"the tables of {self.limits.max_requests} requests hold {entries:,} int32 "
                "entries, indexed by int32 (> 2**31 - 1)",
                "lower max_context or max_requests",
            )

    def __hash__(self) -> int:
        # The plan is a jit static argument: every call hashes it, and hashing the nested
        # group tuples costs ~0.2 ms on V4-Flash. Hash once.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.groups, self.limits, self.num_pages, self.name, self.evict_ahead_tokens))
            object.__setattr__(self, "_hash", h)
        return h

    # --- lookups -------------------------------------------------------------------------
    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {g.name: i for i, g in enumerate(self.groups)}

    def group_index(self, name: str) -> int:
        """Position of the group called ``name`` (its pool index)."""
        try:
            return self._index[name]
        except KeyError:
            fail("group", name, f"this plan has groups {list(self._index)}", "ask for one of those")

    def group(self, name: str) -> GroupSpec:
        """The group called ``name``."""
        return self.groups[self.group_index(name)]

    def groups_of(self, owner: Owner) -> tuple[GroupSpec, ...]:
        """The groups owned by the target or the draft model."""
        return tuple(g for g in self.groups if g.owner is owner)

    # --- geometry ------------------------------------------------------------------------
    def min_usable_pages(self, g: GroupSpec) -> int:
        """Usable pages one request needs in group ``g`` at the plan's limits."""
        lim = self.limits
        if g.is_window:
            return g.live_blocks(lim.max_count)
        return g.blocks_for_tokens(lim.max_context + lim.verify_width)

    @property
    def prefix_granularity(self) -> int:
        """Token granularity of prefix hits: the lcm of all block spans (a power of two in V4)."""
        return lcm_block_tokens(self.groups)

    def table_width(self, g: GroupSpec | int | str) -> int:
        """Slots in a request's table row: ``ceil((max_context + verify_width) / block_tokens)``."""
        g = self._resolve(g)
        return g.blocks_for_tokens(self.limits.max_context + self.limits.verify_width)

    def table_shape(self, g: GroupSpec | int | str) -> tuple[int, int]:
        """Shape of group ``g``'s table: ``(max_requests, table_width)``, int32."""
        return (self.limits.max_requests, self.table_width(g))

    def evict_ahead_pages(self, g: GroupSpec | int | str) -> int:
        """Pages an evicting allocation frees ahead in group ``g``'s pool:
        ``ceil(max_requests * evict_ahead_tokens / block_tokens)``, at most its usable pages
        (0 when ``evict_ahead_tokens`` is 0)."""
        g = self._resolve(g)
        want = -(-self.limits.max_requests * self.evict_ahead_tokens // g.block_tokens)
        return min(want, self.usable_pages(g))

    def usable_pages(self, g: GroupSpec | int | str) -> int:
        """Pages that can be handed out (excludes the null and scratch pages)."""
        return self.pages(g) - RESERVED_PAGES

    def pages(self, g: GroupSpec | int | str) -> int:
        """Pages in the pool array of group ``g`` (including null and scratch)."""
        return self.num_pages[self.group_index(self._resolve(g).name)]

    def scratch_page(self, g: GroupSpec | int | str) -> int:
        """Page id of group ``g``'s scratch page (its last page)."""
        return self.pages(g) - 1

    def pool_shape(self, g: GroupSpec | int | str, field: str) -> tuple[int, ...]:
        """Shape of one (group, field, layer) pool array: ``[num_pages, rows_per_page, *row]``."""
        g = self._resolve(g)
        return (self.pages(g), g.rows_per_page, *g.field(field).format.shape)

    def pool_bytes(self, g: GroupSpec | int | str) -> int:
        """Device bytes of group ``g``'s pool (all fields and layers, all pages)."""
        g = self._resolve(g)
        return self.pages(g) * g.page_bytes

    def payload_bytes(self, g: GroupSpec | int | str) -> int:
        """Bytes of the usable pages of group ``g`` (what holds cache data)."""
        g = self._resolve(g)
        return self.usable_pages(g) * g.page_bytes

    def table_bytes(self, g: GroupSpec | int | str) -> int:
        """Device bytes of group ``g``'s int32 table."""
        r, w = self.table_shape(g)
        return 4 * r * w

    @property
    def total_pool_bytes(self) -> int:
        return sum(self.pool_bytes(g) for g in self.groups)

    @property
    def total_table_bytes(self) -> int:
        return sum(self.table_bytes(g) for g in self.groups)

    @property
    def total_bytes(self) -> int:
        """Pools plus tables: the device bytes the plan accounts for."""
        return self.total_pool_bytes + self.total_table_bytes

    # --- capacity --------------------------------------------------------------------------
    def fixed_bytes_per_request(self, g: GroupSpec | int | str | None = None) -> int:
        """Window-group bytes one running request holds in steady decode (all groups if None)."""
        groups = self.groups if g is None else (self._resolve(g),)
        return sum(
            x.live_blocks(self.limits.decode_tokens) * x.page_bytes for x in groups if x.is_window
        )

    @property
    def history_bytes_per_token(self) -> float:
        """History bytes one raw token costs across all history groups."""
        return sum(g.bytes_per_token() for g in self.groups)

    @property
    def token_capacity(self) -> int:
        """History tokens the pools hold across all requests (each request may leave one
        partial block per history group). Without history groups, ``max_requests * max_context``."""
        caps = [
            max(0, self.usable_pages(g) - self.limits.max_requests) * g.block_tokens
            for g in self.groups
            if not g.is_window
        ]
        return min(caps) if caps else self.limits.max_requests * self.limits.max_context

    @property
    def largest_request_tokens(self) -> int:
        """The longest single request the pools and tables can hold on their own."""
        caps = [self.usable_pages(g) * g.block_tokens for g in self.groups if not g.is_window]
        return min([self.limits.max_context, *caps])

    def _resolve(self, g: GroupSpec | int | str) -> GroupSpec:
        if isinstance(g, GroupSpec):
            return self.groups[self.group_index(g.name)]
        if isinstance(g, str):
            return self.group(g)
        return self.groups[g]


def check_plan(plan: object, what: str = "plan") -> CachePlan:
    """Returns ``plan`` if it is a :class:`CachePlan`; otherwise raises ``TypeError`` naming
    its type (the one check every entry point that takes a plan shares)."""
    if not isinstance(plan, CachePlan):
        fail(
            what,
            type(plan).__name__,
            "it must be a CachePlan",
            "build one with plan_with_pages or plan_for_budget",
            exc=TypeError,
        )
    return plan
