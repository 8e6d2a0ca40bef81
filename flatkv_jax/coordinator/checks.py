"""Trace-time checks of what the operations are given: the state against the plan, the batch
fields' dtypes and shapes, and the results that make up one step.

Everything here runs while an operation is traced (shapes, dtypes and the static layout are
known then), so a wrong input is a ``ValueError``/``TypeError`` naming the field, what was
given, the rule and the fix — never a silently wrong step. Inside the compiled operation they
cost nothing.
"""

from __future__ import annotations

import jax
import numpy as np

from flatkv_jax.block_pool import PoolLayout
from flatkv_jax.coordinator.batches import (
    AdmitBatch,
    ExtendBatch,
    HandleBatch,
    ReleaseBatch,
    RetireBatch,
    RewindBatch,
)
from flatkv_jax.coordinator.layout import admit_lanes_width
from flatkv_jax.coordinator.results import StepResult
from flatkv_jax.coordinator.state import (
    CacheState,
    StateLayout,
    state_layout,
    table_size,
)
from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.prefix.index import WAYS
from flatkv_jax.prefix.keys import CHAIN_WORDS, KEY_WORDS, LANES, SEED_WORDS

_BOOL, _INT = "bool", "int32"

#: Per batch class, its fields: (name, dtype, rank, optional).
_FIELDS: dict[type, tuple[tuple[str, str, int, bool], ...]] = {
    AdmitBatch: (
        ("valid", _BOOL, 1, False),
        ("prompt_len", _INT, 1, False),
        ("first_chunk", _INT, 1, False),
        ("tokens", _INT, 2, True),
        ("namespace", _INT, 1, True),
    ),
    ExtendBatch: (
        ("valid", _BOOL, 1, False),
        ("slot", _INT, 1, False),
        ("generation", _INT, 1, False),
        ("count", _INT, 1, False),
        ("tokens", _INT, 2, True),
    ),
    RetireBatch: (
        ("valid", _BOOL, 1, False),
        ("slot", _INT, 1, False),
        ("generation", _INT, 1, False),
        ("accepted", _INT, 1, False),
    ),
    RewindBatch: (
        ("valid", _BOOL, 1, False),
        ("slot", _INT, 1, False),
        ("generation", _INT, 1, False),
        ("extent", _INT, 1, False),
    ),
    HandleBatch: (
        ("valid", _BOOL, 1, False),
        ("slot", _INT, 1, False),
        ("generation", _INT, 1, False),
    ),
    ReleaseBatch: (
        ("valid", _BOOL, 1, False),
        ("slot", _INT, 1, False),
        ("generation", _INT, 1, False),
        ("mode", _INT, 1, False),
    ),
}

_BUILDER = {
    AdmitBatch: "host.admit_batch",
    ExtendBatch: "host.extend_batch",
    RetireBatch: "host.retire_batch",
    RewindBatch: "host.rewind_batch",
    HandleBatch: "host.handle_batch",
    ReleaseBatch: "host.release_batch",
}


def check_batch(batch: object, cls: type, op: str) -> int:
    """Checks that ``batch`` is a ``cls`` whose every field has its dtype and shape.

    ``valid`` must be ``bool[B]`` (an int mask would be read as something else), the int
    fields ``int32[B]``, ``tokens`` ``int32[B, L]`` (``L >= 1``), dtypes as jit sees them
    (with 64-bit types off an ``int64`` NumPy array is ``int32``); ``B >= 1`` is the same for
    every field. Returns ``B``.

    Raises:
      TypeError: not a ``cls``, a field that is not an array, or of the wrong dtype.
      ValueError: a field of the wrong rank or batch size.
    """
    name = cls.__name__
    if not isinstance(batch, cls):
        fail(
            "batch",
            type(batch).__name__,
            f"{op} takes an {name}" if name[0] in "AEIOU" else f"{op} takes a {name}",
            f"build it with {_BUILDER[cls]}(plan, rows)",
            exc=TypeError,
        )
    b = None
    for field, dtype, rank, optional in _FIELDS[cls]:
        what = f"{name}.{field}"
        x = getattr(batch, field)
        if x is None and optional:
            continue
        want = f"{dtype}[B]" if rank == 1 else f"{dtype}[B, L]"
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            fail(
                what,
                type(x).__name__,
                f"it must be an array of {want}",
                f"pass a jax array (build the batch with {_BUILDER[cls]})",
                exc=TypeError,
            )
        shape = tuple(x.shape)
        if len(shape) != rank:
            fail(
                what,
                f"an array of shape {shape}",
                f"it must be {want} (rank {rank})",
                f"pass one {'entry' if rank == 1 else 'row'} per batch row "
                f"(build the batch with {_BUILDER[cls]})",
            )
        # As jit sees it: with 64-bit types off an int64 NumPy array arrives as int32.
        got = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
        if got != np.dtype(dtype):
            fix = (
                f"pass {field} as a bool array (e.g. jnp.asarray(mask, jnp.bool_)); an int "
                "array is not a mask"
                if dtype == _BOOL
                else f"cast it with jnp.asarray({field}, jnp.int32)"
            )
            fail(what, f"an array of dtype {got}", f"it must be {want}", fix, exc=TypeError)
        if b is None:
            b = shape[0]
            if b < 1:
                fail(
                    what,
                    f"an array of shape {shape}",
                    "a batch needs at least one row (B >= 1)",
                    "pad the batch with rows whose valid is False",
                )
        elif shape[0] != b:
            fail(
                what,
                f"an array of shape {shape}",
                f"every field of one batch has the same batch size B = {b} (from {name}.valid)",
                "give every field one entry per batch row",
            )
        if rank == 2 and shape[1] < 1:
            fail(what, f"an array of shape {shape}", "a token row needs L >= 1 columns", "pad it")
    return b


