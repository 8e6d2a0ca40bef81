"""Sleep / wake: release the pools' device memory and get it back.

A serving process sometimes has to hand its accelerator memory to someone else for a while
(an RL trainer updating the weights, a second model, a memory-hungry compilation). The pools
are almost all of that memory. :func:`sleep` takes the coordinator state and the pools and
returns a small frozen :class:`Sleeping` value; the pools' device buffers are deleted
(``jax.Array.delete``), so the memory is really free, not merely unreferenced. :func:`wake`
re-creates the pools and returns the state to continue with.

- :attr:`SleepMode.OFFLOAD` copies every pool array to host memory first; :func:`wake` puts
  the copy back with the same shardings: pools and state are bit-identical to what they were,
  every request continues where it stopped.
- :attr:`SleepMode.DISCARD` drops the contents. :func:`wake` returns zeroed pools and a
  *repaired* state (:func:`repair`): every live request is retracted (its pages returned, its
  handle stale; the engine readmits it and recomputes), and the prefix index and LRUs are
  emptied with every reference they held returned, so no later admission is ever served a
  prefix hit on pages whose contents are gone.

Sleeping with steps in flight is refused (``ValueError``): an in-flight step's tokens are being
written into the very pools that would go away. Retire (or rewind and retire) them first.

Contract and examples: docs/sleep.md.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flatkv_jax.compile_options import COORDINATOR_COMPILER_OPTIONS
from flatkv_jax.coordinator.batches import ReleaseBatch, ReleaseMode
from flatkv_jax.coordinator.state import CacheState, state_layout
from flatkv_jax.errors import fail
from flatkv_jax.plan import CachePlan, check_plan
from flatkv_jax.pools import Pools, pool_specs

_I32 = jnp.int32

Handle = tuple[int, int]


class SleepMode(enum.Enum):
    """What :func:`sleep` does with the pools' contents."""

    #: Keep a host copy; :func:`wake` restores it bit-exactly (host memory: the pools' bytes).
    OFFLOAD = "offload"
    #: Drop the contents; :func:`wake` zeroes the pools and repairs the state (:func:`repair`).
    DISCARD = "discard"


@dataclasses.dataclass(frozen=True, eq=False)
class Sleeping:
    """A sleeping cache, as returned by :func:`sleep`; pass it to :func:`wake`.

    It owns the state passed to :func:`sleep` (do not use that state until :func:`wake`
    returns it) and, for :attr:`SleepMode.OFFLOAD`, the host copy of the pools. A sleeping
    value can be woken once.

    Attributes:
      plan: the cache plan.
      state: the coordinator state (on device, untouched while asleep).
      mode: :class:`SleepMode`.
      treedef: the pools' pytree structure (a :class:`~flatkv_jax.pools.Pools` or any pytree
        of arrays, e.g. target and draft pools together).
      specs: per pool array (leaf order), its shape, dtype and sharding.
      host: :attr:`SleepMode.OFFLOAD`: per pool array, its contents as a NumPy array;
        :attr:`SleepMode.DISCARD`: ``None``.
      committed: per pool array, whether it was committed to its device (placed explicitly).
        :func:`wake` restores the same: ``jax.jit`` caches by committed-ness, so pools woken
        committed after uncommitted ones would recompile every step function once.
    """

    plan: CachePlan
    state: CacheState
    mode: SleepMode
    treedef: Any
    specs: tuple[jax.ShapeDtypeStruct, ...]
    host: tuple[np.ndarray, ...] | None
    committed: tuple[bool, ...] = ()
    # Set by the first wake: an OFFLOAD state is handed out as is, and a second wake would
    # hand the same state out beside a second copy of the pools (nothing deleted to notice).
    _woken: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def device_bytes(self) -> int:
        """Device bytes the pools occupied (released while asleep)."""
        return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in self.specs)

    @property
    def host_bytes(self) -> int:
        """Host bytes of the offloaded copy (0 for :attr:`SleepMode.DISCARD`)."""
        return 0 if self.host is None else sum(a.nbytes for a in self.host)


class Woken(NamedTuple):
    """What :func:`wake` returns.

    Attributes:
      state: the state to continue with (the one given to :func:`sleep` after OFFLOAD; the
        repaired one after DISCARD).
      pools: the re-created pools, same structure, shapes, dtypes and shardings.
      retracted: the handles ``(slot, generation)`` of the requests the repair retracted,
        slot order (always empty after OFFLOAD). They are stale now: readmit those requests
        with their prompt and the tokens generated so far.
    """

    state: CacheState
    pools: Any
    retracted: tuple[Handle, ...]


