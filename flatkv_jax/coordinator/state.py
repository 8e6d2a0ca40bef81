"""The coordinator's cache state: one pytree of int32/bool arrays, shaped by the plan.

Nothing here is Python state: every field is an array, so the whole state can be passed into
and returned from a jitted function (donated), sharded, or checkpointed. Shapes depend only on
the plan and ``fifo_depth`` (static), never on the requests.

Per request slot ``s`` (``R = max_requests`` slots):

- ``live[s]``: the slot holds a request; ``generation[s]`` counts how often the slot was freed
  (a handle is ``(slot, generation)``); ``pending[s]`` is 0, or ``1 + ReleaseMode`` when a
  release waits for the request's in-flight steps (the request takes no new steps).
- ``extent[s]`` (``n``) and ``committed[s]`` (``c``), ``c <= n``.
- per group ``g``: the table row ``table(plan, state, g)[s, :]`` (``-1`` unallocated, ``0``
  hole, ``>= 1`` a page of the group's pool), ``lo[g, s]`` and ``hi[g, s]``: columns ``[0, lo)``
  are holes (window groups after reclaim), columns ``[lo, hi)`` hold pages, columns
  ``[hi, width)`` are -1. ``hi`` can exceed ``ceil(n / block_tokens)`` after a rewind (pages
  are kept for the next step's overwrite).

Every group's ``[max_requests, table_width(g)]`` table lives in one flat int32 buffer,
``tables``, at ``table_offset(plan)[g]`` with row stride ``table_width(g)`` (kernels take the
offset and stride as data); the allocator state of every pool is one
:class:`~flatkv_jax.block_pool.BlockPoolSet`. One flat buffer per kind keeps each operation
a few vectorised ops whatever the number of groups.
- the in-flight step FIFO: ``fifo_len[s]`` records from ``fifo_head[s]`` (circular, depth
  ``D``): ``fifo_start`` (first position), ``fifo_count`` (tokens written) and ``fifo_cap``
  (tokens still valid: ``count`` unless a rewind cut the step).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from flatkv_jax.block_pool import BlockPoolSet, create_block_pool_set
from flatkv_jax.coordinator.layout import (
    StateLayout,
    admit_lanes_width,
    pool_layout,
    state_layout,
    table_offset,
    table_size,
)
from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan
from flatkv_jax.prefix.index import PrefixIndex, PrefixIndexSet, create_index_set, unpack
from flatkv_jax.prefix.keys import CHAIN_WORDS, LANES, new_seed, seed_words
from flatkv_jax.prefix.lru import CachedLRU, CachedLRUSet, create_lru_set
from flatkv_jax.prefix.lru import unpack as unpack_lrus

_I32 = jnp.int32

# The layout names live in .layout and are re-exported here, where the state's users look.
__all__ = [
    "CacheState",
    "PoolView",
    "StateLayout",
    "create_state",
    "pool_layout",
    "state_bytes",
    "state_layout",
    "table",
    "table_offset",
    "table_size",
]


class PoolView(NamedTuple):
    """One pool's allocator arrays (slices of the flat :class:`BlockPoolSet`).

    Attributes:
      free_ids: ``int32[usable]``; ``free_ids[:top]`` are the free pages.
      top: ``int32[]``.
      refcount: ``int32[num_pages]``.
    """

    free_ids: jax.Array
    top: jax.Array
    refcount: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "allocator", "table_buffer", "lo", "hi", "generation", "live", "pending", "extent",
        "committed", "fifo_start", "fifo_count", "fifo_cap", "fifo_head", "fifo_len",
        "index", "lru", "pinned", "chain", "namespace", "subkeys", "keyed", "fifo_tokens",
        "admit_hashed", "admit_lanes", "admit_chain", "key_seed",
    ],
    meta_fields=["layout"],
)  # fmt: skip
@dataclasses.dataclass(frozen=True)
class CacheState:
    """Everything the coordinator knows, as arrays (see the module docstring).

    Attributes:
      allocator: the allocator of every pool (``layout.pools`` places them); per-pool views:
        :attr:`pools`.
      table_buffer: ``int32[sum_g R * table_width(g)]``, every group's table; per-group views:
        :attr:`tables`.
      lo: ``int32[G, R]``, first column holding a page (0 for history groups).
      hi: ``int32[G, R]``, one past the last column holding a page.
      generation: ``int32[R]``.
      live: ``bool[R]``.
      pending: ``int32[R]``, 0 or ``1 + ReleaseMode`` of a deferred release.
      extent: ``int32[R]``, ``n``.
      committed: ``int32[R]``, ``c``.
      fifo_start, fifo_count, fifo_cap: ``int32[R, D]``.
      fifo_head, fifo_len: ``int32[R]``.
      index: every group's prefix index (key -> page) in one
        :class:`~flatkv_jax.prefix.index.PrefixIndexSet` (``None`` without prefix caching);
        per-group views: :attr:`indexes`.
      lru: every pool's LRU of cached-only pages in one
        :class:`~flatkv_jax.prefix.lru.CachedLRUSet` (``None`` without prefix caching);
        per-group views: :attr:`lrus`.
      pinned: ``bool[total pages]`` (pool ``g``'s pages at its ``page_offset``, as the
        allocator's refcounts; ``None`` without prefix caching), all False between calls
        (admit's scratch mask of
        pages matched in the call; kept in the state so setting it costs O(pages matched)).
      chain: ``uint32[R, CHAIN_WORDS]``, the chain state of each request's committed tokens
        (:func:`flatkv_jax.prefix.keys.extend_chain`).
      namespace: ``int32[R]``, each request's namespace (low word).
      subkeys: ``uint32[R, 3, LANES]``, each request's hash subkeys (term, chain, final) of
        ``key_seed`` and its namespace (:class:`flatkv_jax.prefix.keys.Subkeys`), derived once
        at admission so that a publishing step runs no cipher pass for them.
      keyed: ``bool[R]``, the request's committed tokens are known (it publishes).
      fifo_tokens: ``int32[R, D, T]``, the token ids of each in-flight step (``T = max(
        chunk_tokens, 1 + verify_width)``), published when the step retires.
      admit_hashed: ``bool[R]``, the request's admission hashed its first step's tokens
        (with the whole prompt, to match it) and kept what publishing them needs in
        ``admit_lanes`` / ``admit_chain``: the retire of that step takes them instead of
        hashing the tokens again (docs/coordinator.md, "The prefill is hashed once").
        Cleared by the request's first retire, whatever its outcome (and by a release); set
        only by ``admit``.
      admit_lanes: ``uint32[R, N, LANES]``, the lanes of the prefixes ending at ``(h // u +
        1 + j) * u`` (``u``: the publish unit, ``h``: the hit, ``N = max_count // u + 1``;
        ``N = 0`` when publishing hashes at every token), as
        :func:`flatkv_jax.prefix.keys.extend_chain` returns them for the first step.
      admit_chain: ``uint32[R, CHAIN_WORDS]``, the chain state at the end of the first step.
      key_seed: ``uint32[SEED_WORDS]``, the secret seed of every prefix key of this state
        (docs/prefix.md, "Threat model"); drawn from OS entropy unless ``create_state(seed=)``.
    """

    allocator: BlockPoolSet
    table_buffer: jax.Array
    lo: jax.Array
    hi: jax.Array
    generation: jax.Array
    live: jax.Array
    pending: jax.Array
    extent: jax.Array
    committed: jax.Array
    fifo_start: jax.Array
    fifo_count: jax.Array
    fifo_cap: jax.Array
    fifo_head: jax.Array
    fifo_len: jax.Array
    index: PrefixIndexSet | None
    lru: CachedLRUSet | None
    pinned: jax.Array | None
    chain: jax.Array
    namespace: jax.Array
    subkeys: jax.Array
    keyed: jax.Array
    fifo_tokens: jax.Array
    admit_hashed: jax.Array
    admit_lanes: jax.Array
    admit_chain: jax.Array
    key_seed: jax.Array
    layout: StateLayout

    @property
    def tables(self) -> tuple[jax.Array, ...]:
        """Per group, its table ``int32[max_requests, table_width(g)]`` (a view of
        ``table_buffer``; inside jit a slice, so kernels should prefer the flat buffer with
        ``layout.table_offset[g]`` and stride ``layout.table_width[g]``)."""
        r = self.layout.max_requests
        return tuple(
            self.table_buffer[o : o + r * w].reshape(r, w)
            for o, w in zip(self.layout.table_offset, self.layout.table_width, strict=True)
        )

    @property
    def pools(self) -> tuple[PoolView, ...]:
        """Per pool, its allocator arrays (views of ``allocator``)."""
        pl, a = self.layout.pools, self.allocator
        return tuple(
            PoolView(a.free_ids[so : so + u], a.top[g], a.refcount[po : po + n])
            for g, (so, u, po, n) in enumerate(
                zip(pl.stack_offset, pl.usable, pl.page_offset, pl.num_pages, strict=True)
            )
        )

    @property
    def max_requests(self) -> int:
        return self.generation.shape[0]

    @property
    def fifo_depth(self) -> int:
        return self.fifo_start.shape[1]

    @property
    def prefix(self) -> bool:
        """Whether the state keeps a prefix index (``create_state(..., prefix=...)``)."""
        return self.index is not None

    @property
    def indexes(self) -> tuple[PrefixIndex, ...]:
        """Per group, its index as a :class:`~flatkv_jax.prefix.index.PrefixIndex` (views of
        :attr:`index`, for reading; ``()`` without prefix caching)."""
        return () if self.index is None else unpack(self.index)

    @property
    def lrus(self) -> tuple[CachedLRU, ...]:
        """Per group, its LRU as a :class:`~flatkv_jax.prefix.lru.CachedLRU` (views of
        :attr:`lru`, for reading; ``()`` without prefix caching)."""
        return () if self.lru is None else unpack_lrus(self.lru)


def create_state(
    plan: CachePlan,
    fifo_depth: int = 2,
    *,
    prefix: bool = True,
    seed: int | None = None,
) -> CacheState:
    """An empty cache state for ``plan``: every page free, every slot free, tables all -1.

    Args:
      plan: the cache plan.
      fifo_depth: in-flight steps one request may have (steps extended but not retired);
        2 serves a pipelined (async) scheduler.
      prefix: keep a prefix index (issue 5). ``False`` builds a state without index, LRU,
        pin masks or step tokens: the operations then compile without any
        prefix code (a smaller, faster step on CPU, where even an untaken branch costs time
        per op; docs/coordinator.md) and reject batches that carry tokens.
      seed: the secret seed of the prefix keys: ``None`` (default) draws 128 bits from the
        operating system's entropy (``secrets``), so nobody outside the process can predict a
        key; an int in ``[0, 2**128)`` or ``uint32[4]`` words makes keys reproducible (tests).
        Never derive it from public data (docs/prefix.md, "Threat model").

    Returns:
      The state. Device bytes: the plan's table bytes plus about ``8 * num_pages`` per pool
      for the allocator and, with ``prefix``, about ``54 * num_pages`` per pool for the prefix
      index and LRU, ``4 * max_requests * fifo_depth * max(chunk_tokens, 1 + verify_width)``
      of step tokens and ``16 * max_requests * (max_count / publish_unit + 1)`` of the
      admissions' kept hash lanes (``admit_lanes``; V4-Flash at 4,096-token chunks: 1 KB a
      slot).

    Raises:
      ValueError/TypeError: a bad ``fifo_depth``, ``prefix`` or ``seed``.
    """
    check_positive_int("fifo_depth", fifo_depth)
    if not isinstance(prefix, bool):
        fail(
            "prefix",
            prefix,
            "prefix is a bool (keep a prefix index or not)",
            "pass True or False",
            exc=TypeError,
        )
    if prefix and plan.prefix_granularity >= plan.limits.max_context:
        # A hit is a whole number of granules and leaves at least one prompt token to
        # compute, so no prompt of at most max_context tokens could ever hit: prefix reuse
        # would run (hashing, publishing) for 0 % hits (docs/semantics.md; DESIGN's lesson of
        # hit lengths blown up by the lcm of block spans).
        fail(
            "prefix",
            prefix,
            f"the plan's prefix hit granularity (the lcm of its block spans) is "
            f"{plan.prefix_granularity} tokens, not below max_context="
            f"{plan.limits.max_context}: no prompt could ever hit",
            "pass prefix=False, or choose page spans whose lcm is well below max_context",
        )
    r = plan.limits.max_requests
    width = plan.limits.max_count if prefix else 0

    # Every leaf is its own buffer: the ops donate the state, and XLA refuses to donate one
    # buffer twice.
    def zeros():
        return jnp.zeros((r,), _I32)

    def fifo():
        return jnp.zeros((r, fifo_depth), _I32)

    return CacheState(
        allocator=create_block_pool_set(pool_layout(plan)),
        table_buffer=jnp.full((table_size(plan),), -1, _I32),
        lo=jnp.zeros((len(plan.groups), r), _I32),
        hi=jnp.zeros((len(plan.groups), r), _I32),
        generation=zeros(),
        live=jnp.zeros((r,), jnp.bool_),
        pending=zeros(),
        extent=zeros(),
        committed=zeros(),
        fifo_start=fifo(),
        fifo_count=fifo(),
        fifo_cap=fifo(),
        fifo_head=zeros(),
        fifo_len=zeros(),
        index=create_index_set(plan) if prefix else None,
        lru=create_lru_set(plan) if prefix else None,
        pinned=jnp.zeros((pool_layout(plan).total_pages,), jnp.bool_) if prefix else None,
        chain=jnp.zeros((r, CHAIN_WORDS), jnp.uint32),
        namespace=zeros(),
        subkeys=jnp.zeros((r, 3, LANES), jnp.uint32),
        keyed=jnp.zeros((r,), jnp.bool_),
        fifo_tokens=jnp.zeros((r, fifo_depth, width), _I32),
        admit_hashed=jnp.zeros((r,), jnp.bool_),
        admit_lanes=jnp.zeros((r, admit_lanes_width(plan) if prefix else 0, LANES), jnp.uint32),
        admit_chain=jnp.zeros((r, CHAIN_WORDS), jnp.uint32),
        key_seed=jnp.asarray(new_seed() if seed is None else seed_words(seed)),
        layout=state_layout(plan),
    )


def table(plan: CachePlan, state: CacheState, g: int | str) -> jax.Array:
    """Group ``g``'s table, ``int32[max_requests, table_width(g)]`` (a slice of ``tables``)."""
    return state.tables[plan.group_index(g) if isinstance(g, str) else g]


def state_bytes(state: CacheState) -> int:
    """Device bytes of every array of ``state``."""
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(state))