def _describe(layout: StateLayout) -> str:
    return (
        f"max_requests={layout.max_requests}, num_pages={layout.pools.num_pages}, "
        f"table widths={layout.table_width}"
    )


def check_state_for_plan(plan: object, state: object, op: str) -> CachePlan:
    """Checks that ``state`` was created for ``plan`` (``create_state(plan)``): its static
    layout and every array's shape and dtype. A state of another plan would hand out page
    ids outside this plan's pools, or read tables with another stride.

    Raises:
      TypeError: ``plan`` is not a CachePlan or ``state`` not a CacheState.
      ValueError: the state belongs to another plan (the message names both).
    """
    plan = check_plan(plan)
    if not isinstance(state, CacheState):
        fail(
            "state",
            type(state).__name__,
            f"{op} takes a CacheState",
            "build it with create_state(plan)",
            exc=TypeError,
        )
    want, got = state_layout(plan), state.layout
    if got != want:
        same_sizes = dataclass_sizes(got) == dataclass_sizes(want)
        fail(
            "state",
            f"a state built for a plan with {_describe(got)}"
            + (" (other groups or limits)" if same_sizes else ""),
            f"{op} was given a plan{f' {plan.name!r}' if plan.name else ''} with "
            f"{_describe(want)}; a state only works with the plan it was created for",
            "pass the plan the state was created with, or create a state for this plan with "
            "create_state(plan)",
        )
    _check_shapes(plan, state, op)
    return plan


def dataclass_sizes(layout: StateLayout) -> tuple:
    """The sizes of a layout (everything but the plan fingerprint and the per-group
    constants)."""
    return (layout.pools, layout.table_offset, layout.table_width, layout.max_requests)