# The generated constructor's annotations are strings (this module's `from __future__ import
# annotations`) that only this module's names resolve: resolve them here, so that tools
# reading the signature (the API reference) see the types.
Woken.__new__.__annotations__ = typing.get_type_hints(Woken)


def in_flight_slots(state: CacheState) -> list[int]:
    """Slots of live requests with steps in flight (reads two small arrays to the host)."""
    live, flen = np.asarray(state.live), np.asarray(state.fifo_len)
    return [int(s) for s in np.flatnonzero(live & (flen > 0))]


def sleep(plan: CachePlan, state: CacheState, pools: Any, mode: SleepMode | str) -> Sleeping:
    """Releases the pools' device memory.

    Every pool array is deleted (``jax.Array.delete``): the caller's ``pools`` must not be used
    again (as after donating them), and the memory is free as soon as this returns. Blocks
    until the pools' pending computations are done.

    Args:
      plan: the cache plan of ``state`` and ``pools``.
      state: the coordinator state; owned by the returned value until :func:`wake`.
      pools: the pools (a :class:`~flatkv_jax.pools.Pools`, or any pytree of device arrays:
        target and draft pools together, say).
      mode: :attr:`SleepMode.OFFLOAD` (keep a host copy; bit-exact restore) or
        :attr:`SleepMode.DISCARD` (drop the contents; the state is repaired at wake), or
        their values ``"offload"`` / ``"discard"``.

    Returns:
      The :class:`Sleeping` value to pass to :func:`wake`.

    Raises:
      ValueError: steps in flight (retire them first); pools or state of another plan; an
        unknown mode.
      TypeError: a plan, state or pools of the wrong type.
    """
    check_plan(plan)
    mode = _check_mode(mode)
    _check_state(plan, state, "state")
    leaves, treedef = jax.tree_util.tree_flatten(pools)
    _check_pools(plan, pools, leaves)
    busy = in_flight_slots(state)
    if busy:
        fail(
            "state",
            f"{len(busy)} request(s) with steps in flight (slots {busy})",
            "sleep needs every step retired: an in-flight step's tokens are written into the "
            "pools that sleep releases",
            "retire (or rewind and retire) every in-flight step, then sleep; in a serving loop, "
            "sleep between steps after reading their results",
        )
    specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in leaves)
    committed = tuple(bool(getattr(a, "_committed", True)) for a in leaves)
    host = None
    if mode is SleepMode.OFFLOAD:
        # A real copy: on the CPU backend np.asarray may alias the device buffer we delete next.
        host = tuple(np.array(a, copy=True) for a in leaves)
    else:
        jax.block_until_ready(leaves)  # nothing may still be writing the buffers we delete
    for a in leaves:
        a.delete()
    return Sleeping(plan, state, mode, treedef, specs, host, committed)


def wake(sleeping: Sleeping) -> Woken:
    """Re-creates the pools of a :class:`Sleeping` cache and returns the state to continue.

    :attr:`SleepMode.OFFLOAD`: the host copy goes back to the device with the original
    shardings (bit-exact); the state is the one given to :func:`sleep`, unchanged.
    :attr:`SleepMode.DISCARD`: the pools are created as zeros and the state is repaired
    (:func:`repair`): every live request is retracted (listed in ``retracted``), the prefix
    index and the LRUs are empty, every page is free.

    Raises:
      TypeError: ``sleeping`` is not a :class:`Sleeping`.
      ValueError: it was woken already (its state was handed out and may be consumed).
    """
    if not isinstance(sleeping, Sleeping):
        fail(
            "sleeping",
            type(sleeping).__name__,
            "it must be the Sleeping value sleep() returned",
            "call wake(sleep(plan, state, pools, mode))",
            exc=TypeError,
        )
    if sleeping._woken or any(
        leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(sleeping.state)
    ):
        fail(
            "sleeping",
            "a Sleeping value woken already"
            if sleeping._woken
            else "a Sleeping value whose state is deleted",
            "a sleeping cache can be woken once (wake hands its state out, and the operations "
            "donate it)",
            "keep the Woken value of the first wake and continue with its state and pools",
        )
    if sleeping.mode is SleepMode.OFFLOAD:
        leaves = [
            jax.device_put(h, s.sharding if c else None)
            for h, s, c in zip(sleeping.host, sleeping.specs, _committed(sleeping), strict=True)
        ]
        state, retracted = sleeping.state, ()
    else:
        leaves = [
            _zeros(s.shape, s.dtype, s.sharding if c else None)()
            for s, c in zip(sleeping.specs, _committed(sleeping), strict=True)
        ]
        state, was_live, old_gen = repair(sleeping.plan, sleeping.state)
        live, gen = np.asarray(was_live), np.asarray(old_gen)
        retracted = tuple((int(s), int(gen[s])) for s in np.flatnonzero(live))
    pools = jax.tree_util.tree_unflatten(sleeping.treedef, leaves)
    sleeping._woken.append(True)
    return Woken(state, pools, retracted)


