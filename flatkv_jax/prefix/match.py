"""Prefix matching: the longest cached prefix every group of a plan can serve.

Rule (see ``docs/prefix.md`` for a worked example). For a candidate boundary ``b`` (the hit
length: positions ``[0, b)`` come from the cache and the request computes from ``b`` on):

- a **history** group with block span ``B`` serves ``b`` iff its blocks ``0 .. b/B - 1`` all hit
  (blocks match left to right until the first miss);
- a **window** group with window ``W`` serves ``b`` iff the blocks holding positions
  ``[b - R, b)`` all hit, ``R = hit_reach`` (``W - 1`` for a sliding window): blocks ``i``
  with ``(i + 1) * B > b - R`` and ``i * B < b``, i.e. ``i in [max(0, (b - R) // B), b / B)``
  — for a sliding window exactly the blocks docs/semantics.md says a request with committed
  length ``b`` holds after reclaim (the window of position ``b``, the first position the
  request will compute, reaches back to ``b - W + 1``); a group with a ``period`` (a
  compressor's state) reads back only its ``carry`` from a boundary. That is at most
  ``need = ceil(R / B)`` blocks (possibly 0); older blocks become holes (page 0);
- the hit ``h`` is the largest ``b`` that is a positive multiple of the prefix granularity
  ``G``, ``b <= prompt_len - 1`` (the last prompt token is always recomputed, so the request
  produces logits), and that every group serves; 0 if none.

``G`` must be a multiple of every group's block span: a hit shares whole pages and never copies,
so a boundary inside a block would make the new request write into a shared page. With spans
that are powers of two ``G`` is the largest span (``plan.prefix_granularity``), e.g. 128 tokens
for V4 geometry with 128-token compressed pages.

Candidates are evaluated all at once (vectorised over ``b``); window groups look up only the
``need`` blocks behind each candidate (or all blocks when that is fewer lookups).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.errors import check_positive_int, fail
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.prefix import index as index_lib
from flatkv_jax.prefix import keys as keys_lib


@dataclasses.dataclass(frozen=True)
class GroupMatch:
    """Static lookup geometry of one group for prompts of at most ``max_len`` tokens.

    Attributes:
      block_tokens: the group's block span ``B``.
      window: ``W`` for window groups, ``None`` for history groups.
      slots: table slots a hit can fill, ``max_len // B``.
      need: window groups: blocks behind a boundary that must hit, ``ceil(hit_reach / B)``
        (``ceil((W - 1) / B)`` for a sliding window; 0 for a state with no carry).
    """

    block_tokens: int
    window: int | None
    slots: int
    need: int

    @property
    def is_window(self) -> bool:
        return self.window is not None


@dataclasses.dataclass(frozen=True)
class MatchLayout:
    """Static matching geometry (frozen, hashable: a ``jax.jit`` static argument).

    Build it with :meth:`for_plan`.

    Attributes:
      groups: per plan group, in plan order.
      granularity: ``G``, hits are multiples of it.
      max_len: prompt axis length ``L`` the layout serves (the tokens' padded width).
      unit: hashing unit: the gcd of the granularity and of every end a lookup reads
        (:meth:`lookup_ends`); lanes are computed at its multiples only.
    """

    groups: tuple[GroupMatch, ...]
    granularity: int
    max_len: int
    unit: int

    @property
    def candidates(self) -> int:
        """Candidate boundaries ``G, 2G, .., M*G`` with ``M = (max_len - 1) // G``."""
        return (self.max_len - 1) // self.granularity

    @classmethod
    def for_plan(
        cls, plan: CachePlan, max_len: int, *, granularity: int | None = None
    ) -> MatchLayout:
        """The layout for ``plan``'s groups and prompts padded to ``max_len`` tokens.

        Args:
          plan: the cache plan.
          max_len: static prompt axis length.
          granularity: hit granularity in tokens; defaults to ``plan.prefix_granularity``.
            Must be a multiple of every group's block span.

        Raises:
          ValueError/TypeError: bad plan, length or granularity.
        """
        check_plan(plan)
        check_positive_int("max_len", max_len)
        if granularity is None:
            granularity = plan.prefix_granularity
        check_positive_int("granularity", granularity)
        spans = [g.block_tokens for g in plan.groups] + [g.period or 1 for g in plan.groups]
        bad = [g.name for g in plan.groups if granularity % g.block_tokens]
        if bad:
            fail(
                "granularity",
                granularity,
                f"hits share whole pages, so the granularity must be a multiple of every block span (groups {bad} do not divide it)",
                f"use a multiple of {math.lcm(*spans)}",
            )
        bad = [g.name for g in plan.groups if g.period and granularity % g.period]
        if bad:
            fail(
                "granularity",
                granularity,
                f"hits must land on period boundaries, where a group with a period needs only its carry (groups {bad} have periods that do not divide it)",
                f"use a multiple of {math.lcm(*spans)}",
            )
        groups = tuple(
            GroupMatch(
                block_tokens=g.block_tokens,
                window=g.window if g.is_window else None,
                slots=max_len // g.block_tokens,
                need=-(-g.hit_reach // g.block_tokens) if g.is_window else 0,
            )
            for g in plan.groups
        )
        layout = cls(groups=groups, granularity=granularity, max_len=max_len, unit=granularity)
        # Hash only at the ends some lookup reads (V4: multiples of 64, the sliding window's
        # blocks; a 4-token state is looked up only at its boundary's block), not at every
        # block end of every group: the finishing mixes follow the lookups.
        ends = [e.reshape(-1) for e in layout.lookup_ends().values()]
        unit = int(np.gcd.reduce(np.concatenate([*ends, [granularity]])))
        return dataclasses.replace(layout, unit=unit)

    def lookup_ends(self) -> dict[int, np.ndarray]:
        """Per group that looks anything up: the static prefix ends (int32) its lookups key:
        every block end of a history group, the ``need`` blocks behind each candidate of a
        window group (or all its blocks when that is fewer)."""
        wanted = {}
        for g, gm in enumerate(self.groups):
            if not gm.is_window:
                wanted[g] = ((np.arange(gm.slots) + 1) * gm.block_tokens).astype(np.int32)
            elif gm.need:
                wanted[g] = _window_ends(self, gm)[0]
        return wanted


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The result of matching a batch of prompts.

    Attributes:
      hit: int32[B], hit length in tokens (a multiple of the granularity, ``<= len - 1``; 0 on
        no hit or an invalid row).
      pages: per group, int32[B, slots_g] table rows for the hit: slot ``i < hit / B`` holds the
        cached page (>= 1), or 0 (a hole: a window group's block behind its window); slots
        ``>= hit / B`` are -1 (not allocated). Every page >= 1 here takes one table reference.
      state: uint32[B, CHAIN_WORDS], the chain state at ``hit`` (zeros when ``hit == 0``),
        from which :func:`flatkv_jax.prefix.keys.extend_chain` continues when later blocks
        are published.
      listed: per group, int32[B, n_g], the same pages as ``pages`` (each page entry >= 1 of a
        row exactly once) packed into the few columns that can hold one: ``n_g = slots`` for
        a history group, ``need`` for a window group (its trailing run), -1 elsewhere. Pinning
        and taking the hit's pages walk these ``O(hit pages)`` entries instead of every table
        slot of ``pages`` (a window group with 4-token blocks has ``max_len / 4`` slots and
        at most ``need`` pages).
      prompt: the hashes of every prompt (:func:`flatkv_jax.prefix.keys.chain_lanes` at
        ``layout.unit``), from which the publish of the prompt's first step can take its
        lanes instead of hashing the tokens again.
    """

    hit: jax.Array
    pages: tuple[jax.Array, ...]
    state: jax.Array
    listed: tuple[jax.Array, ...]
    prompt: keys_lib.PromptHash


def history_run(pages: jax.Array) -> jax.Array:
    """int32[B]: leading hits of a history group's lookup row ``pages`` int32[B, n] (first miss)."""
    return jnp.sum(jnp.cumprod((pages > 0).astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def window_ok(pages: jax.Array, needed: jax.Array) -> jax.Array:
    """bool[B, M]: every needed block behind each candidate hits.

    Args:
      pages: int32[B, M, need] lookups of the ``need`` blocks behind each candidate.
      needed: bool[M, need] (or [B, M, need]); False for block indices below 0.
    """
    if needed.ndim == 2:
        needed = needed[None]
    return jnp.all((pages > 0) | ~needed, axis=-1)


def common_hit(
    layout: MatchLayout,
    lengths: jax.Array,
    history_blocks: tuple[jax.Array | None, ...],
    window_served: tuple[jax.Array | None, ...],
) -> jax.Array:
    """int32[B]: the largest candidate boundary every group serves (0 if none).

    Args:
      layout: static geometry.
      lengths: int32[B] prompt lengths (``b <= length - 1``).
      history_blocks: per group, int32[B] leading hit blocks (history groups) or None.
      window_served: per group, bool[B, M] (window groups) or None.
    """
    m = layout.candidates
    b = (jnp.arange(m, dtype=jnp.int32)[None, :] + 1) * layout.granularity  # [1, M]
    served = b <= lengths[:, None] - 1
    for gm, hb, ws in zip(layout.groups, history_blocks, window_served, strict=True):
        ok = ws if gm.is_window else hb[:, None] * gm.block_tokens >= b
        served = served & ok
    return jnp.max(jnp.where(served, b, 0), axis=1, initial=0)


def _window_ends(layout: MatchLayout, gm: GroupMatch) -> tuple[np.ndarray, np.ndarray, bool]:
    """Static end positions to look up for a window group, and how to map them to candidates.

    Returns ``(ends, blocks, direct)``: if ``direct``, ``ends`` is [M, need] (looked up as is);
    otherwise ``ends`` is [slots] (every block) and ``blocks`` [M, need] indexes into it.
    ``blocks`` < 0 marks a block before position 0 (not needed).
    """
    m = layout.candidates
    bt = gm.block_tokens
    cand = (np.arange(m) + 1) * layout.granularity // bt  # b / B
    blocks = cand[:, None] - gm.need + np.arange(gm.need)[None, :]  # [M, need]
    if m * gm.need <= gm.slots:
        return ((blocks + 1) * bt).astype(np.int32), blocks.astype(np.int32), True
    return ((np.arange(gm.slots) + 1) * bt).astype(np.int32), blocks.astype(np.int32), False


def match_prompts(
    layout: MatchLayout,
    indexes: tuple[index_lib.PrefixIndex, ...] | index_lib.PrefixIndexSet,
    tokens: jax.Array,
    lengths: jax.Array,
    namespace,
    valid: jax.Array | None = None,
    *,
    seed,
) -> PrefixMatch:
    """Matches a batch of prompts against the per-group indexes (read-only; jit with ``layout`` static).

    Args:
      layout: :meth:`MatchLayout.for_plan` for the plan and ``tokens.shape[1]``.
      indexes: one :class:`~flatkv_jax.prefix.index.PrefixIndex` per plan group, or every
        group's in one :class:`~flatkv_jax.prefix.index.PrefixIndexSet` (one batched lookup).
      tokens: int32[B, L] prompt token ids (``L == layout.max_len``), padded beyond ``lengths``.
      lengths: int32[B] prompt lengths.
      namespace: uint32[2] or uint32[B, 2] (or an int / pair).
      valid: optional bool[B]; invalid rows get ``hit == 0``.
      seed: the secret key seed the index's keys were made with (``state.key_seed``).

    Returns:
      :class:`PrefixMatch`. Nothing is mutated: the caller takes references (refcount +1,
      :func:`flatkv_jax.prefix.lru.take`) only once the admission succeeds.
    """
    if not isinstance(layout, MatchLayout):
        fail(
            "layout",
            layout,
            "it must be a MatchLayout",
            "build it with MatchLayout.for_plan",
            exc=TypeError,
        )
    n_ix = indexes.groups if isinstance(indexes, index_lib.PrefixIndexSet) else len(indexes)
    if n_ix != len(layout.groups):
        fail(
            "indexes",
            n_ix,
            f"one index per group ({len(layout.groups)})",
            "pass create_indexes(plan)",
        )
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] != layout.max_len:
        fail(
            "tokens.shape",
            tokens.shape,
            f"the layout serves [B, {layout.max_len}] prompts",
            "rebuild the layout with MatchLayout.for_plan(plan, L)",
        )
    bsz = tokens.shape[0]
    lengths = jnp.asarray(lengths)
    if lengths.shape != (bsz,) or lengths.dtype != jnp.int32:
        fail(
            "lengths",
            f"{lengths.dtype}{list(lengths.shape)}",
            f"one int32 per prompt, shape ({bsz},)",
            "pass int32[B]",
        )
    if valid is not None:
        lengths = jnp.where(valid, lengths, 0)
    hashed = keys_lib.chain_lanes(tokens, lengths, namespace, seed=seed, unit=layout.unit)

    # Every group's lookups first: with a PrefixIndexSet they are one batched lookup (rows of
    # every group at once), with a tuple of indexes one per group.
    looked = _lookups(indexes, hashed.lanes, layout.unit, lengths, namespace, layout.lookup_ends())

    hist, win, rows = [], [], []
    for g, gm in enumerate(layout.groups):
        if not gm.is_window:
            pages = looked[g]
            hist.append(history_run(pages))
            win.append(None)
            rows.append(pages)
            continue
        if not gm.need:
            # Nothing behind a boundary is read (a state with no carry): every candidate is
            # served, and the hit's columns are all holes.
            win.append(jnp.ones((bsz, layout.candidates), bool))
            hist.append(None)
            rows.append(jnp.zeros((bsz, layout.candidates, 0), jnp.int32))
            continue
        _, blocks, direct = _window_ends(layout, gm)
        if direct:
            per_cand = looked[g]
        else:
            per_cand = jnp.take(
                looked[g], np.clip(blocks, 0, max(gm.slots - 1, 0)).reshape(-1), axis=1
            )
            per_cand = per_cand.reshape(bsz, *blocks.shape)
        win.append(window_ok(per_cand, jnp.asarray(blocks >= 0)))
        hist.append(None)
        rows.append(per_cand)
    hit = common_hit(layout, lengths, tuple(hist), tuple(win))

    out, listed = [], []
    for gm, r in zip(layout.groups, rows, strict=True):
        slot = jnp.arange(gm.slots, dtype=jnp.int32)[None, :]
        n_hit = (hit // gm.block_tokens)[:, None]  # [B, 1] slots covered by the hit
        if not gm.is_window:
            out.append(jnp.where(slot < n_hit, r, -1))
            listed.append(out[-1])
            continue
        # Row of the chosen candidate (hit / G - 1), then place its `need` blocks at
        # slots n_hit - need .. n_hit - 1; older slots are holes.
        m_idx = jnp.clip(hit // layout.granularity - 1, 0, max(layout.candidates - 1, 0))
        chosen = jnp.take_along_axis(r, m_idx[:, None, None], axis=1)[:, 0, :]  # [B, need]
        j = slot - (n_hit - gm.need)
        page = (
            jnp.take_along_axis(chosen, jnp.clip(j, 0, max(gm.need - 1, 0)), axis=1)
            if gm.need
            else jnp.zeros_like(slot)
        )
        page = jnp.broadcast_to(page, (bsz, gm.slots))
        out.append(jnp.where(slot >= n_hit, -1, jnp.where(j >= 0, page, 0)))
        # The trailing run's `need` pages: column n_hit - need + i holds chosen[:, i] (columns
        # below 0, before the prompt, hold nothing; without a hit nothing is listed).
        col = n_hit - gm.need + jnp.arange(gm.need, dtype=jnp.int32)[None, :]
        listed.append(jnp.where((col >= 0) & (n_hit > 0), chosen, -1))
    state = keys_lib.chain_state(hashed, hit)
    state = jnp.where((hit > 0)[:, None], state, jnp.uint32(0))
    return PrefixMatch(hit=hit, pages=tuple(out), state=state, listed=tuple(listed), prompt=hashed)


def _lookups(indexes, lanes, unit: int, lengths, namespace, wanted: dict) -> dict:
    """Pages of the prefixes ending at ``wanted[g]`` (static int32 arrays of ends) in group
    ``g``'s index, per group: ``int32[B, *ends.shape]`` (0: a miss or an invalid end)."""
    if not wanted:
        return {}
    b = lengths.shape[0]
    flat = {g: ends.reshape(-1) for g, ends in wanted.items()}
    if isinstance(indexes, index_lib.PrefixIndexSet):
        ends = np.concatenate(list(flat.values()))
        group = np.concatenate([np.full(e.size, g, np.int32) for g, e in flat.items()])
        keys, ok = keys_lib.keys_at(lanes, unit, lengths, namespace, ends)
        pages = index_lib.lookup_in(
            indexes, jnp.asarray(np.broadcast_to(group, (b, group.size)).reshape(-1)), keys, ok
        )
        out, at = {}, 0
        for g, e in flat.items():
            out[g] = pages[:, at : at + e.size].reshape(b, *wanted[g].shape)
            at += e.size
        return out
    out = {}
    for g, e in flat.items():
        keys, ok = keys_lib.keys_at(lanes, unit, lengths, namespace, e)
        out[g] = index_lib.lookup(indexes[g], keys, ok).reshape(b, *wanted[g].shape)
    return out