def _check_shapes(plan: CachePlan, state: CacheState, op: str) -> None:
    r, g = plan.limits.max_requests, len(plan.groups)
    d = state.fifo_start.shape[1] if state.fifo_start.ndim == 2 else -1
    pools = PoolLayout(plan.num_pages)
    prefix = state.index is not None
    width = plan.limits.max_count if prefix else 0
    expect = [
        ("allocator.free_ids", state.allocator.free_ids, (sum(pools.usable),), _INT),
        ("allocator.top", state.allocator.top, (g,), _INT),
        ("allocator.refcount", state.allocator.refcount, (pools.total_pages,), _INT),
        ("table_buffer", state.table_buffer, (table_size(plan),), _INT),
        ("lo", state.lo, (g, r), _INT),
        ("hi", state.hi, (g, r), _INT),
        ("live", state.live, (r,), _BOOL),
        ("keyed", state.keyed, (r,), _BOOL),
        ("chain", state.chain, (r, CHAIN_WORDS), "uint32"),
        ("subkeys", state.subkeys, (r, 3, LANES), "uint32"),
        ("key_seed", state.key_seed, (SEED_WORDS,), "uint32"),
        ("fifo_tokens", state.fifo_tokens, (r, d, width), _INT),
        ("admit_hashed", state.admit_hashed, (r,), _BOOL),
        (
            "admit_lanes",
            state.admit_lanes,
            (r, admit_lanes_width(plan) if prefix else 0, LANES),
            "uint32",
        ),
        ("admit_chain", state.admit_chain, (r, CHAIN_WORDS), "uint32"),
    ]
    expect += [(n, getattr(state, n), (r,), _INT) for n in _PER_SLOT]
    expect += [(n, getattr(state, n), (r, d), _INT) for n in _PER_STEP]
    if prefix:
        ix = state.index
        if not (ix.num_pages == tuple(plan.num_pages) == state.lru.num_pages):
            fail(
                "state",
                f"a state whose prefix index has pools of {ix.num_pages} pages",
                f"the plan has {g} groups of {tuple(plan.num_pages)} pages (an index and an LRU "
                "per group)",
                "create the state with create_state(plan)",
            )
        nb = sum(ix.num_buckets)
        expect += [
            ("index.keys", ix.keys, (nb, WAYS, KEY_WORDS), "uint32"),
            ("index.pages", ix.pages, (nb, WAYS), _INT),
            ("index.slot_of_page", ix.slot_of_page, (sum(plan.num_pages),), _INT),
            ("index.count", ix.count, (g,), _INT),
            ("lru.ring", state.lru.ring, (sum(state.lru.ring_sizes),), _INT),
            ("lru.seq_of_page", state.lru.seq_of_page, (sum(plan.num_pages),), "uint32"),
            ("lru.cached", state.lru.cached, (sum(plan.num_pages),), _BOOL),
            ("lru.head", state.lru.head, (g,), "uint32"),
            ("lru.tail", state.lru.tail, (g,), "uint32"),
            ("lru.count", state.lru.count, (g,), _INT),
        ]
        expect += [("pinned", state.pinned, (pools.total_pages,), _BOOL)]
    for name, x, shape, dtype in expect:
        if tuple(x.shape) != shape or np.dtype(x.dtype) != np.dtype(dtype):
            fail(
                f"state.{name}",
                f"{np.dtype(x.dtype)}{list(x.shape)}",
                f"{op} was given a plan whose state has {dtype}{list(shape)} there",
                "pass the state create_state(plan) built for this plan, unchanged in shape",
            )


_PER_SLOT = (
    "generation",
    "pending",
    "extent",
    "committed",
    "fifo_head",
    "fifo_len",
    "namespace",
)
_PER_STEP = ("fifo_start", "fifo_count", "fifo_cap")


def check_same_step(plan: CachePlan, same_step: object, op: str) -> tuple[StepResult, ...]:
    """Checks ``same_step``: the results of the calls made earlier in the same step, in call
    order (``same_step[i].step_index == i``), each of this plan's groups."""
    check_step_results(plan, same_step, "same_step", op, allow_empty=True)
    return same_step


def check_step_results(
    plan: CachePlan, steps: object, what: str, op: str, *, allow_empty: bool
) -> None:
    """Checks a tuple of :class:`StepResult` that makes up one step (see
    :func:`check_same_step`); ``step_metadata`` uses it with ``allow_empty=False``."""
    if (
        not isinstance(steps, tuple)
        or (not steps and not allow_empty)
        or not all(isinstance(x, StepResult) for x in steps)
    ):
        fail(
            what,
            type(steps).__name__,
            ("a tuple" if allow_empty else "a non-empty tuple")
            + " of StepResult (from admit/extend)",
            "pass (result,) or (admit_result, extend_result)",
            exc=TypeError,
        )
    g = len(plan.groups)
    for i, x in enumerate(steps):
        if x.step_index != i:
            fail(
                f"{what}[{i}]",
                f"a result with step_index={x.step_index}",
                f"{op} takes the results of one step in call order, each call made with "
                f"same_step= the results before it (so the ops kept the step within "
                f"step_tokens={plan.limits.step_tokens}); result {i} of a step has step_index {i}",
                "pass the step's earlier results to each later admit/extend "
                "(e.g. extend(..., same_step=(admit_result,))) and give all of them, in order",
            )
        if x.status.ndim != 1 or x.zero.ndim != 2 or x.zero.shape[0] != g:
            fail(
                f"{what}[{i}]",
                f"a result with status{list(x.status.shape)} and zero{list(x.zero.shape)}",
                f"a result of this plan has status[B] and zero[{g}, B * K] (one row per group)",
                "pass results of admit/extend made with this plan",
            )