def repair_fn(plan: CachePlan, state: CacheState) -> tuple[CacheState, jax.Array, jax.Array]:
    """The state after the pools' contents were lost: nothing cached, nothing live.

    Every live request is freed without publishing (its handle becomes stale: generation + 1),
    which returns every table reference; then every cached-only page is evicted, which empties
    the prefix index and the LRUs and returns the index's references. Every page ends on its
    pool's free stack with refcount 0, so no admission can hit a page whose contents are gone.
    The caller must have retired every in-flight step (:func:`sleep` checks).

    Returns:
      ``(state, was_live bool[max_requests], generation int32[max_requests])``: the repaired
      state, which slots held a request, and their generations before the repair (with the
      slot, the retracted requests' handles).
    """
    # Imported here: ops imports the prefix machinery; sleep is rarely used.
    from flatkv_jax.coordinator.alloc import evict
    from flatkv_jax.coordinator.ops import release_fn

    r = state.max_requests
    was_live, old_gen = state.live, state.generation
    batch = ReleaseBatch(
        valid=was_live,
        slot=jnp.arange(r, dtype=_I32),
        generation=old_gen,
        mode=jnp.full((r,), int(ReleaseMode.ABORT), _I32),
    )
    # ABORT: the contents are gone, so nothing may be published; the requests themselves are
    # retracted (the caller readmits them), which for the cache is exactly an abort.
    state, _ = release_fn(plan, state, batch)
    if state.prefix:
        # With no table reference left, every indexed page is cached-only: evicting all of
        # them empties the index and the LRU and puts the pages on the free stacks.
        counts = state.lru.count
        state = evict(plan, state, counts, max(plan.usable_pages(g) for g in plan.groups))
    return state, was_live, old_gen


#: :func:`repair_fn` jitted (plan static, state donated).
repair = jax.jit(
    repair_fn,
    static_argnames=("plan",),
    donate_argnames=("state",),
    compiler_options=COORDINATOR_COMPILER_OPTIONS,
)


def _check_mode(mode: object) -> SleepMode:
    if isinstance(mode, SleepMode):
        return mode
    if isinstance(mode, str) and mode in {m.value for m in SleepMode}:
        return SleepMode(mode)
    fail(
        "mode",
        mode,
        "it must be SleepMode.OFFLOAD or SleepMode.DISCARD ('offload' or 'discard')",
        "pass SleepMode.OFFLOAD to keep the contents on the host, SleepMode.DISCARD to drop them",
        exc=ValueError if isinstance(mode, str) else TypeError,
    )


def _check_state(plan: CachePlan, state: object, what: str) -> None:
    if not isinstance(state, CacheState):
        fail(
            what,
            type(state).__name__,
            "it must be a CacheState",
            "pass the state create_state(plan) made (as returned by the last operation)",
            exc=TypeError,
        )
    if state.layout != state_layout(plan):
        fail(
            what,
            "a CacheState of another plan",
            "its tables and pools are laid out for a different plan",
            "pass the plan the state was created with",
        )


def _check_pools(plan: CachePlan, pools: object, leaves: list) -> None:
    if not leaves or not all(isinstance(a, jax.Array) for a in leaves):
        fail(
            "pools",
            type(pools).__name__,
            "it must be the pools (a Pools, or a pytree of device arrays)",
            "pass the Pools create_pools(plan) made (as returned by the last step)",
            exc=TypeError,
        )
    deleted = sum(a.is_deleted() for a in leaves)
    if deleted:
        fail(
            "pools",
            f"pools with {deleted} deleted array(s)",
            "sleep needs live pools (a donated or already released array has no contents)",
            "pass the pools the last step returned, and sleep each cache once",
        )
    if isinstance(pools, Pools):
        want = [(s.shape, s.dtype) for s in jax.tree_util.tree_leaves(pool_specs(plan))]
        if [(a.shape, a.dtype) for a in leaves] != want:
            fail(
                "pools",
                "a Pools of another plan",
                "its arrays' shapes or dtypes are not the plan's pool_specs",
                "pass the pools create_pools(plan) made for this plan",
            )


def _committed(sleeping: Sleeping) -> tuple[bool, ...]:
    return sleeping.committed or (True,) * len(sleeping.specs)


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple[int, ...], dtype, sharding):
    # Created directly on device with its sharding (no host staging), compiled once per shape;
    # sharding None: an uncommitted array on the default device, like create_pools makes.
    if sharding is None:
        return jax.jit(lambda: jnp.zeros(shape, dtype))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
